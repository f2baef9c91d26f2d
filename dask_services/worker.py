"""The worker side: hosts instances, routes peer RPCs, holds produced outputs.

Registered on every worker by the scheduler plugin as ``worker.extensions["dask_services"]``.
Extensions (replicated services, diagnostics) are plugins of their own: nothing here
names them.
Messages from the scheduler arrive on the worker's batched stream (so they are ordered with
the ``compute-task`` messages of hand-offs); peer RPCs use ordinary worker handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import shutil
import weakref
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import dask.config
from dask.typing import Key
from dask.utils import parse_bytes, parse_timedelta, typename
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import pickle
from distributed.protocol.serialize import to_serialize
from distributed.utils import sync
from distributed.worker_state_machine import UpdateDataEvent
from tornado.ioloop import PeriodicCallback

from dask_services._buffers import IncomingBuffers, put_slot
from dask_services._bulk import BulkLane, lane_host
from dask_services._config_check import as_count
from dask_services._counters import CounterReports, instance_counters, size_of
from dask_services._host import Instance, InstanceSpec, ServiceHost
from dask_services._memory import release_freed_memory
from dask_services._memory_share import memory_to_plan_on
from dask_services._messages import dumps_exception, loads_exception, unwrap
from dask_services._payload import pack, unpack
from dask_services._pending_inputs import PendingInputs
from dask_services._produced import ProducedOutputs
from dask_services._sending import window_size
from dask_services._streams import flush
from dask_services._threads import ServiceThreads
from dask_services._worker_context import as_worker
from dask_services._worker_environment import (
    _RAISED,
    _RESULT,
    _STALE,
    _TAKEN,
    WorkerEnvironment,
    _traffic,
)
from dask_services.config import setting
from dask_services.graph import ConsumingClaimSpec
from dask_services.service import (
    OutputLostError,
    PeerCallError,
    ServiceId,
    StaleRunError,
    WorkerSetupError,
)

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("dask_services")
T = TypeVar("T")

EXTENSION = "dask_services"
_STREAM_OPS = (
    "service-start",
    "service-all-started",
    "service-inputs-done",
    "service-stop",
    "service-task-outcome",
    "service-drop-output",
    "service-land-output",
)
_RPC_OPS = ("service_rpc", "service_add_key", "service_lane")
COLLECT_EVERY_S = 1.0  # at most one garbage collection a second after runs that failed
# while a worker is paused, the heap's freed memory goes back to the OS at most this often
# (``_trim_while_paused``)
TRIM_WHILE_PAUSED_EVERY_S = 1.0
# a hand-off pushing its input to a participant of a run this worker takes no part in
# tries this many more times when the connection fails (the participant left: the
# scheduler restarts the run, and releases the hand-off or names other participants),
# waiting PUSH_RETRY_DELAY seconds, doubled each time up to a second, in between
PUSH_ATTEMPTS = 8
PUSH_RETRY_DELAY = 0.05
# Worker task states of a claim that has not started (its value still held as produced),
# and those of one that has ended
_CLAIM_NOT_STARTED = frozenset({"released", "waiting", "ready", "constrained"})
_CLAIM_ENDED = frozenset({"memory", "error", "released", "forgotten"})
# Worker task states in which a service task cannot be waiting for its outcome.
_NOT_RUNNING = frozenset({"cancelled", "released", "forgotten", "memory", "error"})


def service_threads(worker: Worker) -> ServiceThreads:
    """The threads of the services' CPU work on ``worker`` (``concierge.run_in_executor``):
    ``dask_services.threads`` of them, by default as many as the worker has task threads.

    Not the worker's task threads: a task thread may wait on a service.  A hand-off fused
    with the tasks that make its input runs in a task thread, and when the input cannot be
    taken at once (the hand-off buffer is full, or too many bytes are on their way to
    peers) that thread waits until the instance has taken it, which is what holds back the
    making of more inputs.  Were the instance's split, or a peer's writing of what it
    receives, queued behind that thread, on a one-thread worker nothing would ever run
    again.  dask.distributed's P2P extensions have threads of their own for the same
    reason (``distributed.p2p.threads``).
    """
    threads = setting("threads")
    if threads is None:
        threads = worker.state.nthreads
    with contextlib.suppress(TypeError, ValueError, OverflowError):
        threads = as_count(threads)  # "2" and 2.0 too, as the config check takes them
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(
            f"dask_services.threads must be a number of threads of at least 1, or null for "
            f"as many as the worker has task threads; got {threads!r}"
        )
    return ServiceThreads(threads, thread_name_prefix="dask-services")


class ServiceWorkerPlugin(WorkerPlugin):
    """Worker extension carrying out service tasks; see ``design/architecture.md``.

    One object per worker: register it pickled (``Scheduler.register_worker_plugin`` takes
    bytes), since in-process workers (``LocalCluster(processes=False)``, inproc comms)
    would otherwise all be handed the same object.
    """

    name = EXTENSION
    idempotent = True

    def setup(self, worker: Worker) -> None:
        try:
            self._setup(worker)
        except Exception as exc:
            _refuse_runs(worker, exc)
            raise  # distributed logs it, and returns it to whoever registered the plugin

    def _setup(self, worker: Worker) -> None:
        if getattr(self, "worker", worker) is not worker:
            raise RuntimeError(
                "one ServiceWorkerPlugin object was given to two workers; register it "
                "pickled (distributed.protocol.pickle.dumps(plugin)) so that every worker "
                "gets its own"
            )
        # The config's values first, which can fail, before anything is registered or
        # started: a failed setup leaves nothing for teardown to undo.
        # Inputs waiting to be taken are memory distributed can neither see nor spill: at
        # most 1/32 of the worker's memory limit, as the bytes in flight.
        # (the budgets of the worker's runs are shares of the same figure: WorkerEnvironment)
        memory = memory_to_plan_on(getattr(worker.memory_manager, "memory_limit", None),
                                   worker.state.nthreads)
        pending_inputs = PendingInputs(window_size(parse_bytes(setting("hand-off-buffer")),
                                                   memory))
        threads = service_threads(worker)
        self.worker = worker
        self.memory_to_plan_on = memory
        self.pending_inputs = pending_inputs
        self.threads = threads
        self.host = ServiceHost(WorkerEnvironment(self))
        self.produced = ProducedOutputs(self.host.env.local_directory)
        self.outcomes: dict[Key, asyncio.Future] = {}
        # claims running when the scheduler took their outputs into memory here (a
        # retirement), until they end (``_service_land_output``)
        self.claims_after_landing: set[Key] = set()
        self._background: set[asyncio.Task] = set()
        self.executor = self.threads.executor
        self.counter_reports = CounterReports()
        for op in _STREAM_OPS:
            worker.stream_handlers[op] = self._guarded(getattr(self, "_" + op.replace("-", "_")))
        worker.handlers["service_rpc"] = self.service_rpc
        worker.handlers["service_add_key"] = self.service_add_key
        worker.handlers["service_lane"] = self.service_lane
        host = lane_host(worker.address)
        # opens its listening socket when a peer first asks for it (service_lane)
        self.lane: BulkLane | None = (
            BulkLane(host, self._lane_call, self._lane_endpoint_of, connect_timeout=min(
                10.0, parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))),
                keep_idle=lambda: bool(self.host.instances))
            if host is not None else None)
        worker.extensions[EXTENSION] = self
        worker.metrics["dask_services_managed_bytes"] = lambda w: self.host.managed_bytes()
        worker.metrics["dask_services_spilled_bytes"] = lambda w: self.host.spilled_bytes()
        self._evicting = False
        # garbage collections after runs that did not finish: the loop time of the last,
        # and the one planned (at most one a second: ``_collect_soon``)
        self._collected_at = -math.inf
        self._collection: asyncio.TimerHandle | None = None
        self._spilling = asyncio.Lock()
        self._spill_failed = False  # the last write of produced outputs failed (warned)
        self._trimmed_at = -math.inf  # loop time of the last trim while paused
        self.trims_while_paused = 0
        self._memory_check = PeriodicCallback(self._check_memory, 500)
        self._memory_check.start()

    async def teardown(self, worker: Worker) -> None:
        if getattr(self, "worker", None) is not worker:
            return  # its setup failed (before registering anything) or never ran
        self._memory_check.stop()
        with as_worker(worker):
            await self.host.stop_all()
        self.host.late_jobs.close()
        if self._collection is not None:
            self._collection.cancel()
            self._collection = None
        for fut in self.outcomes.values():
            if not fut.done():
                fut.set_result(("cancelled", None))
        self.outcomes.clear()
        if self.lane is not None:
            await self.lane.close()
        self.produced.clear()
        self.counter_reports.clear()
        for op in _STREAM_OPS:
            # The scheduler may still send an op (a closing worker's stream stays open
            # until the end); an unknown op would kill the stream, so ignore it instead.
            worker.stream_handlers[op] = _ignore_stream_op
        for op in _RPC_OPS:
            worker.handlers.pop(op, None)
        worker.metrics.pop("dask_services_managed_bytes", None)
        worker.metrics.pop("dask_services_spilled_bytes", None)
        worker.extensions.pop(EXTENSION, None)
        # every instance has stopped: nothing is queued; a job still running finishes alone
        self.threads.shutdown()
        shutil.rmtree(self.host.env.local_directory, ignore_errors=True)

    # ------------------------------------------------------------- helpers

    def _guarded(self, handler: Callable[..., Any]) -> Callable[..., None]:
        """Stream handlers must never raise: an exception would close the stream."""

        def run(**msg: Any) -> None:
            try:
                handler(**msg)
            except Exception:
                logger.exception("dask_services: handling %s failed", handler.__name__)

        return run

    def _spawn(self, coro: Any) -> None:
        with as_worker(self.worker):  # get_worker() in the hooks, as in a task
            task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------- scheduler -> worker

    def _service_start(self, spec: Any, **_: Any) -> None:
        spec = unwrap(spec)
        assert isinstance(spec, InstanceSpec)
        try:
            inst = self.host.create(spec)
        except Exception as exc:  # the class cannot be instantiated here: the run fails
            self.host.env.failed(spec, exc)
            return
        self._spawn(self.host.start(inst))

    def _service_all_started(self, id: str, **_: Any) -> None:
        self._spawn(self.host.all_started(ServiceId(id)))

    def _service_inputs_done(self, id: str, **_: Any) -> None:
        self._spawn(self.host.all_inputs_done(ServiceId(id)))

    def _service_stop(self, id: str, reason: str = "", **_: Any) -> None:
        self._spawn(self._stop(ServiceId(id), finished=reason == "finished"))

    async def _stop(self, sid: ServiceId, finished: bool = False) -> None:
        inst = self.host.instances.get(sid)
        await self.host.stop(sid)
        if not self.host.instances and self.lane is not None:
            self.lane.close_idle()  # no run here: no connection kept open
        if inst is not None:
            self.counter_reports.stopped(instance_counters(inst, final=True))
            del inst
            if finished:
                self._collect_if_pressed()
            else:
                self._collect_soon()  # failed, cancelled or restarted: see below

    def _collect_soon(self) -> None:
        """Collect garbage now, or, if the last collection was less than a second ago,
        once that second is over (one collection for all the runs stopped meanwhile: a
        full collection of a large heap holds the event loop for a while)."""
        if self._collection is not None:
            return
        loop = asyncio.get_running_loop()

        def collect() -> None:
            self._collection = None
            self._collected_at = loop.time()
            gc.collect()

        wait = self._collected_at + COLLECT_EVERY_S - loop.time()
        if wait <= 0:
            collect()
        else:
            self._collection = loop.call_later(wait, collect)

    def _collect_if_pressed(self) -> None:
        """A stopped instance's memory may live on in reference cycles (an exception out
        of a hook holds the hook's frames, which hold its data; a transfer cancelled mid-
        message holds its arrays so) until Python's garbage collector runs, which
        distributed never asks for and which counts allocations, not bytes: a worker
        paused for memory could stay paused for a minute, and one with room held a
        cancelled 200 MB transfer (1 run in 4).  A run that did not finish (failed,
        cancelled, restarted) is collected at once; a finished one when memory is above
        the worker's target (distributed.worker.memory.target, else spill): many small
        finished runs would each pay for a collection."""
        mm = self.worker.memory_manager
        limit = mm.memory_limit
        target = mm.memory_target_fraction or mm.memory_spill_fraction
        if self.worker.status == Status.paused or (
                limit and target
                and self.worker.monitor.get_process_memory() > limit * target):
            gc.collect()

    def heartbeat(self) -> dict:
        """Counters of the instances here (``_counters.py``), for the scheduler plugin."""
        return self.counter_reports.heartbeat(self.host.instances.values())

    def _service_task_outcome(self, key: Key, error: bytes | None = None, **_: Any) -> None:
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.state in _NOT_RUNNING:
            return  # the service task is no longer (or not yet) executing here
        fut = self._outcome(key)
        if not fut.done():
            fut.set_result(("error", error) if error is not None else ("done", None))

    def _service_drop_output(self, key: Key, **_: Any) -> None:
        self.produced.drop(key)

    def _service_land_output(self, key: Key, stimulus_id: str, consumer: bool = False,
                             **_: Any) -> None:
        """This worker is being retired and runs no task, so the claim of output ``key``,
        produced here, will not run: the scheduler took the output into memory here, and
        the produced value becomes the key's data, which the retirement moves to another
        worker (``ServiceSchedulerPlugin._land_outputs_of_retiring``).  A claim that runs
        the output's only consumer (``consumer``) has the consumer's result as its data:
        the consumer runs in a service thread (the retirement waits for the key).  Where
        the key cannot be made here, the scheduler is told (``_not_landed``)."""
        ts = self.worker.state.tasks.get(key)
        if ts is not None and ts.state not in _CLAIM_NOT_STARTED:
            self._claim_started(key, ts.state, stimulus_id)
            return
        if consumer:
            if ts is not None and isinstance(ts.run_spec, ConsumingClaimSpec):
                self._spawn(self._land_consumed(key, ts.run_spec.consumer, stimulus_id))
            else:  # no claim here to say what its consumer is
                self._not_landed(key, stimulus_id)
            return
        try:
            value = self.produced.take(key)
        except KeyError:  # let go of meanwhile
            self._not_landed(key, stimulus_id)
            return
        self._landed(key, value, stimulus_id)

    async def _land_consumed(self, key: Key, consumer: Callable[[Any], Any],
                             stimulus_id: str) -> None:
        try:
            value = self.produced.take(key, keep=True)
            result = await asyncio.get_running_loop().run_in_executor(self.executor,
                                                                      consumer, value)
        except Exception as e:  # its claim, run again by a new run, raises it to the user
            logger.warning("dask_services: the output %r cannot be made on a worker being "
                           "retired (%r); a new run makes it again", key, e)
            self._not_landed(key, stimulus_id)
            return
        del value
        ts = self.worker.state.tasks.get(key)
        if ts is None:
            return  # let go of meanwhile (the scheduler released it)
        if ts.state not in _CLAIM_NOT_STARTED:  # the retirement was given up: it ran
            self._claim_started(key, ts.state, stimulus_id)
            return
        self.produced.drop(key)
        self._landed(key, result, stimulus_id)

    def _claim_started(self, key: Key, state: str, stimulus_id: str) -> None:
        """The claim of output ``key``, which the scheduler took into memory here, started
        on its own: it reports as it ends (``transition``), or it ended already (a failure
        the scheduler ignores once the key is in memory: it is told here)."""
        if state == "error":
            self._not_landed(key, stimulus_id)
        elif state not in _CLAIM_ENDED:
            self.claims_after_landing.add(key)

    def _landed(self, key: Key, value: Any, stimulus_id: str) -> None:
        self.worker.handle_stimulus(UpdateDataEvent(data={key: value},
                                                    stimulus_id=stimulus_id))
        landed = self.worker.state.tasks.get(key)
        if landed is not None and landed.state == "memory":
            self.worker.batched_stream.send({"op": "service-landed", "key": key,
                                             "nbytes": landed.nbytes,
                                             "typename": typename(type(value))})

    def _not_landed(self, key: Key, stimulus_id: str) -> None:
        """The scheduler took output ``key`` into memory here and this worker has no value
        for it: distributed's message of a worker letting go of a key, after which the
        scheduler makes it again (a new run).  Without it a retirement would wait for
        ever to move data the worker does not have."""
        self.worker.batched_stream.send({"op": "release-worker-data", "key": key,
                                         "stimulus_id": stimulus_id})

    def _outcome(self, key: Key) -> asyncio.Future:
        fut = self.outcomes.get(key)
        if fut is None:
            fut = self.outcomes[key] = asyncio.get_running_loop().create_future()
        return fut

    def transition(self, key: Key, start: str, finish: str, **kwargs: Any) -> None:
        # A waiting service task that is cancelled must stop waiting.  (No outcomes after
        # a failed setup: distributed calls the plugin all the same.)
        if finish in _NOT_RUNNING and key in getattr(self, "outcomes", ()):
            fut = self.outcomes.pop(key)
            if not fut.done():
                fut.set_result(("cancelled", None))
        # a claim that ran after the scheduler took its output into memory here reports
        # a failure the scheduler ignores (the key is in memory): it is told instead
        if finish in _CLAIM_ENDED and key in getattr(self, "claims_after_landing", ()):
            self.claims_after_landing.discard(key)
            if finish == "error":
                self._not_landed(key, f"claim-failed-after-landing-{key}")

    # ------------------------------------------------------------- peer -> worker

    async def service_rpc(self, comm: Any, target: str, source: str, run_id: int, seq: int,
                          method: str, payload: Any, unsent: str | None = None) -> Any:
        call = f"{method}() from {source} to {target}"

        async def load() -> tuple[tuple, dict]:
            if unsent is not None:
                raise PeerCallError(unsent)
            return await unpack(unwrap(payload), f"the arguments of {call}")

        async def encode(result: Any) -> tuple[Any, int]:
            packed = await pack(result, f"the result of {call}")
            return to_serialize(packed), packed.nbytes

        return await self._answer(target, source, run_id, seq, method, load, encode,
                                  None if unsent is not None
                                  else getattr(unwrap(payload), "nbytes", 0))

    async def _answer(self, target: str, source: str, run_id: int, seq: int, method: str,
                      load: Callable[[], Awaitable[tuple[tuple, dict]]],
                      encode: Callable[[Any], Awaitable[tuple[Any, int]]],
                      nbytes: int | None) -> Any:
        """Run a peer call that came in (``service_rpc``, or on the bulk lane) and answer
        it: ``encode(result)`` gives the reply and its bytes; ``load()`` the arguments,
        of ``nbytes`` bytes (None: the call carries none, it was not sent)."""
        taken: int | None = None  # the bytes counted as received once the call took its turn

        async def arguments() -> tuple[tuple, dict]:
            nonlocal taken
            if nbytes is not None:
                # the call has taken its turn: its bytes are received (_counters.py)
                taken = nbytes
                _traffic(self.host, target).bytes_received += taken
            return await load()

        try:
            with as_worker(self.worker):  # get_worker() in the method, as in a task
                result = await self.host.deliver(ServiceId(target), ServiceId(source), run_id,
                                                 seq, method, arguments)
            reply, sent = await encode(result)
            if result is not None:
                _traffic(self.host, target).bytes_sent += sent
            return reply
        except StaleRunError as exc:
            # Routine at the end of a run (a peer's last call races the stop): answered, not
            # logged as a handler failure.  Stale before its turn (refused), or in the method
            # (a peer call of its own to a stopped instance) after its arguments were
            # counted as received: the caller keeps its count then.
            return {_STALE: str(exc), _TAKEN: taken is not None}
        except asyncio.CancelledError:
            # The instance stopped under the call (which goes unanswered: its connection
            # is cut): the caller takes its count back, so this side does too.
            if taken is not None:
                _traffic(self.host, target).bytes_received -= taken
            raise
        except Exception as exc:
            # The caller's error (a refused method, a payload that cannot be read, an
            # exception in the method): raised there with its type and traceback.
            return {_RAISED: dumps_exception(exc)}

    async def service_lane(self, comm: Any = None) -> dict | None:
        """This worker's bulk lane (host, port, token), or None if it has none."""
        return self.lane.endpoint() if self.lane is not None else None

    async def _lane_endpoint_of(self, address: str) -> dict | None:
        return await self.worker.rpc(address).service_lane()

    async def _lane_call(self, request: dict, incoming: IncomingBuffers) -> dict:
        """A peer call that came on the bulk lane: as ``service_rpc``, with ``incoming`` in
        place of its ``Buffers`` argument."""
        call = f"{request['method']}() from {request['source']} to {request['target']}"

        async def load() -> tuple[tuple, dict]:
            await incoming.call_started()  # (called once the call took its turn)
            try:
                args, kwargs = pickle.loads(request["args"])
            except Exception as exc:
                raise PeerCallError(
                    f"the arguments of {call} could not be deserialized: "
                    f"{type(exc).__name__}: {exc}") from exc
            return put_slot(args, kwargs, incoming)

        async def encode(result: Any) -> tuple[Any, int]:
            try:
                body = pickle.dumps(result)
            except Exception as exc:
                raise PeerCallError(f"the result of {call} could not be serialized: "
                                    f"{type(exc).__name__}: {exc}") from exc
            return {_RESULT: body}, len(body)

        return await self._answer(request["target"], request["source"], request["run_id"],
                                  request["seq"], request["method"], load, encode,
                                  incoming.nbytes + len(request["args"]))

    async def service_add_key(self, comm: Any, target: str, key: Key, payload: Any) -> bool:
        sid = ServiceId(target)
        inst = self.host.instances.get(sid)
        if inst is None:
            return False
        with as_worker(self.worker):
            ok = await self.host.add_key(sid, key, unwrap(payload))
        if ok:
            self._report_handed_off(inst.spec, key)
        return ok

    async def _add_input(self, spec: InstanceSpec, key: Key, value: Any,
                         still_wanted: Callable[[], bool], nbytes: int,
                         admitted: bool = False) -> None:
        try:
            if await self.host.add_key(spec.id, key, value, still_wanted, nbytes):
                self._report_handed_off(spec, key)
        finally:
            if admitted:
                self.pending_inputs.release(nbytes)

    def _report_handed_off(self, spec: InstanceSpec, key: Key) -> None:
        self.worker.batched_stream.send({"op": "service-handed-off",
                                         "service_key": spec.service_key,
                                         "run_id": spec.run_id, "key": key,
                                         "id": str(spec.id)})

    # ------------------------------------------------------------- called by tasks

    async def hand_off(self, handoff_key: Key, service_key: Key, input_key: Key,
                       value: Any, nbytes: int | None = None, attempt: int = 0
                       ) -> int | None:
        """Give ``value`` (input ``input_key``, ``nbytes`` if measured already) to the
        local instance of ``service_key``, or to a participant where this worker has none
        (``attempt``: how many pushes to participants failed before)."""
        def still_wanted() -> bool:
            # A hand-off released by the scheduler (its run was restarted) keeps running
            # until it returns; it must not give its input to the next run, which gets it
            # from the hand-off's new execution, perhaps on another worker.
            ts = self.worker.state.tasks.get(handoff_key)
            return ts is not None and ts.state in ("executing", "long-running", "resumed")

        if not still_wanted():
            return None
        inst = self.host.current.get(service_key)
        if inst is not None and not inst.stopping:
            return await self._give_locally(inst, handoff_key, input_key, value, nbytes,
                                            still_wanted)
        # No instance here (yet): ask the scheduler for the live run.
        info = await self.worker.scheduler.service_run_info(
            service_key=service_key, handoff_key=handoff_key, worker=self.worker.address)
        if not info or not still_wanted():
            # no live run (a new run will ask for this input again), or this execution is
            # stale (released by a restart: the next run gets the input from its new one)
            return None
        mine = [sid for sid, address in info["peers"].items()
                if address == self.worker.address]
        if mine:
            # This worker takes part in the run, but its instance has not started yet:
            # the input goes to it once created, as its other hand-offs' do, not to a
            # peer.  (Pushed to a peer, a second execution of the hand-off for the same
            # run, given the input locally, made its rows count twice.)
            inst = await self.host.created(ServiceId(mine[0]), info["run_id"])
            if inst is None and self.host.latest_run < info["run_id"] and still_wanted():
                # not created within the connect timeout (its start message lost): fail
                # the hand-off, as a push to a peer without it would, rather than finish
                # it with the run never getting the input
                raise StaleRunError(
                    f"instance {mine[0]} of run {info['run_id']} was not created on "
                    f"{self.worker.address} within distributed.comm.timeouts.connect: "
                    f"the hand-off of {input_key!r} cannot give it its input")
            if inst is None or inst.stopping or not still_wanted():
                return None  # a later run came first: this execution is stale
            return await self._give_locally(inst, handoff_key, input_key, value, nbytes,
                                            still_wanted)
        # This worker takes no part in the current run: push the input to a participant,
        # the same one from any worker (``hash()`` of a string differs between processes):
        # a hand-off that runs again elsewhere gives it to the instance that took it.
        peers = sorted(info["peers"].items())
        target, address = peers[zlib.crc32(str(input_key).encode()) % len(peers)]
        try:
            await self._push_input(address, target, input_key, value)
        except OSError:
            # The participant left (or its connection broke): its run restarts and this
            # hand-off is released (a new run asks for the input again), or the run goes
            # on and the input goes to a participant it still has.
            if attempt >= PUSH_ATTEMPTS:
                raise
            await asyncio.sleep(min(PUSH_RETRY_DELAY * 2 ** attempt, 1.0))
            return await self.hand_off(handoff_key, service_key, input_key, value, nbytes,
                                       attempt + 1)
        return info["run_id"]

    async def _give_locally(self, inst: Instance, handoff_key: Key, input_key: Key,
                            value: Any, nbytes: int | None,
                            still_wanted: Callable[[], bool]) -> int:
        """Give the input to ``inst``, this worker's instance of the run; its run id."""
        if nbytes is None:
            ts = self.worker.state.tasks.get(input_key)
            nbytes = (ts.nbytes if ts is not None and ts.nbytes is not None
                      else size_of(value))  # the worker's own measure, if it has one
        if self.pending_inputs.admit(nbytes):
            # Returned at once: the worker runs its next task while the instance takes
            # the input (the scheduler's barrier waits for the report, not for this
            # task).  The bytes waiting so are bounded (``hand-off-buffer``).
            def not_released() -> bool:
                ts = self.worker.state.tasks.get(handoff_key)
                return ts is not None and ts.state in (
                    "executing", "long-running", "resumed", "memory")

            self._spawn(self._add_input(inst.spec, input_key, value, not_released,
                                        nbytes, admitted=True))
            return inst.spec.run_id
        await self._add_input(inst.spec, input_key, value, still_wanted, nbytes)
        return inst.spec.run_id

    async def _push_input(self, address: str, target: str, key: Key, value: Any) -> None:
        await self.worker.rpc(address).service_add_key(
            target=target, key=key, payload=to_serialize(value)
        )

    async def wait_outcome(self, service_key: Key) -> tuple[str, bytes | None]:
        ts = self.worker.state.tasks.get(service_key)
        if ts is None or ts.state not in ("executing", "long-running", "resumed"):
            # cancelled before it started waiting (a cancelled task keeps running until
            # it returns, and may even secede)
            self.outcomes.pop(service_key, None)
            return ("cancelled", None)
        fut = self._outcome(service_key)
        if not fut.done():
            # the scheduler may have moved the task here without a transition its plugin
            # sees (work stealing), after sending the outcome where it was queued before
            self.worker.batched_stream.send({"op": "service-task-executing",
                                             "key": service_key})
        try:
            return await fut
        finally:
            if self.outcomes.get(service_key) is fut:
                del self.outcomes[service_key]

    # ------------------------------------------------------------- memory

    async def _check_memory(self) -> None:
        if self._evicting:
            return
        if self.worker.status == Status.paused and self.produced.in_memory():
            await self.spill_produced()
        if self.worker.status == Status.paused:
            await self._trim_while_paused()
        if not self.host.instances:
            return
        mm = self.worker.memory_manager
        limit = mm.memory_limit
        target = mm.memory_target_fraction or mm.memory_spill_fraction
        if not limit or not target:
            return
        process = self.worker.monitor.get_process_memory()
        excess = process - int(limit * target)
        if excess <= 0:
            return
        self._evicting = True
        try:
            with as_worker(self.worker):
                await self.host.evict(excess)
        finally:
            self._evicting = False

    async def _trim_while_paused(self) -> None:
        """Give the heap's freed memory back to the OS, at most once every
        ``TRIM_WHILE_PAUSED_EVERY_S``.  What pauses a worker is its process memory, and
        nothing runs there until it falls (a run's inputs and claims, its service task
        itself, which must start on its worker to finish); but the memory freed by the
        tasks and runs before (decompressed chunks, received pieces) stays in glibc's
        heap, counted, until something trims it, which distributed never does: workers
        stayed paused with little managed memory (an xarray groupby-anomaly of 234 MB
        through 500 MB workers, for over ten minutes at 386-408 MB with 4-43 MB
        managed; a trim by hand resumed them; ``design/architecture.md``)."""
        if asyncio.get_running_loop().time() - self._trimmed_at >= TRIM_WHILE_PAUSED_EVERY_S:
            await self._trim()

    async def _trim(self) -> None:
        """Give the heap's freed memory back to the OS, in a service thread (a trim of a
        large heap holds the thread for a while); counted as a trim while paused."""
        loop = asyncio.get_running_loop()
        self._trimmed_at = loop.time()
        self.trims_while_paused += 1
        await loop.run_in_executor(self.executor, release_freed_memory)

    async def spill_produced(self) -> int:
        """Write the outputs held for their claims to disk (a paused worker runs no
        claim, and distributed cannot spill them); returns how many were written."""
        async with self._spilling:
            try:
                count, nbytes = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.produced.spill)
            except OSError as e:
                # the outputs stay in memory (their claims take them when the worker runs
                # again), as distributed keeps what it cannot spill; said once, not at
                # every memory check while the disk stays full
                if not self._spill_failed:
                    logger.warning("dask_services: worker %s is paused and cannot write "
                                   "produced outputs to disk (kept in memory): %s",
                                   self.worker.address, e)
                self._spill_failed = True
                count, nbytes = getattr(e, "spilled", (0, 0))  # written before it failed
            else:
                self._spill_failed = False
        if count:
            await self._trim()  # the values written are freed: the next check waits
            logger.info("dask_services: worker %s is paused; %d produced outputs (%d bytes) "
                        "written to disk until their claims run", self.worker.address, count,
                        nbytes)
        return count


def _refuse_runs(worker: Worker, exc: Exception) -> None:
    """After a failed setup: every run that starts an instance on ``worker`` fails with
    the setup's error, and a hand-off there raises it, instead of a run waiting for ever
    on a worker that cannot take part (an unknown op would also close its stream)."""
    error = WorkerSetupError(
        f"dask_services could not set up on worker {worker.address}: {exc!r}; fix what it "
        "names (a config value set for the workers: environment variables, config files) "
        "and restart the worker")
    error.__cause__ = exc
    _setup_errors[worker] = error

    def refuse(spec: Any, **_: Any) -> None:
        spec = unwrap(spec)
        worker.batched_stream.send({
            "op": "service-failed", "service_key": spec.service_key,
            "run_id": spec.run_id, "exception": dumps_exception(error)})
        flush(worker.batched_stream)

    for op in _STREAM_OPS:
        worker.stream_handlers[op] = refuse if op == "service-start" else _ignore_stream_op


# worker -> the error of its failed setup (``_refuse_runs``)
_setup_errors: weakref.WeakKeyDictionary[Worker, WorkerSetupError] = weakref.WeakKeyDictionary()


def _worker_extension() -> tuple[Worker, ServiceWorkerPlugin]:
    from distributed.worker import get_worker

    worker = get_worker()
    ext = worker.extensions.get(EXTENSION)
    if ext is None and worker in _setup_errors:
        error = _setup_errors[worker]
        raise WorkerSetupError(*error.args) from error.__cause__
    if ext is None:
        raise RuntimeError(
            "dask_services is not installed on this worker; call "
            "dask_services.install(client) (with an asynchronous client, `await "
            "dask_services.install_async(client)`) or start the scheduler with "
            "`--preload dask_services`"
        )
    return worker, ext


def _ignore_stream_op(**msg: Any) -> None:
    """Stream handler left in place once the extension is gone: the op has no one to do it."""


async def hand_off_on_worker(handoff_key: Key, service_key: Key, input_key: Key,
                             value: Any, nbytes: int | None = None) -> int | None:
    """Body of a hand-off task on a worker (a coroutine, run on the event loop)."""
    _, ext = _worker_extension()
    return await ext.hand_off(handoff_key, service_key, input_key, value, nbytes)


def wait_for_service_task(service_key: Key) -> None:
    """Body of a service task on a worker: wait, without a thread slot, for the run."""
    from distributed import secede

    worker, ext = _worker_extension()
    secede()
    status, error = sync(worker.loop, ext.wait_outcome, service_key)
    if status == "error":
        assert error is not None
        raise loads_exception(error)


def claim_output_on_worker(key: Key, *, keep: bool = False) -> Any:
    """Body of a virtual output on the worker whose instance produced it; ``keep``: the
    value stays held (a claim running a consumer lets go of it once the consumer returned,
    so that a retry of a consumer that raised finds it again)."""
    _, ext = _worker_extension()
    try:
        return ext.produced.take(key, keep=keep)
    except KeyError:
        raise OutputLostError(
            f"output {key!r} is not held on this worker; it must be produced again by a "
            "new run of its service task"
        ) from None


def let_go_of_output_on_worker(key: Key) -> None:
    """A claim that ran its output's consumer is done with the produced value."""
    _, ext = _worker_extension()
    ext.produced.drop(key)
