"""A deployment's load as the autoscaler and a scale-down read it: the figures its
replicas' workers last reported with their heartbeats (``_table.ReplicaReports``), and
the callers waiting for a replica to wake.  Reads only, no cluster needed."""

from __future__ import annotations

from dask_services.replicated._deployment import Deployment
from dask_services.replicated._lifecycle import ReplicaMachine, ReplicaState
from dask_services.replicated._table import ReplicaReports


def busy(m: ReplicaMachine, reports: ReplicaReports) -> int:
    """Calls running or queued on a healthy replica, as of its worker's last heartbeat
    (0 for a replica not healthy)."""
    if m.state is not ReplicaState.HEALTHY:
        return 0
    figures = reports.get(str(m.id))
    return int(figures["in_flight"]) + int(figures["queued"])


def ongoing(dep: Deployment, reports: ReplicaReports) -> int:
    """Calls running or queued on the deployment's healthy replicas, as of their
    workers' last heartbeats, and calls waiting for a replica (``wake``): what
    ``target_ongoing_requests`` is weighed against."""
    return sum(busy(m, reports) for m in dep.slots.values()) + dep.callers_waiting


def called_lately(dep: Deployment, reports: ReplicaReports) -> bool:
    """Whether calls were made on ``dep``'s replicas lately: the latest report of a
    healthy replica (its worker's heartbeat) counted more calls than the one before it;
    between reports the verdict of the last one stands (kept in ``dep.calls_seen``)."""
    seen: dict[str, tuple[float, float | None, bool]] = {}
    for m in dep.slots.values():
        rid = str(m.id)
        calls = reports.get(rid)["calls"]
        if m.state is not ReplicaState.HEALTHY or calls != calls:  # NaN: no report
            continue
        reported = reports.updated.get(m.worker or "")
        before = dep.calls_seen.get(rid)
        if rid not in reports.figures:  # not reported yet: not known idle
            grew = True
        elif before is None:
            grew = calls > 0
        elif reported != before[1]:
            grew = calls > before[0]
        else:
            grew = before[2]
        seen[rid] = (calls, reported, grew)
    dep.calls_seen = seen
    return any(grew for _, _, grew in seen.values())
