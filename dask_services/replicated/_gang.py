"""Replicas of several ranks (``options(procs_per_replica=n)``): the worker side.

A replica of ``n`` ranks is a *gang*: ``n`` instances of the class, one per distinct
worker, started together by the scheduler part (``_scheduler.py``; placement is all or
nothing) and stopped together.  Rank 0 is the replica callers see (its id is the
replica's); rank ``r > 0`` is instance ``<replica id>/<r>``.

Inside a rank: ``self.rank``, ``self.world_size`` and ``self.ranks``, a mapping from rank to
a :class:`RankHandle`; ``await self.ranks[r].method(*args)`` calls the ``@dask_services.rpc``
method ``method`` of rank ``r`` of the same incarnation.  As between the instances of a
service task, calls from one rank to another start in the order they were made (each
channel, source rank to target rank, numbers its calls; the receiver runs them in turn).

A call routed to the replica reaches rank 0, which (unless the endpoint is declared
``@endpoint(ranks="first")``) sends it to every other rank at once
(``replicated_rank_call``) and runs it itself: the answer is rank 0's result once every
rank has finished.  If another rank cannot be reached, or a rank's peer call cannot, the
call answers ``gone`` and the caller re-sends it to a healthy replica, as for a lost
worker: the scheduler part is then recovering the whole gang.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.core import send_recv
from distributed.protocol.serialize import to_serialize

from dask_services._messages import (
    dumps_exception,
    guarded,
    guarded_in_thread,
    loads_exception,
    unwrap,
)
from dask_services._worker_context import in_current_context
from dask_services.replicated._errors import (
    ReplicaGone,
    ScaledDown,
    ServiceOverloaded,
    ServiceShutdown,
    gone_answer,
)
from dask_services.replicated._options import endpoint_ranks
from dask_services.service import RPCRefused, ServiceId, is_rpc_method

if TYPE_CHECKING:
    from dask_services.replicated._worker import HostedReplica, ReplicaWorker

RANK_QUEUE = 1_000_000  # ranks > 0 queue what rank 0 admitted: never refused for load


class RankLost(ReplicaGone):
    """Another rank of the replica could not be reached: the replica is being recovered,
    and the call is re-sent to a healthy replica.  ``in_flight``: the connection broke
    after the rank was sent the call (its worker died, perhaps of the call), which the
    caller counts against ``distributed.scheduler.allowed-failures`` as it counts a
    replica lost while it had the call."""

    def __init__(self, message: str, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


def rank_id(replica: str, rank: int) -> ServiceId:
    """Instance id of rank ``rank`` of incarnation ``replica``."""
    return ServiceId(replica if rank == 0 else f"{replica}/{rank}")


def incarnation_of(instance: str) -> str:
    """The incarnation (replica) id an instance id belongs to."""
    return str(instance).split("/", 1)[0]


@dataclass(eq=False)
class GangMember:
    """What a rank knows of its gang: its rank, and every rank's id and worker."""

    rank: int
    ranks: list[tuple[ServiceId, str]]  # (instance id, worker address) by rank
    next_seq_out: dict[int, int] = field(default_factory=dict)
    next_seq_in: dict[int, int] = field(default_factory=dict)
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def fans_out(self, cls: type, method: str) -> bool:
        """Whether a call of ``method`` on rank 0 runs on every rank."""
        return self.rank == 0 and self.world_size > 1 and endpoint_ranks(cls, method) == "all"


class RankHandle:
    """``await handle.method(*args, **kwargs)`` runs ``@rpc`` method ``method`` on one rank
    of the same replica; calls from one rank to another start in order."""

    __slots__ = ("_ext", "_rep", "rank")

    def __init__(self, ext: ReplicaWorker, rep: HostedReplica, rank: int) -> None:
        self._ext = ext
        self._rep = rep
        self.rank = rank

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise RPCRefused(f"rank method {name!r} refused: private names cannot be called")

        def call(*args: Any, **kwargs: Any) -> Any:
            cls = type(self._rep.service)
            if not is_rpc_method(cls, name):
                return _raise(RPCRefused(
                    f"{cls.__name__}.{name} is not callable by other ranks: only methods "
                    "marked with @dask_services.rpc are"))
            return _started_rank_call(self, name, args, kwargs)

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"<RankHandle rank {self.rank} of {incarnation_of(self._rep.id)}>"


class Ranks(Mapping):
    """``self.ranks``: rank -> :class:`RankHandle`, every rank of the replica (itself
    included)."""

    def __init__(self, ext: ReplicaWorker, rep: HostedReplica) -> None:
        self._ext = ext
        self._rep = rep

    def __getitem__(self, rank: int) -> RankHandle:
        gang = self._rep.gang
        size = 1 if gang is None else gang.world_size
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise KeyError(rank)
        return RankHandle(self._ext, self._rep, rank)

    def __iter__(self) -> Iterator[int]:
        gang = self._rep.gang
        return iter(range(1 if gang is None else gang.world_size))

    def __len__(self) -> int:
        gang = self._rep.gang
        return 1 if gang is None else gang.world_size


async def _raise(exc: BaseException) -> Any:
    raise exc


def attach(ext: ReplicaWorker, rep: HostedReplica, rank: int,
           ranks: list[tuple[str, str]] | None) -> None:
    """Give ``rep`` (just created by ``ReplicaWorker.start``) its place in its gang and
    the ``rank``, ``world_size`` and ``ranks`` attributes of its instance."""
    members = [(ServiceId(i), w) for i, w in (ranks or [(str(rep.id), ext.worker.address)])]
    rep.gang = GangMember(rank, members)
    service = rep.service
    service.rank = rank  # type: ignore[attr-defined]
    service.world_size = len(members)  # type: ignore[attr-defined]
    service.ranks = Ranks(ext, rep)  # type: ignore[attr-defined]
    for waiter in _arrivals(ext).pop(rep.id, ()):
        if not waiter.done():
            waiter.set_result(None)


def _arrivals(ext: ReplicaWorker) -> dict[ServiceId, list[asyncio.Future]]:
    return ext.__dict__.setdefault("_rank_arrivals", {})


def no_more_arrivals(ext: ReplicaWorker) -> None:
    """The worker's replicas are closed (``ReplicaWorker.close``): no rank will start here,
    so the rank calls waiting for one are answered (``RankLost``) at once."""
    for waiters in _arrivals(ext).values():
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


async def _instance(ext: ReplicaWorker, sid: ServiceId, timeout: float) -> HostedReplica:
    """Rank ``sid`` on this worker, waiting up to ``timeout`` for its start to arrive
    (ranks start at once; a peer call may come first)."""
    rep = ext.replicas.get(sid)
    if rep is None and not ext.closed:
        waiter = asyncio.get_running_loop().create_future()
        _arrivals(ext).setdefault(sid, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            waiters = _arrivals(ext).get(sid, [])
            if waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    _arrivals(ext).pop(sid, None)
        rep = ext.replicas.get(sid)
    if rep is None or rep.closing or rep.gang is None:
        raise RankLost(f"rank {sid} is not running on {ext.worker.address}")
    return rep


# ------------------------------------------------------------------ rank -> rank RPC


async def _started_rank_call(handle: RankHandle, name: str, args: tuple, kwargs: dict) -> Any:
    """A rank call takes its sequence number when it starts, not when its coroutine is
    made (as peer calls do): one made and never awaited, or awaited after a later one,
    would leave a number every later call to that rank waits for."""
    gang = handle._rep.gang
    assert gang is not None
    seq = gang.next_seq_out.get(handle.rank, 0)
    gang.next_seq_out[handle.rank] = seq + 1
    return await _send_rank_rpc(handle._ext, handle._rep, handle.rank, seq, name, args, kwargs)


async def _send_rank_rpc(ext: ReplicaWorker, rep: HostedReplica, target: int, seq: int,
                         method: str, args: tuple, kwargs: dict) -> Any:
    gang = rep.gang
    assert gang is not None
    target_id, address = gang.ranks[target]
    resp = await _rank_request(ext, address, f"rank {target} of {incarnation_of(rep.id)}",
                               op="replicated_rank_rpc", target=str(target_id),
                               source=gang.rank, seq=seq, method=method,
                               payload=to_serialize((args, kwargs)))
    if resp["status"] == "ok":
        return unwrap(resp["result"])
    if resp["status"] == "gone":
        raise RankLost(resp["message"], in_flight=bool(resp.get("lost_in_flight")))
    raise loads_exception(resp["exception"])


async def _rank_request(ext: ReplicaWorker, address: str, rank: str, **msg: Any) -> dict:
    """Send ``msg`` to ``rank`` on ``address`` and return its answer; ``RankLost`` if it
    cannot be reached, ``RankLost(in_flight=True)`` if the connection broke once sent (the
    rank may have been running it: its worker died, perhaps of the call)."""
    pool = ext.worker.rpc
    try:
        comm = await pool.connect(address)
    except OSError as e:
        raise RankLost(f"{rank} on {address} is unreachable: {type(e).__name__}: {e}"
                       ) from e
    try:
        return await send_recv(comm, serializers=pool.serializers,
                               deserializers=pool.deserializers, **msg)
    except OSError as e:
        raise RankLost(f"{rank} on {address} was lost while it had the call: "
                       f"{type(e).__name__}: {e}", in_flight=True) from e
    finally:
        pool.reuse(address, comm)


async def rank_rpc(ext: ReplicaWorker, target: str, source: int, seq: int, method: str,
                   payload: Any, timeout: float) -> dict:
    """Handler ``replicated_rank_rpc``: run ``@rpc`` method ``method`` of rank ``target``
    once the earlier calls from rank ``source`` have started."""
    try:
        rep = await _instance(ext, ServiceId(target), timeout)
    except RankLost as e:
        return {"status": "gone", "message": str(e)}
    gang = rep.gang
    assert gang is not None

    async def turn() -> None:
        async with gang.turn:
            await gang.turn.wait_for(lambda: gang.next_seq_in.get(source, 0) == seq)
            gang.next_seq_in[source] = seq + 1
            gang.turn.notify_all()

    waiting = asyncio.ensure_future(turn())
    stopped = asyncio.ensure_future(rep.stopped.wait())
    try:
        await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not waiting.done():
            waiting.cancel()
    if not waiting.done() or waiting.cancelled():
        return {"status": "gone", "message": f"rank {target} stopped"}
    # The turn is taken: whatever becomes of this call, the next one goes on.
    cls = type(rep.service)
    try:
        if not is_rpc_method(cls, method):
            raise RPCRefused(f"{cls.__name__}.{method} is not callable by other ranks: only "
                             "methods marked with @dask_services.rpc are")
        args, kwargs = unwrap(payload)
        result = await _run(rep, method, args, kwargs)
    except ReplicaGone as e:
        return gone_answer(e)
    except Exception as e:
        return {"status": "error", "exception": dumps_exception(e)}
    return {"status": "ok", "result": to_serialize(result)}


# ------------------------------------------------------------------ rank 0 -> every rank


async def _run(rep: HostedReplica, method: str, args: tuple, kwargs: dict) -> Any:
    """Run ``method`` on this rank.  What it raises that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) or cannot be a future's
    outcome (``StopIteration``) fails the call as a ``RuntimeError`` naming it: let out of
    the task that runs a rank's part, it would stop the worker's event loop, and the call,
    re-sent, the next worker's."""
    fn = getattr(rep.service, method)
    what = f"{rep.name}.{method} (rank {rep.gang.rank if rep.gang else 0})"
    if inspect.iscoroutinefunction(fn):
        return await guarded(fn(*args, **kwargs), what, "the call")
    return await asyncio.get_running_loop().run_in_executor(
        rep.executor, in_current_context(guarded_in_thread(
            functools.partial(fn, *args, **kwargs), what, "the call")))


async def gang_call(ext: ReplicaWorker, rep: HostedReplica, method: str, args: tuple,
                    kwargs: dict) -> Any:
    """On rank 0: run ``method`` on every rank at once; rank 0's result once all finished.

    A rank that cannot be reached (or answers ``gone``) makes the call ``RankLost``, which
    the caller re-sends; otherwise the first exception, rank 0's first, is raised."""
    gang = rep.gang
    assert gang is not None
    payload = to_serialize((args, kwargs))

    async def remote(rank: int) -> Any:
        sid, address = gang.ranks[rank]
        resp = await _rank_request(ext, address, f"rank {rank} of {rep.id}",
                                   op="replicated_rank_call", id=str(sid), method=method,
                                   payload=payload)
        if resp["status"] == "ok":
            return None
        if resp["status"] == "error":
            raise loads_exception(resp["exception"])
        if resp["status"] == "cut":  # it started there: not to be run again
            raise ScaledDown(resp["message"])
        raise RankLost(f"rank {rank} of {rep.id}: {resp.get('message', resp['status'])}",
                       in_flight=bool(resp.get("lost_in_flight")))

    results = await asyncio.gather(_run(rep, method, args, kwargs),
                                   *(remote(r) for r in range(1, gang.world_size)),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    for kind in (ScaledDown, ReplicaGone):  # a rank cut after it started, then one lost
        for error in errors:
            if isinstance(error, kind):
                raise error
    if errors:
        raise errors[0]
    return results[0]


async def rank_call(ext: ReplicaWorker, id: str, method: str, payload: Any) -> dict:
    """Handler ``replicated_rank_call``: rank 0 runs a call on this rank (``id``, r > 0).
    Rank 0 admitted it, so only its concurrency applies here; the answer carries no
    result (rank 0's is the call's)."""
    rep = ext.replicas.get(ServiceId(id))
    if rep is None or not rep.ready or rep.closing:
        return {"status": "gone", "message": f"rank {id} is not running on "
                                             f"{ext.worker.address}"}
    try:
        await rep.gate.acquire()
    except (ReplicaGone, ServiceShutdown, ServiceOverloaded) as e:
        return {"status": "gone", "message": str(e)}
    task = asyncio.current_task()
    if task is not None:
        rep.running.add(task)
    try:
        args, kwargs = unwrap(payload)
        await _run(rep, method, args, kwargs)
    except asyncio.CancelledError:
        if not rep.cancelled:
            raise
        if isinstance(rep.closed_with, ScaledDown):
            return {"status": "cut", "message": f"rank {id} was scaled down mid-call"}
        return {"status": "gone", "message": f"rank {id} stopped"}
    except ReplicaGone as e:
        return gone_answer(e)
    except Exception as e:
        return {"status": "error", "exception": dumps_exception(e)}
    finally:
        if task is not None:
            rep.running.discard(task)
        rep.gate.release()
    return {"status": "ok"}
