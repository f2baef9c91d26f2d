"""The scheduler part: the source of truth for where replicas are and how they are.

:class:`Deployments` is a scheduler plugin of its own (``scheduler.extensions[EXTENSION]``),
installed next to the service-task core by ``dask_services.install()``; the core knows
nothing of it.  It keeps one :class:`~dask_services.replicated._lifecycle.ReplicaMachine`
per replica slot, feeds it events (setup results, workers added, lost and retiring, failed
probes, scale and shutdown; distributed calls ``add_worker``, ``remove_worker``,
``log_event`` and ``heartbeat`` on it directly) and carries out its actions: choose a
worker, start or stop an instance over the worker RPC.  At ``start`` it registers its
worker plugin (``_worker.ReplicaWorker``).  Handles ask it for the replica table and cache
it; calls never pass through here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps
from tornado.ioloop import PeriodicCallback

from dask_services._run_model import new_stimulus_id
from dask_services._worker_status import status_change
from dask_services.config import setting
from dask_services.replicated import _adaptive, _placement
from dask_services.replicated import _lifecycle as lc
from dask_services.replicated import _replica_rpc as _rpc
from dask_services.replicated._autoscale import AutoscalePolicy, AutoscalingConfig
from dask_services.replicated._departures import Departures
from dask_services.replicated._deployment import Deployment, WakeAsk, first_set
from dask_services.replicated._gang import incarnation_of, rank_id
from dask_services.replicated._lifecycle import ReplicaState
from dask_services.replicated._options import config_seconds
from dask_services.replicated._rebalancer import Rebalancer
from dask_services.replicated._scaling import EVENT_TOPIC, Scaling
from dask_services.replicated._table import ReplicaReports
from dask_services.replicated._worker import EXTENSION, ReplicaWorker

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, WorkerState

    from dask_services.service import ServiceId

logger = logging.getLogger("dask_services")
NAMES_KEPT = 10_000  # service names whose slot counts are kept (``_slots_made``)
HANDLERS = ("replicated_deploy", "replicated_wait", "replicated_table", "replicated_replicas",
            "replicated_metrics", "replicated_scale", "replicated_shutdown", "replicated_story",
            "replicated_wake")


def _name_taken(dep: Deployment, client: str | None) -> str:
    """Why a deployment of ``dep``'s name is refused, as the one holding it stands."""
    name = dep.name
    if dep.stopping:
        return (f"a service named {name!r} is still shutting down; deploy it again once "
                "its shutdown() returned, or pick another options(name=...)")
    if dep.deploying_client is not None:
        whose = "this client's" if dep.deploying_client == client else "another client's"
        return (f"a service named {name!r} is being deployed ({whose} as_service() has "
                "not returned yet); pick another options(name=...), or use the handle "
                "that as_service() returns")
    return f"a service named {name!r} is already deployed; pick another options(name=...)"


class Deployments(Scaling, SchedulerPlugin):
    """Every replicated service deployed on this scheduler (a scheduler plugin and
    extension, ``EXTENSION``)."""

    name = EXTENSION
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # set by start()
        self.deployments: dict[str, Deployment] = {}
        self._prefix = uuid.uuid4().hex[:6] + "-"
        # slots made by service name, over its deployments (a replica id is never
        # reused); the least recently deployed names beyond NAMES_KEPT are dropped, and a
        # name not kept starts above every slot of a dropped one
        self._slots_made: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._dropped_slots = 0
        # incarnations whose health probe runs, with their ranks' workers
        self._probing: dict[ServiceId, tuple[str, ...]] = {}
        # workers whose connection broke once sent a start or probe, awaited to leave
        self._departures = Departures()
        self._probe: PeriodicCallback | None = None
        self._autoscaler: PeriodicCallback | None = None
        self.reports = ReplicaReports()  # figures of each replica, from worker heartbeats
        # stops of replicas a worker reports that no deployment places there (their stop
        # was lost), by instance id
        self._orphan_stops: dict[str, asyncio.Task] = {}
        # (worker, incarnation id) of every stop under way: its replica is not an orphan
        self._stops_under_way: collections.Counter[tuple[str, str]] = collections.Counter()
        self._freed_pending = False  # a "capacity freed" broadcast is due this loop turn
        # shutdowns of deployments whose deploying client left (``remove_client``)
        self._abandoned_shutdowns: set[asyncio.Task] = set()
        # callers (client ids, worker addresses) that left this turn of the loop, and
        # the messages telling the replicas' workers (``_callers_left``)
        self._callers_gone: set[str] = set()
        self._callers_told: set[asyncio.Task] = set()
        self._closing = False
        # resources that instances being stopped (draining their calls) still hold
        self._held_by_stops: dict[tuple[str, str], dict[str, float]] = {}

    async def start(self, scheduler: Scheduler) -> None:
        """Install the scheduler handlers, start the health probes and register the
        worker plugin."""
        self.scheduler = scheduler
        scheduler.extensions[EXTENSION] = self
        _adaptive.install(self)  # replicas count in an adaptive cluster's target
        for name in HANDLERS:
            scheduler.handlers[name] = getattr(self, name[len("replicated_"):])
        period = config_seconds("health-check-period")
        if period > 0:
            self._probe = PeriodicCallback(self._probe_all, period * 1000)
            self._probe.start()
        self._autoscaler = PeriodicCallback(
            self._autoscale_all, config_seconds("autoscaling-interval") * 1000)
        self._autoscaler.start()
        await scheduler.register_worker_plugin(
            # pickled, so that every worker gets its own object (inproc comms would hand
            # in-process workers one and the same)
            None, dumps(ReplicaWorker()), name=EXTENSION, idempotent=True
        )

    async def close(self) -> None:
        """Stop probing and everything under way, remove the handlers (the scheduler is
        closing)."""
        self._closing = True
        if self._probe is not None:
            self._probe.stop()
        if self._autoscaler is not None:
            self._autoscaler.stop()
        tasks = [task for dep in self.deployments.values() for task in dep.tasks]
        tasks += self._orphan_stops.values()
        tasks += self._abandoned_shutdowns
        tasks += self._callers_told
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in HANDLERS:
            if self.scheduler.handlers.get(name) == getattr(self, name[len("replicated_"):]):
                del self.scheduler.handlers[name]
        if self.scheduler.extensions.get(EXTENSION) is self:
            del self.scheduler.extensions[EXTENSION]
        _adaptive.uninstall(self)

    # ------------------------------------------------------------ distributed's hooks

    def heartbeat(self, ws: WorkerState, data: Any) -> None:
        """Figures of the replicas on ``ws``, sent by ``ReplicaWorker.heartbeat``."""
        self.worker_report(ws.address, data or ())

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        """A client left: the replicas give back the calls it had queued, and a
        deployment it was still waiting for (its ``as_service()`` interrupted by the
        client closing) is shut down, since no one holds a handle."""
        self._callers_left(client)
        for dep in list(self.deployments.values()):
            if dep.deploying_client == client and not dep.stopping:
                self.scheduler.log_event(EVENT_TOPIC, {
                    "action": "deploy-abandoned", "service": dep.name, "client": client})
                logger.info("replicated service %s: shut down, its deploying client %s "
                            "left before it was deployed", dep.name, client)
                task = asyncio.ensure_future(self.shutdown(None, dep.name, 0, uid=dep.uid))
                self._abandoned_shutdowns.add(task)
                task.add_done_callback(self._abandoned_shutdowns.discard)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """A worker joined: replicas waiting for one are launched, and replicas crowded
        on other workers spread to it."""
        self._worker_added(new_stimulus_id(f"add-worker-{worker}"))

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str = "",
                      **kwargs: Any) -> None:
        """A worker left: its replicas are relaunched elsewhere."""
        self._broadcast(lc.WorkerLost(
            worker, probing=frozenset(sid for sid, on in self._probing.items()
                                      if worker in on),
            stimulus_id=stimulus_id or new_stimulus_id(f"remove-worker-{worker}")))
        self._departures.left(worker)
        self._callers_left(worker)

    def _callers_left(self, caller: str) -> None:
        """``caller`` (a client's id, a worker's address) left: the workers holding
        replicas are told, once per turn of the loop for every caller that left in it (a
        scale-down removes many workers at once), and give back the calls it had queued,
        which no one would read."""
        if self._closing or not self.deployments:
            return
        if not self._callers_gone:
            asyncio.get_running_loop().call_soon(self._tell_callers_left)
        self._callers_gone.add(caller)

    def _tell_callers_left(self) -> None:
        gone, self._callers_gone = self._callers_gone, set()
        if self._closing or self.scheduler.status in (Status.closing, Status.closed):
            return
        hosts = {w for dep in self.deployments.values() for m in dep.slots.values()
                 for w in m.workers if w not in gone and w in self.scheduler.workers}
        for worker in hosts:
            task = asyncio.ensure_future(_rpc.callers_left(self.scheduler.rpc, worker,
                                                           sorted(gone)))
            self._callers_told.add(task)
            task.add_done_callback(self._callers_told.discard)

    def valid_workers_downscaling(self, scheduler: Scheduler,
                                  workers: list[WorkerState]) -> list[WorkerState]:
        """Workers holding a rank of a replica are not to be retired by an adaptive
        cluster (``Scheduler.workers_to_close``): see ``_adaptive.py``."""
        return _adaptive.closable(self, workers)

    def log_event(self, topic: Any, msg: Any) -> None:
        """Worker status changes reach plugins only through the event log; retiring a
        worker (``closing_gracefully``) moves its replicas."""
        change = status_change(topic, msg)
        if change is not None:
            self.worker_status(*change[:2])

    # ------------------------------------------------------------ handlers

    async def deploy(self, comm: Any, name: str, blob: bytes, replicas: int,
                     max_concurrency: int, max_queued: int, workers: list[str] | None,
                     resources: dict | None, cls: str = "", procs_per_replica: int = 1,
                     autoscaling: dict | None = None,
                     max_replicas_per_worker: int | None = None,
                     client: str | None = None, uid: str | None = None) -> dict:
        """Create a deployment of ``replicas`` replicas of ``procs_per_replica`` ranks and
        launch them (does not wait); ``autoscaling``: see ``_autoscale.py``.  ``client``:
        the id of the client deploying it, which waits (``wait(deploying=True)``); should
        it leave first, the deployment is shut down (``remove_client``).  ``uid``: the
        deployment's, made by that client, so that it can shut the deployment down even
        when it was interrupted before this answered."""
        if name in self.deployments:
            return {"status": "error", "error": _name_taken(self.deployments[name], client)}
        policy = None
        if autoscaling is not None:
            policy = AutoscalePolicy(AutoscalingConfig(**autoscaling))
            replicas = policy.config.initial(replicas)
        dep = Deployment(name=name, blob=blob, max_concurrency=max_concurrency,
                         max_queued=max_queued, workers=tuple(workers) if workers else None,
                         resources=resources or None, cls=cls,
                         procs_per_replica=procs_per_replica, autoscaling=policy,
                         max_replicas_per_worker=max_replicas_per_worker,
                         **({"uid": uid} if uid else {}))
        # slots go on from those of earlier deployments of the name: a replica id is
        # never reused, so nothing meant for one reaches another
        dep.next_slot = self._slots_made.get(name, self._dropped_slots)
        dep.deploying_client = client
        dep.rebalancer = self._rebalancer_for(dep)
        self._slots_made[name] = dep.next_slot
        self._slots_made.move_to_end(name)
        while len(self._slots_made) > NAMES_KEPT:
            _, made = self._slots_made.popitem(last=False)
            self._dropped_slots = max(self._dropped_slots, made)
        self.deployments[name] = dep
        for _ in range(replicas):
            self._add_slot(dep)
        return {"status": "ok", "uid": dep.uid}

    def _deployment(self, name: str, uid: str | None) -> Deployment | None:
        """The deployment named ``name``; None if there is none, or if ``uid`` (a handle's)
        is not its own: that handle's service was shut down and the name used again."""
        dep = self.deployments.get(name)
        if dep is None or (uid is not None and uid != dep.uid):
            return None
        return dep

    async def wait(self, comm: Any, name: str, timeout: float,
                   slots: list[int] | None = None, uid: str | None = None,
                   deploying: bool = False) -> dict:
        """Until every (given) replica is healthy, one is unhealthy, or ``timeout``.
        ``deploying``: the deploying client's wait; once it ends well, the deployment no
        longer depends on that client."""
        result = await self._wait(name, timeout, slots, uid)
        dep = self._deployment(name, uid)
        if deploying and result["status"] == "ok" and dep is not None:
            dep.deploying_client = None
        return result

    async def _wait(self, name: str, timeout: float, slots: list[int] | None = None,
                    uid: str | None = None) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            dep = self._deployment(name, uid)
            if dep is None or dep.stopping:
                # shut down (from another handle) before its replicas were healthy
                return {"status": "error", "shutdown": True,
                        "error": f"service {name} was shut down while its replicas started"}
            machines = {s: m for s, m in dep.slots.items()
                        if (slots is None or s in slots) and m.state is not ReplicaState.STOPPED}
            for s, m in machines.items():
                if m.state is ReplicaState.UNHEALTHY:
                    return {"status": "error", "error": m.last_error,
                            "exception": dep.errors.get(s)}
            if all(m.state is ReplicaState.HEALTHY for m in machines.values()):
                return {"status": "ok"}
            left = deadline - loop.time()
            if left <= 0:
                late = _why_not_all_healthy(m for m in machines.values()
                                            if m.state is not ReplicaState.HEALTHY)
                return {"status": "error", "late": True, "error": (
                    f"replicas of {name} not healthy after {timeout} s (the timeout "
                    f"given, by default dask_services.replicated.deploy-timeout): {late}")}
            try:
                await asyncio.wait_for(dep.changed.wait(), left)
            except TimeoutError:
                pass

    def table(self, comm: Any, name: str, uid: str | None = None) -> dict | None:
        """The replica table handles cache: id, worker and state of each replica (and,
        while none is healthy, what they wait for)."""
        dep = self._deployment(name, uid)
        if dep is None:
            return None
        active = [m for m in dep.slots.values() if m.state is not ReplicaState.STOPPED]
        info = {"stopping": dep.stopping, "scales_to_zero": dep.scales_to_zero(),
                "draining": sorted(dep.draining),
                "min_replicas": (dep.autoscaling.config.min_replicas
                                 if dep.autoscaling is not None else None), "replicas": [
            {"id": str(m.id), "worker": m.worker, "state": m.state.value} for m in active
        ]}
        if active and not any(m.state is ReplicaState.HEALTHY for m in active):
            # for the error of a call that finds none healthy (a gang waiting for workers)
            info["why_none_healthy"] = _why_not_all_healthy(active)
        return info

    async def wake(self, comm: Any, name: str, timeout: float,
                   uid: str | None = None, callers: int = 1, asker: str | None = None,
                   seq: int = 0) -> dict:
        """Wait for a healthy replica of a service that scales to zero, for ``callers``
        calls that found none: they count in the autoscaler's load while they wait, and
        a service at zero replicas is scaled up at once.  ``{"status": "none"}`` for a
        service that does not scale to zero (the callers retry as for any other); an
        error once every replica's setup failed; ``{"status": "pending"}`` after
        ``timeout`` (a few seconds: the handle asks again while calls still wait, so
        calls that went away stop counting in the load within that time).  A handle's
        (``asker``) newer ask (``seq``) replaces its count of waiting calls, and the ask
        it replaces is answered at once; an older one arriving late is not counted."""
        dep = self._deployment(name, uid)
        if dep is None or dep.stopping:
            return {"status": "error", "shutdown": True,
                    "error": f"service {name} was shut down (or never deployed)"}
        if not dep.scales_to_zero():
            return {"status": "none"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = object() if asker is None else asker
        entry = WakeAsk(seq, max(1, int(callers)))
        current = dep.waiting.get(key)
        if current is not None and current.seq > seq:
            entry.superseded.set()  # an older ask of the handle, arriving late
        else:
            if current is not None:
                current.superseded.set()
            dep.waiting[key] = entry
        try:
            while True:
                if dep.stopping:
                    return {"status": "error", "shutdown": True,
                            "error": f"service {name} was shut down while a call waited "
                                     "for a replica"}
                active = dep.active()
                if any(m.state is ReplicaState.HEALTHY for m in active.values()):
                    if dep.waiting.get(key) is entry:
                        dep.rebalancer.woken(key, entry.callers)
                    return {"status": "ok"}
                failed = [s for s, m in active.items() if m.state is ReplicaState.UNHEALTHY]
                if active and len(failed) == len(active):
                    # every replica's setup failed: the waiting calls fail with its error,
                    # and the replicas go, so that the next call tries a fresh setup
                    m = active[failed[0]]
                    if dep.failed_removal is None or dep.failed_removal.done():
                        # once for all the callers that wait and see them fail
                        dep.failed_removal = self._spawn(dep, self._scale_down(dep, 0))
                    return {"status": "error", "error": m.last_error,
                            "exception": dep.errors.get(failed[0])}
                superseded = entry.superseded.is_set()
                if not superseded:  # none healthy: the waiting calls decide at once
                    self._autoscale(dep, loop.time())
                left = deadline - loop.time()
                if left <= 0 or superseded:
                    return {"status": "pending",
                            "why": _why_not_all_healthy(active.values())}
                await first_set((dep.changed, entry.superseded), left)
        finally:
            if dep.waiting.get(key) is entry:
                del dep.waiting[key]

    async def replicas(self, comm: Any, name: str, uid: str | None = None
                       ) -> list[dict] | None:
        """id, worker, state, in_flight, queued and last_error of each replica."""
        rows = await self._rows(name, uid)
        if rows is None:
            return None
        keep = ("id", "worker", "state", "in_flight", "queued", "last_error")
        return [{k: row.get(k) for k in keep} for row in rows]

    async def metrics(self, comm: Any, name: str, uid: str | None = None
                      ) -> list[dict] | None:
        """Calls, errors and latency quantiles of each replica."""
        rows = await self._rows(name, uid)
        if rows is None:
            return None
        keep = ("id", "worker", "state", "calls", "errors", "overloaded", "p50_ms", "p99_ms")
        return [{k: row.get(k) for k in keep} for row in rows]

    async def _rows(self, name: str, uid: str | None = None) -> list[dict] | None:
        dep = self._deployment(name, uid)
        if dep is None:
            return None
        rows = [{"id": str(m.id), "worker": m.worker, "state": m.state.value,
                 "last_error": m.last_error}
                for m in dep.slots.values() if m.state is not ReplicaState.STOPPED]
        found = await self._stats({row["id"]: row["worker"] for row in rows
                                   if row["worker"] is not None})
        for row in rows:
            row.update(found.get(row["id"], {}))
        return rows

    async def _stats(self, placed: Mapping[str, str]) -> dict[str, dict]:
        """The figures now of the replicas ``placed`` (``_replica_rpc.replica_stats``)."""
        return await _rpc.replica_stats(self.scheduler.rpc, placed)

    async def shutdown(self, comm: Any, name: str, timeout: float,
                       uid: str | None = None) -> dict:
        """Stop every replica (draining calls in flight for ``timeout`` s) and forget the
        deployment."""
        dep = self._deployment(name, uid)
        if dep is None:
            return {"status": "ok"}
        if dep.stopping:
            # a shutdown is under way: this one returns when it is over (replicas gone,
            # the name free), as the first does
            await dep.stopped.wait()
            return {"status": "ok"}
        dep.stopping = True
        try:
            stops = []
            draining = set()
            for s, m in list(dep.slots.items()):
                if m.state is ReplicaState.STOPPED:
                    draining.add(str(m.id))  # stopped by a scale-down, perhaps draining
                stops += self._apply(dep, s, m.handle(lc.StopRequested()), reason="shutdown",
                                     timeout=timeout)
            # a scale-down's drain still under way gets the shutdown's timeout too
            for worker, sid in list(self._stops_under_way):
                if sid in draining:
                    stops.append(self._spawn(dep, self._stop(worker, sid, timeout,
                                                             "shutdown")))
            await self._await(stops, timeout + 10)
            # Starts still under way answer "stopped" once their stop cancelled them.
            await self._await([t for t in dep.tasks if t not in stops], 10)
        finally:
            self.deployments.pop(name, None)
            self._capacity_freed()
            self.reports.prune(self.placed())
            dep.stopped.set()
            dep.notify()
        self._log(name, "shutdown", None, None, f"timeout={timeout}")
        return {"status": "ok"}

    def story(self, comm: Any, name: str, replica: str | None = None,
              uid: str | None = None) -> list[dict] | None:
        """What the replica slot of incarnation ``replica`` (every slot: None) received,
        decided and sent, oldest first; None for an unknown service."""
        dep = self._deployment(name, uid)
        if dep is None:
            return None
        slots = list(dep.slots.values())
        if replica is not None:
            slots = [m for m in slots if str(replica).rsplit(".", 1)[0] == m.base]
        entries = [e for m in slots for e in m.story_log]
        entries.sort(key=lambda e: e.seq)
        return [e.as_dict() for e in entries]

    # ------------------------------------------------------------ status

    def placed(self) -> dict[str, str]:
        """Incarnation id -> worker of every replica placed on a worker (not stopped)."""
        return {str(m.id): m.worker for dep in self.deployments.values()
                for m in dep.slots.values()
                if m.worker is not None and m.state is not ReplicaState.STOPPED}

    def worker_report(self, worker: str, records: Any) -> None:
        """Figures of the replicas on ``worker``, from its heartbeat (``_table.py``)."""
        self.reports.update(worker, records, self.placed())
        self._stop_orphans(worker, records)

    def _stop_orphans(self, worker: str, records: Any) -> None:
        """Stop the replicas ``worker`` reports that no deployment places there: their
        stop was lost (the worker froze past the stop's wait, e.g. a native call holding
        the GIL, while the replica was relaunched elsewhere or the service shut down).
        A worker reports only replicas that are ready and not closing."""
        placed = None
        for record in records:
            rid = str(record.get("id"))
            if rid in self._orphan_stops:
                continue
            if placed is None:  # every rank of every replica not stopped, and its worker
                placed = {str(rank_id(str(m.id), rank)): w
                          for dep in self.deployments.values() for m in dep.slots.values()
                          if m.state is not ReplicaState.STOPPED
                          for rank, w in enumerate(m.workers)}
            if placed.get(rid) == worker or (worker, incarnation_of(rid)) in self._stops_under_way:
                continue
            logger.warning("replica %s on %s belongs to no deployment any more (its stop "
                           "was lost): stopping it", rid, worker)
            task = asyncio.ensure_future(self._stop(worker, rid, 0, "no longer deployed"))
            self._orphan_stops[rid] = task
            task.add_done_callback(lambda _, rid=rid: self._orphan_stops.pop(rid, None))

    # ------------------------------------------------------------ cluster events

    def worker_status(self, worker: str, status: str) -> None:
        """A worker changed status (seen through the scheduler's event log)."""
        stimulus_id = new_stimulus_id(f"worker-status-{status}-{worker}")
        if status == Status.closing_gracefully.name:
            self._broadcast(lc.WorkerRetiring(worker, stimulus_id=stimulus_id))
        elif status == Status.running.name:
            self._worker_added(stimulus_id)

    def _worker_added(self, stimulus_id: str) -> None:
        """A worker joined or turned running: replicas waiting for one are launched, and
        replicas crowded on other workers spread to it."""
        self._broadcast(lc.WorkerAdded(stimulus_id=stimulus_id))
        for dep in list(self.deployments.values()):
            self._spread_soon(dep)

    def _capacity_freed(self) -> None:
        """A replica let go of its workers (its instance stopped, after any drain; it
        turned unhealthy; its service was shut down): replicas of any service waiting for
        a worker, a resource or a ``max_replicas_per_worker`` place try again, once the
        current step is carried out (one broadcast per turn of the loop, however many
        replicas let go)."""
        if self._freed_pending:
            return
        self._freed_pending = True

        def broadcast() -> None:
            self._freed_pending = False
            if self.scheduler is not None:
                self._broadcast(lc.WorkerAdded(stimulus_id=new_stimulus_id("capacity-freed")))

        asyncio.get_running_loop().call_soon(broadcast)

    def _broadcast(self, event: lc.Event) -> None:
        for dep in list(self.deployments.values()):
            if dep.stopping:
                continue
            for s, m in list(dep.slots.items()):
                self._apply(dep, s, m.handle(event), prune=False)
        self.reports.prune(self.placed())  # once, not once per slot

    # ------------------------------------------------------------ actions

    def _add_slot(self, dep: Deployment) -> int:
        slot = dep.next_slot
        dep.next_slot += 1
        self._slots_made[dep.name] = dep.next_slot
        allowed_failures = int(dask.config.get("distributed.scheduler.allowed-failures", 3))
        machine = lc.ReplicaMachine(
            base=f"{self._prefix}{dep.name}.{slot}",
            max_setup_attempts=int(setting("replicated.setup-attempts")),
            max_lost_in_setup=allowed_failures, max_lost_in_probe=allowed_failures,
            size=dep.procs_per_replica,
        )
        dep.slots[slot] = machine
        self._apply(dep, slot, machine.start())
        return slot

    def _apply(self, dep: Deployment, slot: int, actions: list[lc.Action],
               reason: str = "moved", timeout: float | None = None,
               prune: bool = True) -> list[asyncio.Task]:
        """Carry out ``actions``; returns the stop tasks started.  ``prune=False``: the
        caller forgets the figures of replaced incarnations itself."""
        stops: list[asyncio.Task] = []
        machine = dep.slots[slot]
        pending = list(actions)
        while pending:
            action = pending.pop(0)
            if isinstance(action, lc.Launch):
                workers, why = self._place(dep, action.exclude)
                sid = action.stimulus_id
                event = lc.NoWorker(action.id, why, stimulus_id=sid) if workers is None \
                    else lc.Placed(action.id, workers[0], tuple(workers[1:]), stimulus_id=sid)
                if workers is None:
                    # With no running worker left (the cluster is closing or scaled to
                    # zero) the replica simply waits for one: not worth a warning; nor
                    # is waiting again for what it waited for (a retry on a broadcast).
                    running = any(ws.status == Status.running
                                  for ws in self.scheduler.workers.values())
                    again = machine.last_error == why
                    logger.log(logging.WARNING if running and not again else logging.INFO,
                               "replica %s of %s waits: %s", action.id, dep.name, why)
                pending += machine.handle(event)
            elif isinstance(action, lc.StartOn):
                self._spawn(dep, self._start(dep, slot, action.id,
                                             (action.worker, *action.others)))
            elif isinstance(action, lc.Stop):
                drain = config_seconds("drain-timeout") if timeout is None else timeout
                for worker in (action.worker, *action.others):
                    if dep.resources:  # held until the instance is gone, drain included
                        self._held_by_stops[(worker, str(action.id))] = dict(dep.resources)
                    stop = self._spawn(dep, self._stop(
                        worker, action.id, drain if action.drain else 0, reason))
                    if action.drain and drain > 0:
                        self._count_drain(dep, str(action.id), worker, drain, stop)
                    stops.append(stop)
            elif isinstance(action, lc.StateChanged):
                if action.state is ReplicaState.UNHEALTHY:  # holds no worker any more
                    self._capacity_freed()
                    if dep.moves.pop(slot, None) is not None:  # a move's new replica
                        # failed its setup: the replica it was to replace stays
                        asyncio.get_running_loop().call_soon(
                            self._stop_slots, dep, [slot], "spread failed")
                elif action.state is ReplicaState.HEALTHY:
                    dep.rebalancer.soon()
                    replaced = dep.moves.pop(slot, None)
                    if replaced is not None:  # stopped in this step: no check moves it
                        self._stop_slots(dep, [replaced], "spread")
                    self._spread_soon(dep)
                self._log(dep.name, action.state.value, machine.id, machine.worker,
                          machine.last_error)
                dep.notify()
            else:
                raise TypeError(f"no way to carry out {action!r}")
            if self.scheduler.validate:
                machine.validate()
        if actions and prune:  # a replaced or stopped incarnation's figures go at once
            self.reports.prune(self.placed())
        return stops

    def _count_drain(self, dep: Deployment, sid: str, worker: str, drain: float,
                     stop: asyncio.Task) -> None:
        """Incarnation ``sid`` on ``worker`` drains until ``stop`` ends
        (``Deployment.draining``), or, if the worker left the cluster meanwhile, until its
        drain time is over: ``retire_workers`` removes the worker once its data has moved,
        which breaks the stop's connection while the replica still drains there (its
        worker's close waits for it), and its calls must not be re-sent meanwhile."""
        loop = asyncio.get_running_loop()
        until = loop.time() + drain + 1.0
        dep.draining[sid] += 1

        def release() -> None:
            dep.draining[sid] -= 1
            if dep.draining[sid] <= 0:
                del dep.draining[sid]

        def done(_: asyncio.Task) -> None:
            left = until - loop.time()
            if self.scheduler is not None and worker not in self.scheduler.workers \
                    and left > 0 and not dep.stopping:
                loop.call_later(left, release)
            else:
                release()

        stop.add_done_callback(done)

    def _rebalancer_for(self, dep: Deployment) -> Rebalancer:
        """The passes spreading ``dep``'s queued calls, over this scheduler."""

        def healthy() -> dict[str, str]:
            return {str(m.id): m.worker for m in dep.slots.values()
                    if m.state is ReplicaState.HEALTHY and m.worker is not None}

        async def shed(worker: str, rid: str, keep: int, table: list) -> int:
            return await _rpc.shed_calls(self.scheduler.rpc, worker, rid, keep, table)

        return Rebalancer(
            dep.name, healthy=healthy, stats=self._stats, shed=shed,
            spawn=lambda coro: self._spawn(dep, coro),
            log_event=lambda msg: self.scheduler.log_event(EVENT_TOPIC, msg),
            stopping=lambda: dep.stopping)

    def _spawn(self, dep: Deployment, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        dep.tasks.add(task)
        task.add_done_callback(dep.tasks.discard)
        return task

    async def _await(self, tasks: list[asyncio.Task], timeout: float) -> None:
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def _eligible(self, dep: Deployment) -> list[WorkerState]:
        used = (_placement.resources_held(self.deployments.values(), self._held_by_stops)
                if dep.resources else {})
        return _placement.eligible_workers(dep, self.scheduler.workers.values(), used)

    def _place(self, dep: Deployment,
               exclude: frozenset[str]) -> tuple[list[str] | None, str]:
        """Workers for every rank of a replica at once (``_placement.place``)."""
        running = sum(ws.status == Status.running for ws in self.scheduler.workers.values())
        return _placement.place(dep, self.deployments.values(), self._eligible(dep),
                                running, exclude)

    async def _start_rank(self, dep: Deployment, sid: Any, rank: int,
                          ranks: list[tuple[str, str]]) -> dict:
        return await _rpc.start_rank(self.scheduler.rpc, dep, rank, ranks,
                                     known=lambda worker: worker in self.scheduler.workers)

    async def _start_gang(self, dep: Deployment, sid: Any,
                          workers: tuple[str, ...]) -> dict:
        """Start every rank at once; the first that fails stops the others (their setup
        may be waiting for it) and is the answer."""
        ranks = [(str(rank_id(str(sid), r)), w) for r, w in enumerate(workers)]
        if len(ranks) == 1:
            return await self._start_rank(dep, sid, 0, ranks)
        starts = [asyncio.ensure_future(self._start_rank(dep, sid, r, ranks))
                  for r in range(len(ranks))]
        failed: dict | None = None
        try:
            for next_done in asyncio.as_completed(starts):
                resp = await next_done
                if resp["status"] != "ok":
                    failed = resp
                    if resp["status"] == "error":
                        rank = next(r for r, t in enumerate(starts)
                                    if t.done() and t.result() is resp)
                        resp["error"] = f"rank {rank}: {resp['error']}"
                    break
        finally:
            if failed is not None:
                await self._await([self._spawn(dep, self._stop(w, sid, 0, "gang-failed"))
                                   for w in workers], 50)
                await asyncio.gather(*starts, return_exceptions=True)
        return failed or {"status": "ok"}

    async def _start(self, dep: Deployment, slot: int, sid: Any,
                     workers: tuple[str, ...]) -> None:
        resp = await self._start_gang(dep, sid, workers)
        if resp.get("in_flight"):
            # the worker most likely died while it started the replica: its removal
            # (counted then, the start being under way) comes first, rather than a
            # relaunch placed on it again and lost a second time for one death
            await self._wait_for_departure(workers)
        machine = dep.slots.get(slot)
        current = (self.deployments.get(dep.name) is dep and machine is not None
                   and machine.id == sid and machine.state is not ReplicaState.STOPPED)
        if not current:
            if resp["status"] == "ok":  # an instance nobody wants any more
                for worker in workers:
                    self._spawn(dep, self._stop(worker, sid, 0, "stale"))
            return
        status = resp["status"]
        stimulus_id = new_stimulus_id(f"replicated-start-{status}")
        if status == "ok":
            event: lc.Event = lc.SetupSucceeded(sid, stimulus_id=stimulus_id)
        elif status == "error":
            dep.errors[slot] = resp.get("exception")
            event = lc.SetupFailed(sid, resp["error"], stimulus_id=stimulus_id)
        elif status == "lost":
            event = lc.LaunchLost(sid, resp["error"], in_flight=bool(resp.get("in_flight")),
                                  stimulus_id=stimulus_id)
        else:
            return
        self._apply(dep, slot, machine.handle(event))

    def _stop(self, worker: str, sid: Any, timeout: float, reason: str) -> Coroutine:
        """Stop incarnation ``sid`` (its rank) on ``worker``: counted as under way at once
        (a heartbeat in between must not take the replica for an orphan), then the
        returned coroutine asks the worker."""
        under_way = (worker, str(sid))
        self._stops_under_way[under_way] += 1
        return self._stop_on(worker, sid, timeout, reason, under_way)

    async def _stop_on(self, worker: str, sid: Any, timeout: float, reason: str,
                       under_way: tuple[str, str]) -> None:
        try:
            if worker not in self.scheduler.workers:
                return
            await _rpc.stop_rank(self.scheduler.rpc, worker, sid, timeout, reason)
        finally:
            self._stops_under_way[under_way] -= 1
            if self._stops_under_way[under_way] <= 0:
                del self._stops_under_way[under_way]
                self._held_by_stops.pop(under_way, None)
            # the instance is gone (or its worker did not answer): what it held, a GPU
            # say, is free for a replica waiting for it, not while the instance drains
            self._capacity_freed()

    # ------------------------------------------------------------ health probes

    def _probe_all(self) -> None:
        timeout = config_seconds("health-check-timeout")
        for dep in list(self.deployments.values()):
            if dep.stopping:
                continue
            for slot, m in list(dep.slots.items()):
                if m.state is ReplicaState.HEALTHY and m.id not in self._probing:
                    self._probing[m.id] = m.workers
                    self._spawn(dep, self._probe_one(dep, slot, m.id, m.workers, timeout))

    async def _probe_one(self, dep: Deployment, slot: int, sid: ServiceId,
                         workers: tuple[str, ...], timeout: float) -> None:
        """Probe every rank; the first failure is the replica's.  A rank whose connection
        broke once probed most likely died while ``check_health`` ran: its removal is
        awaited, and counts (the probe being under way) as a worker lost in a probe."""
        try:
            answers = await asyncio.gather(*(
                _rpc.probe_rank(self.scheduler.rpc, sid, r, w, timeout)
                for r, w in enumerate(workers)))
            failed = next((a for a in answers if a.in_flight), None)
            if failed is None:
                failed = next((a for a in answers if a.error is not None), None)
            if failed is not None and failed.in_flight:
                await self._wait_for_departure(workers)
            machine = dep.slots.get(slot)
            if machine is None or machine.id != sid or dep.stopping \
                    or not all(w in self.scheduler.workers for w in workers):
                return
            if failed is None:
                if machine.lost_in_probe:
                    self._apply(dep, slot, machine.handle(lc.ProbePassed(
                        sid, stimulus_id=new_stimulus_id(f"probe-passed-{sid}"))))
                return
            logger.warning("replica %s of %s failed its health probe: %s", sid,
                           dep.name, failed.error)
            self._apply(dep, slot, machine.handle(lc.ProbeFailed(
                sid, failed.error, in_flight=failed.in_flight,
                stimulus_id=new_stimulus_id(f"probe-failed-{sid}"))))
        finally:
            self._probing.pop(sid, None)

    async def _wait_for_departure(self, workers: tuple[str, ...]) -> None:
        """Until one of ``workers`` left, for at most ``health-check-timeout``."""
        await self._departures.any_gone_within(
            workers, lambda w: w in self.scheduler.workers,
            config_seconds("health-check-timeout"))

    # ------------------------------------------------------------ events

    def _log(self, name: str, what: str, sid: Any, worker: str | None,
             detail: str | None) -> None:
        msg = {"action": f"replica-{what}", "service": name, "replica": str(sid),
               "worker": worker, "detail": detail}
        self.scheduler.log_event(EVENT_TOPIC, msg)
        logger.info("replicated service %s: replica %s on %s %s %s", name, sid, worker, what,
                    detail or "")


def _why_not_all_healthy(machines: Iterable[lc.ReplicaMachine]) -> str:
    """What each of ``machines`` waits for, in words: ``"<id>: <why>; ..."``."""
    return "; ".join(f"{m.id}: {_why_not_healthy(m)}" for m in machines)


def _why_not_healthy(m: lc.ReplicaMachine) -> str:
    """What a replica that is not healthy yet is waiting for, in words."""
    if m.waiting_for_worker:
        return m.last_error or "waiting for a worker"
    if m.starting:
        return f"setup() still running on {', '.join(m.workers)}"
    return m.state.value + (f" ({m.last_error})" if m.last_error else "")
