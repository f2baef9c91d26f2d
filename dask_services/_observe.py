"""Hooks the observability pieces into a scheduler: the dashboard page and the metrics.

Called by the scheduler plugin at ``start`` and ``close``; each piece is optional (no
dashboard, no ``prometheus_client``) and a failure in one never stops the plugin.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

    from dask_services.scheduler import ServiceSchedulerPlugin

logger = logging.getLogger("dask_services")


def attach(plugin: ServiceSchedulerPlugin, scheduler: Scheduler) -> None:
    from dask_services import _metrics, dashboard

    try:
        dashboard.add_page(scheduler)
    except Exception:
        logger.exception("dask_services: could not add the /services dashboard page")
    try:
        _metrics.register(plugin)
    except Exception:
        logger.exception("dask_services: could not register the Prometheus metrics")


def detach(plugin: ServiceSchedulerPlugin) -> None:
    from dask_services import _metrics

    _metrics.unregister(plugin)
