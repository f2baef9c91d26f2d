"""Where a replica goes: the workers eligible for a deployment's replicas and the choice
among them, as pure functions of the deployments and the scheduler's workers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from distributed.core import Status

if TYPE_CHECKING:
    from distributed.scheduler import WorkerState

    from dask_services.replicated._deployment import Deployment


def resources_held(deployments: Iterable[Deployment],
                   held_by_stops: Mapping[tuple[str, str], Mapping[str, float]]
                   ) -> dict[str, dict[str, float]]:
    """Resources that placed ranks hold on each worker (``options(resources=...)`` is
    per rank, and held while the rank is placed, and while it is stopped: until its
    instance is gone, ``held_by_stops`` by (worker, replica id))."""
    holders = [(w, resources) for (w, _), resources in held_by_stops.items()]
    holders += [(w, d.resources) for d in deployments if d.resources
                for m in d.slots.values() for w in m.workers]
    used: dict[str, dict[str, float]] = {}
    for w, resources in holders:
        held = used.setdefault(w, {})
        for k, v in resources.items():
            held[k] = held.get(k, 0) + v
    return used


def eligible_workers(dep: Deployment, workers: Iterable[WorkerState],
                     used: Mapping[str, Mapping[str, float]]) -> list[WorkerState]:
    """The running workers a new rank of ``dep`` may go to: within its ``workers``, its
    ``max_replicas_per_worker`` and the resources left free (``used``: held by rank)."""
    out = []
    limit = dep.max_replicas_per_worker
    mine: dict[str, int] = {}
    if limit is not None:
        for m in dep.slots.values():
            for w in m.workers:
                mine[w] = mine.get(w, 0) + 1
    for ws in workers:
        if ws.status != Status.running:
            continue
        if limit is not None and mine.get(ws.address, 0) >= limit:
            continue
        if dep.workers is not None and ws.address not in dep.workers \
                and str(ws.name) not in dep.workers:
            continue
        if dep.resources:
            held = used.get(ws.address, {})
            if any(ws.resources.get(k, 0) - held.get(k, 0) < v
                   for k, v in dep.resources.items()):
                continue
        out.append(ws)
    return out


def place(dep: Deployment, deployments: Iterable[Deployment], eligible: list[WorkerState],
          running: int, exclude: frozenset[str]) -> tuple[list[str] | None, str]:
    """Workers for every rank of a replica of ``dep`` at once, all distinct, from
    ``eligible``, or (None, why): a replica never holds some workers while it waits for
    others, so replicas competing for too few workers cannot deadlock.  The eligible
    workers with the fewest replicas of this service, then of all ``deployments``, are
    chosen; ``exclude`` (the workers a replica is leaving) only when there is no other
    choice.  ``running``: how many workers run, for the reason."""
    size = dep.procs_per_replica
    if len(eligible) < size:
        needs = [f"workers={list(dep.workers)}"] if dep.workers else []
        if dep.resources:
            needs.append(f"resources={dep.resources} free")
        if dep.max_replicas_per_worker is not None:
            needs.append(f"fewer than {dep.max_replicas_per_worker} replicas of "
                         f"{dep.name} (max_replicas_per_worker)")
        what = f"{size} workers at once" if size > 1 else "a worker"
        return None, (f"waiting for {what}{' with ' + ', '.join(needs) if needs else ''}"
                      f": {len(eligible)} eligible of {running} running")
    mine: dict[str, int] = {}
    total: dict[str, int] = {}
    for d in deployments:
        for m in d.slots.values():
            for w in m.workers:
                total[w] = total.get(w, 0) + 1
                if d is dep:
                    mine[w] = mine.get(w, 0) + 1
    ranked = sorted(eligible, key=lambda ws: (ws.address in exclude,
                                              mine.get(ws.address, 0),
                                              total.get(ws.address, 0), ws.address))
    return [ws.address for ws in ranked[:size]], ""
