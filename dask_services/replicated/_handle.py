"""The caller's side: the handle of a deployed service, its endpoints, calls and sessions.

A handle caches the replica table (id, worker, state) that the scheduler part keeps, picks
a healthy replica with its router and sends the call straight to that replica's worker over
the worker RPC.  Infrastructure failures (the worker is gone, the replica moved) drop the
replica from the cache, refresh it from the scheduler and re-send the call elsewhere, with
bounded retries and backoff.  Handles pickle: unpickled in a task or a replica they talk
through the worker they are on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dask.config
from distributed.core import send_recv

from dask_services._messages import loads_exception
from dask_services.config import setting
from dask_services.replicated import _shared_tables as shared_tables
from dask_services.replicated._background import consume, idle
from dask_services.replicated._endpoints import Endpoint, ReplicaPeers, Session
from dask_services.replicated._errors import (
    EndpointRefused,
    ServiceOverloaded,
    ServiceShutdown,
    ServiceUnavailable,
)
from dask_services.replicated._options import (
    config_seconds,
    endpoints,
    is_endpoint,
)
from dask_services.replicated._routing import LeastLoaded, ReplicaView, make_router
from dask_services.replicated._transport import Transport, current_transport
from dask_services.replicated._waking import Waking
from dask_services.replicated._watch import ReplacementWatch
from dask_services.replicated._wire import pack, unpack
from dask_services.service import ServiceId


def _bad_scale(n: Any) -> ValueError:
    return ValueError(
        f"scale(n) needs an integer n >= 1, got {n!r}; to stop the service call "
        "svc.shutdown() (scale(0) lifts the floor of a service autoscaled with "
        "min_replicas: 0)")


# how often a delivery checks its replica was not replaced, when the config would have it
# check without pause (``_watch_period``)
WATCH_FLOOR_S = 2.0

@dataclass(frozen=True)
class _Replica:
    id: ServiceId
    worker: str
    state: str



# ------------------------------------------------------------------ the handle


class ReplicatedService:
    """A deployed service: ``svc.<endpoint>.route(...)``, sessions, scaling, shutdown.

    Created by ``MyService.options(...).as_service(...)``; pickles (tasks running on
    workers can call the service through it).
    """

    def __init__(self, name: str, service_class: type, options: Mapping[str, Any],
                 transport: Transport | None = None, uid: str | None = None) -> None:
        self.name = name
        # the deployment's own id (None: whichever is deployed under the name, as for a
        # replica's own handle): a handle never reaches another service of the same name
        self._uid = uid
        self.service_class = service_class
        self.options = dict(options)
        self._transport_ = transport
        self._router = make_router(self.options.get("router", "least_loaded"))
        self._sticky = getattr(self._router, "sticky", False)
        self._own_session: Session | None = None
        self._table: list[_Replica] = []
        self._table_time = -1.0
        self._scales_to_zero = False  # and back, on a call (from the table)
        self._draining: frozenset[str] = frozenset()  # incarnations draining (the table)
        self._why_none_healthy: str | None = None  # what the table said, none healthy
        self._min_replicas: int | None = None  # its autoscaling's (from the table)
        self._stale_at = 0.0  # monotonic time after which the table is refreshed
        self._refreshing: asyncio.Future | None = None
        self._outstanding: collections.Counter = collections.Counter()
        # calls running or queued on each replica (from every caller), as its last answer
        # to this handle said
        self._reported: dict[ServiceId, int] = {}
        self._session_counts: collections.Counter = collections.Counter()
        # calls to one replica made in the same turn of the event loop, sent as one message
        self._outbox: dict[ServiceId, list[tuple[dict, asyncio.Future]]] = {}
        self._watch_every: float | None = None  # seconds between ReplacementWatch checks
        self._waking = Waking()  # calls waiting for a replica of the service at zero

    # -------------------------------------------------------- plumbing

    @property
    def _transport(self) -> Transport:
        transport = self._transport_
        if transport is None or transport.closed():
            # never bound, or its Client was closed: the worker this runs on, or the
            # default client (a new Client becomes it)
            try:
                transport = self._transport_ = current_transport()
            except ValueError:
                if transport is None:
                    raise
                raise ValueError(
                    f"the Client that service {self.name}'s handle used was closed; create "
                    "a distributed.Client connected to the cluster (it becomes the default "
                    "client) and the handle uses it"
                ) from None
        return transport

    def __reduce__(self) -> tuple:
        return (ReplicatedService, (self.name, self.service_class, self.options, None,
                                    self._uid))

    def _watch_period(self) -> float:
        """How often a delivery checks that its replica was not replaced (read once: the
        config values are parsed strings).  With probes off and the table refreshed for
        every call (both 0), every ``WATCH_FLOOR_S``, not in a loop."""
        if self._watch_every is None:
            self._watch_every = max(config_seconds("health-check-period"),
                                    config_seconds("refresh-interval")) or WATCH_FLOOR_S
        return self._watch_every

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("__") or (name.startswith("_") and name.endswith("_")):
            raise AttributeError(name)  # protocols (copy, pickle, IPython) look these up
        self._check_endpoint(name)
        return Endpoint(self, name)

    def __repr__(self) -> str:
        return f"<ReplicatedService {self.name} ({self.service_class.__name__})>"

    def _check_endpoint(self, name: str) -> None:
        if not is_endpoint(self.service_class, name):
            raise EndpointRefused(
                f"{name!r} is not an endpoint of {self.service_class.__name__}; only methods "
                f"marked with @dask_services.endpoint can be called (its endpoints: "
                f"{endpoints(self.service_class)})"
            )

    @property
    def endpoints(self) -> list[str]:
        """Names of the service's endpoints."""
        return endpoints(self.service_class)

    # -------------------------------------------------------- replica table

    async def _refresh(self, now: bool = True) -> None:
        """The table as it is now: a fetch sent from here on (or this handle's own under
        way, as a handle's calls share theirs); with ``now=False``, any fetch under way
        through this handle's worker or client will do."""
        if idle(self._refreshing):
            self._refreshing = asyncio.ensure_future(
                self._fetch_table(sent_after=time.monotonic() if now else -math.inf))
        await asyncio.shield(self._refreshing)

    async def _ready_table(self) -> None:
        """The table for a call: a handle's first (unpickled in a task, most often) is the
        one another handle of the service through the same worker or client got less than
        ``refresh-interval`` ago, else a fetch (``_shared_tables``); later, refreshed in
        the background once it is older than ``refresh-interval``."""
        if self._table_time >= 0:
            self._maybe_refresh()
            return
        transport = self._transport
        recent = shared_tables.recent(transport.owner, self.name, self._uid,
                                      config_seconds("refresh-interval"))
        if recent is None:
            await self._refresh(now=False)  # with the tasks starting beside it
        else:
            self._adopt(*recent)

    async def _fetch_table(self, sent_after: float = -math.inf) -> None:
        transport = self._transport
        self._adopt(*await shared_tables.fetch(transport.owner, transport.scheduler,
                                               self.name, self._uid, sent_after))

    def _adopt(self, info: dict | None, fetched: float) -> None:
        """Take the scheduler's table ``info``, fetched at ``fetched`` (monotonic)."""
        if info is None:
            self._table = []
            self._table_time = time.monotonic()
            raise ServiceShutdown(f"service {self.name} was shut down (or never deployed)")
        self._table = [_Replica(ServiceId(r["id"]), r["worker"], r["state"])
                       for r in info["replicas"]]
        self._scales_to_zero = bool(info.get("scales_to_zero"))
        # incarnations draining their calls in flight: a call on one is answered there,
        # though its slot has a successor (a retired worker's replica, ``ReplacementWatch``)
        self._draining = frozenset(info.get("draining", ()))
        self._why_none_healthy = info.get("why_none_healthy")
        self._min_replicas = info.get("min_replicas")
        # Loads replicas reported in their answers are forgotten as the table ages: a
        # replica reported busy and then no longer chosen would never report again.
        self._reported.clear()
        # when to refresh next (read here, not on every call: parsing it costs)
        self._stale_at = fetched + config_seconds("refresh-interval")
        self._table_time = fetched

    def _no_healthy_replica(self) -> str:
        """The failure of a call that found no healthy replica, with what the replicas
        wait for as the last table said (a gang's ranks waiting for workers, a setup
        still running)."""
        why = self._why_none_healthy
        return f"no healthy replica ({why})" if why else "no healthy replica"

    def _maybe_refresh(self) -> None:
        """Refresh the table in the background once it is older than refresh-interval."""
        if time.monotonic() <= self._stale_at:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        if idle(self._refreshing):
            self._refreshing = asyncio.ensure_future(self._fetch_table())
            self._refreshing.add_done_callback(consume)

    async def _wake(self) -> bool:
        """For a call that found no healthy replica: wait for one if the service scales
        to zero (``_waking``); False if it does not."""
        return await self._waking.wait(self)

    def _learn(self, replicas: list) -> None:
        """The healthy replicas the scheduler told of with a call given back (``[id,
        worker, load]``, the load each is to have once the calls given back are sent on):
        those the cached table lacks are added, those it has in another state (starting
        when it was fetched) taken as healthy, and the loads taken as reported, so that
        the call goes to the replicas with less to do without a round trip for the table,
        though this caller has sent them nothing yet."""
        told = {ServiceId(rid): worker for rid, worker, _ in replicas}
        # those the cached table has in another state (still starting when it was
        # fetched) are healthy now, as the scheduler says
        self._table = [r for r in self._table if r.id not in told] + [
            _Replica(rid, worker, "healthy") for rid, worker in told.items()]
        for rid, _, load in replicas:
            self._reported[ServiceId(rid)] = int(load)

    def _drop(self, sid: ServiceId) -> None:
        self._table = [r for r in self._table if r.id != sid]

    def _healthy(self) -> list[_Replica]:
        return [r for r in self._table if r.state == "healthy"]

    def _views(self, healthy: list[_Replica]) -> list[ReplicaView]:
        return [ReplicaView(r.id, r.worker,
                            max(self._outstanding[r.id], self._reported.get(r.id, 0)),
                            self._session_counts[r.id]) for r in healthy]

    def _choose(self, session: Session | None) -> _Replica | None:
        healthy = self._healthy()
        if not healthy:
            return None
        if session is None and self._sticky:
            if self._own_session is None:
                self._own_session = Session(self)
            session = self._own_session
        if session is not None:
            for r in healthy:
                if r.id == session.replica:
                    return r
            chosen = LeastLoaded().choose(self._views(healthy))
            session.bind(chosen.id)
        else:
            chosen = self._router.choose(self._views(healthy))
        return self._chosen(healthy, chosen)

    def _chosen(self, healthy: list[_Replica], chosen: Any) -> _Replica:
        """The healthy replica the router chose (one of the views it was given, or the id
        of one); anything else is the router's mistake, said so."""
        wanted = getattr(chosen, "id", chosen)
        for r in healthy:
            if r.id == wanted:
                return r
        raise ValueError(
            f"the router of service {self.name} ({type(self._router).__name__}.choose) "
            f"returned {chosen!r}, "
            "which is not one of the healthy replicas it was given ("
            f"{', '.join(str(r.id) for r in healthy)}); choose() must return one of "
            "them (a replica it chose earlier may have been replaced since)")

    # -------------------------------------------------------- calls

    async def _call(self, method: str, args: tuple, kwargs: dict,
                    session: Session | None = None, pin: ServiceId | None = None) -> Any:
        await self._ready_table()
        try:
            payload = pack((args, kwargs), "payload")
        except TypeError as e:  # the caller's mistake: nothing to re-send
            raise TypeError(f"the arguments of {self.name}.{method} cannot be sent to a "
                            f"replica: {e}") from None
        failures: list[str] = []
        delay = -1.0  # the retry settings are read at the first failure (not per call)
        in_flight_losses = 0  # connections that broke while a replica had the call
        # Nothing holds the call to one replica: while queued there it may be given back
        # (replicas were added) and sent to another (at most once per replica added).
        movable = pin is None and session is None and not self._sticky
        moved = False  # given back by a replica (counted where it arrives next)
        just_moved = False  # ... by the replica the last attempt went to
        woken = False  # waited for a replica of a service scaled to zero (``_wake``)
        while True:
            if pin is not None:
                target = next((r for r in self._table if r.id == pin), None)
                if target is None:
                    await self._refresh()
                    target = next((r for r in self._table if r.id == pin), None)
                    if target is None:
                        raise ServiceUnavailable(f"replica {pin} of {self.name} is gone")
            else:
                target = self._choose(session)
            if target is not None:
                self._outstanding[target.id] += 1
                status = None
                try:
                    msg = {"id": str(target.id), "method": method,
                           "caller": self._transport.caller, **payload}
                    if movable:
                        msg["movable"] = True
                    if moved:
                        msg["moved"] = True
                    resp = await self._send(target, msg)
                except OSError as e:
                    failure = f"{target.id} on {target.worker}: {type(e).__name__}: {e}"
                    if isinstance(e, LostInFlight):
                        in_flight_losses += 1
                        self._give_up_if_killing(method, target, in_flight_losses,
                                                 failure)
                else:
                    status = resp.get("status") if isinstance(resp, dict) else None
                    if status == "ok":
                        self._reported[target.id] = int(resp.get("load", 0))
                        return unpack(resp, "result")
                    if status == "error":
                        raise loads_exception(resp["exception"])
                    if status == "overloaded" and not just_moved:
                        raise ServiceOverloaded(resp["message"])
                    if status == "shutdown":
                        raise ServiceShutdown(resp["message"])
                    if status == "cut":  # started, then its replica was scaled down
                        raise ServiceUnavailable(resp["message"])
                    failure = (f"{target.id}: {resp['message']}"
                               if status in ("gone", "overloaded")
                               else f"{target.id} on {target.worker}: no answer ({resp!r})")
                    if status == "gone" and resp.get("lost_in_flight"):
                        in_flight_losses += 1  # another rank of a gang died with it
                        self._give_up_if_killing(method, target, in_flight_losses,
                                                 failure)
                finally:
                    self._outstanding[target.id] -= 1
                    if self._outstanding[target.id] <= 0:
                        del self._outstanding[target.id]
                just_moved = status == "moved"
                if just_moved:  # not a failure: to a replica with less to do
                    # (given back as its caller was taken for gone: sent again as it was,
                    # not counted as moved in by a rebalancing pass)
                    moved = moved or not resp.get("caller_left")
                    self._learn(resp.get("replicas") or [])
                    self._reported[target.id] = max(self._reported.get(target.id, 0),
                                                    int(resp.get("load", 0)))
                    continue
                # An "overloaded" answer here is to a call given back and sent on that
                # found no room (callers with other views of the loads sent theirs there
                # too): it was taken in once, so it is re-sent like a lost one (once: a
                # second replica full is an overload), and the replica stays known.
                if status != "overloaded":
                    self._drop(target.id)
                if pin is not None:
                    raise ServiceUnavailable(
                        f"replica {pin} of {self.name} was lost during the call: {failure}")
            else:
                if not woken and await self._wake():
                    woken = True  # not a failure: the service was at zero replicas
                    continue
                failure = self._no_healthy_replica()
            failures.append(failure)
            if delay < 0:
                retries = int(setting("replicated.call-retries"))
                delay = config_seconds("retry-backoff")
                max_delay = config_seconds("retry-backoff-max")
            if len(failures) > retries:
                with contextlib.suppress(Exception):
                    await self._refresh()  # the states now, not the table less the failed
                states = collections.Counter(r.state for r in self._table)
                raise ServiceUnavailable(
                    f"{self.name}.{method} failed after {len(failures)} attempts "
                    f"(dask_services.replicated.call-retries={retries}); replica states: "
                    f"{dict(states) or 'none'}; last failure: {failures[-1]}"
                )
            if len(failures) > 1 or target is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)
            await self._refresh()

    def _give_up_if_killing(self, method: str, target: _Replica, losses: int,
                            failure: str) -> None:
        """A call lost ``losses`` times while a replica (or a rank of one) had it fails
        past ``distributed.scheduler.allowed-failures``, as a task does with
        ``KilledWorker``: re-sent again, it may kill the next worker too."""
        allowed = int(dask.config.get("distributed.scheduler.allowed-failures", 3))
        if losses > allowed:
            self._drop(target.id)
            raise ServiceUnavailable(
                f"{self.name}.{method}: the call was lost on {losses} replicas while "
                "they had it (a worker died, or its replica stopped answering its "
                "health probes, frozen or blocked, and was replaced), more than "
                f"distributed.scheduler.allowed-failures={allowed} allows: the call "
                "itself may be what kills or freezes them (as KilledWorker says of a "
                f"task); last failure: {failure}")

    async def _send(self, target: _Replica, msg: dict) -> Any:
        """Send one call's message to ``target`` and return its answer.

        Calls to the same replica made in the same turn of the event loop (many callers,
        or one caller with many calls in flight) travel together: one
        ``replicated_calls`` message with the list, one answer with the list of answers,
        instead of a round trip each (what a call costs is mostly the messages).  A lone
        call is sent as ``replicated_call``."""
        loop = asyncio.get_running_loop()
        box = self._outbox.get(target.id)
        if box is None:
            box = self._outbox[target.id] = []
            loop.call_soon(self._flush, target, box)
        fut = loop.create_future()
        box.append((msg, fut))
        return await fut

    def _flush(self, target: _Replica, box: list[tuple[dict, asyncio.Future]]) -> None:
        if self._outbox.get(target.id) is box:
            del self._outbox[target.id]
        task = asyncio.ensure_future(self._deliver(target, box))
        task.add_done_callback(consume)

    async def _deliver(self, target: _Replica, box: list[tuple[dict, asyncio.Future]]) -> None:
        """Send the calls of ``box``; each answer goes to its caller as it arrives (the
        worker writes one message per call, in the order they finish)."""
        comm = None
        sent = False
        watch: ReplacementWatch | None = None
        try:
            comm = await self._connect(target)
            sent = True  # from here on, the replica may be running the calls
            watch = ReplacementWatch(self, target, comm)
            if len(box) == 1:
                answer = await send_recv(comm=comm, op="replicated_call", **box[0][0])
                if not box[0][1].done():
                    box[0][1].set_result(answer)
            else:
                await comm.write({"op": "replicated_calls", "calls": [m for m, _ in box]})
                left = len(box)
                while left:
                    for answer in await comm.read():  # the answers ready together
                        left -= 1
                        fut = box[int(answer.pop("i"))][1]
                        if not fut.done():
                            fut.set_result(answer)
        except BaseException as e:
            if comm is not None and not comm.closed():
                comm.abort()  # part of the answers may still be on their way
            for _, fut in box:
                if not fut.done():
                    if sent:
                        lost: OSError = LostInFlight(
                            watch.replaced if watch is not None and watch.replaced
                            else f"{type(e).__name__}: {e}")
                        lost.__cause__ = e
                    else:
                        lost = e if isinstance(e, OSError) else OSError(
                            f"{type(e).__name__}: {e}")
                    fut.set_exception(lost)
            if not isinstance(e, Exception):
                raise
        finally:
            if watch is not None:
                watch.cancel()
            if comm is not None:
                self._transport.pool.reuse(target.worker, comm)

    async def _connect(self, target: _Replica, timeout: float | None = None) -> Any:
        """A pooled connection to ``target``'s worker.

        distributed retries a refused connection until its timeout, which is what a dead
        worker does: if connecting takes a moment, ask the scheduler whether the replica
        is still there, and give up at once (``OSError``: re-send elsewhere) if not.
        """
        pool = self._transport.pool
        if any(not comm.closed() for comm in pool.available.get(target.worker, ())):
            return await pool.connect(target.worker)  # no I/O: reuse one
        if timeout is None:
            timeout = config_seconds("connect-timeout")
        connect = asyncio.ensure_future(pool.connect(target.worker, timeout=timeout))
        try:
            done, _ = await asyncio.wait({connect}, timeout=0.1)
            while not done:
                await self._refresh()
                if not any(r.id == target.id and r.state == "healthy" for r in self._table):
                    raise OSError(f"replica {target.id} left {target.worker} while connecting")
                done, _ = await asyncio.wait({connect}, timeout=0.5)
            return connect.result()
        except BaseException:
            if not connect.done():
                connect.cancel()
            elif not connect.cancelled() and connect.exception() is None:
                pool.reuse(target.worker, connect.result())  # connected just in time
            raise

    async def _fanout(self, method: str, args: tuple, kwargs: dict) -> list[Any]:
        await self._refresh()
        targets = [r.id for r in self._healthy()]
        if not targets and await self._wake():
            targets = [r.id for r in self._healthy()]
        if not targets:
            raise ServiceUnavailable(f"{self.name} has {self._no_healthy_replica()}")
        return list(await asyncio.gather(
            *(self._call(method, args, kwargs, pin=sid) for sid in targets)))

    # -------------------------------------------------------- management

    def session(self) -> Session:
        """``with svc.session():`` (or ``async with``): every call in the block goes to one
        replica, the least-loaded when the first call is made."""
        return Session(self)

    def peers(self) -> ReplicaPeers:
        """The healthy replicas, by id: ``await svc.peers()[sid].endpoint(...)``."""
        return ReplicaPeers(self)

    def refresh(self) -> Any:
        """Fetch the replica table from the scheduler now."""
        return self._transport.sync(self._refresh)

    def replicas(self) -> Any:
        """One dict per replica: id, worker, state, in_flight, queued, last_error."""
        return self._transport.sync(self._management, "replicated_replicas")

    def metrics(self) -> Any:
        """One dict per replica: id, worker, calls, errors, overloaded, p50_ms, p99_ms."""
        return self._transport.sync(self._management, "replicated_metrics")

    def story(self, replica: Any = None) -> Any:
        """What the scheduler's lifecycle machine of replica ``replica`` (an id from
        ``replicas()``, any incarnation of the slot; None: every replica) received,
        decided and sent, oldest first: one dict per entry with ``time``, ``replica``,
        ``stimulus_id``, ``kind`` (``received``, ``decided``, ``sent``), ``what`` and
        ``detail``.  Bounded by ``dask_services.story.entries`` per replica."""
        return self._transport.sync(self._management, "replicated_story",
                                    replica=None if replica is None else str(replica))

    async def _management(self, op: str, **kwargs: Any) -> Any:
        result = await getattr(self._transport.scheduler, op)(name=self.name, uid=self._uid,
                                                              **kwargs)
        if result is None:
            raise ServiceShutdown(f"service {self.name} was shut down (or never deployed)")
        if isinstance(result, dict) and result.get("status") == "error":
            if result.get("exception"):
                raise loads_exception(result["exception"])
            if result.get("shutdown"):
                raise ServiceShutdown(result["error"])
            raise ServiceUnavailable(result["error"])
        return [dict(row) for row in result] if isinstance(result, (list, tuple)) else result

    def scale(self, n: int, timeout: float | None = None) -> Any:
        """Add or remove replicas until there are ``n``; waits until they are healthy.

        With autoscaling ``n`` is a floor it never goes below; ``scale(0)`` (for a service
        whose autoscaling has ``min_replicas: 0``) lifts the floor and scales to zero."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise _bad_scale(n)
        if n == 0 and self._table_time >= 0:  # min_replicas known (it never changes)
            self._check_scale_to_zero()
        timeout = config_seconds("deploy-timeout") if timeout is None else timeout
        return self._transport.sync(self._scale, n, timeout)

    def _check_scale_to_zero(self) -> None:
        if self._min_replicas != 0:
            raise _bad_scale(0)

    async def _scale(self, n: int, timeout: float) -> None:
        if n == 0 and self._table_time < 0:  # a handle that never fetched the table
            await self._refresh()
            self._check_scale_to_zero()
        await self._management("replicated_scale", n=n, timeout=timeout)
        await self._refresh()

    def shutdown(self, timeout: float = 30) -> Any:
        """Stop every replica: calls in flight get ``timeout`` seconds to finish, queued
        calls fail with ``ServiceShutdown``; nothing stays on the workers."""
        return self._transport.sync(self._shutdown, timeout)

    async def _shutdown(self, timeout: float) -> None:
        await self._transport.scheduler.replicated_shutdown(name=self.name, timeout=timeout,
                                                            uid=self._uid)
        self._table = []


class LostInFlight(OSError):
    """The connection broke after the call was sent: the replica may have been running
    it (its worker died, perhaps of the call)."""


# What ``svc.<name>`` finds on the handle itself, which an endpoint may not be named.
_HANDLE_NAMES = frozenset(
    {n for n in dir(ReplicatedService) if not n.startswith("_")}
    | {"name", "service_class", "options"})


def check_names(cls: type) -> None:
    """Endpoints may not hide the handle's own methods."""
    clash = sorted(set(endpoints(cls)) & _HANDLE_NAMES)
    if clash:
        raise TypeError(
            f"endpoint(s) {clash} of {cls.__name__} clash with methods of the service "
            "handle; rename them"
        )
