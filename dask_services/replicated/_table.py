"""The ``replicas`` status table: one row per replica of every deployed service.

The scheduler knows where each replica is and how it is (``Deployments``: service, class,
incarnation id, worker, state, last error); the call figures (in flight, queued, calls,
errors, calls refused as overloaded, p50/p99 latency) live on the replica's worker.  They
travel to the scheduler the way the run byte counters do: the replicated worker
extension's ``heartbeat()`` returns them (``ReplicaWorker.report()``), and distributed
hands them to the scheduler extension of the same name (``Deployments.heartbeat``), which
keeps them in :class:`ReplicaReports`.  So the dashboard's figures are as of the worker's
last heartbeat (0.5 s on a small cluster; the page says how old), with no extra messages.
``dask_services.status(client, table="replicas")`` is current: before it reads the table,
:func:`refresh` asks every worker holding a replica for its figures now, as
``svc.metrics()`` does (a heartbeat's figures miss the calls made since: asking only for
figures older than 50 ms, it missed calls made just before in 6 of 40 rounds, 35 of 40
when called in a loop).

Only the current incarnations of placed replicas are kept, so the table is bounded by
the number of replicas deployed; a shut-down service leaves no row and no report behind.
Rows are registered as ``_status.TABLES["replicas"]``: the dashboard's ``/services`` page,
``dask_services.status(client, table="replicas")`` and the per-service Prometheus
families (``dask_services_replicas{service, class, state}``,
``dask_services_replica_calls_total``, ...: ``_metrics.ReplicaTotals``) all read them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dask_services._status import StatusTable, register_table

if TYPE_CHECKING:
    from dask_services._observe import ServiceDiagnostics
    from dask_services.replicated._scheduler import Deployments

FIGURES = ("in_flight", "queued", "calls", "errors", "overloaded", "p50_ms", "p99_ms")


class ReplicaReports:
    """The latest figures of each placed replica, by incarnation id."""

    def __init__(self) -> None:
        self.figures: dict[str, dict[str, Any]] = {}
        self.updated: dict[str, float] = {}  # worker -> time.monotonic() of its last report

    def update(self, worker: str, records: Iterable[Mapping[str, Any]],
               placed: Mapping[str, str]) -> None:
        """Take the records of ``worker``'s heartbeat; ``placed`` maps each current
        incarnation id to its worker (a record of another one is stale and dropped)."""
        self.updated[worker] = time.monotonic()
        self.prune(placed)
        for record in records:
            rid = str(record.get("id"))
            if placed.get(rid) == worker:
                self.figures[rid] = {f: _number(record.get(f)) for f in FIGURES}

    def prune(self, placed: Mapping[str, str]) -> None:
        """Forget the figures of incarnations no longer placed."""
        for rid in [r for r in self.figures if r not in placed]:
            del self.figures[rid]
        workers = set(placed.values())
        for worker in [w for w in self.updated if w not in workers]:
            del self.updated[worker]

    def age(self, placed: Mapping[str, str]) -> float:
        """Seconds since the oldest report of a worker holding replicas (inf: none yet)."""
        workers = set(placed.values())
        if not workers:
            return 0.0
        now = time.monotonic()
        return max(now - self.updated.get(w, -math.inf) for w in workers)

    def get(self, rid: str) -> dict[str, Any]:
        """Figures of incarnation ``rid``: zeros (NaN latencies) before its first report."""
        found = self.figures.get(rid)
        if found is None:
            return {f: (math.nan if f.endswith("_ms") else 0) for f in FIGURES}
        return dict(found)


def _number(value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return value


def rows(deployments: Deployments) -> list[dict[str, Any]]:
    """One row per replica (not stopped) of every deployed service, by service and slot."""
    out = []
    for name in sorted(deployments.deployments):
        dep = deployments.deployments[name]
        for slot, m in sorted(dep.slots.items()):
            if m.state.value == "stopped":
                continue
            rid = str(m.id)
            out.append({
                "service": name, "class": dep.cls, "slot": slot, "replica": rid,
                "worker": m.worker or "", "state": m.state.value,
                "healthy": int(m.state.value == "healthy"),
                "incarnation": m.incarnation,
                **deployments.reports.get(rid),
                "last_error": m.last_error or "",
                # the service's replicas aimed at, and its last autoscaling decision
                "target": len(dep.active()), "decision": dep.last_decision,
            })
    return out


def _deployments(plugin: ServiceDiagnostics) -> Deployments | None:
    from dask_services.replicated._worker import EXTENSION

    return plugin.scheduler.extensions.get(EXTENSION)


def _plugin_rows(plugin: ServiceDiagnostics) -> list[dict[str, Any]]:
    deployments = _deployments(plugin)
    return [] if deployments is None else rows(deployments)


def deployed(plugin: ServiceDiagnostics) -> dict[str, dict[str, Any]]:
    """Every deployed service, replicas or none (scaled to zero): name -> its class and
    its deployment's uid (a service shut down and deployed again under its name has a
    new one)."""
    deployments = _deployments(plugin)
    if deployments is None:
        return {}
    return {name: {"class": dep.cls, "deployment": dep.uid}
            for name, dep in deployments.deployments.items()}


async def refresh(plugin: ServiceDiagnostics, max_age: float = 0.0) -> None:
    """Ask the workers whose figures are older than ``max_age`` (all, by default) for
    them now, as ``svc.metrics()`` does, so that ``status(client, table="replicas")``
    shows the calls made just before it (the heartbeat figures may be up to a heartbeat
    old)."""
    deployments = _deployments(plugin)
    if deployments is None:
        return
    reports = deployments.reports
    by_worker: dict[str, list[str]] = {}
    for rid, worker in deployments.placed().items():
        by_worker.setdefault(worker, []).append(rid)
    now = time.monotonic()
    stale = {w: ids for w, ids in by_worker.items()
             if max_age <= 0 or now - reports.updated.get(w, -math.inf) > max_age}

    async def ask(worker: str, ids: list[str]) -> None:
        try:
            stats = await asyncio.wait_for(
                deployments.scheduler.rpc(worker).replicated_stats(ids=ids), 2)
        except (OSError, TimeoutError):
            return  # gone or slow: its heartbeat figures stay
        reports.update(worker, [{"id": rid, **figures} for rid, figures in stats.items()],
                       deployments.placed())

    await asyncio.gather(*(ask(w, ids) for w, ids in stale.items()))


COLUMNS = ("service", "class", "slot", "replica", "worker", "state", "healthy",
           "incarnation", *FIGURES, "last_error", "target", "decision")

TABLE = register_table(StatusTable(
    name="replicas",
    title="Replicated services: replicas",
    columns=COLUMNS,
    labels=("service", "class", "replica", "worker", "state"),
    figures=("healthy", "incarnation", *FIGURES),
    rows=_plugin_rows,
    refresh=refresh,
    subjects=deployed,
))
