"""What the run machine (``_run_state``) takes and returns: its events (what happened, from
scheduler callbacks and worker messages) and its actions (what the plugin carries out).
Every one is a frozen dataclass with a ``stimulus_id``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dask.typing import Key

from dask_services._run_model import RunSnapshot, stimulus_field
from dask_services.service import ServiceId

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class RunNeeded:
    """The plugin's answer to :class:`PrepareRun`: the facts a new run is made of."""

    run_id: int  # a fresh number; used only if a run is created
    id_prefix: str
    participants: Sequence[str]
    wanted: Sequence[Key]
    placement: dict[Key, str] | None = None  # output -> worker, to agree with other runs
    # ``participants="involved"`` with every input located: the workers holding (or
    # computing) the inputs; the participants that are not among them and own no output
    # are left out of the run
    input_holders: frozenset[str] | None = None
    # where the round-robin of outputs without a place starts among the participants: the
    # plugin carries it on from run to run, so that many small runs (the regions of one
    # rechunk) spread their outputs over the workers instead of each starting at the first
    first_owner: int = 0
    stimulus_id: str = stimulus_field("run-needed")


@dataclass(frozen=True)
class HandOffScheduled:
    """A hand-off of input ``key`` is about to run: a run must exist to receive it."""

    key: Key
    stimulus_id: str = stimulus_field("hand-off-scheduled")


@dataclass(frozen=True)
class WorkerAdded:
    """A worker joined: a service task without inputs that found no worker may start."""

    worker: str
    stimulus_id: str = stimulus_field("worker-added")


@dataclass(frozen=True)
class GraphRejected:
    """The graph breaks a rule of service tasks: the service task errs with ``error``."""

    error: BaseException
    stimulus_id: str = stimulus_field("graph-rejected")


@dataclass(frozen=True)
class InstanceStarted:
    run_id: int
    id: ServiceId
    stimulus_id: str = stimulus_field("instance-started")


@dataclass(frozen=True)
class InputHandedOff:
    """Instance ``id`` of run ``run_id`` took input ``key``."""

    run_id: int
    key: Key
    id: ServiceId | None = None
    stimulus_id: str = stimulus_field("input-handed-off")


@dataclass(frozen=True)
class OutputProduced:
    run_id: int
    key: Key
    worker: str
    stimulus_id: str = stimulus_field("output-produced")


@dataclass(frozen=True)
class HooksReturned:
    """Instance ``id``'s ``all_inputs_done`` returned without failing."""

    run_id: int
    id: ServiceId
    stimulus_id: str = stimulus_field("hooks-returned")


@dataclass(frozen=True)
class UnproducedChecked:
    """The wait asked for by :class:`WatchUnproduced` is over: ``produced`` outputs had
    been produced when it began."""

    run_id: int
    produced: int
    stimulus_id: str = stimulus_field("unproduced-checked")


@dataclass(frozen=True)
class OutputLanded:
    """A produced output reached memory (or was forgotten before it could)."""

    key: Key
    stimulus_id: str = stimulus_field("output-landed")


@dataclass(frozen=True)
class OutputNotNeeded:
    """A produced output cannot be released (nobody wants it any more): drop it."""

    key: Key
    worker: str
    stimulus_id: str = stimulus_field("output-not-needed")


@dataclass(frozen=True)
class OutputLost:
    """A produced output that had not reached memory was lost with its worker."""

    key: Key
    stimulus_id: str = stimulus_field("output-lost")


@dataclass(frozen=True)
class OutputUnproduced:
    """An output that no run produced is about to run: its value does not exist."""

    key: Key
    stimulus_id: str = stimulus_field("output-unproduced")


@dataclass(frozen=True)
class OutputWaiting:
    """Output ``key`` is waiting for its service task (asked for, or lost, again)."""

    key: Key
    stimulus_id: str = stimulus_field("output-waiting")


@dataclass(frozen=True)
class OutputsWanted:
    """A new graph arrived: ``wanted`` are the outputs not in memory now."""

    wanted: Sequence[Key]
    stimulus_id: str = stimulus_field("outputs-wanted")


@dataclass(frozen=True)
class RunFailed:
    run_id: int
    error: BaseException
    stimulus_id: str = stimulus_field("run-failed")


@dataclass(frozen=True)
class RestartRequested:
    run_id: int
    reason: str
    stimulus_id: str = stimulus_field("restart-requested")


@dataclass(frozen=True)
class WantedGrew:
    """Outputs the live run does not produce are wanted now: start over, not a failure."""

    reason: str
    stimulus_id: str = stimulus_field("wanted-grew")


@dataclass(frozen=True)
class WorkerLost:
    worker: str
    stimulus_id: str = stimulus_field("worker-lost")


@dataclass(frozen=True)
class WorkerRetiring:
    """``worker`` is being retired gracefully (its status is ``closing_gracefully``): it
    runs no new task, and leaves once the scheduler has moved the data it holds."""

    worker: str
    stimulus_id: str = stimulus_field("worker-retiring")


@dataclass(frozen=True)
class ServiceTaskProcessing:
    """The service task itself was sent to ``worker`` (it waits there for the outcome)."""

    worker: str
    stimulus_id: str = stimulus_field("service-task-processing")


@dataclass(frozen=True)
class ServiceTaskExecuting:
    """The service task started waiting for its outcome on ``worker`` without having it
    there: the scheduler may have moved it without a transition (work stealing takes a
    task from a worker's queue to another's), so an outcome sent before went elsewhere."""

    worker: str
    stimulus_id: str = stimulus_field("service-task-executing")


@dataclass(frozen=True)
class OutcomeUndelivered:
    """The outcome could not be delivered: the service task left ``processing`` on the
    worker it was meant for; it runs on ``worker`` now (None: nowhere yet)."""

    error: BaseException | None
    worker: str | None
    stimulus_id: str = stimulus_field("outcome-undelivered")


@dataclass(frozen=True)
class ServiceTaskReleased:
    """The service task left ``processing`` without finishing.

    ``still_wanted``: its outputs are still wanted, so it left because the worker running it
    died (``worker_gone``) or because a hand-off receipt it needed was lost with a worker;
    a live run is then restarted, and after a finished run the hand-offs run again.  With
    every receipt still in memory (``inputs_kept``) and its worker alive, a live run goes
    on.  Otherwise nobody wants the outputs any more: cancelled.
    """

    worker_gone: bool = False
    still_wanted: bool = False
    # every hand-off receipt it depends on is still in memory: it will run again with all
    # of them, and the live run has lost nothing
    inputs_kept: bool = False
    # released to run again because it erred and has ``retries`` left (not because an
    # execution of it that a restart had cancelled answered)
    retried: bool = False
    stimulus_id: str = stimulus_field("service-task-released")


@dataclass(frozen=True)
class RescheduleCarriedOut:
    """The scheduler is about to carry out the last ``RescheduleServiceTask`` (release the
    service task and its hand-offs); until then no new run may start."""

    run_id: int | None = None  # the run whose end asked for it
    stimulus_id: str = stimulus_field("reschedule-carried-out")


@dataclass(frozen=True)
class ServiceTaskDone:
    """The service task reached memory or erred: the outcome was delivered, or the
    scheduler erred it (``KilledWorker``: its workers kept dying while it waited)."""

    erred: bool = False
    stimulus_id: str = stimulus_field("service-task-done")


@dataclass(frozen=True)
class ServiceTaskForgotten:
    """The scheduler forgot the service task: a live run is cancelled."""

    stimulus_id: str = stimulus_field("service-task-forgotten")


Event = (
    RunNeeded
    | HandOffScheduled
    | WorkerAdded
    | GraphRejected
    | InstanceStarted
    | InputHandedOff
    | OutputProduced
    | HooksReturned
    | UnproducedChecked
    | OutputLanded
    | OutputNotNeeded
    | OutputLost
    | OutputUnproduced
    | OutputWaiting
    | RescheduleCarriedOut
    | OutputsWanted
    | RunFailed
    | RestartRequested
    | WantedGrew
    | WorkerLost
    | WorkerRetiring
    | ServiceTaskProcessing
    | ServiceTaskExecuting
    | OutcomeUndelivered
    | ServiceTaskReleased
    | ServiceTaskDone
    | ServiceTaskForgotten
)

# ---------------------------------------------------------------- actions
# ``stimulus_id`` is the id of the event that caused the action (set by ``handle``); it
# does not take part in comparisons.


def _action_stimulus() -> Any:
    return field(default="", kw_only=True, compare=False)


@dataclass(frozen=True)
class PrepareRun:
    """A run may start: gather its facts (participants, wanted outputs, placement) and
    answer with :class:`RunNeeded`."""

    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class StartInstances:
    run: RunSnapshot
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class BroadcastAllStarted:
    run: RunSnapshot
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class BroadcastInputsDone:
    run: RunSnapshot
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class ReleaseOutput:
    """Cut the output's edge to the service task and let it reach memory on ``worker``."""

    key: Key
    worker: str
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class DropOutput:
    """A value produced on ``worker`` will never be used (stale run, duplicate): drop it."""

    key: Key
    worker: str
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class WatchUnproduced:
    """Every hook of the run returned and wanted outputs are not produced: wait
    ``dask_services.unproduced-timeout``, then answer with :class:`UnproducedChecked`
    (``produced``: the outputs produced now)."""

    run_id: int
    produced: int
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class StopInstances:
    run: RunSnapshot
    reason: str
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class NotifyServiceTask:
    """Tell the waiting service task on ``worker`` to finish (or to raise ``error``)."""

    worker: str
    error: BaseException | None
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class ErrWaitingServiceTask:
    """The run failed while its service task waits for inputs (it runs on no worker, so
    no worker can raise ``error`` for it): err it in the scheduler now, if it still waits,
    rather than once its last input is computed.  (Otherwise the error stays pending and
    goes to wherever it runs.)"""

    error: BaseException
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class RescheduleServiceTask:
    """Release the service task and its hand-offs so that a new run gets every input."""

    reason: str
    run_id: int | None = None  # the run that is over
    stimulus_id: str = _action_stimulus()


@dataclass(frozen=True)
class Log:
    action: str  # "started" | "finished" | "failed" | "restarted" | "cancelled"
    run_id: int
    detail: str = ""
    stimulus_id: str = _action_stimulus()


Action = (
    PrepareRun
    | StartInstances
    | BroadcastAllStarted
    | BroadcastInputsDone
    | ReleaseOutput
    | DropOutput
    | WatchUnproduced
    | StopInstances
    | NotifyServiceTask
    | ErrWaitingServiceTask
    | RescheduleServiceTask
    | Log
)

# Per-key events and actions: many per run.  A story keeps them apart from the run's
# milestones, so that a large run's routine never pushes its start out of the story.
ROUTINE: frozenset[type] = frozenset({
    HandOffScheduled, InstanceStarted, InputHandedOff, OutputProduced, OutputLanded,
    OutputNotNeeded, OutputWaiting, ReleaseOutput, DropOutput, HooksReturned,
})
