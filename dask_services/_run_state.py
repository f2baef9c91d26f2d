"""The lifecycle of a service task's runs, as a closed state machine: events in, actions out.

The scheduler plugin translates scheduler callbacks and worker messages into events (a
hand-off was scheduled, an instance started, an input was handed off, an output was
produced, a worker left...), feeds them to one :class:`ServiceTaskMachine` per service
task and carries out the actions it returns; every decision about a run is made here.
Nothing here touches the network or the scheduler, so every transition is testable without
a cluster.  Modelled on distributed's ``worker_state_machine``: every event and action
carries a ``stimulus_id``; the machine keeps a bounded story per run of what it received,
decided and sent (``story()``); ``validate()`` checks its invariants, after every event when
``validating`` (``distributed.scheduler.validate``); actions carry immutable
:class:`RunSnapshot` objects, never the live :class:`Run`.  The events and actions are
defined in ``_run_events``, the run's data in ``_run_model`` and its story in
``_run_story``; this module is the machine.

Lifecycle of one run::

    (no run) --RunNeeded--> STARTING --all InstanceStarted--> RUNNING
    RUNNING --all InputHandedOff--> INPUTS_DONE --all wanted OutputProduced--> FINISHED
    INPUTS_DONE --all HooksReturned, then no OutputProduced for a while--> FAILED
    any live phase --RunFailed--> FAILED
    any live phase --RestartRequested / participant WorkerLost or WorkerRetiring /
                     OutputLost / WantedGrew / OutputsWanted / OutputWaiting-->
                     (no run; next RunNeeded)
    any live phase --ServiceTaskReleased / ServiceTaskForgotten--> (no run)
    FINISHED or FAILED --ServiceTaskReleased, still wanted (lost, or retried)-->
                     (no run; its hand-offs run again, then RunNeeded)

The barrier (``all_inputs_done``) is sent once every input was handed off *and* every
instance has started, so ``all_started`` always comes first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import dask.config
from dask.typing import Key

from dask_services._run_events import (
    ROUTINE,
    Action,
    BroadcastAllStarted,
    BroadcastInputsDone,
    DropOutput,
    ErrWaitingServiceTask,
    Event,
    GraphRejected,
    HandOffScheduled,
    HooksReturned,
    InputHandedOff,
    InstanceStarted,
    Log,
    NotifyServiceTask,
    OutcomeUndelivered,
    OutputLanded,
    OutputLost,
    OutputNotNeeded,
    OutputProduced,
    OutputsWanted,
    OutputUnproduced,
    OutputWaiting,
    PrepareRun,
    ReleaseOutput,
    RescheduleCarriedOut,
    RescheduleServiceTask,
    RestartRequested,
    RunFailed,
    RunNeeded,
    ServiceTaskDone,
    ServiceTaskExecuting,
    ServiceTaskForgotten,
    ServiceTaskProcessing,
    ServiceTaskReleased,
    StartInstances,
    StopInstances,
    UnproducedChecked,
    WantedGrew,
    WatchUnproduced,
    WorkerAdded,
    WorkerLost,
    WorkerRetiring,
)
from dask_services._run_model import Phase, Run
from dask_services._run_story import RunStory, StoryEntry, next_seq, story_limits
from dask_services.service import (
    OutputsNotProducedError,
    ProduceKeyError,
    ServiceId,
    TooManyRestarts,
)

# ---------------------------------------------------------------- the machine


class ServiceTaskMachine:
    """Scheduler-side state of one service task across its runs."""

    _handlers: ClassVar[dict[type, Callable[[ServiceTaskMachine, Any], list[Action]]]]

    def __init__(
        self,
        key: Key,
        input_keys: Sequence[Key],
        output_keys: Sequence[Key],
        max_restarts: int,
        validating: bool | None = None,
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
        # A RescheduleServiceTask not yet carried out: a run started meanwhile (the service
        # task placed again by the scheduler as the worker left) would be released by it,
        # which would count as one more restart, and so on until TooManyRestarts.
        self.rescheduling = False
        # The workers of the last run that finished, and why one of them left since: the
        # next run is then a restart (its outputs, or the service task, were lost with it).
        self.finished_on: frozenset[str] = frozenset()
        # The error the service task was told to err with, until it erred: an execution of
        # it that a restart had cancelled may take it instead (the scheduler then releases
        # the task and runs it again), and the next execution must get it too.
        self.failure: BaseException | None = None
        # Set once the restarts are used up, until a retry (``retries=``)
        self.exhausted: TooManyRestarts | None = None
        self.lost_since_finished: str | None = None
        if validating is None:
            validating = bool(dask.config.get("distributed.scheduler.validate", False))
        self.validating = validating
        self.story_entries, self.story_runs = story_limits()
        self.stories: OrderedDict[int | None, RunStory] = OrderedDict()

    # ------------------------------------------------------------ helpers

    @property
    def live_run(self) -> Run | None:
        return self.run if self.run is not None and self.run.live else None

    def worker_that_took(self, input_key: Key) -> str | None:
        """The worker of the live run's instance that took ``input_key``, if one did: a
        hand-off of that input run again goes there, whose instance ignores a key it
        took, rather than to another instance, which would take it a second time."""
        run = self.live_run
        sid = None if run is None else run.taken_by.get(input_key)
        return None if sid is None else run.worker_of.get(sid)

    def workers_in_use(self) -> set[str]:
        """The workers this service task's run needs until it is over: every participant
        of a live run (its instances hold what they received, which the scheduler does
        not see), and the workers holding outputs produced but not yet in memory."""
        run = self.run
        if run is None:
            return set()
        in_use = set(run.participants) if run.live else set()
        in_use.update(worker for key, worker in run.produced.items()
                      if key not in run.landed)
        return in_use

    def _current(self, run_id: int) -> Run | None:
        run = self.live_run
        return run if run is not None and run.run_id == run_id else None

    def _may_start(self) -> bool:
        """Whether a new run may start now (facts permitting)."""
        if self.live_run is not None or self.pending_outcome is not None:
            return False
        if self.rescheduling:
            return False
        if self.graph_error is not None or self.failure is not None:
            return False  # the service task is to err
        # finished; the service task is about to reach memory
        return not (self.run is not None and self.run.phase is Phase.FINISHED
                    and self.task_worker)

    def _conclude(self, error: BaseException | None) -> list[Action]:
        if self.task_worker is not None:
            return [NotifyServiceTask(self.task_worker, error)]
        self.pending_outcome = (error,)
        return [] if error is None else [ErrWaitingServiceTask(error)]

    def _maybe_barrier(self, run: Run) -> list[Action]:
        if (
            run.phase is Phase.RUNNING
            and len(run.handed_off) == len(self.input_keys)
        ):
            run.phase = Phase.INPUTS_DONE
            return [BroadcastInputsDone(run.snapshot())]
        return []

    def _maybe_finished(self, run: Run) -> list[Action]:
        if run.phase is Phase.INPUTS_DONE and len(run.produced) == len(run.wanted):
            return self._finish(run)
        return []

    def _finish(self, run: Run) -> list[Action]:
        run.phase = Phase.FINISHED
        self.finished_on = frozenset(run.participants)
        self.lost_since_finished = None
        return [
            StopInstances(run.snapshot(), "finished"),
            Log("finished", run.run_id, f"{len(run.produced)} output"
                f"{'s' if len(run.produced) != 1 else ''} produced"),
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
        # The service task errs. Its count of restarts stays: distributed runs an erred
        # task again when an input it had is lost and recomputed, and a run then would
        # start the loop again; only a retry (``retries=``) starts from none.
        self.failure = error
        actions: list[Action] = []
        if run is not None:
            run.phase = Phase.FAILED
            actions.append(StopInstances(run.snapshot(), f"failed: {error!r}"))
            actions.append(Log("failed", run.run_id, repr(error)))
        return actions + self._conclude(error)

    def _restart(self, run: Run, reason: str, counted: bool = True) -> list[Action]:
        self.restarts += counted
        if self.restarts > self.max_restarts:
            self.exhausted = self._too_many_restarts(reason)
            return self._fail(run, self.exhausted)
        run.phase = Phase.FAILED
        self.run = None
        self.rescheduling = True
        return [
            StopInstances(run.snapshot(), f"restarting: {reason}"),
            Log("restarted", run.run_id, reason),
            RescheduleServiceTask(reason, run.run_id),
        ]

    def _too_many_restarts(self, reason: str) -> TooManyRestarts:
        return TooManyRestarts(
            f"service task {self.key!r} was restarted {self.restarts - 1} times and "
            f"needed one more, more than dask_services.restarts={self.max_restarts} "
            f"allows; the last restart was needed because {reason}. Raise the "
            "`dask_services.restarts` config value if your workers are expected to come "
            "and go; if their nannies restarted them for exceeding their memory limit "
            "(see the workers' logs), a partition may be larger than a worker's memory: "
            "split the work into more partitions or give workers more memory."
        )

    # ------------------------------------------------------------ events

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; returns the actions to carry out, in order, each stamped with
        the event's ``stimulus_id``.  An event type without a handler raises."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"{type(self).__name__} has no handler for {event!r}")
        before = self._state()
        run_before = self.run
        actions = handler(self, event)
        stimulus_id = event.stimulus_id
        actions = [a if a.stimulus_id else replace(a, stimulus_id=stimulus_id)
                   for a in actions]
        self._tell_story(event, run_before, before, actions)
        if self.validating:
            self.validate()
        return actions

    def _on_RunNeeded(self, ev: RunNeeded) -> list[Action]:
        if not self._may_start():
            return []
        if not ev.participants:
            return []  # no worker yet; the plugin asks again when one arrives
        if self.exhausted is not None:
            # erred with TooManyRestarts, then run again by distributed (an input it had
            # was lost and recomputed): errs again, or the losses go on for ever
            return self._fail(None, self.exhausted)
        again = ""
        if self.lost_since_finished is not None:
            # Produced once, then lost with a worker: counted as a restart, whatever
            # finished in between, so that outputs lost again and again (a worker killed
            # each time it holds one) end in TooManyRestarts instead of running for ever.
            reason, self.lost_since_finished = self.lost_since_finished, None
            again = f", again: {reason} (counted as a restart)"
            self.restarts += 1
            if self.restarts > self.max_restarts:
                self.exhausted = self._too_many_restarts(reason)
                return self._fail(None, self.exhausted)
        participants = tuple(ev.participants)
        wanted = tuple(ev.wanted)
        owner_workers = _owners(wanted, participants, ev.placement or {}, ev.first_owner)
        if ev.input_holders is not None:
            involved = ev.input_holders | set(owner_workers.values())
            participants = tuple(w for w in participants if w in involved)
        ids = {
            w: ServiceId(f"{ev.id_prefix}{ev.run_id}.{i}")
            for i, w in enumerate(participants)
        }
        owners = {key: ids[w] for key, w in owner_workers.items()}
        run = Run(
            run_id=ev.run_id,
            participants=participants,
            ids=ids,
            wanted=wanted,
            owners=owners,
            leader=ids[participants[0]],
        )
        self.run = run
        return [StartInstances(run.snapshot()),
                Log("started", run.run_id,
                    f"on {len(ids)} worker{'s' if len(ids) != 1 else ''}{again}")]

    def _on_HandOffScheduled(self, ev: HandOffScheduled) -> list[Action]:
        return [PrepareRun()] if self._may_start() else []

    def _on_WorkerAdded(self, ev: WorkerAdded) -> list[Action]:
        # a service task without inputs, processing, that found no worker to run on
        if not self.input_keys and self.task_worker is not None and self._may_start():
            return [PrepareRun()]
        return []

    def _on_GraphRejected(self, ev: GraphRejected) -> list[Action]:
        self.graph_error = ev.error
        return []

    def _on_InstanceStarted(self, ev: InstanceStarted) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None or ev.id not in run.worker_of:
            return []
        run.started.add(ev.id)
        if run.phase is Phase.STARTING and len(run.started) == len(run.ids):
            run.phase = Phase.RUNNING
            actions: list[Action] = [BroadcastAllStarted(run.snapshot())]
            actions += self._maybe_barrier(run)
            actions += self._maybe_finished(run)
            return actions
        return []

    def _on_InputHandedOff(self, ev: InputHandedOff) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None or ev.key not in self.input_key_set:
            return []
        if ev.id is not None:
            first = run.taken_by.setdefault(ev.key, ev.id)
            if first != ev.id and run.live:
                # its hand-off ran again on another worker (its result lost with its
                # worker, or its execution released) before the first instance's report
                # came, and gave the input to a second instance: it would count twice
                return self._restart(run, f"input {ev.key!r} was taken by two instances, "
                                          f"{first} and {ev.id} (its hand-off ran again "
                                          "on another worker)")
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

    def _on_HooksReturned(self, ev: HooksReturned) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None or ev.id not in run.worker_of or ev.id in run.returned:
            return []
        run.returned.add(ev.id)
        if run.phase is Phase.INPUTS_DONE and len(run.returned) == len(run.ids):
            # Nothing of the service is bound to run any more; outputs may still come from
            # work its hooks left behind, as long as some keep coming.
            return [WatchUnproduced(run.run_id, len(run.produced))]
        return []

    def _on_UnproducedChecked(self, ev: UnproducedChecked) -> list[Action]:
        run = self._current(ev.run_id)
        if run is None or run.phase is not Phase.INPUTS_DONE:
            return []
        if len(run.produced) > ev.produced:  # progress: wait once more
            return [WatchUnproduced(run.run_id, len(run.produced))]
        missing = [key for key in run.wanted if key not in run.produced]
        return self._fail(run, OutputsNotProducedError(
            f"service task {self.key!r}: every instance of run {run.run_id} returned from "
            f"all_inputs_done, and {len(missing)} of the {len(run.wanted)} wanted outputs "
            f"were not produced, e.g. {missing[:3]!r}, nor any other output since. A "
            "service must produce every key of `concierge.wanted_outputs`, once, with "
            "`await concierge.produce_key(key, value)` (e.g. each on the instance "
            "`concierge.owner(key)` names). If it produces outputs later, from work its "
            "hooks started, raise the `dask_services.unproduced-timeout` config value."))

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

    def _on_OutputNotNeeded(self, ev: OutputNotNeeded) -> list[Action]:
        return [DropOutput(ev.key, ev.worker),
                *self._on_OutputLanded(OutputLanded(ev.key, stimulus_id=ev.stimulus_id))]

    def _on_OutputLost(self, ev: OutputLost) -> list[Action]:
        reason = "a produced output was lost"
        run = self.live_run
        if run is not None:
            return self._restart(run, reason)
        return [RescheduleServiceTask(reason)]

    def _on_OutputUnproduced(self, ev: OutputUnproduced) -> list[Action]:
        # take it back (before the worker can answer) and give it a new run
        return [RescheduleServiceTask(f"output {ev.key!r} was about to run but no run "
                                      "produced it")]

    def _on_OutputWaiting(self, ev: OutputWaiting) -> list[Action]:
        run = self.live_run
        if run is not None and ev.key in self.output_key_set and ev.key not in run.wanted_set:
            # e.g. lost while a run that does not know it is under way
            return self._restart(run, "more outputs were asked for", counted=False)
        return []

    def _on_OutputsWanted(self, ev: OutputsWanted) -> list[Action]:
        run = self.live_run
        if run is not None and not run.wanted_set.issuperset(ev.wanted):
            return self._restart(run, "more outputs were asked for", counted=False)
        return []

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
        elif run is None and ev.worker in self.finished_on:
            self.lost_since_finished = (f"worker {ev.worker} left the cluster after the "
                                        "run had finished, with what it held")
        return actions

    def _on_WorkerRetiring(self, ev: WorkerRetiring) -> list[Action]:
        # at once, not once it has left: its instance's part of the run is lost with it,
        # and until it leaves (the scheduler moving what it holds may take a while) the
        # run would go on feeding an instance whose outputs no claim can take there (a
        # retiring worker runs no task).  Counted, as a death is: retirements that come
        # faster than a run can finish end in ``TooManyRestarts``, not in endless restarts
        run = self.live_run
        if run is not None and ev.worker in run.ids:
            return self._restart(run, f"worker {ev.worker} is being retired")
        return []

    def _on_ServiceTaskProcessing(self, ev: ServiceTaskProcessing) -> list[Action]:
        self.task_worker = ev.worker
        if self.pending_outcome is not None:
            (error,) = self.pending_outcome
            self.pending_outcome = None
            return [NotifyServiceTask(ev.worker, error)]
        if self.graph_error is not None:
            return [NotifyServiceTask(ev.worker, self.graph_error)]
        if not self.input_keys and self._may_start():
            return [PrepareRun()]  # nothing to hand off: the task itself needs the run
        return []

    def _on_ServiceTaskExecuting(self, ev: ServiceTaskExecuting) -> list[Action]:
        if ev.worker == self.task_worker:
            return []  # an outcome decided went there, or will
        # moved without a transition (work stealing): the outcome decided, if any, went
        # to a worker that dropped it with the task; it goes to this one
        self.task_worker = None
        if self.pending_outcome is None and self.failure is not None:
            self.pending_outcome = (self.failure,)
        elif self.pending_outcome is None and self.run is not None and self.run.concluded:
            self.pending_outcome = (None,)
        return self._on_ServiceTaskProcessing(
            ServiceTaskProcessing(ev.worker, stimulus_id=ev.stimulus_id))

    def _on_OutcomeUndelivered(self, ev: OutcomeUndelivered) -> list[Action]:
        # deliver the outcome wherever the service task runs next
        self.task_worker = None
        self.pending_outcome = (ev.error,)
        if ev.worker is None:
            return [] if ev.error is None else [ErrWaitingServiceTask(ev.error)]
        return self._on_ServiceTaskProcessing(
            ServiceTaskProcessing(ev.worker, stimulus_id=ev.stimulus_id))

    def _on_RescheduleCarriedOut(self, ev: RescheduleCarriedOut) -> list[Action]:
        self.rescheduling = False
        return []

    def _on_ServiceTaskReleased(self, ev: ServiceTaskReleased) -> list[Action]:
        worker, self.task_worker = self.task_worker, None
        run = self.live_run
        if run is not None and ev.worker_gone:
            return self._restart(run, f"worker {worker} left the cluster")
        if run is not None and ev.still_wanted and ev.inputs_kept:
            # Released and about to run again (distributed does so with the result of a
            # stale execution: one cancelled by a restart, then taken up again by its worker
            # for the next run): the run goes on; its outcome goes to wherever the task runs
            return []
        if run is not None and ev.still_wanted:
            return self._restart(run, "an input it had received was lost with its worker")
        if run is None and self.failure is not None and ev.still_wanted and not ev.retried:
            # told to err, but a stale execution took the error and the task runs again
            # (or its worker died first): the next execution errs with it
            self.pending_outcome = (self.failure,)
            return []
        if run is None:
            if ev.retried:  # a retry (``retries=``) counts its own restarts
                self.restarts, self.exhausted = 0, None
            over = self.run is not None and self.run.phase in (Phase.FINISHED, Phase.FAILED)
            self.pending_outcome = None
            self.failure = None
            if not over:
                return []
            # Finished (or failed) but the task was released before reaching memory (or
            # erred): a later run produces whatever is still missing.
            over_id, failed, self.run = self.run.run_id, self.run.phase is Phase.FAILED, None
            if ev.still_wanted:
                # It runs again (its worker died with outputs the client still wants, or
                # the run failed and the task has retries left): the hand-offs that
                # survived gave their inputs to the run that is over, so they run again
                # too, or the next run waits for them for ever.
                self.rescheduling = True
                return [RescheduleServiceTask(
                    "the service task is retried after its run failed" if failed else
                    "the service task was lost before it reached memory, after its run "
                    "had finished", over_id)]
            return []
        return self._cancel(run, f"nothing wants its outputs any more ({len(run.produced)} "
                                 f"of {len(run.wanted)} produced)")

    def _cancel(self, run: Run, detail: str) -> list[Action]:
        run.phase = Phase.FAILED
        self.run = None
        self.pending_outcome = None
        return [StopInstances(run.snapshot(), detail or "cancelled"),
                Log("cancelled", run.run_id, detail)]

    def _on_ServiceTaskDone(self, ev: ServiceTaskDone) -> list[Action]:
        self.task_worker = None
        self.pending_outcome = None
        self.failure = None
        run, self.run = self.live_run, None
        if run is None:
            return []
        # erred by the scheduler while its run was live (its workers kept dying while it
        # waited: KilledWorker): the run's instances stop, as after a failure, and it
        # counts as a restart (distributed may run it again when an input is recomputed)
        run.phase = Phase.FAILED
        self.restarts += 1
        if self.restarts > self.max_restarts:
            self.restarts = self.max_restarts + 1
            self.exhausted = self._too_many_restarts(
                "the workers running the service task kept dying (distributed erred it "
                "with KilledWorker)")
        return [StopInstances(run.snapshot(), "the service task erred"),
                Log("failed", run.run_id, "the scheduler erred the service task")]

    def _on_ServiceTaskForgotten(self, ev: ServiceTaskForgotten) -> list[Action]:
        run = self.live_run
        self.task_worker = None
        self.pending_outcome = None
        if run is None:
            return []
        return self._cancel(run, "forgotten")

    # ------------------------------------------------------------ story

    def _state(self) -> tuple:
        run = self.run
        return (run.run_id if run is not None else None,
                run.phase if run is not None else None, self.restarts,
                self.pending_outcome is not None, self.task_worker,
                self.graph_error is not None)

    def _story(self, run_id: int | None) -> RunStory:
        story = self.stories.get(run_id)
        if story is None:
            story = self.stories[run_id] = RunStory(self.story_entries)
            while len(self.stories) > self.story_runs:
                self.stories.popitem(last=False)
        return story

    def _tell_story(self, event: Any, run_before: Run | None, before: tuple,
                    actions: list[Action]) -> None:
        now = time.time()
        sid = event.stimulus_id
        # the run the event is about: its own run id if that run is known, else the run
        # current when it arrived (or the one it created)
        run_id = None if isinstance(event, RunNeeded) else getattr(event, "run_id", None)
        if run_id is None or run_id not in self.stories:
            run = run_before if run_before is not None else self.run
            run_id = run.run_id if run is not None else None
        story = self._story(run_id)
        (story.routine if type(event) in ROUTINE else story.milestones).append(
            StoryEntry(next_seq(), now, self.key, run_id, sid, "received", event))
        after = self._state()
        if after != before:
            for text in _decisions(before, after):
                story.milestones.append(StoryEntry(next_seq(), now, self.key, run_id,
                                                   sid, "decided", text))
        for action in actions:
            arid = action.run.run_id if hasattr(action, "run") else getattr(
                action, "run_id", run_id)
            target = story if arid == run_id else self._story(arid)
            (target.routine if type(action) in ROUTINE else target.milestones).append(
                StoryEntry(next_seq(), now, self.key, arid, sid, "sent", action))

    def story(self, run_id: int | None = None) -> list[StoryEntry]:
        """What this machine received, decided and sent, in order: about run ``run_id``,
        or (None) about every run it keeps and about none."""
        if run_id is not None:
            story = self.stories.get(run_id)
            return story.entries() if story is not None else []
        entries = [e for story in self.stories.values() for e in story.entries()]
        entries.sort(key=lambda e: e.seq)
        return entries

    # ------------------------------------------------------------ invariants

    def validate(self) -> None:
        """Check the machine's invariants; raises AssertionError naming the broken one."""
        run = self.run
        assert 0 <= self.restarts <= self.max_restarts + 1, self.restarts
        assert self.pending_outcome is None or self.task_worker is None, \
            "an outcome waits although the service task is processing"
        for story in self.stories.values():
            assert len(story.milestones) <= self.story_entries
            assert len(story.routine) <= self.story_entries
        assert len(self.stories) <= self.story_runs
        if run is None:
            return
        assert run.participants and set(run.ids) == set(run.participants), run.ids
        sids = set(run.ids.values())
        assert len(sids) == len(run.ids), "two workers share an instance id"
        assert run.leader in sids
        assert set(run.owners.values()) <= sids
        assert list(run.owners) == list(run.wanted)
        assert run.started <= sids
        assert run.returned <= sids
        assert run.handed_off <= self.input_key_set
        assert set(run.produced) <= run.wanted_set
        assert run.landed <= set(run.produced)
        if run.phase in (Phase.RUNNING, Phase.INPUTS_DONE, Phase.FINISHED):
            assert run.started == sids or run.phase is Phase.FINISHED and not run.live
        if run.phase in (Phase.INPUTS_DONE, Phase.FINISHED):
            assert len(run.handed_off) == len(self.input_keys)
        if run.phase is Phase.FINISHED:
            assert len(run.produced) == len(run.wanted)
        if run.concluded:
            assert run.phase is Phase.FINISHED and run.landed == set(run.produced)


ServiceTaskMachine._handlers = {
    ev_type: getattr(ServiceTaskMachine, "_on_" + ev_type.__name__)
    for ev_type in Event.__args__  # type: ignore[attr-defined]
}


def _decisions(before: tuple, after: tuple) -> list[str]:
    """The changes of state between two ``ServiceTaskMachine._state()`` tuples, as text."""
    (run0, phase0, restarts0, pending0, worker0, rejected0) = before
    (run1, phase1, restarts1, pending1, worker1, rejected1) = after
    out = []
    if run0 != run1:
        if run0 is not None:
            out.append(f"run {run0} is over")
        if run1 is not None:
            out.append(f"run {run1} created")
    elif phase0 is not phase1 and phase1 is not None:
        out.append(f"run {run1}: {phase0.value} -> {phase1.value}")
    if restarts1 != restarts0:
        out.append(f"restarts: {restarts0} -> {restarts1}")
    if pending1 and not pending0:
        out.append("outcome decided; it waits for the service task to be processing")
    if worker1 != worker0:
        out.append(f"service task on {worker1}" if worker1 else "service task not processing")
    if rejected1 and not rejected0:
        out.append("graph rejected")
    return out


def _owners(wanted: Sequence[Key], participants: Sequence[str],
            placement: dict[Key, str], first: int = 0) -> dict[Key, str]:
    """The worker of every wanted output: its place in ``placement`` where that is a
    participant; the others round-robin from participant ``first`` (modulo their number),
    or, once some are placed, each to the participant with the fewest outputs so far."""
    present = set(participants)
    chosen = {key: placement[key] for key in wanted if placement.get(key) in present}
    load = dict.fromkeys(participants, 0)
    for worker in chosen.values():
        load[worker] += 1
    rest = [key for key in wanted if key not in chosen]
    some_placed = bool(chosen)
    for i, key in enumerate(rest):
        if some_placed:
            worker = min(participants, key=load.__getitem__)
        else:
            worker = participants[(first + i) % len(participants)]
        chosen[key] = worker
        load[worker] += 1
    return {key: chosen[key] for key in wanted}
