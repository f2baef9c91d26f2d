"""The scheduler side: the leader of every run.

``ServiceSchedulerPlugin`` watches the scheduler's transitions for the three kinds of nodes
that ``graph.py`` builds, translates them (and the workers' messages) into events for a
:class:`ServiceTaskMachine` per service task, and carries out the actions it returns:
start/stop instances, broadcast the barrier, release produced outputs into memory, finish
or fail the service task, and reschedule it for a restart.  It decides nothing about a run
itself; every event and action carries a ``stimulus_id``, and ``story()`` (the
``service_story`` handler behind ``dask_services.story()``) tells what the machines
received, decided and sent.  Its intake of a graph (``update_graph``) is
``_graph_intake.GraphIntake``, which it inherits.

Scheduler internals it relies on (checked by ``tests/test_hooks.py``; why each, in
``design/architecture.md``, *Distributed internals*): ``TaskState``'s
``dependencies``/``dependents``/``waiting_on``/``waiters`` (the edge of a virtual output is
cut and restored), ``loose_restrictions``, ``resource_restrictions`` and ``priority``;
``Scheduler.transitions``, ``stimulus_queue_slots_maybe_opened``, ``set_restrictions``,
``stream_comms``, ``stream_handlers`` and ``handlers``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import dask.config
from dask.typing import Key
from dask.utils import parse_timedelta
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps
from distributed.protocol.serialize import ToPickle

from dask_services import _run_events as run_events
from dask_services import _run_model as run_model
from dask_services import _run_placement as placement
from dask_services import _run_state as rs
from dask_services import _run_story as run_story
from dask_services._graph_intake import GraphIntake
from dask_services._host import InstanceSpec
from dask_services._messages import (
    describe_exception,
    dumps_as_raised,
    dumps_exception,
    loads_exception,
)
from dask_services._run_log import (
    OwnEdgeCollisions,
    RunLogEntry,
    RunObserver,
    keep_archive_within,
    story_entries,
)
from dask_services._streams import flush
from dask_services._worker_status import status_change
from dask_services.config import setting
from dask_services.graph import (
    ConsumingClaimSpec,
    ServiceDefinition,
    install_order,
)
from dask_services.service import ServiceId
from dask_services.worker import EXTENSION, ServiceWorkerPlugin

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState, WorkerState

logger = logging.getLogger("dask_services")

EVENT_TOPIC = "dask_services"
# A produced output's claim waits this long for its producing worker to run tasks again
# (paused for lack of memory) before the output counts as lost and a new run produces it:
# the values a paused worker holds for claims cannot be spilled, so it might never resume.
UNPLACED_CLAIM_GRACE = 30.0
UNPLACED_CLAIM_CHECK = 1.0
# How a worker's report names a task it fetched from another worker (in flight when the
# scheduler asked it to compute the task) rather than ran: ``Worker.gather_dep``
FETCHED_NOT_RUN = "gather-dep-success-"


class ServiceSchedulerPlugin(GraphIntake, SchedulerPlugin):
    """Scheduler plugin (and extension) that carries out service tasks."""

    name = EXTENSION
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.machines: dict[Key, rs.ServiceTaskMachine] = {}
        self.definitions: dict[Key, ServiceDefinition] = {}
        self.handoff_of: dict[Key, Key] = {}  # hand-off key -> service key
        self.input_of_handoff: dict[Key, Key] = {}  # hand-off key -> its input key
        # hand-offs run again where their input was taken (``_pin_to_taker``) -> their
        # own restrictions (workers, loose), given back once the run no longer needs it
        self.pinned: dict[Key, tuple[set[str], bool]] = {}
        self.handoffs_of_input: dict[Key, set[Key]] = {}  # input key -> hand-off keys
        self.output_of: dict[Key, Key] = {}  # output key -> service key
        self.cut: dict[Key, str] = {}  # produced output not yet in memory -> its worker
        # service task -> its ``retries`` when it last went to processing
        self.retries_left: dict[Key, int] = {}
        # claims left without a worker, whose producing worker is checked soon
        self.unplaced: set[Key] = set()
        # hand-offs being released to run again (``_hand_off_again_unless_taken``)
        self.handing_off_again: set[Key] = set()
        # service tasks to check, once the transitions under way are done, for whether
        # anything still needs them (``_forget_if_unneeded``): one check per batch each
        self.maybe_unneeded: set[Key] = set()
        self.produced_at: dict[Key, str] = {}  # produced output -> worker that may hold it
        self.restrictions: dict[Key, tuple] = {}  # output -> its own restrictions while cut
        # placement group -> its mapping, while a service task of the group is known
        self.placements: dict[str, placement.PlacementGroup] = {}
        # a plain number, not an ``itertools.count``: the plugin travels pickled from the
        # client, and itertools objects stop pickling in Python 3.14 (3.12 warns)
        self._last_run_id = 0
        # the round-robin of outputs carries on from run to run (``RunNeeded.first_owner``)
        self._next_owner = 0
        self._prefix = uuid.uuid4().hex[:6] + "-"
        self.observers: list[RunObserver] = []  # e.g. the diagnostics (``_observe.py``)
        # stories of forgotten service tasks: key -> their machine's stories
        self.archive: OrderedDict[Key, OrderedDict[int | None, run_story.RunStory]] = OrderedDict()
        # service task -> its WatchUnproduced waits under way (cancelled when it is forgotten)
        self.timers: dict[Key, set[asyncio.TimerHandle]] = {}
        self.collisions: OwnEdgeCollisions | None = None  # the log filter, while started

    # ------------------------------------------------------------- set-up

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.extensions[EXTENSION] = self
        if self.collisions is None:
            self.collisions = OwnEdgeCollisions(self)
            logging.getLogger("distributed.scheduler").addFilter(self.collisions)
        install_order()  # service tasks' graphs are ordered without a walk per pair
        scheduler.stream_handlers.update({
            "service-started": self._guard(self._on_started),
            "service-handed-off": self._guard(self._on_handed_off),
            "service-produced": self._guard(self._on_produced),
            "service-landed": self._guard(self._on_landed),
            "service-failed": self._guard(self._on_failed),
            "service-restart": self._guard(self._on_restart),
            "service-hooks-returned": self._guard(self._on_hooks_returned),
            "service-task-executing": self._guard(self._on_task_executing),
        })
        scheduler.handlers["service_run_info"] = self.run_info
        scheduler.handlers["service_story"] = self.story
        replies = await scheduler.register_worker_plugin(
            # pickled, so that every worker gets its own object (inproc comms would hand
            # in-process workers one and the same)
            None, dumps(ServiceWorkerPlugin()), name=EXTENSION, idempotent=True
        )
        failed = {w: r.get("text") or r.get("exception") for w, r in (replies or {}).items()
                  if isinstance(r, dict) and r.get("status") == "error"}
        if failed:
            logger.warning("dask_services could not set up on %d worker(s); service tasks "
                           "taking part there fail with the error: %s", len(failed), failed)

    def heartbeat(self, ws: Any, data: Any) -> None:  # scheduler-extension protocol
        records = data.get("instances", ())
        self._tell("counters_reported", ws.address, records)

    def _tell(self, method: str, *args: Any) -> None:
        """Call ``method`` on every observer; one failing never affects the others."""
        for observer in list(self.observers):
            try:
                getattr(observer, method)(*args)
            except Exception:
                logger.exception("dask_services: observer %r failed", observer)

    async def close(self) -> None:
        self.observers.clear()
        if self.collisions is not None:
            logging.getLogger("distributed.scheduler").removeFilter(self.collisions)
            self.collisions = None
        for timers in self.timers.values():
            for timer in timers:
                timer.cancel()
        self.timers.clear()

    def _guard(self, handler: Any) -> Any:
        def run(**msg: Any) -> None:
            try:
                handler(**msg)
            except Exception:
                logger.exception("dask_services: %s failed", handler.__name__)

        return run

    @property
    def max_restarts(self) -> int:
        return int(setting("restarts"))

    # ------------------------------------------------------------- hand-offs run again

    def _pin_to_taker(self, handoff_key: Key) -> None:
        """A hand-off about to run again (its result was lost with a worker outside the
        run, or distributed released its execution) whose input the live run has taken:
        it runs on the worker of the instance that took it, which ignores an input it has,
        not where another instance would take it a second time.  Otherwise its own
        restrictions are given back."""
        hts = self.scheduler.tasks.get(handoff_key)
        machine = self.machines.get(self.handoff_of[handoff_key])
        input_key = self.input_of_handoff.get(handoff_key)
        worker = None
        if machine is not None and input_key is not None:
            worker = machine.worker_that_took(input_key)
        if hts is None or worker is None or worker not in self.scheduler.workers:
            saved = self.pinned.pop(handoff_key, None)
            if saved is not None and hts is not None:
                self.scheduler.set_restrictions({handoff_key: list(saved[0])})
                hts.loose_restrictions = saved[1]
                self._restrict_handoff(hts)
            return
        if handoff_key not in self.pinned:
            self.pinned[handoff_key] = (set(hts.worker_restrictions or ()),
                                        hts.loose_restrictions)
        self.scheduler.set_restrictions({handoff_key: [worker]})
        hts.loose_restrictions = False

    # ------------------------------------------------------------- transitions

    def transition(self, key: Key, start: str, finish: str, *args: Any,
                   stimulus_id: str = "", **kwargs: Any) -> None:
        try:
            self._transition(key, start, finish, stimulus_id)
        except Exception:
            # distributed logs a plugin's failure at INFO level only, and the event it
            # carried is lost (a run waiting for it would wait for ever): say so loudly
            logger.exception("dask_services: handling %s -> %s of %r failed", start,
                             finish, key)

    def _transition(self, key: Key, start: str, finish: str, stimulus_id: str) -> None:
        stimulus_id = stimulus_id or run_model.new_stimulus_id("transition")
        if key in self.machines:
            self._service_task_transition(key, start, finish, stimulus_id)
        elif key in self.handoff_of:
            if finish == "processing":
                self._event(self.handoff_of[key],
                            run_events.HandOffScheduled(key, stimulus_id=stimulus_id))
            elif finish == "waiting":
                self._pin_to_taker(key)
            elif finish == "memory" and stimulus_id.startswith(FETCHED_NOT_RUN):
                self._later(self._hand_off_again_unless_taken, key, stimulus_id)
        elif key in self.output_of:
            self._output_transition(key, start, finish, stimulus_id)
        if finish == "memory" and key in self.handoffs_of_input:
            for h in self.handoffs_of_input[key]:
                hts = self.scheduler.tasks.get(h)
                if hts is not None:
                    self._restrict_handoff(hts)
        if finish == "forgotten":
            self._forget(key, stimulus_id)

    def _service_task_transition(self, key: Key, start: str, finish: str,
                                 stimulus_id: str) -> None:
        machine = self.machines[key]
        ts = self.scheduler.tasks[key]
        if finish == "processing":
            self.retries_left[key] = ts.retries
            self._event(key, run_events.ServiceTaskProcessing(ts.processing_on.address,
                                                      stimulus_id=stimulus_id))
        elif finish == "erred" or (start == "processing" and finish == "memory"):
            # (erred while waiting too: by ``_err_waiting``, or as an input of it erred)
            self._event(key, run_events.ServiceTaskDone(erred=finish == "erred",
                                                stimulus_id=stimulus_id))
        elif start == "processing":
            worker = machine.task_worker
            gone = worker is not None and worker not in self.scheduler.workers
            # Still wanted means it will run again: not a cancellation (e.g. a worker that
            # held a hand-off receipt it had not fetched yet died).
            wanted = bool(ts.waiters or ts.who_wants)
            # Every hand-off receipt still in memory: nothing the run received was lost
            # (distributed released the task over a result of a stale execution, one that a
            # restart had cancelled and that the worker took up again)
            kept = all(dts.state == "memory" or dts.key in self.handing_off_again
                       for dts in ts.dependencies)
            # distributed takes one of its retries when it releases an erred task to run
            # it again (a stale execution's answer releases it without taking one)
            retried = ts.retries < self.retries_left.get(key, ts.retries)
            self._event(key, run_events.ServiceTaskReleased(
                worker_gone=gone, still_wanted=wanted, inputs_kept=kept, retried=retried,
                stimulus_id=stimulus_id))
        elif finish == "released" and not self._still_needed(key):
            # Not needed any more before it ran (every consumer erred on a sibling's
            # failure, say): a run started early, as its hand-offs ran, is cancelled.
            self._event(key, run_events.ServiceTaskReleased(
                worker_gone=False, still_wanted=False, inputs_kept=True,
                stimulus_id=stimulus_id))

    def _output_transition(self, key: Key, start: str, finish: str,
                           stimulus_id: str) -> None:
        service_key = self.output_of[key]
        if key in self.cut:
            if finish == "memory":
                # Landed: attach it to its service task again, so that if it is ever lost
                # the scheduler recomputes it through a new run of the service task.
                self._attach_again(service_key, key)
                self._event(service_key, run_events.OutputLanded(key, stimulus_id=stimulus_id))
            elif finish == "forgotten":
                del self.cut[key]
                self._event(service_key, run_events.OutputLanded(key, stimulus_id=stimulus_id))
            elif finish == "erred" or (finish == "released" and not self._still_needed(key)):
                # Erred (a consumer run by the claim raised, its retries used up), or
                # nothing wants it any more before it landed (every consumer erred on a
                # sibling's failure, say, while the client holds the failed result): its
                # value is let go and the claim attached to its service task again, so
                # that the run can finish (it waits for every produced output) and, asked
                # for again, the output is made by a new run.
                self._let_go_of_output(service_key, key, stimulus_id)
            elif finish == "no-worker":
                # The producing worker died before the output landed, or it is paused (for
                # lack of memory): checked after the transitions under way (a worker's
                # loss comes first).
                self._check_unplaced(service_key, key, stimulus_id)
        elif finish in ("processing", "no-worker"):
            self._event(service_key, run_events.OutputUnproduced(key, stimulus_id=stimulus_id))
        elif finish == "waiting":
            self._event(service_key, run_events.OutputWaiting(key, stimulus_id=stimulus_id))

    def _still_needed(self, key: Key) -> bool:
        """Whether a task waits for ``key`` or a client wants it."""
        ts = self.scheduler.tasks.get(key)
        return ts is not None and bool(ts.waiters or ts.who_wants)

    def _let_go_of_output(self, service_key: Key, key: Key, stimulus_id: str) -> None:
        """A produced output's claim erred, or was released with nothing wanting it: the
        producer drops the value, the claim gets its edge to the service task back."""
        producer = self._attach_again(service_key, key)
        self.produced_at.pop(key, None)
        if service_key not in self.machines:
            # the service task was forgotten first (distributed forgets it with the last
            # output that had its edge back): no machine decides any more, the value goes
            self._send(producer, {"op": "service-drop-output", "key": key})
            return
        self._event(service_key, run_events.OutputNotNeeded(key, producer, stimulus_id=stimulus_id))

    def _attach_again(self, service_key: Key, key: Key) -> str:
        """Give the claim of output ``key``, cut from its service task when produced, its
        edge back and its own restrictions; returns the worker that produced it."""
        producer = self.cut.pop(key)
        tasks = self.scheduler.tasks
        ots, sts = tasks[key], tasks.get(service_key)
        self._restore_restrictions(ots)
        if sts is not None:
            ots.dependencies.add(sts)
            sts.dependents.add(ots)
        return producer

    def _check_unplaced(self, service_key: Key, key: Key, stimulus_id: str) -> None:
        """Check, once the transitions under way are done, the producing worker of a claim
        that has no worker to run on (:meth:`_claim_without_worker`); once per claim."""
        if key not in self.unplaced:
            self.unplaced.add(key)
            self._later(self._claim_without_worker, service_key, key, stimulus_id)

    def _claim_without_worker(self, service_key: Key, key: Key, stimulus_id: str,
                              waited: float = 0.0) -> None:
        """A produced output's claim found no worker to run on.  While the producing
        worker is still in the cluster (paused, or closing) the claim waits for it, up to
        ``UNPLACED_CLAIM_GRACE`` seconds: the scheduler runs it once the worker runs tasks
        again.  If that worker leaves instead, ``remove_worker`` checks the claim at once:
        the scheduler does not move a task that waits for a worker, and the run may be over
        (every output produced), so that no ``WorkerLost`` restarts it.  An output whose
        worker is gone, or that waited too long, is lost: a new run produces it."""
        worker = self.cut.get(key)
        ts = self.scheduler.tasks.get(key)
        if worker is None or ts is None or ts.state != "no-worker":
            self.unplaced.discard(key)  # placed, landed or forgotten meanwhile
            return
        if worker in self.scheduler.workers and waited < UNPLACED_CLAIM_GRACE:
            logger.debug("dask_services: output %r waits for worker %s, which runs no "
                         "tasks now", key, worker)
            asyncio.get_running_loop().call_later(
                UNPLACED_CLAIM_CHECK, self._later, self._claim_without_worker, service_key,
                key, stimulus_id, waited + UNPLACED_CLAIM_CHECK)
            return
        self.unplaced.discard(key)
        if worker in self.scheduler.workers:  # waited too long: it lets go of the value
            self._send(worker, {"op": "service-drop-output", "key": key})
        self._event(service_key, run_events.OutputLost(key, stimulus_id=stimulus_id))

    def _forget(self, key: Key, stimulus_id: str) -> None:
        if key in self.output_of:
            if key in self.produced_at:
                self._send(self.produced_at.pop(key),
                           {"op": "service-drop-output", "key": key})
            # a claim cut from its service task (produced, then erred or forgotten before
            # it landed) takes no edge with it: distributed cannot tell that it was the
            # service task's last dependent
            service_key = self.output_of[key]
            if service_key not in self.maybe_unneeded:
                self.maybe_unneeded.add(service_key)
                self._later(self._forget_if_unneeded, service_key, stimulus_id)
            if service_key not in self.machines:
                # its service task went first (a claim cut from it when produced keeps no
                # edge to it until it lands or is let go): nothing else will clean up
                del self.output_of[key]
                self.cut.pop(key, None)
                self.restrictions.pop(key, None)
                self.unplaced.discard(key)
        elif key in self.machines:
            machine = self.machines[key]
            self._event(key, run_events.ServiceTaskForgotten(stimulus_id=stimulus_id))
            del self.machines[key]
            self.retries_left.pop(key, None)
            for timer in self.timers.pop(key, ()):
                timer.cancel()  # its runs are over: nothing left to check
            self.archive[key] = machine.stories
            keep_archive_within(self.archive, machine.story_runs)
            definition = self.definitions.pop(key)
            if definition.placement is not None:
                group = self.placements[definition.placement]
                group.service_tasks -= 1
                if not group.service_tasks:
                    del self.placements[definition.placement]
            for h, i in zip(definition.handoff_keys, definition.input_keys, strict=True):
                self.handoff_of.pop(h, None)
                self.input_of_handoff.pop(h, None)
                self.pinned.pop(h, None)
                hs = self.handoffs_of_input.get(i)
                if hs is not None:
                    hs.discard(h)
                    if not hs:
                        del self.handoffs_of_input[i]
            for o in definition.output_keys:
                if o not in self.scheduler.tasks and self.output_of.get(o) == key:
                    self.output_of.pop(o, None)
                    self.cut.pop(o, None)
                    self.produced_at.pop(o, None)
                    self.restrictions.pop(o, None)

    def _forget_if_unneeded(self, service_key: Key, stimulus_id: str) -> None:
        """Forget a service task that nothing needs any more, as distributed forgets a task
        once its last dependent is forgotten: no dependent, no client wanting it, and no
        output of it produced and not yet landed (those have no edge to it either).
        Without this a consumer that failed on a produced output, then released, left the
        service task (and its run, if still going) behind for the scheduler's life."""
        self.maybe_unneeded.discard(service_key)
        sts = self.scheduler.tasks.get(service_key)
        if (sts is None or sts.state == "forgotten" or sts.dependents or sts.who_wants
                or sts.waiters or service_key not in self.machines):
            return
        if any(self.output_of.get(k) == service_key for k in self.cut):
            return
        self.scheduler.transitions({service_key: "forgotten"}, stimulus_id=stimulus_id)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str = "",
                      **kwargs: Any) -> None:
        stimulus_id = stimulus_id or run_model.new_stimulus_id("remove-worker")
        for key in list(self.machines):
            self._event(key, run_events.WorkerLost(worker, stimulus_id=stimulus_id))
        tasks = self.scheduler.tasks
        for key, producer in list(self.cut.items()):
            ts = tasks.get(key)
            if producer == worker and ts is not None and ts.state == "no-worker":
                self.unplaced.add(key)  # a check may be waiting too: it finds it placed
                self._later(self._claim_without_worker, self.output_of[key], key,
                            stimulus_id)

    def log_event(self, topic: Any, msg: Any) -> None:
        """Worker status changes reach plugins only through the event log: a worker
        being retired (``closing_gracefully``: ``retire_workers``, a worker's
        ``lifetime``) restarts the live runs it takes part in at once."""
        change = status_change(topic, msg)
        if change is None or change[1] != Status.closing_gracefully.name:
            return
        worker, _, stimulus_id = change
        stimulus_id = stimulus_id or run_model.new_stimulus_id("worker-retiring")
        for key in list(self.machines):
            self._event(key, run_events.WorkerRetiring(worker, stimulus_id=stimulus_id))
        self._land_outputs_of_retiring(worker, stimulus_id)

    def _land_outputs_of_retiring(self, worker: str, stimulus_id: str) -> None:
        """Take into memory on ``worker``, which is being retired, the outputs finished
        runs produced there whose claims have not run: a retiring worker starts no task,
        so they would wait until it left, and a new run would then make them again.  In
        memory, they are data the retirement moves to other workers before the worker
        leaves.  Called as distributed logs the status change, before the retirement
        looks at what the worker holds (in the same call).  A claim that runs the
        output's only consumer (``ConsumingClaimSpec``) is taken in as well, the worker
        running the consumer itself (a retirement fetching it before it is done finds it
        missing and asks again).  The outputs of a run the retirement restarted are not
        taken: that run makes them again."""
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return
        tasks = self.scheduler.tasks
        landing, without_worker = [], []
        for key, producer in self.cut.items():
            ts = tasks.get(key)
            if producer != worker or ts is None:
                continue
            machine = self.machines.get(self.output_of[key])
            if machine is None or machine.rescheduling or machine.live_run is not None:
                continue
            if ts.processing_on is ws:
                landing.append(ts)
            elif ts.state == "no-worker":
                without_worker.append(ts)
        if without_worker:
            # a worker paused before its retirement started none of these claims: they wait
            # without a worker (``_claim_without_worker`` watches them, and finds them
            # placed).  Placed on it through distributed's transition, the worker in
            # ``running`` for that call only (distributed takes it out right after the
            # logging anyway), they reach the worker before the landing, as the claims
            # queued on a running worker do
            self.scheduler.running.add(ws)
            try:
                self.scheduler.transitions(
                    {ts.key: "processing" for ts in without_worker}, stimulus_id)
            finally:
                self.scheduler.running.discard(ws)
            landing += [ts for ts in without_worker if ts.processing_on is ws]
        if not landing:
            return
        # distributed takes the worker out of ``running`` right after logging the change:
        # the outputs' dependents, made ready below, must not be sent to it
        self.scheduler.running.discard(ws)
        for ts in landing:
            self._send(worker, {"op": "service-land-output", "key": ts.key,
                                "stimulus_id": stimulus_id,
                                "consumer": isinstance(ts.run_spec, ConsumingClaimSpec)})
        flush(self.scheduler.stream_comms.get(worker))
        for ts in landing:
            # as if the claim had run there; the worker reports the value's size and type
            self.scheduler.handle_task_finished(
                key=ts.key, worker=worker, stimulus_id=stimulus_id, run_id=ts.run_id,
                metadata={}, nbytes=ts.get_nbytes(), type=None,
                typename=ts.type or "object", startstops=[], thread=None)

    def valid_workers_downscaling(self, scheduler: Scheduler,
                                  workers: list[WorkerState]) -> list[WorkerState]:
        """Workers an adaptive cluster may close (``Scheduler.workers_to_close``): not those
        a running service task needs (``workers_in_use``), whose loss would restart it."""
        in_use = set().union(*(m.workers_in_use() for m in self.machines.values()))
        return [ws for ws in workers if ws.address not in in_use]

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        stimulus_id = run_model.new_stimulus_id(f"add-worker-{worker}")
        for key in list(self.machines):
            self._event(key, run_events.WorkerAdded(worker, stimulus_id=stimulus_id))

    # ------------------------------------------------------------- runs

    def _wanted(self, service_key: Key) -> list[Key]:
        ts = self.scheduler.tasks[service_key]
        pending = [d for d in ts.dependents
                   if d.state != "memory" and self.output_of.get(d.key) == service_key]
        pending.sort(key=lambda d: d.priority or ())
        return [d.key for d in pending]

    def _prepare_run(self, service_key: Key, stimulus_id: str) -> None:
        """Carry out ``PrepareRun``: the facts a run is made of, as ``RunNeeded``."""
        machine = self.machines.get(service_key)
        if machine is None or service_key not in self.scheduler.tasks:
            return
        definition = self.definitions[service_key]
        tasks = self.scheduler.tasks
        participants, input_holders = placement.participants(
            tasks[service_key], {ws.address for ws in self.scheduler.running},
            definition.participants, definition.input_keys, tasks)
        places = None
        if definition.placement is not None and participants:
            places = self.placements[definition.placement].place(
                definition.output_keys, participants, self.scheduler.workers)
        elif definition.affinity and participants:
            places = placement.near_inputs(tasks, definition.affinity, participants)
        elif participants:
            # (rotated as the round robin would start: many small runs spread their
            # outputs; an "involved" run's input holders come first as they are)
            first = (self._next_owner % len(participants) if input_holders is None else 0)
            places = placement.owned_as_the_service_says(
                definition, [*participants[first:], *participants[:first]])
        wanted = self._wanted(service_key)
        if participants and getattr(definition.service_class, "outputs_by_position", False):
            # (only such a service's outputs run their consumers: _claim_fusion)
            places, lacking = placement.with_resources(
                tasks, wanted, participants, self.scheduler.workers, places)
            for key in lacking:  # its claim would wait for ever on its producer
                logger.warning(
                    "dask_services: no worker of the run of %r has the resources %s that "
                    "the consumer run with output %r needs; it runs without them",
                    service_key, tasks[key].resource_restrictions, key)
                tasks[key].resource_restrictions = None
        first_owner = 0
        if input_holders is None and participants:
            # not "involved" (whose outputs go to the input holders first): start where the
            # last such run's outputs stopped
            first_owner = self._next_owner % len(participants)
            self._next_owner += len(wanted)
        self._last_run_id += 1
        event = run_events.RunNeeded(
            run_id=self._last_run_id,
            id_prefix=self._prefix,
            participants=participants,
            wanted=wanted,
            placement=places,
            input_holders=input_holders,
            first_owner=first_owner,
            stimulus_id=stimulus_id,
        )
        self._event(service_key, event)

    def run_info(self, service_key: Key, handoff_key: Key | None = None,
                 worker: str | None = None) -> dict | None:
        """The live run's id and instances, for a hand-off on a worker without an
        instance, which pushes its input to one; None if there is no live run, or if
        ``handoff_key`` is no longer processing on ``worker``.  The worker learns that its
        hand-off was released (a restart) through its stream, which this answer may
        overtake: a stale execution would then push its input to the next run, whose own
        execution of the hand-off gives it to another instance, and the shuffle's
        outputs got those rows twice (4 runs in 8 of a persisted shuffle whose worker
        died after it finished).  The run created after the release is what tells it
        here, so no stale push gets a run."""
        machine = self.machines.get(service_key)
        run = machine.live_run if machine is not None else None
        if run is None:
            return None
        if handoff_key is not None:
            hts = self.scheduler.tasks.get(handoff_key)
            if hts is None or hts.state != "processing" or hts.processing_on is None \
                    or hts.processing_on.address != worker:
                return None
        return {"run_id": run.run_id, "peers": {str(sid): w for w, sid in run.ids.items()}}

    # ------------------------------------------------------------- worker messages

    def _on_started(self, service_key: Key, run_id: int, id: str, worker: str = "") -> None:
        self._event(service_key, run_events.InstanceStarted(
            run_id, ServiceId(id), stimulus_id=run_model.new_stimulus_id(f"service-started-{id}")))

    def _on_task_executing(self, key: Key, worker: str = "") -> None:
        """The service task waits for its outcome on ``worker``, which does not have it."""
        ts = self.scheduler.tasks.get(key)
        if key not in self.machines or ts is None or ts.processing_on is None \
                or ts.processing_on.address != worker:
            return  # no longer (or not yet) meant to run there: a transition will say
        self._event(key, run_events.ServiceTaskExecuting(
            worker, stimulus_id=run_model.new_stimulus_id("service-task-executing")))

    def _on_handed_off(self, service_key: Key, run_id: int, key: Key, worker: str = "",
                       id: str | None = None) -> None:
        self._event(service_key, run_events.InputHandedOff(
            run_id, key, ServiceId(id) if id is not None else None,
            stimulus_id=run_model.new_stimulus_id("service-handed-off")))

    def _on_produced(self, service_key: Key, run_id: int, key: Key, worker: str = "") -> None:
        if service_key not in self.machines:
            # produced after its service task was forgotten (a consumer failed, the
            # computation was let go of, while the run's last outputs were being made):
            # no machine decides any more, and nothing will ever take the value
            self._send(worker, {"op": "service-drop-output", "key": key})
            return
        self._event(service_key, run_events.OutputProduced(
            run_id, key, worker, stimulus_id=run_model.new_stimulus_id("service-produced")))

    def _on_landed(self, key: Key, nbytes: int, typename: str, worker: str = "") -> None:
        """The size and type of an output taken into memory on a retiring worker
        (:meth:`_land_outputs_of_retiring`), as the worker measured them."""
        ts = self.scheduler.tasks.get(key)
        ws = self.scheduler.workers.get(worker)
        if ts is not None and ts.state == "memory" and ws in (ts.who_has or ()):
            ts.set_nbytes(nbytes)
            ts.type = typename

    def _on_failed(self, service_key: Key, run_id: int, exception: bytes,
                   worker: str = "") -> None:
        self._event(service_key, run_events.RunFailed(
            run_id, loads_exception(exception),
            stimulus_id=run_model.new_stimulus_id(f"service-failed-{worker}")))

    def _on_restart(self, service_key: Key, run_id: int, reason: str, worker: str = "") -> None:
        self._event(service_key, run_events.RestartRequested(
            run_id, reason, stimulus_id=run_model.new_stimulus_id(f"service-restart-{worker}")))

    def _on_hooks_returned(self, service_key: Key, run_id: int, id: str,
                           worker: str = "") -> None:
        self._event(service_key, run_events.HooksReturned(
            run_id, ServiceId(id), stimulus_id=run_model.new_stimulus_id(f"hooks-returned-{id}")))

    def _event(self, service_key: Key, event: run_events.Event) -> None:
        """Feed ``event`` to the machine of ``service_key`` (if it still has one) and carry
        out its actions."""
        machine = self.machines.get(service_key)
        if machine is None:
            return
        actions = machine.handle(event)
        if self.observers and machine.run is not None:
            self._tell("run_progressed", service_key, machine.run.snapshot())
        self._apply(service_key, actions)

    # ------------------------------------------------------------- actions

    def _apply(self, service_key: Key, actions: list[run_events.Action]) -> None:
        for action in actions:
            carry_out = self._ACTIONS.get(type(action))
            if carry_out is None:
                raise TypeError(f"no way to carry out {action!r}")
            carry_out(self, service_key, action)

    def _do_prepare_run(self, service_key: Key, action: run_events.PrepareRun) -> None:
        self._prepare_run(service_key, action.stimulus_id)

    def _do_start(self, service_key: Key, action: run_events.StartInstances) -> None:
        self._apply_start(service_key, action.run)

    def _do_all_started(self, service_key: Key, action: run_events.BroadcastAllStarted) -> None:
        self._broadcast(action.run, "service-all-started")

    def _do_inputs_done(self, service_key: Key, action: run_events.BroadcastInputsDone) -> None:
        self._broadcast(action.run, "service-inputs-done")

    def _do_release(self, service_key: Key, action: run_events.ReleaseOutput) -> None:
        self._release_output(service_key, action.key, action.worker, action.stimulus_id)

    def _do_drop(self, service_key: Key, action: run_events.DropOutput) -> None:
        self._send(action.worker, {"op": "service-drop-output", "key": action.key})

    def _do_watch_unproduced(self, service_key: Key, action: run_events.WatchUnproduced) -> None:
        timeout = setting("unproduced-timeout")
        if timeout is None or timeout is False:
            return  # wait for ever, as asked

        def check() -> None:
            waits = self.timers.get(service_key)
            if waits is not None:
                waits.discard(timer)
                if not waits:
                    del self.timers[service_key]
            self._event(service_key, run_events.UnproducedChecked(
                action.run_id, action.produced,
                stimulus_id=run_model.new_stimulus_id("unproduced-checked")))

        timer = asyncio.get_running_loop().call_later(
            parse_timedelta(timeout), self._later, check)
        self.timers.setdefault(service_key, set()).add(timer)

    def _do_stop(self, service_key: Key, action: run_events.StopInstances) -> None:
        self._apply_stop(action.run, action.reason)

    def _do_notify(self, service_key: Key, action: run_events.NotifyServiceTask) -> None:
        # After the current transitions, so that the worker has the service task (its
        # compute-task message) before it hears the outcome.
        self._later(self._notify, service_key, action.worker, action.error,
                    action.stimulus_id)

    def _do_err_waiting(self, service_key: Key,
                        action: run_events.ErrWaitingServiceTask) -> None:
        self._later(self._err_waiting, service_key, action.error, action.stimulus_id)

    def _do_reschedule(self, service_key: Key, action: run_events.RescheduleServiceTask) -> None:
        self._later(self._reschedule, service_key, action.stimulus_id, action.run_id)

    def _do_log(self, service_key: Key, action: run_events.Log) -> None:
        self._log(service_key, action)

    _ACTIONS: dict[type, Any] = {
        run_events.PrepareRun: _do_prepare_run,
        run_events.StartInstances: _do_start,
        run_events.BroadcastAllStarted: _do_all_started,
        run_events.BroadcastInputsDone: _do_inputs_done,
        run_events.ReleaseOutput: _do_release,
        run_events.DropOutput: _do_drop,
        run_events.WatchUnproduced: _do_watch_unproduced,
        run_events.StopInstances: _do_stop,
        run_events.NotifyServiceTask: _do_notify,
        run_events.ErrWaitingServiceTask: _do_err_waiting,
        run_events.RescheduleServiceTask: _do_reschedule,
        run_events.Log: _do_log,
    }

    def _send(self, worker: str, msg: dict, now: bool = False) -> None:
        """Send ``msg`` to ``worker``; ``now`` for a run's control messages (``_streams``)."""
        comm = self.scheduler.stream_comms.get(worker)
        if comm is not None:
            comm.send(msg)
            if now:
                flush(comm)

    def _apply_start(self, service_key: Key, run: run_model.RunSnapshot) -> None:
        definition = self.definitions[service_key]
        peers = {sid: w for w, sid in run.ids.items()}
        ts = self.scheduler.tasks.get(service_key)
        span_id = ts.group.span_id if ts is not None else None
        for worker, sid in run.ids.items():
            spec = InstanceSpec(
                service_key=service_key, run_id=run.run_id, id=sid, peers=peers,
                # in the order given, as under dask's local schedulers: a service may
                # tell its inputs apart by position (they were sorted by priority)
                input_keys=definition.input_keys, output_keys=definition.output_keys,
                wanted=run.wanted, owners=run.owners, leader=run.leader,
                service_class=definition.service_class, params=definition.params,
                span_id=span_id,
            )
            self._send(worker, {"op": "service-start", "spec": ToPickle(spec)}, now=True)

    def _broadcast(self, run: run_model.RunSnapshot, op: str) -> None:
        for worker, sid in run.ids.items():
            self._send(worker, {"op": op, "id": str(sid)}, now=True)

    def _apply_stop(self, run: run_model.RunSnapshot, reason: str) -> None:
        for worker, sid in run.ids.items():
            self._send(worker, {"op": "service-stop", "id": str(sid), "reason": reason},
                       now=True)

    def _notify(self, service_key: Key, worker: str, error: BaseException | None,
                stimulus_id: str) -> None:
        ts = self.scheduler.tasks.get(service_key)
        if ts is None or service_key not in self.machines:
            return
        if ts.processing_on is None or ts.processing_on.address != worker:
            # It moved meanwhile.
            now = ts.processing_on.address if ts.processing_on is not None else None
            self._event(service_key, run_events.OutcomeUndelivered(error, now,
                                                           stimulus_id=stimulus_id))
            return
        if error is None:
            self._send(worker, {"op": "service-task-outcome", "key": service_key}, now=True)
        else:
            self._send(worker, {"op": "service-task-outcome", "key": service_key,
                                "error": dumps_exception(error)}, now=True)

    def _err_waiting(self, service_key: Key, error: BaseException, stimulus_id: str) -> None:
        """Err a service task that waits for inputs with the failure of its run, as
        distributed errs a task whose dependency erred: its clients hear at once, its
        outputs err, and inputs computed for it alone are released (the failure would
        otherwise reach them once every input was computed, to no use)."""
        ts = self.scheduler.tasks.get(service_key)
        machine = self.machines.get(service_key)
        if ts is None or machine is None or ts.state != "waiting" \
                or machine.pending_outcome != (error,):
            return  # it runs (the outcome goes there) or it went
        ts.exception = dumps_as_raised(error)
        ts.exception_text = describe_exception(error)
        ts.traceback = ts.traceback_text = None
        ts.exception_blame = ts
        # waiting -> released -> erred: distributed has no direct transition and goes
        # through released, which recommends no new wait for a task with a blame
        self.scheduler.transitions({service_key: "erred"}, stimulus_id=stimulus_id)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)

    def _release_output(self, service_key: Key, key: Key, worker: str,
                        stimulus_id: str) -> None:
        """Cut the edge service task -> output and let the output run on ``worker``."""
        tasks = self.scheduler.tasks
        ots = tasks.get(key)
        sts = tasks.get(service_key)
        if (ots is None or sts is None or ots.state not in ("waiting", "released")
                or (ots.state == "released" and not self._still_needed(key))):
            # (released and wanted by nothing: every consumer erred on a sibling's failure,
            # say; a claim cut now would never run, and the run would wait for it)
            self._event(service_key,
                        run_events.OutputNotNeeded(key, worker, stimulus_id=stimulus_id))
            return
        ots.dependencies.discard(sts)
        sts.dependents.discard(ots)
        if ots.waiting_on:
            ots.waiting_on.discard(sts)
        if sts.waiters:
            sts.waiters.discard(ots)
        self.restrictions.setdefault(key, (ots.worker_restrictions, ots.loose_restrictions))
        self.scheduler.set_restrictions({key: worker})
        ots.loose_restrictions = False
        if ots.priority is not None:
            # The value exists already: its claim only moves it into the worker's memory,
            # so it goes before every task waiting on that worker (outputs produced while
            # hand-offs still queue there land at once, not after them).
            ots.priority = (float("-inf"), *ots.priority[1:])
        self.cut[key] = worker
        self.produced_at[key] = worker
        if ots.state == "waiting" and not ots.waiting_on:
            self.scheduler.transitions({key: "processing"}, stimulus_id=stimulus_id)
            # the claim's compute-task message: the value is ready and waits only for it
            flush(self.scheduler.stream_comms.get(worker))

    # ------------------------------------------------------------- restarts

    def _later(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` soon, outside of the transition engine."""

        def run() -> None:
            try:
                fn(*args)
            except Exception:
                logger.exception("dask_services: %s failed", getattr(fn, "__name__", fn))

        asyncio.get_running_loop().call_soon(run)

    def _hand_off_again_unless_taken(self, handoff_key: Key, stimulus_id: str) -> None:
        """A hand-off reached memory on a worker that fetched its receipt instead of
        running it: the worker had the receipt of an earlier execution in flight (the
        service task's worker gathers every receipt) when a restart released the hand-off
        and the scheduler sent it there to run again, and distributed takes a fetched
        value for a computed one (a key's value is the same wherever it is made).  A
        receipt's worth is its side effect, the input handed to a run: unless the current
        run has the input (another execution gave it, or the run even finished with it),
        the hand-off is released to run again.  The service task released with it, if it
        was processing, keeps its run: no input the run received is lost."""
        hts = self.scheduler.tasks.get(handoff_key)
        service_key = self.handoff_of.get(handoff_key)
        machine = None if service_key is None else self.machines.get(service_key)
        if hts is None or hts.state != "memory" or machine is None:
            return
        run = machine.run  # live, or over: a finished run had every input
        if run is not None and self.input_of_handoff.get(handoff_key) in run.handed_off:
            return
        logger.debug("dask_services: hand-off %r fetched, not run: it runs again",
                     handoff_key)
        self.handing_off_again.add(handoff_key)
        try:
            self.scheduler.transitions({handoff_key: "released"}, stimulus_id=stimulus_id)
        finally:
            self.handing_off_again.discard(handoff_key)
        self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)

    def _reschedule(self, service_key: Key, stimulus_id: str,
                    run_id: int | None = None) -> None:
        """Release the service task and its hand-offs: a new run receives every input."""
        # from here on a run may start again (the releases below lead to it)
        self._event(service_key, run_events.RescheduleCarriedOut(run_id, stimulus_id=stimulus_id))
        tasks = self.scheduler.tasks
        sts = tasks.get(service_key)
        definition = self.definitions.get(service_key)
        if sts is None or definition is None:
            return
        # The service task first, in a batch of its own: the scheduler works through a
        # batch last-in first-out, so a hand-off released with it could run again (and
        # start the next run) before the service task left processing, which would then
        # look like a loss to that new run and restart it once more.
        recs: dict[Key, str] = self._reattach(service_key)
        if sts.state in ("memory", "processing", "queued", "no-worker"):
            recs[service_key] = "released"
        if recs:
            self.scheduler.transitions(recs, stimulus_id=stimulus_id)
        handoffs = {}
        for h in definition.handoff_keys:
            hts = tasks.get(h)
            if hts is not None and hts.state in ("memory", "processing", "queued", "no-worker"):
                handoffs[h] = "released"
        if handoffs:
            self.scheduler.transitions(handoffs, stimulus_id=stimulus_id)
        if recs or handoffs:
            self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)

    def _reattach(self, service_key: Key) -> dict[Key, str]:
        """Give lost outputs back their edge to the service task; returns recommendations."""
        tasks = self.scheduler.tasks
        recs: dict[Key, str] = {}
        for o in self.definitions[service_key].output_keys:
            ots = tasks.get(o)
            if ots is None or o not in self.cut or ots.state not in ("no-worker", "processing"):
                continue
            producer = self._attach_again(service_key, o)
            # the value the lost run produced there is not taken: the next run produces it
            # again, maybe elsewhere (it stayed, unspillable, until the worker closed)
            if producer in self.scheduler.workers:
                self._send(producer, {"op": "service-drop-output", "key": o})
            if self.produced_at.get(o) == producer:
                del self.produced_at[o]
            recs[o] = "released"
        return recs

    def _restore_restrictions(self, ots: TaskState) -> None:
        saved = self.restrictions.pop(ots.key, None)
        if saved is not None:
            self.scheduler.set_restrictions({ots.key: saved[0]})
            ots.loose_restrictions = saved[1]

    # ------------------------------------------------------------- events

    def _log(self, service_key: Key, action: run_events.Log,
             machine: rs.ServiceTaskMachine | None = None) -> None:
        definition = self.definitions.get(service_key)
        name = definition.service_class.__name__ if definition else "?"
        machine = machine or self.machines.get(service_key)
        action = _within_error_length(action)
        if machine is not None and self.observers:
            run = machine.run.snapshot() if machine.run is not None else None
            self._tell("run_logged", RunLogEntry(
                name, service_key, action.action, action.run_id, action.detail,
                run, len(machine.input_keys), machine.restarts,
            ))
        msg = {"action": action.action, "service": name, "key": str(service_key),
               "run_id": action.run_id, "detail": action.detail}
        self.scheduler.log_event(EVENT_TOPIC, msg)
        logger.info("service %s %r run %d %s %s", name, service_key, action.run_id,
                    action.action, action.detail)

    # ------------------------------------------------------------- stories

    def story(self, key: Key | None = None, run_id: int | None = None
              ) -> list[dict[str, Any]]:
        """What happened to service task ``key`` (every run the scheduler keeps of it) or
        to run ``run_id``: each event received, decision taken and action sent, in order,
        with its time and stimulus id.  Forgotten service tasks are kept too, up to
        ``dask_services.story.runs`` of them."""
        return story_entries(self.machines, self.archive, self.output_of, key, run_id)


def _within_error_length(action: run_events.Log) -> run_events.Log:
    """``action`` with its detail cut to ``distributed.admin.max-error-length``
    characters, as distributed cuts a task's error text: the event log, the logger, the
    status table and the run history keep it, and a 50 MB exception message kept there
    in full took the scheduler from 64 MB to 1.4 GB after two failures."""
    limit = dask.config.get("distributed.admin.max-error-length", 10_000)
    detail = action.detail
    if not isinstance(limit, int) or limit <= 0 or len(detail) <= limit:
        return action
    return dataclasses.replace(
        action, detail=detail[:limit] + f"... ({len(detail) - limit} characters cut)")

