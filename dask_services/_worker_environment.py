"""The worker's side of a service host (``_host.Environment``): a run's messages to the
scheduler, the sending of peer calls (through distributed's comms, or on the bulk lane
for calls with ``Buffers``), and the service threads' executor.

``ServiceWorkerPlugin`` (``worker.py``) makes one for its host; the answers of the
worker's peer-call handlers carry the reply markers defined here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dask.typing import Key
from dask.utils import key_split
from distributed.core import Status
from distributed.protocol import pickle
from distributed.protocol.serialize import to_serialize

from dask_services._buffers import buffers_of, put_slot
from dask_services._bulk import LaneUnreachable, Turn
from dask_services._counters import Traffic
from dask_services._directory import directory_in
from dask_services._host import Environment, InstanceSpec, ServiceHost
from dask_services._messages import dumps_exception, loads_exception, unwrap
from dask_services._payload import known_arguments_nbytes, pack, unpack
from dask_services._streams import flush
from dask_services._threads import kept_until_done
from dask_services._worker_context import in_current_context
from dask_services.config import setting
from dask_services.service import (
    PeerCallError,
    PeerUnreachableError,
    ServiceId,
    StaleRunError,
)

if TYPE_CHECKING:
    from dask_services.worker import ServiceWorkerPlugin

logger = logging.getLogger("dask_services")
T = TypeVar("T")

_STALE = "dask-services-stale-run"  # reply of service_rpc for an instance no longer here
_TAKEN = "dask-services-taken"  # ... and whether the call had taken its turn there
_RAISED = "dask-services-raised"  # reply of service_rpc for a call that raised
_RESULT = "dask-services-result"  # reply of a call on the bulk lane: its pickled result


class WorkerEnvironment(Environment):
    def __init__(self, ext: ServiceWorkerPlugin) -> None:
        self.ext = ext
        worker = ext.worker
        self.address = worker.address
        self.local_directory = directory_in(worker.local_directory)
        self.memory_limit = worker.memory_manager.memory_limit or None
        self.memory_to_plan_on = ext.memory_to_plan_on

    def _send(self, msg: dict) -> None:
        """A run's message to the scheduler, sent at once (see ``_streams``)."""
        stream = self.ext.worker.batched_stream
        stream.send(msg)
        flush(stream)

    def started(self, spec: InstanceSpec) -> None:
        self._send({"op": "service-started", "service_key": spec.service_key,
                    "run_id": spec.run_id, "id": str(spec.id)})

    def failed(self, spec: InstanceSpec, exc: BaseException) -> None:
        logger.info("instance %s of %r failed: %r", spec.id, spec.service_key, exc)
        self._send({"op": "service-failed", "service_key": spec.service_key,
                    "run_id": spec.run_id, "exception": dumps_exception(exc)})

    def restart(self, spec: InstanceSpec, reason: str) -> None:
        self._send({"op": "service-restart", "service_key": spec.service_key,
                    "run_id": spec.run_id, "reason": str(reason)})

    def produced(self, spec: InstanceSpec, key: Key, value: Any) -> None:
        self.ext.produced.put(key, value)
        self._send({"op": "service-produced", "service_key": spec.service_key,
                    "run_id": spec.run_id, "key": key})

    def hooks_returned(self, spec: InstanceSpec) -> None:
        self._send({"op": "service-hooks-returned", "service_key": spec.service_key,
                    "run_id": spec.run_id, "id": str(spec.id)})

    async def memory_backpressure(self) -> None:
        # A paused worker (memory above distributed.worker.memory.pause) runs no tasks, so
        # nothing consumes produced outputs: what was produced goes to disk before the
        # service goes on.  (Waiting for the worker to resume instead never ends when the
        # instance's own memory is what keeps it paused.)
        worker = self.ext.worker
        while worker.status == Status.paused and self.ext.produced.in_memory():
            if not await self.ext.spill_produced():
                break  # what is left cannot be written (not serializable): it stays

    async def send_rpc(self, address: str, target: ServiceId, source: ServiceId, run_id: int,
                       seq: int, method: str, args: tuple, kwargs: dict) -> Any:
        call = f"{method}() from {source} to {target}"
        lane = self.ext.lane
        # (a call with two Buffers was refused before it took its sequence number)
        if lane is not None and setting("bulk-lane") \
                and buffers_of(args, kwargs) is not None:
            # its place in the line to that worker, before the first await (_bulk.py)
            ticket = lane.ticket(address)
            try:
                return await self._send_with_ticket(address, target, source, run_id, seq,
                                                    method, args, kwargs, ticket)
            except _NotOnLane:
                pass
            finally:
                lane.done_with(address, ticket)
        unsent: PeerCallError | None = None
        nbytes = 0
        try:
            packed = await pack((args, kwargs), f"the arguments of {call}",
                                known_arguments_nbytes())
            payload: Any = to_serialize(packed)
            nbytes = packed.nbytes
        except PeerCallError as exc:
            # The call has its sequence number: the receiver must still take its turn, or
            # every later call on this channel would wait for it.
            payload, unsent = None, exc
        response = await self._exchange(address, call, source, nbytes, lambda: (
            self.ext.worker.rpc(address).service_rpc(
                target=str(target), source=str(source), run_id=run_id, seq=seq,
                method=method, payload=payload,
                unsent=str(unsent) if unsent is not None else None)))
        if unsent is not None:
            raise unsent
        result = await unpack(unwrap(response), f"the result of {call}")
        if result is not None:
            _traffic(self.ext.host, source).bytes_received += getattr(
                unwrap(response), "nbytes", 0)
        return result

    async def _exchange(self, address: str, call: str, source: ServiceId, nbytes: int,
                        send: Callable[[], Awaitable[Any]]) -> Any:
        """``send()`` a peer call (through the comms or on the lane) and its answer, checked
        for the stale-run and raised forms.  Bytes of peer calls (_counters.py): sent now,
        taken back if the call never reached the instance.  A broken connection is
        ``PeerUnreachableError``, but for ``LaneUnreachable``, which the caller handles."""
        traffic = _traffic(self.ext.host, source)
        traffic.in_flight += nbytes
        traffic.bytes_sent += nbytes
        try:
            response = await send()
        except LaneUnreachable:
            traffic.bytes_sent -= nbytes
            raise
        except OSError as exc:  # CommClosedError, a refused or timed-out connection
            traffic.bytes_sent -= nbytes
            raise _unreachable(call, address, exc) from exc
        except Exception:
            traffic.bytes_sent -= nbytes
            raise
        finally:
            traffic.in_flight -= nbytes
        if isinstance(response, dict):
            if _STALE in response:
                if not response.get(_TAKEN):  # refused: its bytes never reached the callee
                    traffic.bytes_sent -= nbytes
                raise StaleRunError(response[_STALE])
            if _RAISED in response:
                raise loads_exception(response[_RAISED])
        return response

    async def _send_with_ticket(self, address: str, target: ServiceId, source: ServiceId,
                                run_id: int, seq: int, method: str, args: tuple,
                                kwargs: dict, ticket: Turn) -> Any:
        """A call with ``Buffers`` on the bulk lane, holding ``ticket``; ``_NotOnLane`` if
        it must go through distributed's comms instead."""
        call = f"{method}() from {source} to {target}"
        lane = self.ext.lane
        assert lane is not None
        for attempt in range(2):
            try:
                on_lane = await lane.available(address)
            except OSError as exc:
                raise _unreachable(call, address, exc) from exc
            if not on_lane:
                raise _NotOnLane
            try:
                return await self._send_on_lane(address, target, source, run_id, seq,
                                                method, args, kwargs, ticket)
            except _NotPicklable:
                raise _NotOnLane from None  # the ordinary path says so, in its turn
            except LaneUnreachable as exc:
                if exc.fresh or attempt:
                    # the worker answered, its lane cannot be reached: a firewall may let
                    # distributed's ports through and not the lane's
                    logger.warning("dask_services: %s; sending to that worker through "
                                   "distributed's comms", exc)
                    lane.refuse(address)
                    raise _NotOnLane from None
                # a lane known from before: ask the worker again (if it died, that fails
                # as PeerUnreachableError; if it is back, with a new lane)
        raise _NotOnLane

    async def _send_on_lane(self, address: str, target: ServiceId, source: ServiceId,
                            run_id: int, seq: int, method: str, args: tuple, kwargs: dict,
                            ticket: Turn) -> Any:
        """A call with a ``Buffers`` argument, on the bulk lane (``_bulk.py``).  Raises
        ``_NotPicklable`` before sending anything if its other arguments cannot be pickled
        (the ordinary path then answers that, taking the call's turn)."""
        call = f"{method}() from {source} to {target}"
        buffers = buffers_of(args, kwargs)
        assert buffers is not None
        try:
            packed = pickle.dumps(put_slot(args, kwargs))
        except Exception as exc:
            raise _NotPicklable from exc
        lane = self.ext.lane
        assert lane is not None
        response = await self._exchange(
            address, call, source, buffers.nbytes + len(packed), lambda: lane.call(
                address, {"target": str(target), "source": str(source), "run_id": run_id,
                          "seq": seq, "method": method, "args": packed},
                buffers.arrays, ticket))
        try:
            result = pickle.loads(response[_RESULT])
        except Exception as exc:
            raise PeerCallError(f"the result of {call} could not be deserialized: "
                                f"{type(exc).__name__}: {exc}") from exc
        if result is not None:
            _traffic(self.ext.host, source).bytes_received += len(response[_RESULT])
        return result

    def thread_time_used(self, spec: InstanceSpec, cpu: float, wall: float) -> None:
        # under the service task's span and prefix, as distributed meters a task's own
        # threads ("thread-cpu", "thread-noncpu"): Fine Performance Metrics and
        # ``Span.cumulative_worker_metrics`` show where a run's time went
        prefix = key_split(spec.service_key)
        digest = self.ext.worker.digest_metric
        digest(("execute", spec.span_id, prefix, "service-thread-cpu", "seconds"), cpu)
        digest(("execute", spec.span_id, prefix, "service-thread-noncpu", "seconds"),
               max(0.0, wall - cpu))

    def run_in_executor(self, fn: Callable[..., T], *args: Any,
                        jobs: set[concurrent.futures.Future[Any]] | None = None
                        ) -> asyncio.Future[T]:
        return kept_until_done(self.ext.threads.submit(in_current_context(fn), *args), jobs)

    def let_go_of_jobs(self, jobs: set[concurrent.futures.Future[Any]]) -> int:
        return self.ext.threads.let_go(jobs)


def _unreachable(call: str, address: str, exc: BaseException) -> PeerUnreachableError:
    return PeerUnreachableError(
        f"{call}: the connection to {address} failed ({type(exc).__name__}: {exc}); the "
        "worker left or died")


class _NotPicklable(Exception):
    """The arguments of a call for the bulk lane cannot be pickled."""


class _NotOnLane(Exception):
    """A call with ``Buffers`` goes through distributed's comms after all."""


def _traffic(host: ServiceHost, sid: Any) -> Traffic:
    """The byte counts of instance ``sid``'s peer calls (a throwaway one if it is gone)."""
    inst = host.instances.get(ServiceId(sid))
    return inst.traffic if inst is not None else Traffic()
