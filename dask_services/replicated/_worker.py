"""The worker part: hosts replicas and answers calls, probes, starts and stops.

:class:`ReplicaWorker` is a worker plugin of its own, ``worker.extensions[EXTENSION]``,
registered on every worker (pickled, one object per worker) by the scheduler part.  Its
handlers are ordinary worker RPC handlers: calls come straight from callers (clients or
tasks), starts, stops and probes from the scheduler part.  Its ``heartbeat()`` sends the
replicas' figures to the scheduler extension of the same name.  The service-task core
knows nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import pickle

from dask_services._messages import (
    describe_exception,
    dumps_exception,
    future_safe,
    guarded,
    guarded_in_thread,
)
from dask_services._worker_context import in_current_context, worker_handler
from dask_services.replicated._batching import Batcher
from dask_services.replicated._errors import (
    CallMoved,
    ReplicaGone,
    ScaledDown,
    ServiceOverloaded,
    ServiceShutdown,
    gone_answer,
)
from dask_services.replicated._metrics import ReplicaMetrics
from dask_services.replicated._options import (
    REPLICA_ATTRIBUTES,
    config_seconds,
    endpoint_spec,
    is_endpoint,
)
from dask_services.replicated._queue import CallGate, ThreadCall, not_admitted
from dask_services.replicated._wire import pack, unpack
from dask_services.service import Service, ServiceId, refuse_own_values

if TYPE_CHECKING:
    from distributed import Worker

    from dask_services.replicated._gang import GangMember

logger = logging.getLogger("dask_services")

EXTENSION = "dask_services_replicated"  # the worker and the scheduler extension's name
HANDLERS = ("replicated_start", "replicated_stop", "replicated_call", "replicated_health",
            "replicated_stats", "replicated_rank_call", "replicated_rank_rpc",
            "replicated_stream", "replicated_calls", "replicated_shed",
            "replicated_callers_left")
WORKER_CLOSING = (Status.closing, Status.closed, Status.failed)
STATUS_CHANGE = "worker-status-change"  # the stream message telling a worker its status


@dataclass(eq=False)
class HostedReplica:
    """A replica living on this worker, with its queue, thread pool and metrics."""

    id: ServiceId
    name: str
    service: Service
    gate: CallGate
    executor: ThreadPoolExecutor
    metrics: ReplicaMetrics = field(default_factory=ReplicaMetrics)
    ready: bool = False
    closing: bool = False
    cancelled: bool = False
    closed_with: BaseException | None = None  # what queued calls were failed with
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    # when a stop's drain gives up on the calls in flight (loop time); a later stop with an
    # earlier deadline brings it forward and sets ``hurry``
    drain_deadline: float = float("inf")
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    setup_task: asyncio.Task | None = None
    running: set[asyncio.Task] = field(default_factory=set)
    gang: GangMember | None = None  # its rank and the other ranks (``_gang.py``)
    batchers: dict[str, Batcher] = field(default_factory=dict)  # by batched endpoint
    moved_in: int = 0  # calls that arrived after another replica gave them back
    handle: Any = None  # the ReplicatedService behind its self.service and self.peers

    async def peers_known(self) -> None:
        """Before its first call runs, the replica's handle fetches the replica table, so
        that ``self.peers`` has every healthy replica from the start (later on, the table
        is refreshed as it ages)."""
        if self.handle is not None and self.handle._table_time < 0:
            with contextlib.suppress(Exception):  # a shut-down service: its calls say so
                await self.handle._refresh()


class ReplicaWorker(WorkerPlugin):
    """Replicas hosted on one worker (a worker plugin and extension, ``EXTENSION``)."""

    name = EXTENSION
    idempotent = True

    def __init__(self) -> None:
        self.replicas: dict[ServiceId, HostedReplica] = {}
        self.closed = False  # no replica starts here any more
        # the scheduler is retiring this worker (``closing_gracefully``): its replicas,
        # replaced elsewhere, drain their calls in flight before the worker closes
        self.retiring = False
        # (wrapper, the worker's own handler) of status changes (``_watch_status``)
        self._status_watch: tuple[Any, Any] | None = None

    def setup(self, worker: Worker) -> None:
        """Install the RPC handlers and the extension on ``worker``."""
        if getattr(self, "worker", worker) is not worker:
            raise RuntimeError("one ReplicaWorker object was given to two workers; "
                               "register it pickled so that every worker gets its own")
        self.worker = worker
        for name in HANDLERS:
            worker.handlers[name] = getattr(self, name[len("replicated_"):])
        worker.extensions[EXTENSION] = self
        self._watch_status(worker)

    def _watch_status(self, worker: Worker) -> None:
        """Learn when the scheduler retires this worker: its status changes to
        ``closing_gracefully`` (distributed's ``worker-status-change`` stream message)
        before the scheduler closes it.  A worker plugin has no hook of its own for this:
        the worker's handler is wrapped, and restored at teardown."""
        original = worker.stream_handlers.get(STATUS_CHANGE)
        if self._status_watch is not None:
            return
        if original is None:  # (``tests/test_hooks.py`` checks distributed has it)
            logger.warning("dask_services: the worker has no %r handler: replicas on a "
                           "retired worker will not drain their calls", STATUS_CHANGE)
            return

        def status_changed(status: str, **kwargs: Any) -> Any:
            self.retiring = status == Status.closing_gracefully.name
            return original(status=status, **kwargs)

        self._status_watch = (status_changed, original)
        worker.stream_handlers[STATUS_CHANGE] = status_changed

    def _unwatch_status(self) -> None:
        if self._status_watch is None:
            return
        wrapper, original = self._status_watch
        if self.worker.stream_handlers.get(STATUS_CHANGE) is wrapper:
            self.worker.stream_handlers[STATUS_CHANGE] = original
        self._status_watch = None

    async def teardown(self, worker: Worker) -> None:
        """Stop every replica at once and remove the handlers."""
        await self.close()
        worker.extensions.pop(EXTENSION, None)

    @worker_handler
    async def close(self) -> None:
        """Stop every replica (the plugin is going away): at once, but on a worker the
        scheduler retired, whose replicas were replaced elsewhere: they drain their calls
        in flight first (``drain-timeout``), as a scale-down's do, which holds the worker's
        close meanwhile.  The handlers are removed, but on a closing worker: the scheduler
        may still send it a start or a probe (it relaunches the replicas of the workers a
        closing cluster closed first, on workers it does not know are closing too), which
        are answered, a start as lost, rather than logged as a missing handler with a
        traceback."""
        from dask_services.replicated import _gang

        self.closed = True
        _gang.no_more_arrivals(self)
        retired = self.retiring and self.worker.status in WORKER_CLOSING
        drain = config_seconds("drain-timeout") if retired else 0
        why = "was retired" if retired else "is closing"
        await asyncio.gather(*(self._stop(r, drain, ReplicaGone(
            f"replica {r.id} stopped: its worker {why}")) for r in list(
            self.replicas.values())), return_exceptions=True)
        self._unwatch_status()
        if self.worker.status not in WORKER_CLOSING:
            for name in HANDLERS:
                self.worker.handlers.pop(name, None)

    def heartbeat(self) -> list[dict]:
        """The replicas' figures, for ``Deployments.heartbeat`` on the scheduler
        (distributed hands a worker extension's heartbeat data to the scheduler extension
        of the same name)."""
        return self.report()

    # ------------------------------------------------------------ scheduler -> worker

    @worker_handler
    async def start(self, comm: Any, id: str, name: str, blob: bytes, max_concurrency: int,
                    max_queued: int, setup_timeout: float, peers_of: str, rank: int = 0,
                    ranks: list[tuple[str, str]] | None = None,
                    uid: str | None = None) -> dict:
        """Create replica ``id`` (rank ``rank`` of the gang ``ranks``, (id, worker) by rank)
        and run its ``setup``; answers once it is healthy or not."""
        from dask_services.replicated import _gang
        from dask_services.replicated._endpoints import ReplicaPeers
        from dask_services.replicated._handle import ReplicatedService
        from dask_services.replicated._transport import WorkerTransport

        if self.closed:
            return {"status": "lost", "error": f"worker {self.worker.address} is closing"}
        sid = ServiceId(id)
        try:
            cls, args, kwargs, options = pickle.loads(blob)
            service = cls()
            refuse_own_values(service, REPLICA_ATTRIBUTES, "every replica")
            handle = ReplicatedService(peers_of, cls, options, WorkerTransport(self.worker),
                                       uid=uid)  # its own deployment's, never another's
            service.id = sid
            service.key = name
            service.params = dict(kwargs)
            service.service = handle
            # a replica of one process calls its own endpoints in place (OwnEndpoints)
            service.peers = ReplicaPeers(handle, None if ranks and len(ranks) > 1
                                         else (sid, service))
        except Exception as e:
            return {"status": "error", "error": f"{type(e).__name__}: {e}",
                    "exception": dumps_exception(e)}
        rep = HostedReplica(
            id=sid, name=name, service=service,
            # ranks > 0 run what rank 0 admitted: its queue bounds theirs
            gate=CallGate(max_concurrency, max_queued if rank == 0 else _gang.RANK_QUEUE,
                          f"replica {sid} of {name}"),
            executor=ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"replica-{sid}"),
            handle=handle,
        )
        self.replicas[sid] = rep
        _gang.attach(self, rep, rank, ranks)
        rep.setup_task = asyncio.ensure_future(self._setup(rep, args, kwargs, setup_timeout))
        try:
            await rep.setup_task
        except asyncio.CancelledError:
            if not rep.closing:  # the start request itself was cancelled: leave nothing
                await asyncio.shield(self._stop(rep, 0, ReplicaGone(f"start of {sid} cancelled")))
                raise
            return {"status": "stopped"}
        except Exception as e:
            logger.info("setup of replica %s of %s failed: %r", sid, name, e)
            await self._stop(rep, 0, ServiceShutdown("setup failed"))
            return {"status": "error", "error": f"{type(e).__name__}: {e}",
                    "exception": dumps_exception(e)}
        if rep.closing:
            return {"status": "stopped"}
        rep.ready = True
        return {"status": "ok"}

    async def _setup(self, rep: HostedReplica, args: tuple, kwargs: dict,
                     timeout: float) -> None:
        setup = getattr(rep.service, "setup", None)
        if setup is None:
            return
        what = f"setup() of replica {rep.id}"
        if inspect.iscoroutinefunction(setup):
            coro = guarded(setup(*args, **kwargs), what, "the setup")
        else:
            loop = asyncio.get_running_loop()
            coro = loop.run_in_executor(rep.executor, in_current_context(guarded_in_thread(
                functools.partial(setup, *args, **kwargs), what, "the setup")))
        try:
            await within(coro, timeout)
        except Late:
            raise TimeoutError(
                f"setup of replica {rep.id} did not finish within {timeout} s "
                "(dask_services.replicated.setup-timeout)"
            ) from None

    @worker_handler
    async def stop(self, comm: Any, id: str, timeout: float, reason: str) -> dict:
        """Stop replica ``id``: calls in flight get ``timeout`` seconds to finish; queued
        calls fail (``reason="shutdown"``) or go back to their callers to be re-sent."""
        rep = self.replicas.get(ServiceId(id)) or next(  # or its rank held here
            (r for r in self.replicas.values() if str(r.id).split("/", 1)[0] == id), None)
        if rep is None:
            return {"status": "unknown"}
        if reason == "shutdown":
            exc: BaseException = ServiceShutdown(
                f"service {rep.name} is shutting down: the call was queued on replica "
                f"{rep.id} and never started"
            )
        elif reason == "scale-down":
            exc = ScaledDown(f"replica {rep.id} is stopping ({reason})")
        else:
            exc = ReplicaGone(f"replica {rep.id} is stopping ({reason})")
        await self._stop(rep, timeout, exc)
        return {"status": "stopped"}

    async def _stop(self, rep: HostedReplica, timeout: float, exc: BaseException) -> None:
        deadline = asyncio.get_running_loop().time() + max(timeout, 0)
        if rep.closing:
            # another stop is under way (a scale-down's drain): this one's deadline, if
            # earlier (a shutdown, the worker closing), cuts its drain short
            if deadline < rep.drain_deadline:
                rep.drain_deadline = deadline
                if isinstance(exc, ServiceShutdown):
                    rep.closed_with = exc  # a stream cut now says so
                rep.hurry.set()
            await rep.stopped.wait()
            return
        rep.closing = True
        rep.closed_with = exc
        rep.drain_deadline = deadline
        try:
            if rep.setup_task is not None and not rep.setup_task.done():
                rep.setup_task.cancel()
            rep.gate.close(exc)
            for batcher in rep.batchers.values():
                batcher.close(exc)
            if rep.gate.in_flight and not await self._drained(rep):
                rep.cancelled = True
                running = list(rep.running)
                for task in running:
                    task.cancel()
                if running:  # the cancelled calls answer their callers first
                    await asyncio.wait(running, timeout=1)
            stop = getattr(rep.service, "stop", None)
            if stop is not None:
                try:
                    what = f"stop() of replica {rep.id}"
                    if inspect.iscoroutinefunction(stop):
                        await asyncio.wait_for(guarded(stop(), what, "the stop"), 30)
                    else:  # never on the event loop
                        await asyncio.wait_for(asyncio.to_thread(
                            guarded_in_thread(stop, what, "the stop")), 30)
                except Exception:
                    logger.exception("stop() of replica %s raised", rep.id)
        finally:
            rep.executor.shutdown(wait=False, cancel_futures=True)
            rep.stopped.set()
            if self.replicas.get(rep.id) is rep:
                del self.replicas[rep.id]

    @staticmethod
    async def _drained(rep: HostedReplica) -> bool:
        """Whether the replica's calls in flight finished before its drain deadline (which
        a later stop may bring forward meanwhile)."""
        loop = asyncio.get_running_loop()
        idle = asyncio.ensure_future(rep.gate.wait_idle())
        try:
            while not idle.done():
                rep.hurry.clear()
                remaining = rep.drain_deadline - loop.time()
                if remaining <= 0:
                    return False
                hurry = asyncio.ensure_future(rep.hurry.wait())
                try:
                    await asyncio.wait({idle, hurry}, timeout=remaining,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    hurry.cancel()
            return True
        finally:
            idle.cancel()

    @worker_handler
    async def health(self, comm: Any, id: str, timeout: float) -> dict:
        """Run the replica's ``check_health`` (if any) within ``timeout`` seconds."""
        rep = self.replicas.get(ServiceId(id))
        if rep is None or not rep.ready or rep.closing:
            return {"status": "error", "error": f"replica {id} is not running on this worker"}
        check = getattr(rep.service, "check_health", None)
        if check is None:
            return {"status": "ok"}
        try:
            what = f"check_health() of replica {rep.id}"
            if inspect.iscoroutinefunction(check):
                ok = await within(guarded(check(), what, "the probe"), timeout)
            else:
                # Not in the replica's own threads: busy endpoints must not fail the probe.
                ok = await within(asyncio.to_thread(
                    guarded_in_thread(check, what, "the probe")), timeout)
        except Late:
            return {"status": "error", "error": f"check_health() took longer than {timeout} s"}
        except Exception as e:
            return {"status": "error", "error": f"check_health() raised {type(e).__name__}: {e}"}
        if ok is False:
            return {"status": "error", "error": "check_health() returned False"}
        return {"status": "ok"}

    @worker_handler
    async def rank_call(self, comm: Any, id: str, method: str, payload: Any) -> dict:
        """Run a call that rank 0 of a replica admitted on this rank (``_gang.py``)."""
        from dask_services.replicated._gang import rank_call

        return await rank_call(self, id, method, payload)

    @worker_handler
    async def rank_rpc(self, comm: Any, target: str, source: int, seq: int, method: str,
                       payload: Any) -> dict:
        """An ordered ``@rpc`` call from rank ``source`` to rank ``target`` (``_gang.py``)."""
        from dask_services.replicated._gang import rank_rpc
        from dask_services.replicated._options import config_seconds

        return await rank_rpc(self, target, source, seq, method, payload,
                              config_seconds("setup-timeout"))

    def stats(self, comm: Any, ids: list[str]) -> dict:
        """In-flight and queued calls plus metrics of the replicas ``ids`` held here."""
        out = {}
        for id in ids:
            rep = self.replicas.get(ServiceId(id))
            if rep is not None:
                out[id] = {"in_flight": rep.gate.running, "queued": rep.gate.queued,
                           "moved_in": rep.moved_in, **rep.metrics.summary()}
        return out

    def shed(self, comm: Any, id: str, keep: int, replicas: list | None = None) -> int:
        """Give back queued calls of replica ``id`` that nothing holds to it, the last
        queued first, until it has at most ``keep`` running and queued (the scheduler asks
        when replicas were added, ``replicas`` the healthy ones): their callers send them
        to replicas with less to do.  Returns how many were given back."""
        rep = self.replicas.get(ServiceId(id))
        if rep is None or not rep.ready or rep.closing:
            return 0
        return rep.gate.shed(int(keep), "gave the call back: replicas were added",
                             replicas)

    def callers_left(self, comm: Any, callers: list[str]) -> int:
        """``callers`` (client ids, worker addresses) left the cluster: every replica here
        gives back their queued calls rather than run them for nobody.  Returns how many
        were given back."""
        gone = set(callers)
        given_back = 0
        why = "gave the call back: its caller left the cluster"
        for rep in self.replicas.values():
            if rep.ready and not rep.closing:
                given_back += rep.gate.give_back_calls_of(gone, why)
                for batcher in rep.batchers.values():
                    given_back += batcher.give_back_calls_of(gone, why)
        if given_back:
            logger.info("gave back %d queued calls of %s, which left the cluster",
                        given_back, ", ".join(sorted(gone)))
        return given_back

    def report(self) -> list[dict]:
        """The figures of every replica ready here, for the worker's heartbeat: id,
        in-flight and queued calls, and the metrics summary (see ``_table.py``)."""
        return [{"id": str(rep.id), "in_flight": rep.gate.running,
                 "queued": rep.gate.queued, **rep.metrics.summary()}
                for rep in self.replicas.values() if rep.ready and not rep.closing]

    # ------------------------------------------------------------ caller -> worker

    @worker_handler
    async def call(self, comm: Any, id: str, method: str, payload: Any = None,
                   pickled: bytes | None = None, movable: bool = False,
                   moved: bool = False, caller: str | None = None) -> dict:
        """Run endpoint ``method`` on replica ``id`` within its concurrency limits.

        ``movable``: nothing holds the call to this replica (no session or pin), so while
        it is queued it may be given back to be sent to a replica with less to do
        (:meth:`shed`); ``moved``: another replica gave it back (counted in
        ``moved_in``); ``caller``: the client id or worker address that made it (its
        queued calls are given back should it leave, :meth:`callers_left`)."""
        rep = self.replicas.get(ServiceId(id))
        if rep is None or not rep.ready or rep.closing:
            return {"status": "gone", "message": f"replica {id} is not running on "
                                                 f"{self.worker.address}"}
        if not is_endpoint(type(rep.service), method):
            from dask_services.replicated._errors import EndpointRefused

            return {"status": "error", "exception": dumps_exception(EndpointRefused(
                f"{method!r} is not an endpoint of {type(rep.service).__name__}"))}
        try:
            args, kwargs = arguments(rep, method, payload, pickled)
        except TypeError as e:
            return {"status": "error", "exception": dumps_exception(e)}
        arrived = time.perf_counter()
        await rep.peers_known()
        spec = endpoint_spec(type(rep.service), method)
        if spec.stream:
            return {"status": "error", "exception": dumps_exception(TypeError(
                f"{method!r} is a streaming endpoint (a generator): call it with "
                f"svc.{method}.stream(...)"))}
        if spec.batched:
            return await self._call_batched(rep, method, args, kwargs, arrived, caller)
        fn = getattr(rep.service, method)
        fans_out = rep.gang is not None and rep.gang.fans_out(type(rep.service), method)
        in_thread: ThreadCall | None = None
        if moved:  # counted as it is queued (or started): a pass then sees it in the loads
            rep.moved_in += 1
        try:
            if fans_out or inspect.iscoroutinefunction(fn):
                await rep.gate.acquire(movable=movable, caller=caller)
            else:  # the replica's thread that ends a call may start this one itself
                in_thread = rep.gate.admit_to_thread(rep.executor, in_current_context(
                    functools.partial(fn, *args, **kwargs)), what=f"{rep.name}.{method}",
                    movable=movable, caller=caller)
        except (ServiceOverloaded, ReplicaGone, ServiceShutdown, CallMoved) as e:
            return not_admitted(rep.metrics, e, rep.gate)
        task = asyncio.current_task()
        if task is not None:
            rep.running.add(task)
        error = True
        try:
            if in_thread is not None:
                result = await rep.gate.outcome(in_thread)
            elif fans_out:
                from dask_services.replicated._gang import gang_call

                result = await gang_call(self, rep, method, args, kwargs)  # every rank
            else:
                result = await fn(*args, **kwargs)
            error = False
        except CallMoved as e:  # given back while queued for a thread: never started
            error = False
            return not_admitted(rep.metrics, e, rep.gate)
        except asyncio.CancelledError as e:
            if not rep.cancelled:
                if task is None or task.cancelling():
                    raise
                return escaped(rep, method, e)
            return cut_short(rep)
        except ScaledDown as e:  # another rank was cut by a scale-down mid-call
            return _cut(rep, str(e))
        except ReplicaGone as e:  # another rank of the replica is lost: re-sent
            return gone_answer(e)
        except Exception as e:  # ("coroutine raised StopIteration" named: future_safe)
            return {"status": "error", "exception": dumps_exception(
                future_safe(e, f"{rep.name}.{method}"))}
        except BaseException as e:  # SystemExit, KeyboardInterrupt, GeneratorExit... end
            # the call, not the worker: let out of this handler's task, asyncio would raise
            # them from the event loop itself (and re-sent, they would stop the next one)
            return escaped(rep, method, e)
        finally:
            if error:  # a result is counted once answered: it may not be sendable
                rep.metrics.record(time.perf_counter() - arrived, error)
            if task is not None:
                rep.running.discard(task)
            if in_thread is None:  # a thread call's slot is its thread's to give back
                rep.gate.release()
        return answered(rep, method, result, arrived)

    async def calls(self, comm: Any, calls: list[dict]) -> Any:
        """Several calls in one message (``ReplicatedService._send``): each runs as if it
        came alone (its own admission, batch, result or error) and its answer, tagged with
        its index ``i``, is written as soon as it is ready: the answers ready in the same
        turn of the event loop (a batch's, say) as one message, a list."""
        from distributed.core import Status

        loop = asyncio.get_running_loop()
        ready: list[dict] = []
        writes: list[asyncio.Future] = []

        def flush() -> None:
            if ready:
                answers = ready[:]
                ready.clear()
                writes.append(asyncio.ensure_future(comm.write(answers)))

        async def one(i: int, call: dict) -> None:
            answer = await self.call(comm, **call)
            answer["i"] = i
            ready.append(answer)
            if len(ready) == 1:
                loop.call_soon(flush)

        await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
        flush()  # the last answers now (their scheduled flush finds nothing left)
        await asyncio.gather(*writes)
        return Status.dont_reply

    @worker_handler
    async def stream(self, comm: Any, id: str, method: str, window: int,
                     payload: Any = None, pickled: bytes | None = None,
                     caller: str | None = None) -> Any:
        """Run generator endpoint ``method`` of replica ``id``, sending its items over
        ``comm`` as the caller takes them (``_streaming.py``); ``caller`` as for
        :meth:`call`."""
        from distributed.core import Status

        from dask_services.replicated import _streaming

        rep = self.replicas.get(ServiceId(id))
        if rep is None or not rep.ready or rep.closing:
            await comm.write({"status": "gone", "message": f"replica {id} is not running "
                                                           f"on {self.worker.address}"})
            return Status.dont_reply
        if not is_endpoint(type(rep.service), method) or not endpoint_spec(
                type(rep.service), method).stream:
            from dask_services.replicated._errors import EndpointRefused

            exc: Exception = (TypeError(f"{method!r} is not a streaming endpoint (a "
                                        f"generator): call it with svc.{method}.route(...)")
                              if is_endpoint(type(rep.service), method) else
                              EndpointRefused(f"{method!r} is not an endpoint of "
                                              f"{type(rep.service).__name__}"))
            await comm.write({"status": "error", "exception": dumps_exception(exc)})
            return Status.dont_reply
        try:
            args, kwargs = arguments(rep, method, payload, pickled)
        except TypeError as e:
            await comm.write({"status": "error", "exception": dumps_exception(e)})
            return Status.dont_reply
        await rep.peers_known()
        return await _streaming.serve(rep, comm, method, args, kwargs, int(window),
                                      caller=caller)

    def _batcher(self, rep: HostedReplica, method: str) -> Batcher:
        batcher = rep.batchers.get(method)
        if batcher is None:
            spec = endpoint_spec(type(rep.service), method)
            fn = getattr(rep.service, method)

            async def run(requests: list[Any]) -> Any:
                if rep.gang is not None and rep.gang.fans_out(type(rep.service), method):
                    from dask_services.replicated._gang import gang_call

                    return await gang_call(self, rep, method, (requests,), {})
                if inspect.iscoroutinefunction(fn):
                    return await fn(requests)
                return await asyncio.get_running_loop().run_in_executor(
                    rep.executor, in_current_context(functools.partial(fn, requests)))

            def track(task: asyncio.Task) -> None:
                rep.running.add(task)
                task.add_done_callback(rep.running.discard)

            assert spec.batch_size is not None
            batcher = rep.batchers[method] = Batcher(
                rep.gate, f"{rep.name}.{method}", spec.batch_size, spec.batch_wait, run, track)
        return batcher

    async def _call_batched(self, rep: HostedReplica, method: str, args: tuple,
                            kwargs: dict, arrived: float, caller: str | None = None) -> dict:
        """One call of a batched endpoint: held until its batch runs, then its own slot
        of the batch's results (given back while held should ``caller`` leave)."""
        if len(args) != 1 or kwargs:
            return {"status": "error", "exception": dumps_exception(TypeError(
                f"{method!r} is a batched endpoint: each call passes exactly one request, "
                f"svc.{method}.route(request) (got {len(args)} positional and "
                f"{len(kwargs)} keyword arguments)"))}
        try:
            fut = self._batcher(rep, method).enqueue(args[0], caller=caller)
        except (ServiceOverloaded, ReplicaGone, ServiceShutdown) as e:
            return not_admitted(rep.metrics, e)
        task = asyncio.current_task()
        if task is not None:
            rep.running.add(task)
        error = True
        try:
            result = await fut
            error = False
        except CallMoved as e:  # its caller left while it was held: never started
            error = False
            return not_admitted(rep.metrics, e, rep.gate)
        except asyncio.CancelledError as e:
            if not rep.cancelled:
                if task is None or task.cancelling():
                    raise
                return escaped(rep, method, e)
            return cut_short(rep)
        except Exception as e:
            if e is rep.closed_with:  # held for a batch when the replica stopped
                status = "gone" if isinstance(e, ReplicaGone) else "shutdown"
                return {"status": status, "message": str(e)}
            return {"status": "error", "exception": dumps_exception(e)}
        finally:
            if error:
                rep.metrics.record(time.perf_counter() - arrived, error)
            if task is not None:
                rep.running.discard(task)
        return answered(rep, method, result, arrived)


class Late(Exception):
    """What :func:`within` raises when its awaitable did not finish in time."""


async def within(awaitable: Any, timeout: float) -> Any:
    """The result of ``awaitable``, cancelled and :class:`Late` past ``timeout`` seconds.
    Unlike ``asyncio.wait_for``, a ``TimeoutError`` the user's code raises itself (a
    download that timed out in ``setup``) reaches the caller as it was raised."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()  # as wait_for does
        raise
    if not done:
        task.cancel()
        raise Late
    return task.result()


def answer(rep: HostedReplica, method: str, result: Any) -> dict:
    """The answer carrying a call's result; an error the caller can read if the result
    cannot be sent (a lock, an open file: the endpoint's fault, not the connection's)."""
    try:
        packed = pack(result, "result")
    except TypeError as e:
        error = TypeError(f"the result of {rep.name}.{method} ({type(result).__name__}) "
                          f"cannot be sent back to the caller: {e}")
        return {"status": "error", "exception": dumps_exception(error)}
    return {"status": "ok", **packed, "load": rep.gate.load}


def answered(rep: HostedReplica, method: str, result: Any, arrived: float) -> dict:
    """:func:`answer`, the call counted in the replica's metrics (an error if its result
    cannot be sent)."""
    reply = answer(rep, method, result)
    rep.metrics.record(time.perf_counter() - arrived, reply["status"] != "ok")
    return reply


def escaped(rep: HostedReplica, method: str, exc: BaseException) -> dict:
    """The error answer for a ``CancelledError`` that an endpoint let out without its call
    being cancelled (it awaited a task cancelled elsewhere) or another exception that is
    not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``): the
    caller's error, neither a lost connection to re-send on nor the worker's end."""
    error = RuntimeError(
        f"{rep.name}.{method} raised "
        + ("CancelledError without being cancelled (an awaited task was cancelled?)"
           if isinstance(exc, asyncio.CancelledError) else describe_exception(exc)))
    error.__cause__ = exc
    return {"status": "error", "exception": dumps_exception(error)}


def arguments(rep: HostedReplica, method: str, payload: Any,
              pickled: bytes | None) -> tuple[tuple, dict]:
    """A call's arguments as its caller packed them; ``TypeError`` naming the call if they
    cannot be loaded here (a class this worker cannot import)."""
    try:
        return unpack({"payload": payload, "pickled": pickled}
                      if pickled is not None else {"payload": payload}, "payload")
    except Exception as e:
        raise TypeError(f"the arguments of {rep.name}.{method} cannot be loaded on the "
                        f"replica's worker: {type(e).__name__}: {e}") from e


def cut_short(rep: HostedReplica) -> dict:
    """The answer to a call that started and was cancelled because its replica stopped
    before it finished: sent elsewhere when the replica moves or its worker closes (as
    when a worker dies: at least once), failed when the replica is scaled down (a normal
    decision must not run a call twice) or its service shut down."""
    if isinstance(rep.closed_with, ScaledDown):
        return _cut(rep)
    if isinstance(rep.closed_with, ReplicaGone):  # moved or worker closing: re-send
        return {"status": "gone", "message": str(rep.closed_with)}
    return {"status": "shutdown", "message": (
        f"the call was cancelled: replica {rep.id} of {rep.name} stopped before it "
        "finished (svc.shutdown timeout)")}


def _cut(rep: HostedReplica, detail: str = "") -> dict:
    """The answer ``cut``: the call started and its replica (or a rank of it) was scaled
    down before it finished; the caller raises ``ServiceUnavailable``."""
    return {"status": "cut", "message": (
        f"the call was cancelled: replica {rep.id} of {rep.name} was scaled down and the "
        "call ran past its drain (dask_services.replicated.drain-timeout"
        + (f"; {detail}" if detail else "") + "); it is not sent again, since it had started")}

