"""The lifecycle of a service task's runs, as a pure state machine: events in, actions out.

The scheduler plugin feeds events (a hand-off was scheduled, an instance started, an input
was handed off, an output was produced, a worker left...) to one :class:`ServiceTaskMachine`
per service task and carries out the actions it returns.  Nothing here touches the network
or the scheduler, so every transition is testable without a cluster.

Lifecycle of one run::

    (no run) --RunNeeded--> STARTING --all InstanceStarted--> RUNNING
    RUNNING --all InputHandedOff--> INPUTS_DONE --all wanted OutputProduced--> FINISHED
    any live phase --RunFailed--> FAILED
    any live phase --RestartRequested / participant WorkerLost--> (no run; next RunNeeded)
    any live phase --ServiceTaskReleased--> (no run)

The barrier (``all_inputs_done``) is sent once every input was handed off *and* every
instance has started, so ``all_started`` always comes first.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from dask_services.service import ProduceKeyError, ServiceId, TooManyRestarts

Key = Hashable


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    INPUTS_DONE = "inputs-done"
    FINISHED = "finished"
    FAILED = "failed"


LIVE_PHASES = frozenset({Phase.STARTING, Phase.RUNNING, Phase.INPUTS_DONE})


@dataclass
class Run:
    """One attempt at a service task."""

    run_id: int
    participants: tuple[str, ...]  # worker addresses, in placement order
    ids: dict[str, ServiceId]  # worker address -> instance id
    wanted: tuple[Key, ...]
    owners: dict[Key, ServiceId]
    leader: ServiceId
    phase: Phase = Phase.STARTING
    started: set[ServiceId] = field(default_factory=set)
    handed_off: set[Key] = field(default_factory=set)
    produced: dict[Key, str] = field(default_factory=dict)
    landed: set[Key] = field(default_factory=set)  # produced and in memory (or gone)
    concluded: bool = False

    def __post_init__(self) -> None:
        # membership tests once per event: a tuple would make a run quadratic in its outputs
        self.wanted_set = frozenset(self.wanted)

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES

    @property
    def worker_of(self) -> dict[ServiceId, str]:
        return {sid: w for w, sid in self.ids.items()}


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class RunNeeded:
    """A hand-off (or a service task without inputs) is about to run; a run must exist."""

    run_id: int  # a fresh number; used only if a run is created
    id_prefix: str
    participants: Sequence[str]
    wanted: Sequence[Key]
    placement: dict[Key, str] | None = None  # output -> worker, to agree with other runs


@dataclass(frozen=True)
class InstanceStarted:
    run_id: int
    id: ServiceId


@dataclass(frozen=True)
class InputHandedOff:
    run_id: int
    key: Key


@dataclass(frozen=True)
class OutputProduced:
    run_id: int
    key: Key
    worker: str


@dataclass(frozen=True)
class OutputLanded:
    """A produced output reached memory (or was forgotten before it could)."""

    key: Key


@dataclass(frozen=True)
class RunFailed:
    run_id: int
    error: BaseException


@dataclass(frozen=True)
class RestartRequested:
    run_id: int
    reason: str


@dataclass(frozen=True)
class WantedGrew:
    """Outputs the live run does not produce are wanted now: start over, not a failure."""

    reason: str


@dataclass(frozen=True)
class WorkerLost:
    worker: str


@dataclass(frozen=True)
class ServiceTaskProcessing:
    """The service task itself was sent to ``worker`` (it waits there for the outcome)."""

    worker: str


@dataclass(frozen=True)
class ServiceTaskReleased:
    """The service task left ``processing`` without finishing.

    ``still_wanted``: its outputs are still wanted, so it left because the worker running it
    died (``worker_gone``) or because a hand-off receipt it needed was lost with a worker;
    a live run is then restarted.  Otherwise nobody wants the outputs any more: cancelled.
    """

    worker_gone: bool = False
    still_wanted: bool = False


@dataclass(frozen=True)
class ServiceTaskDone:
    """The service task reached memory or erred; the outcome was delivered."""


Event = (
    RunNeeded
    | InstanceStarted
    | InputHandedOff
    | OutputProduced
    | OutputLanded
    | RunFailed
    | RestartRequested
    | WantedGrew
    | WorkerLost
    | ServiceTaskProcessing
    | ServiceTaskReleased
    | ServiceTaskDone
)

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class StartInstances:
    run: Run


@dataclass(frozen=True)
class BroadcastAllStarted:
    run: Run


@dataclass(frozen=True)
class BroadcastInputsDone:
    run: Run


@dataclass(frozen=True)
class ReleaseOutput:
    """Cut the output's edge to the service task and let it reach memory on ``worker``."""

    key: Key
    worker: str


@dataclass(frozen=True)
class DropOutput:
    """A value produced on ``worker`` will never be used (stale run, duplicate): drop it."""

    key: Key
    worker: str


@dataclass(frozen=True)
class StopInstances:
    run: Run
    reason: str


@dataclass(frozen=True)
class NotifyServiceTask:
    """Tell the waiting service task on ``worker`` to finish (or to raise ``error``)."""

    worker: str
    error: BaseException | None


@dataclass(frozen=True)
class RescheduleServiceTask:
    """Release the service task and its hand-offs so that a new run gets every input."""

    reason: str


@dataclass(frozen=True)
class Log:
    action: str  # "started" | "finished" | "failed" | "restarted" | "cancelled"
    run_id: int
    detail: str = ""


Action = (
    StartInstances
    | BroadcastAllStarted
    | BroadcastInputsDone
    | ReleaseOutput
    | DropOutput
    | StopInstances
    | NotifyServiceTask
    | RescheduleServiceTask
    | Log
)


class ServiceTaskMachine:
    """Scheduler-side state of one service task across its runs."""

    def __init__(
        self,
        key: Key,
        input_keys: Sequence[Key],
        output_keys: Sequence[Key],
        max_restarts: int,
    ) -> None:
        self.key = key
        self.input_keys = tuple(input_keys)
        self.input_key_set = frozenset(self.input_keys)
        self.output_keys = tuple(output_keys)
        self.output_key_set = frozenset(self.output_keys)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.run: Run | None = None
        self.task_worker: str | None = None
        # Outcome decided but not yet delivered to the service task: (error,)
        self.pending_outcome: tuple[BaseException | None] | None = None
        # Set when the graph breaks a rule of service tasks; the task then errs with it.
        self.graph_error: BaseException | None = None

    # ------------------------------------------------------------ helpers

    @property
    def live_run(self) -> Run | None:
        return self.run if self.run is not None and self.run.live else None

    def _current(self, run_id: int) -> Run | None:
        run = self.live_run
        return run if run is not None and run.run_id == run_id else None

    def _conclude(self, error: BaseException | None) -> list[Action]:
        if self.task_worker is not None:
            return [NotifyServiceTask(self.task_worker, error)]
        self.pending_outcome = (error,)
        return []

    def _maybe_barrier(self, run: Run) -> list[Action]:
        if (
            run.phase is Phase.RUNNING
            and len(run.handed_off) == len(self.input_keys)
        ):
            run.phase = Phase.INPUTS_DONE
            return [BroadcastInputsDone(run)]
        return []

    def _maybe_finished(self, run: Run) -> list[Action]:
        if run.phase is Phase.INPUTS_DONE and len(run.produced) == len(run.wanted):
            return self._finish(run)
        return []

    def _finish(self, run: Run) -> list[Action]:
        run.phase = Phase.FINISHED
        return [
            StopInstances(run, "finished"),
            Log("finished", run.run_id, f"{len(run.produced)} outputs produced"),
            *self._maybe_conclude(run),
        ]

    def _maybe_conclude(self, run: Run) -> list[Action]:
        """The service task finishes once every produced output has landed in memory, so
        that each output is attached to it again (and can be recomputed through it)."""
        # landed only ever holds produced keys (see _on_OutputLanded), so equal sizes mean
        # every produced output landed
        if run.phase is Phase.FINISHED and not run.concluded \
                and len(run.landed) == len(run.produced):
            run.concluded = True
            return self._conclude(None)
        return []

    def _fail(self, run: Run | None, error: BaseException) -> list[Action]:
        actions: list[Action] = []
        if run is not None:
            run.phase = Phase.FAILED
            actions.append(StopInstances(run, f"failed: {error!r}"))
            actions.append(Log("failed", run.run_id, repr(error)))
        return actions + self._conclude(error)

    def _restart(self, run: Run, reason: str, counted: bool = True) -> list[Action]:
        self.restarts += counted
        if self.restarts > self.max_restarts:
            error = TooManyRestarts(
                f"service task {self.key!r} was restarted {self.restarts - 1} times, "
                f"more than dask_services.restarts={self.max_restarts} allows; the "
                f"last restart was because {reason}. Raise the `dask_services.restarts` "
                "config value if your workers are expected to come and go."
            )
            return self._fail(run, error)
        run.phase = Phase.FAILED
        self.run = None
        return [
            StopInstances(run, f"restarting: {reason}"),
            Log("restarted", run.run_id, reason),
            RescheduleServiceTask(reason),
        ]

    # ------------------------------------------------------------ events

    def handle(self, event: Event) -> list[Action]:
        method = getattr(self, "_on_" + type(event).__name__)
        return method(event)

    def _on_RunNeeded(self, ev: RunNeeded) -> list[Action]:
        if self.live_run is not None or self.pending_outcome is not None:
            return []
        if self.graph_error is not None:
            return []
        if self.run is not None and self.run.phase is Phase.FINISHED and self.task_worker:
            return []  # finished; the service task is about to reach memory
        if not ev.participants:
            return []  # no worker yet; the plugin asks again when one arrives
        participants = tuple(ev.participants)
        ids = {
            w: ServiceId(f"{ev.id_prefix}{ev.run_id}.{i}")
            for i, w in enumerate(participants)
        }
        wanted = tuple(ev.wanted)
        owners = {key: ids[w] for key, w in
                  _owners(wanted, participants, ev.placement or {}).items()}
        run = Run(
            run_id=ev.run_id,
            participants=participants,
            ids=ids,
            wanted=wanted,
            owners=owners,
            leader=ids[participants[0]],
        )
        self.run = run
        return [StartInstances(run), Log("started", run.run_id, f"on {len(ids)} workers")]

    def _on_InstanceStarted(self, ev: InstanceStarted) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None or ev.id not in run.worker_of:
            return []
        run.started.add(ev.id)
        if run.phase is Phase.STARTING and len(run.started) == len(run.ids):
            run.phase = Phase.RUNNING
            actions: list[Action] = [BroadcastAllStarted(run)]
            actions += self._maybe_barrier(run)
            actions += self._maybe_finished(run)
            return actions
        return []

    def _on_InputHandedOff(self, ev: InputHandedOff) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None or ev.key not in self.input_key_set:
            return []
        run.handed_off.add(ev.key)
        return self._maybe_barrier(run) + self._maybe_finished(run)

    def _on_OutputProduced(self, ev: OutputProduced) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None:
            return [DropOutput(ev.key, ev.worker)]
        if ev.key not in run.wanted_set and ev.key in self.output_key_set:
            # not wanted by this run (its instances drop such values themselves; this one
            # came from elsewhere): dropped, not an error
            return [DropOutput(ev.key, ev.worker)]
        if ev.key not in run.wanted_set or ev.key in run.produced:
            return [DropOutput(ev.key, ev.worker), *self._reject_produced(run, ev)]
        run.produced[ev.key] = ev.worker
        return [ReleaseOutput(ev.key, ev.worker), *self._maybe_finished(run)]

    def _reject_produced(self, run: Run, ev: OutputProduced) -> list[Action]:
        if ev.key not in run.wanted_set:
            return self._fail(
                run,
                ProduceKeyError(
                    f"{ev.key!r} is not an output of service task {self.key!r}"
                ),
            )
        return self._fail(
            run,
            ProduceKeyError(
                f"output {ev.key!r} of service task {self.key!r} was produced twice "
                f"(on {run.produced[ev.key]} and on {ev.worker}); produce each "
                "output once, e.g. only on `concierge.owner(key)`"
            ),
        )

    def _on_OutputLanded(self, ev: OutputLanded) -> list[Action]:
        run = self.run
        if run is None or ev.key not in run.produced:
            return []
        run.landed.add(ev.key)
        return self._maybe_conclude(run)

    def _on_RunFailed(self, ev: RunFailed) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None:
            return []
        return self._fail(run, ev.error)

    def _on_RestartRequested(self, ev: RestartRequested) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None:
            return []
        return self._restart(run, ev.reason)

    def _on_WantedGrew(self, ev: WantedGrew) -> list[Action]:
        run = self.live_run
        if run is None:
            return []
        return self._restart(run, ev.reason, counted=False)

    def _on_WorkerLost(self, ev: WorkerLost) -> list[Action]:
        actions: list[Action] = []
        if self.task_worker == ev.worker:
            self.task_worker = None
        run = self.live_run
        if run is not None and ev.worker in run.ids:
            actions += self._restart(run, f"worker {ev.worker} left the cluster")
        return actions

    def _on_ServiceTaskProcessing(self, ev: ServiceTaskProcessing) -> list[Action]:
        self.task_worker = ev.worker
        if self.pending_outcome is not None:
            (error,) = self.pending_outcome
            self.pending_outcome = None
            return [NotifyServiceTask(ev.worker, error)]
        return []

    def _on_ServiceTaskReleased(self, ev: ServiceTaskReleased) -> list[Action]:
        worker, self.task_worker = self.task_worker, None
        run = self.live_run
        if run is not None and ev.worker_gone:
            return self._restart(run, f"worker {worker} left the cluster")
        if run is not None and ev.still_wanted:
            return self._restart(run, "an input it had received was lost with its worker")
        if run is None:
            if self.run is not None and self.run.phase is Phase.FINISHED:
                # Finished but the task was released before reaching memory (e.g. it was
                # cancelled): a later run will produce whatever is still missing.
                self.run = None
            self.pending_outcome = None
            return []
        run.phase = Phase.FAILED
        self.run = None
        self.pending_outcome = None
        return [StopInstances(run, "cancelled"), Log("cancelled", run.run_id)]

    def _on_ServiceTaskDone(self, ev: ServiceTaskDone) -> list[Action]:
        self.task_worker = None
        self.pending_outcome = None
        self.run = None
        self.restarts = 0
        return []


def _owners(wanted: Sequence[Key], participants: Sequence[str],
            placement: dict[Key, str]) -> dict[Key, str]:
    """The worker of every wanted output: its place in ``placement`` where that is a
    participant; the others round-robin, or, once some are placed, each to the participant
    with the fewest outputs so far."""
    present = set(participants)
    chosen = {key: placement[key] for key in wanted if placement.get(key) in present}
    load = dict.fromkeys(participants, 0)
    for worker in chosen.values():
        load[worker] += 1
    rest = [key for key in wanted if key not in chosen]
    for i, key in enumerate(rest):
        if chosen:
            worker = min(participants, key=load.__getitem__)
        else:
            worker = participants[i % len(participants)]
        chosen[key] = worker
        load[worker] += 1
    return {key: chosen[key] for key in wanted}
