"""The scheduler part's scaling of a deployment: ``svc.scale(n)``, stopping the surplus
(least useful first, draining their calls), spreading replicas over the workers (make
before break) and autoscaling (each deployment's policy sampled, its decisions carried
out and logged); and what the replicas ask of an adaptive cluster (``demand``).
``Deployments`` inherits it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

from dask_services._messages import dumps_exception
from dask_services.replicated import _lifecycle as lc
from dask_services.replicated._autoscale import Decision
from dask_services.replicated._deployment import Deployment
from dask_services.replicated._lifecycle import ReplicaState
from dask_services.replicated._load import busy, called_lately, ongoing
from dask_services.replicated._options import config_seconds
from dask_services.replicated._rebalance import spread_move

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

    from dask_services.replicated._table import ReplicaReports

logger = logging.getLogger("dask_services")
EVENT_TOPIC = "dask_services"  # of the scheduler's event log (as the core's)


class Scaling:
    """Scaling, spreading and autoscaling, on ``Deployments``' own state."""

    # (set by Deployments)
    scheduler: Scheduler
    deployments: dict[str, Deployment]
    reports: ReplicaReports
    _stops_under_way: collections.Counter
    # and its methods _deployment, _wait, _add_slot, _apply, _spawn, _await, _eligible,
    # _place, _log and placed

    async def scale(self, comm: Any, name: str, n: int, timeout: float,
                    uid: str | None = None) -> dict:
        """Add replicas or stop the surplus (least useful first) until there are ``n``."""
        dep = self._deployment(name, uid)
        if dep is None or dep.stopping:
            return None  # type: ignore[return-value]
        if n < 1 and (dep.autoscaling is None or dep.autoscaling.config.min_replicas > 0):
            return {"status": "error", "exception": dumps_exception(ValueError(
                f"scale({n}) of {name}: n must be at least 1 (0 only for a service "
                "autoscaled with min_replicas: 0); to stop it call svc.shutdown()"))}
        active = dep.active()
        if dep.autoscaling is not None:
            dep.floor = n  # a manual floor: autoscaling adds above it, never goes below
            asked, n = n, dep.autoscaling.bounds(n)[0]  # never below min_replicas
            self._log_decision(dep, Decision(len(active), n, f"svc.scale({asked}) sets the "
                                             "floor" + ("" if n == asked else
                                                        f"; min_replicas is {n}")))
        if n > len(active):
            new = [self._add_slot(dep) for _ in range(n - len(active))]
            result = await self._wait(name, timeout, slots=new, uid=dep.uid)
            if result["status"] != "ok":
                if result.get("late"):  # not failed, only late: they stay wanted
                    result["error"] += (
                        f"; the service still aims at {n} replicas and starts them once "
                        f"workers allow: svc.scale({len(active)}) gives them up")
                return result
            return {"status": "ok"}
        await self._scale_down(dep, n)
        return {"status": "ok"}

    async def _scale_down(self, dep: Deployment, n: int) -> None:
        """Stop the surplus over ``n`` replicas, least useful first, draining their calls
        (queued calls go back to their callers and are re-sent)."""
        active = dep.active()
        order = {ReplicaState.UNHEALTHY: 0, ReplicaState.UNINITIALIZED: 1,
                 ReplicaState.RECOVERING: 2, ReplicaState.HEALTHY: 3}
        # the least busy first (an idle replica rather than one whose calls would have to
        # finish within the drain), then the newest
        victims = sorted(active, key=lambda s: (
            order[active[s].state], busy(active[s], self.reports), -s))[:len(active) - n]
        for s in victims:  # a move's new replica stopped: the one it replaces stays
            dep.moves.pop(s, None)
        await self._stop_slots(dep, victims, "scale-down")

    def _stop_slots(self, dep: Deployment, slots: list[int], reason: str) -> asyncio.Task:
        """Stop the replicas of ``slots`` for good, in this step; the returned task drains
        their calls, then forgets them."""
        stops = []
        for s in slots:
            if s in dep.slots:
                stops += self._apply(dep, s, dep.slots[s].handle(lc.StopRequested()),
                                     reason=reason, timeout=config_seconds("drain-timeout"))
        return self._spawn(dep, self._forget_once_stopped(dep, slots, stops))

    async def _forget_once_stopped(self, dep: Deployment, slots: list[int],
                                   stops: list[asyncio.Task]) -> None:
        await self._await(stops, config_seconds("drain-timeout") + 10)
        for s in slots:
            dep.slots.pop(s, None)
            dep.errors.pop(s, None)
        dep.rebalancer.forget_moved()
        self.reports.prune(self.placed())
        dep.notify()

    # ------------------------------------------------------------ spreading

    def _spread_soon(self, dep: Deployment) -> None:
        """Check, once the current step is carried out, whether a replica of ``dep`` is
        to move to a worker holding fewer (``_rebalance.spread_move``)."""
        if dep.spread_pending or dep.stopping:
            return
        dep.spread_pending = True

        def check() -> None:
            dep.spread_pending = False
            if self.deployments.get(dep.name) is dep and not dep.stopping:
                self._spread(dep)

        asyncio.get_running_loop().call_soon(check)

    def _spread(self, dep: Deployment) -> None:
        """Start a new replica on a worker holding fewer of ``dep``'s than the most
        crowded one, for each replica to move; the one it replaces is stopped once it is
        healthy (make before break: the service never has fewer replicas meanwhile)."""
        if dep.procs_per_replica > 1:
            # a gang's ranks are placed together, on the workers with the fewest: moving
            # one can crowd another worker, and every move restarts the whole gang
            return
        while True:
            held: dict[str, int] = collections.Counter()
            movable: dict[str, list[int]] = {}
            for s, m in dep.active().items():  # (replicas being replaced are not)
                if m.worker is not None:
                    held[m.worker] += 1
                    if m.state is ReplicaState.HEALTHY and s not in dep.moves:
                        movable.setdefault(m.worker, []).append(s)
            # read again after each move: a worker the last move filled may be full
            # (max_replicas_per_worker, resources)
            eligible = {ws.address for ws in self._eligible(dep)}
            move = spread_move(held, eligible, movable)
            if move is None:
                return
            slot, source = move
            workers, _ = self._place(dep, frozenset({source}))
            if workers is None or source in workers:
                return
            old = dep.slots[slot]
            new = self._add_slot(dep)
            dep.moves[new] = slot
            self._log(dep.name, "spreading", old.id, source,
                      f"replaced by {dep.slots[new].id} on "
                      f"{dep.slots[new].worker or 'a worker'}: {held[source]} replicas of "
                      "the service on its worker, fewer elsewhere")

    # ------------------------------------------------------------ autoscaling

    def _autoscale_all(self) -> None:
        now = asyncio.get_running_loop().time()
        for dep in list(self.deployments.values()):
            self._autoscale(dep, now)

    def _autoscale(self, dep: Deployment, now: float) -> None:
        """One load sample of ``dep`` given to its policy, and its decision carried out."""
        if dep.autoscaling is None or dep.stopping:
            return
        active = dep.active()
        decision = dep.autoscaling.observe(
            now, len(active), ongoing(dep, self.reports), dep.floor,
            called=dep.scales_to_zero() and called_lately(dep, self.reports),  # matters only there
            none_ready=not any(m.state is ReplicaState.HEALTHY for m in active.values()))
        if decision is None:
            return
        if decision.target > decision.current and any(
                m.state is ReplicaState.UNHEALTHY for m in active.values()):
            return  # setup fails: more replicas would not help (fewer are fine: a
            # scale-down stops the unhealthy ones first)
        if decision.target < decision.current and any(
                m.launching or m.starting for m in active.values()):
            # replicas being placed or set up (the initial ones, an upscale's) have had
            # no load to take: the downscale delay runs again once they are up.  One
            # waiting for a worker does not hold it back: it may wait for good, and is
            # the first a scale-down stops.
            return
        self.autoscale(dep, decision)

    def autoscale(self, dep: Deployment, decision: Decision) -> None:
        """Carry out an autoscaling decision (logged with its reason)."""
        self._log_decision(dep, decision)
        if decision.target > decision.current:
            for _ in range(decision.target - decision.current):
                self._add_slot(dep)
        else:
            self._spawn(dep, self._scale_down(dep, decision.target))

    def _log_decision(self, dep: Deployment, decision: Decision) -> None:
        dep.last_decision = str(decision)
        self.scheduler.log_event(EVENT_TOPIC, {
            "action": "replicas-autoscaled", "service": dep.name, "from": decision.current,
            "to": decision.target, "reason": decision.reason})
        logger.info("replicated service %s: scaling %s", dep.name, decision)

    def demand(self) -> tuple[set[str], int]:
        """The workers that replicas (every rank) occupy, and how many more ranks wait
        for a worker: what the replicas ask of an adaptive cluster (``_adaptive.py``)."""
        # a worker whose replica is stopping (a scale-down's drain) is still held by it
        hosts: set[str] = {worker for worker, _ in self._stops_under_way}
        waiting = 0
        for dep in self.deployments.values():
            for m in dep.slots.values():
                if m.state is ReplicaState.STOPPED:
                    continue
                hosts.update(m.workers)
                if m.waiting_for_worker:
                    waiting += m.size
        return hosts, waiting
