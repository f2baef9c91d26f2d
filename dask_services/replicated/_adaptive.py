"""Replicas in an adaptive cluster's arithmetic (``cluster.adapt(...)``).

distributed's ``Adaptive`` (``LocalCluster.adapt()`` and the deployment tools built on it)
asks the scheduler two things, through its ``adaptive_target`` and ``workers_to_close``
handlers: how many workers the work needs, and which workers can go.  Replicas are not
tasks, so neither answer knows of them: a replica waiting for a worker would never make
the cluster grow, and an idle worker holding replicas looks like the best one to retire.

* ``adaptive_target()`` has no plugin hook: :func:`install` wraps it (the scheduler's
  attribute and the RPC handler ``Adaptive`` calls) so that it is at least the number of
  workers holding a rank of a replica plus the ranks waiting for a worker
  (``Deployments.demand``);
* ``workers_to_close()`` (which ``adaptive_target`` also calls when it scales down) asks
  every scheduler plugin's ``valid_workers_downscaling``; ``Deployments`` answers with
  :func:`closable`, the workers that hold no rank of a replica.

So the cluster grows when replicas (autoscaling, ``scale(n)``, a gang of several ranks)
need more eligible workers than there are, and shrinks back once they are scaled down and
the workers they leave are idle.  ``uninstall`` puts the original back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed.scheduler import WorkerState

    from dask_services.replicated._scheduler import Deployments

_ORIGINAL = "__dask_services_original__"


def replica_demand(deployments: Deployments) -> int:
    """Workers the replicas need: those holding a rank, plus ranks waiting for one."""
    hosts, waiting = deployments.demand()
    return len(hosts & set(deployments.scheduler.workers)) + waiting


def _target(deployments: Deployments, original: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(original)
    def adaptive_target(*args: Any, **kwargs: Any) -> int:
        return max(original(*args, **kwargs), replica_demand(deployments))

    setattr(adaptive_target, _ORIGINAL, original)
    return adaptive_target


def closable(deployments: Deployments, workers: list[WorkerState]) -> list[WorkerState]:
    """``workers`` without those holding a rank of a replica."""
    hosts, _ = deployments.demand()
    return [ws for ws in workers if ws.address not in hosts]


def install(deployments: Deployments) -> None:
    """Count the replicas in ``adaptive_target`` (idempotent)."""
    scheduler = deployments.scheduler
    current = scheduler.adaptive_target
    if not hasattr(current, _ORIGINAL):
        wrapped = _target(deployments, current)
        scheduler.adaptive_target = wrapped  # type: ignore[method-assign]
        scheduler.handlers["adaptive_target"] = wrapped


def uninstall(deployments: Deployments) -> None:
    """Put distributed's own ``adaptive_target`` back."""
    scheduler = deployments.scheduler
    current = scheduler.__dict__.get("adaptive_target")
    if current is not None and hasattr(current, _ORIGINAL):
        del scheduler.__dict__["adaptive_target"]
        scheduler.handlers["adaptive_target"] = scheduler.adaptive_target
