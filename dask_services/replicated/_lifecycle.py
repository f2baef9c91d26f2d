"""The lifecycle of one replica as a pure state machine: events in, actions out.

A *replica* is one slot of a deployment (``svc.scale(n)`` gives n slots).  Each launch of a
slot is an *incarnation* with its own :class:`~dask_services.ServiceId`, never reused, so a
message about an old incarnation (a late setup result, a probe of a replaced instance) can
never be mistaken for one about the current one: events carry the id they are about and
events for another id are ignored.

::

    UNINITIALIZED --setup ok--> HEALTHY --worker lost / probe failed / retiring--> RECOVERING
         |  ^                      ^                                                |  ^
         |  +--setup failed (< n)  +-------------------setup ok---------------------+  |
         |                                                    setup failed (< n) ------+
         +--setup failed n times in a row--> UNHEALTHY <--setup failed n times--+
    any state --stop requested--> STOPPED

A worker that dies while it starts the replica (``setup`` under way) counts too: more
than ``max_lost_in_setup`` in a row (``distributed.scheduler.allowed-failures``) and the
replica is UNHEALTHY, as a task is erred with ``KilledWorker``, rather than a ``setup`` that
kills its worker relaunched on every next one.  So does a worker that dies while the
scheduler's health probe of a healthy replica runs (``max_lost_in_probe``, reset by a probe
that passes): a ``check_health`` that kills its worker is not relaunched for ever.

Nothing here does I/O; the scheduler part (``_scheduler.py``) feeds events and carries out
the actions (choose a worker, start the instance there, stop an instance).  As in
``dask_services._run_state``: one handler per event (``_on_<Event>``), an event without one
raises; every event and action carries a ``stimulus_id``; each replica keeps a bounded
story of what it received, decided and sent (``ReplicaMachine.story()``, ``svc.story()``);
``validate()`` checks the invariants.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from dask_services._run_model import new_stimulus_id
from dask_services._run_story import describe
from dask_services.config import setting
from dask_services.service import ServiceId

_sequence = itertools.count()


def _stimulus(name: str) -> Any:
    return field(default_factory=lambda: new_stimulus_id(name), kw_only=True)


def _action_stimulus() -> Any:
    return field(default="", kw_only=True, compare=False)


class ReplicaState(enum.Enum):
    """Where a replica is in its life; only ``HEALTHY`` replicas receive calls."""

    UNINITIALIZED = "uninitialized"  # never healthy yet: first setup under way (or retried)
    HEALTHY = "healthy"
    RECOVERING = "recovering"  # was healthy; a new incarnation is being set up
    UNHEALTHY = "unhealthy"  # setup failed too often in a row; needs a fix, not a retry
    STOPPED = "stopped"


TERMINAL = frozenset({ReplicaState.UNHEALTHY, ReplicaState.STOPPED})


# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class Placed:
    """The scheduler chose ``worker`` for incarnation ``id`` (rank 0), and ``others`` for
    its other ranks (a replica of several ranks), all at once."""

    id: ServiceId
    worker: str
    others: tuple[str, ...] = ()
    stimulus_id: str = _stimulus("replica-placed")


@dataclass(frozen=True)
class NoWorker:
    """No eligible worker for incarnation ``id``, or (several ranks) not enough at once; it
    waits for one (see ``WorkerAdded``), holding none.  ``reason`` says what is missing."""

    id: ServiceId
    reason: str = ""
    stimulus_id: str = _stimulus("replica-no-worker")


@dataclass(frozen=True)
class WorkerAdded:
    """A worker joined or became eligible (another replica let go of its workers): a
    replica waiting for one launches again."""
    stimulus_id: str = _stimulus("replica-worker-added")


@dataclass(frozen=True)
class SetupSucceeded:
    """``setup`` returned on incarnation ``id``."""

    id: ServiceId
    stimulus_id: str = _stimulus("replica-setup-succeeded")


@dataclass(frozen=True)
class SetupFailed:
    """``setup`` raised on incarnation ``id`` (``error`` is its text)."""

    id: ServiceId
    error: str
    stimulus_id: str = _stimulus("replica-setup-failed")


@dataclass(frozen=True)
class LaunchLost:
    """Starting incarnation ``id`` failed for a reason that is not ``setup`` (a lost
    connection, a worker closing): not counted against the setup attempts.
    ``in_flight``: the connection broke once the start was sent (the worker died while it
    started the replica, perhaps of ``setup``), counted against ``max_lost_in_setup``."""

    id: ServiceId
    error: str
    in_flight: bool = False
    stimulus_id: str = _stimulus("replica-launch-lost")


@dataclass(frozen=True)
class WorkerLost:
    """``worker`` left the cluster; ``probing``: the incarnations whose health probe was
    under way then (a worker dying of ``check_health`` counts)."""

    worker: str
    probing: frozenset[ServiceId] = frozenset()
    stimulus_id: str = _stimulus("replica-worker-lost")


@dataclass(frozen=True)
class WorkerRetiring:
    """``worker`` is being retired: move the replica before it goes."""

    worker: str
    stimulus_id: str = _stimulus("replica-worker-retiring")


@dataclass(frozen=True)
class ProbeFailed:
    """The health probe of incarnation ``id`` failed or timed out.  ``in_flight``: a
    rank's connection broke once the probe was sent (its worker died while
    ``check_health`` ran, perhaps of it), counted against ``max_lost_in_probe``."""

    id: ServiceId
    error: str
    in_flight: bool = False
    stimulus_id: str = _stimulus("replica-probe-failed")


@dataclass(frozen=True)
class ProbePassed:
    """The health probe of incarnation ``id`` passed after workers were lost while it ran
    (sent only then): the count of those starts again."""

    id: ServiceId
    stimulus_id: str = _stimulus("replica-probe-passed")


@dataclass(frozen=True)
class StopRequested:
    """Scale-down or shutdown: stop for good, letting calls in flight finish."""
    stimulus_id: str = _stimulus("replica-stop-requested")


Event = (Placed | NoWorker | WorkerAdded | SetupSucceeded | SetupFailed | LaunchLost
         | WorkerLost | WorkerRetiring | ProbeFailed | ProbePassed | StopRequested)


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class Launch:
    """Choose a worker for incarnation ``id`` (avoiding ``exclude`` when there is a
    choice) and answer with :class:`Placed` or :class:`NoWorker`."""

    id: ServiceId
    exclude: frozenset[str] = frozenset()
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class StartOn:
    """Create incarnation ``id`` on ``worker`` (and its other ranks on ``others``) and run
    its ``setup`` on every rank."""

    id: ServiceId
    worker: str
    others: tuple[str, ...] = ()
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class Stop:
    """Stop incarnation ``id`` on ``worker`` (and its ranks on ``others``); ``drain``: let
    calls in flight finish."""

    id: ServiceId
    worker: str
    drain: bool
    others: tuple[str, ...] = ()
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class StateChanged:
    """The replica's state changed (wake up whoever waits for it)."""

    state: ReplicaState
    stimulus_id: str = _action_stimulus()


Action = Launch | StartOn | Stop | StateChanged


# ------------------------------------------------------------------ stories


@dataclass(frozen=True)
class ReplicaStoryEntry:
    """One line of a replica's story."""

    seq: int
    time: float
    replica: str  # the incarnation it is about
    stimulus_id: str
    kind: str  # "received" (an event), "decided" (a change), "sent" (an action)
    what: Any  # the event or action, or the decision's text

    def as_dict(self) -> dict[str, Any]:
        what = self.what
        return {
            "time": self.time, "replica": self.replica, "stimulus_id": self.stimulus_id,
            "kind": self.kind, "what": what if isinstance(what, str) else type(what).__name__,
            "detail": "" if isinstance(what, str) else describe(what),
        }


def _story_log() -> deque[ReplicaStoryEntry]:
    return deque(maxlen=max(1, int(setting("story.entries"))))


# ------------------------------------------------------------------ the machine


@dataclass
class ReplicaMachine:
    """One replica slot of a deployment.

    ``base`` prefixes the incarnation ids (``<base>.<n>``); ``max_setup_attempts`` is how
    many times in a row ``setup`` may fail before the replica is ``UNHEALTHY``, and
    ``max_lost_in_setup`` how many times in a row a worker may die while it starts the
    replica (``distributed.scheduler.allowed-failures``: ``setup`` itself may be what kills
    them, as ``KilledWorker`` says of a task), and ``max_lost_in_probe`` how many times in
    a row one may die while its health probe runs (``check_health`` may be); ``size`` is
    the number of ranks (``procs_per_replica``): rank 0 on ``worker``, the others on
    ``others``, placed, started, lost and stopped together.
    """

    base: str
    max_setup_attempts: int = 3
    max_lost_in_setup: int = 3
    max_lost_in_probe: int = 3
    size: int = 1
    state: ReplicaState = ReplicaState.UNINITIALIZED
    incarnation: int = 0
    worker: str | None = None
    others: tuple[str, ...] = ()
    waiting_for_worker: bool = False
    launching: bool = False  # a Launch awaits its Placed / NoWorker
    starting: bool = False  # a StartOn awaits its setup result
    setup_failures: int = 0
    lost_in_setup: int = 0  # workers that died in a row while they started the replica
    lost_in_probe: int = 0  # ... while its health probe ran (since a probe last passed)
    last_error: str | None = None
    excluded: frozenset[str] = field(default_factory=frozenset)
    story_log: deque[ReplicaStoryEntry] = field(default_factory=_story_log, repr=False,
                                                 compare=False)

    _handlers: ClassVar[dict[type, Callable[[ReplicaMachine, Any], list[Action]]]]

    def __post_init__(self) -> None:
        if self.max_setup_attempts < 1:
            raise ValueError(f"max_setup_attempts must be >= 1, got {self.max_setup_attempts}")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        for name in ("max_lost_in_setup", "max_lost_in_probe"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def workers(self) -> tuple[str, ...]:
        """The workers of every rank, rank 0 first (empty while not placed)."""
        return () if self.worker is None else (self.worker, *self.others)

    @property
    def id(self) -> ServiceId:
        """Id of the current incarnation."""
        return ServiceId(f"{self.base}.{self.incarnation}")

    def start(self) -> list[Action]:
        """The first launch of the slot."""
        if self.incarnation != 0 or self.state is not ReplicaState.UNINITIALIZED:
            raise RuntimeError("start() is called once, on a new replica")
        actions = self._relaunch(frozenset())
        sid = new_stimulus_id("replica-start")
        actions = [replace(a, stimulus_id=sid) for a in actions]
        now = time.time()
        self.story_log.append(ReplicaStoryEntry(next(_sequence), now, str(self.id), sid,
                                                "decided", "new replica"))
        for action in actions:
            self.story_log.append(ReplicaStoryEntry(next(_sequence), now, str(self.id), sid,
                                                    "sent", action))
        return actions

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; returns the actions to carry out, in order, each stamped with
        the event's ``stimulus_id``.  An event type without a handler raises."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"ReplicaMachine has no handler for {event!r}")
        before = (self.state, self.id, self.worker)
        if self.state is ReplicaState.STOPPED:
            ignored: str | None = "ignored: the replica is stopped"
        elif self.state is ReplicaState.UNHEALTHY and not isinstance(event, StopRequested):
            ignored = "ignored: the replica is unhealthy (until stopped)"
        elif getattr(event, "id", self.id) != self.id:
            ignored = "ignored: about an older incarnation"
        else:
            ignored = None
        actions = [] if ignored is not None else handler(self, event)
        actions = [a if a.stimulus_id else replace(a, stimulus_id=event.stimulus_id)
                   for a in actions]
        self._tell_story(event, before, ignored, actions)
        return actions

    def _on_StopRequested(self, event: StopRequested) -> list[Action]:
        actions: list[Action] = []
        if self.worker is not None and self.state is not ReplicaState.UNHEALTHY:
            actions.append(Stop(self.id, self.worker, drain=True, others=self.others))
        self.worker = None
        self.others = ()
        self.waiting_for_worker = self.launching = self.starting = False
        return actions + self._set(ReplicaState.STOPPED)

    def _on_WorkerAdded(self, event: WorkerAdded) -> list[Action]:
        if self.waiting_for_worker:
            # the incarnation waiting was never placed (nobody knows its id): it tries
            # again as it is, so that workers joining one by one do not burn an id each
            self.waiting_for_worker = False
            self.launching = True
            return [Launch(self.id, self.excluded)]
        return []

    def _on_WorkerLost(self, event: WorkerLost) -> list[Action]:
        if event.worker not in self.workers:
            return []
        old_id = self.id
        survivors = tuple(w for w in self.workers if w != event.worker)
        self.last_error = (f"worker {event.worker} left the cluster" if self.size == 1 else
                           f"rank {self.workers.index(event.worker)} lost: worker "
                           f"{event.worker} left the cluster")
        stops: list[Action] = []
        if survivors:  # the gang goes as a whole: its other ranks are stopped at once
            stops.append(Stop(old_id, survivors[0], drain=False, others=survivors[1:]))
        if self._setup_answered() and self._count_lost_in_setup():
            return stops + self._set(ReplicaState.UNHEALTHY)
        if self.state is ReplicaState.HEALTHY and self.id in event.probing \
                and self._count_lost_in_probe():
            return stops + self._set(ReplicaState.UNHEALTHY)
        return stops + self._recover(frozenset({event.worker}))

    def _on_WorkerRetiring(self, event: WorkerRetiring) -> list[Action]:
        if event.worker not in self.workers:
            return []
        old_id, old_worker, old_others = self.id, self.worker, self.others
        assert old_worker is not None
        self.last_error = f"worker {event.worker} is being retired"
        return [Stop(old_id, old_worker, drain=True, others=old_others),
                *self._recover(frozenset({event.worker}))]

    def _on_Placed(self, event: Placed) -> list[Action]:
        if not self.launching:
            return []  # answers a launch that is not pending
        self.launching = False
        self.worker = event.worker
        self.others = event.others
        self.starting = True
        return [StartOn(self.id, event.worker, others=event.others)]

    def _on_NoWorker(self, event: NoWorker) -> list[Action]:
        if not self.launching:
            return []  # answers a launch that is not pending
        self.launching = False
        self.waiting_for_worker = True
        if event.reason:
            self.last_error = event.reason
        return []

    def _setup_answered(self) -> bool:
        """Whether a setup was under way for this incarnation (it is not any more)."""
        if not self.starting:
            return False
        self.starting = False
        return True

    def _count_lost_in_setup(self) -> bool:
        """Count one more worker that died while it started the replica; True once that
        is more in a row than ``max_lost_in_setup`` allows (``last_error`` then says so,
        and the replica holds no worker)."""
        self.lost_in_setup += 1
        return self._past_allowance(self.lost_in_setup, self.max_lost_in_setup,
                                    "it started the replica", "setup()")

    def _count_lost_in_probe(self) -> bool:
        """The same for a worker that died while the replica's health probe ran
        (``max_lost_in_probe``)."""
        self.lost_in_probe += 1
        return self._past_allowance(self.lost_in_probe, self.max_lost_in_probe,
                                    "the health probe of the replica ran", "check_health()")

    def _past_allowance(self, lost: int, allowed: int, while_: str, suspect: str) -> bool:
        """Whether ``lost`` workers in a row are more than ``allowed``; if so the replica
        lets go of its workers and ``last_error`` names ``suspect`` as what may kill them."""
        if lost <= allowed:
            return False
        self.worker = None
        self.others = ()
        self.last_error = (
            f"a worker died while {while_} {lost} times in a row, more than "
            f"distributed.scheduler.allowed-failures={allowed} allows: {suspect} itself may "
            f"be what kills them (as KilledWorker says of a task); last: {self.last_error}")
        return True

    def _on_SetupSucceeded(self, event: SetupSucceeded) -> list[Action]:
        if not self._setup_answered():
            return []  # no setup under way for this incarnation
        self.setup_failures = 0
        self.lost_in_setup = 0
        self.last_error = None
        return self._set(ReplicaState.HEALTHY)

    def _on_SetupFailed(self, event: SetupFailed) -> list[Action]:
        if not self._setup_answered():
            return []
        self.setup_failures += 1
        self.last_error = event.error
        failed_on = frozenset(self.workers)
        self.worker = None
        self.others = ()
        if self.setup_failures >= self.max_setup_attempts:
            return self._set(ReplicaState.UNHEALTHY)
        return self._relaunch(failed_on)

    def _on_LaunchLost(self, event: LaunchLost) -> list[Action]:
        if not self._setup_answered():
            return []
        self.last_error = event.error
        failed_on = frozenset(self.workers)
        self.worker = None
        self.others = ()
        if event.in_flight and self._count_lost_in_setup():
            return self._set(ReplicaState.UNHEALTHY)
        return self._relaunch(failed_on)

    def _on_ProbeFailed(self, event: ProbeFailed) -> list[Action]:
        if self.state is not ReplicaState.HEALTHY or self.worker is None:
            return []
        old_id, old_worker, old_others = self.id, self.worker, self.others
        self.last_error = f"health probe failed: {event.error}"
        stop = Stop(old_id, old_worker, drain=False, others=old_others)
        if event.in_flight and self._count_lost_in_probe():
            return [stop, *self._set(ReplicaState.UNHEALTHY)]
        return [stop, *self._recover(frozenset({old_worker, *old_others}))]

    def _on_ProbePassed(self, event: ProbePassed) -> list[Action]:
        if self.state is ReplicaState.HEALTHY:
            self.lost_in_probe = 0
        return []

    # ------------------------------------------------------------ story

    def _tell_story(self, event: Event, before: tuple, ignored: str | None,
                    actions: list[Action]) -> None:
        now = time.time()
        sid = event.stimulus_id
        rid = str(before[1])
        log = self.story_log
        log.append(ReplicaStoryEntry(next(_sequence), now, rid, sid, "received", event))
        decisions = [ignored] if ignored is not None else []
        state, incarnation, worker = before
        if self.state is not state:
            decisions.append(f"{state.value} -> {self.state.value}")
        if self.id != incarnation:
            decisions.append(f"new incarnation {self.id}")
        if self.worker != worker and self.worker is not None:
            decisions.append(f"placed on {', '.join(self.workers)}")
        for text in decisions:
            log.append(ReplicaStoryEntry(next(_sequence), now, str(self.id), sid, "decided",
                                         text))
        for action in actions:
            log.append(ReplicaStoryEntry(next(_sequence), now, str(self.id), sid, "sent",
                                         action))

    def story(self) -> list[dict[str, Any]]:
        """What this replica slot received, decided and sent, oldest first (bounded by
        ``dask_services.story.entries``)."""
        return [entry.as_dict() for entry in self.story_log]

    def validate(self) -> None:
        """Check the invariants; raises AssertionError naming the broken one."""
        assert not (self.launching and self.starting), "launching and starting at once"
        assert not self.starting or self.worker is not None, "starting without a worker"
        assert not (self.waiting_for_worker and (self.launching or self.starting))
        assert self.worker is not None or not self.others, "ranks placed without rank 0"
        assert len(self.workers) in (0, self.size), "a replica partly placed"
        assert len(set(self.workers)) == len(self.workers), "two ranks on one worker"
        if self.state is ReplicaState.STOPPED:
            assert self.worker is None and not (self.launching or self.starting
                                                or self.waiting_for_worker)
        assert 0 <= self.setup_failures <= self.max_setup_attempts
        assert 0 <= self.lost_in_setup <= self.max_lost_in_setup + 1
        assert 0 <= self.lost_in_probe <= self.max_lost_in_probe + 1
        if self.state is ReplicaState.UNHEALTHY:
            assert self.worker is None and not (self.launching or self.starting)

    # ------------------------------------------------------------ helpers

    def _recover(self, exclude: frozenset[str]) -> list[Action]:
        self.worker = None
        self.others = ()
        actions: list[Action] = []
        if self.state is ReplicaState.HEALTHY:
            actions += self._set(ReplicaState.RECOVERING)
        return actions + self._relaunch(exclude)

    def _relaunch(self, exclude: frozenset[str]) -> list[Action]:
        self.incarnation += 1
        self.worker = None
        self.others = ()
        self.waiting_for_worker = False
        self.launching = True
        self.starting = False
        self.excluded = exclude
        return [Launch(self.id, exclude)]

    def _set(self, state: ReplicaState) -> list[Action]:
        if state is self.state:
            return []
        self.state = state
        return [StateChanged(state)]


ReplicaMachine._handlers = {
    ev_type: getattr(ReplicaMachine, "_on_" + ev_type.__name__)
    for ev_type in Event.__args__  # type: ignore[attr-defined]
}
