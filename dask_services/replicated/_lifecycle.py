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

Nothing here does I/O; the scheduler part (``_scheduler.py``) feeds events and carries out
the actions (choose a worker, start the instance there, stop an instance).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dask_services.service import ServiceId


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
    """The scheduler chose ``worker`` for incarnation ``id``."""

    id: ServiceId
    worker: str


@dataclass(frozen=True)
class NoWorker:
    """No eligible worker for incarnation ``id``; it waits for one (see ``WorkerAdded``)."""

    id: ServiceId


@dataclass(frozen=True)
class WorkerAdded:
    """A worker joined or became eligible: a replica waiting for one launches again."""


@dataclass(frozen=True)
class SetupSucceeded:
    """``setup`` returned on incarnation ``id``."""

    id: ServiceId


@dataclass(frozen=True)
class SetupFailed:
    """``setup`` raised on incarnation ``id`` (``error`` is its text)."""

    id: ServiceId
    error: str


@dataclass(frozen=True)
class LaunchLost:
    """Starting incarnation ``id`` failed for a reason that is not ``setup`` (a lost
    connection, a worker closing): not counted against the setup attempts."""

    id: ServiceId
    error: str


@dataclass(frozen=True)
class WorkerLost:
    """``worker`` left the cluster."""

    worker: str


@dataclass(frozen=True)
class WorkerRetiring:
    """``worker`` is being retired: move the replica before it goes."""

    worker: str


@dataclass(frozen=True)
class ProbeFailed:
    """The health probe of incarnation ``id`` failed or timed out."""

    id: ServiceId
    error: str


@dataclass(frozen=True)
class StopRequested:
    """Scale-down or shutdown: stop for good, letting calls in flight finish."""


Event = (Placed | NoWorker | WorkerAdded | SetupSucceeded | SetupFailed | LaunchLost
         | WorkerLost | WorkerRetiring | ProbeFailed | StopRequested)


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class Launch:
    """Choose a worker for incarnation ``id`` (avoiding ``exclude`` when there is a
    choice) and answer with :class:`Placed` or :class:`NoWorker`."""

    id: ServiceId
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class StartOn:
    """Create incarnation ``id`` on ``worker`` and run its ``setup``."""

    id: ServiceId
    worker: str


@dataclass(frozen=True)
class Stop:
    """Stop incarnation ``id`` on ``worker``; ``drain``: let calls in flight finish."""

    id: ServiceId
    worker: str
    drain: bool


@dataclass(frozen=True)
class StateChanged:
    """The replica's state changed (wake up whoever waits for it)."""

    state: ReplicaState


Action = Launch | StartOn | Stop | StateChanged


# ------------------------------------------------------------------ the machine


@dataclass
class ReplicaMachine:
    """One replica slot of a deployment.

    ``base`` prefixes the incarnation ids (``<base>.<n>``); ``max_setup_attempts`` is how
    many times in a row ``setup`` may fail before the replica is ``UNHEALTHY``.
    """

    base: str
    max_setup_attempts: int = 3
    state: ReplicaState = ReplicaState.UNINITIALIZED
    incarnation: int = 0
    worker: str | None = None
    waiting_for_worker: bool = False
    launching: bool = False  # a Launch awaits its Placed / NoWorker
    starting: bool = False  # a StartOn awaits its setup result
    setup_failures: int = 0
    last_error: str | None = None
    excluded: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.max_setup_attempts < 1:
            raise ValueError(f"max_setup_attempts must be >= 1, got {self.max_setup_attempts}")

    @property
    def id(self) -> ServiceId:
        """Id of the current incarnation."""
        return ServiceId(f"{self.base}.{self.incarnation}")

    def start(self) -> list[Action]:
        """The first launch of the slot."""
        if self.incarnation != 0 or self.state is not ReplicaState.UNINITIALIZED:
            raise RuntimeError("start() is called once, on a new replica")
        return self._relaunch(frozenset())

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; returns the actions to carry out, in order."""
        if self.state is ReplicaState.STOPPED:
            return []
        if isinstance(event, StopRequested):
            actions: list[Action] = []
            if self.worker is not None and self.state is not ReplicaState.UNHEALTHY:
                actions.append(Stop(self.id, self.worker, drain=True))
            self.worker = None
            self.waiting_for_worker = self.launching = self.starting = False
            return actions + self._set(ReplicaState.STOPPED)
        if self.state is ReplicaState.UNHEALTHY:
            return []
        if isinstance(event, WorkerAdded):
            if self.waiting_for_worker:
                return self._relaunch(self.excluded)
            return []
        if isinstance(event, (WorkerLost, WorkerRetiring)):
            if self.worker != event.worker:
                return []
            retiring = isinstance(event, WorkerRetiring)
            old_id, old_worker = self.id, self.worker
            self.last_error = (f"worker {old_worker} is being retired" if retiring
                               else f"worker {old_worker} left the cluster")
            actions = [Stop(old_id, old_worker, drain=True)] if retiring else []
            return actions + self._recover(frozenset({old_worker}))
        if getattr(event, "id", None) != self.id:
            return []  # about an older incarnation
        if isinstance(event, (Placed, NoWorker)):
            if not self.launching:
                return []  # answers a launch that is not pending
            self.launching = False
            if isinstance(event, NoWorker):
                self.waiting_for_worker = True
                return []
            self.worker = event.worker
            self.starting = True
            return [StartOn(self.id, event.worker)]
        if isinstance(event, (SetupSucceeded, SetupFailed, LaunchLost)):
            if not self.starting:
                return []  # no setup under way for this incarnation
            self.starting = False
        if isinstance(event, SetupSucceeded):
            self.setup_failures = 0
            self.last_error = None
            return self._set(ReplicaState.HEALTHY)
        if isinstance(event, SetupFailed):
            self.setup_failures += 1
            self.last_error = event.error
            failed_on = frozenset({self.worker})
            self.worker = None
            if self.setup_failures >= self.max_setup_attempts:
                return self._set(ReplicaState.UNHEALTHY)
            return self._relaunch(failed_on)
        if isinstance(event, LaunchLost):
            self.last_error = event.error
            failed_on = frozenset({self.worker})
            self.worker = None
            return self._relaunch(failed_on)
        if isinstance(event, ProbeFailed):
            if self.state is not ReplicaState.HEALTHY:
                return []
            old_id, old_worker = self.id, self.worker
            self.last_error = f"health probe failed: {event.error}"
            return [Stop(old_id, old_worker, drain=False)] + self._recover(
                frozenset({old_worker}))
        raise TypeError(f"unknown event {event!r}")

    # ------------------------------------------------------------ helpers

    def _recover(self, exclude: frozenset[str]) -> list[Action]:
        self.worker = None
        actions: list[Action] = []
        if self.state is ReplicaState.HEALTHY:
            actions += self._set(ReplicaState.RECOVERING)
        return actions + self._relaunch(exclude)

    def _relaunch(self, exclude: frozenset[str]) -> list[Action]:
        self.incarnation += 1
        self.worker = None
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
