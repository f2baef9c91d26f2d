"""Prometheus metrics of service runs, on the scheduler's ``/metrics`` endpoint.

distributed's ``/metrics`` handler serves ``prometheus_client``'s global registry, so one
collector registered there (once per process) is enough: it reports on every live
scheduler plugin of the process (normally one).  Exported, for every status table
(``_status.TABLES``) and each of its figures, a gauge ``dask_services_<table>_<figure>``
labelled by the table's label columns; and ``dask_services_run_events_total{service,
action}``, the runs started, finished, failed, restarted and cancelled per service class.
Without ``prometheus_client`` nothing is registered and nothing fails.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dask_services import _status

if TYPE_CHECKING:
    from dask_services.scheduler import ServiceSchedulerPlugin

logger = logging.getLogger("dask_services")
PREFIX = "dask_services"


class ServicesCollector:
    """A ``prometheus_client`` collector reading the plugins' status tables."""

    def __init__(self) -> None:
        self.plugins: weakref.WeakSet[ServiceSchedulerPlugin] = weakref.WeakSet()

    def describe(self) -> list:
        return []  # names vary with the registered tables: skip the registry's check

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        plugins = list(self.plugins)
        for table in _status.TABLES.values():
            rows = [row for p in plugins for row in _safe_rows(table, p)]
            for figure in table.figures:
                family = GaugeMetricFamily(
                    f"{PREFIX}_{table.name}_{figure}",
                    f"{figure.replace('_', ' ')} ({table.title})",
                    labels=list(table.labels),
                )
                for row in rows:
                    value = row.get(figure)
                    if isinstance(value, (int, float)):
                        family.add_metric([str(row.get(c, "")) for c in table.labels], value)
                yield family
        events = CounterMetricFamily(
            f"{PREFIX}_run_events", "service runs started, finished, failed, restarted, "
            "cancelled", labels=["service", "action"],
        )
        totals: dict[tuple[str, str], int] = {}
        for p in plugins:
            for k, n in p.history.totals.items():
                totals[k] = totals.get(k, 0) + n
        for (service, action), n in sorted(totals.items()):
            events.add_metric([service, action], n)
        yield events


def _safe_rows(table: _status.StatusTable, plugin: ServiceSchedulerPlugin) -> list[dict]:
    try:
        return table.rows(plugin)
    except Exception:
        logger.exception("dask_services: status table %s failed", table.name)
        return []


_collector: ServicesCollector | None = None


def register(plugin: ServiceSchedulerPlugin) -> bool:
    """Report on ``plugin`` at ``/metrics``; False if ``prometheus_client`` is missing."""
    global _collector
    try:
        import prometheus_client
    except ImportError:
        return False
    if _collector is None:
        _collector = ServicesCollector()
        prometheus_client.REGISTRY.register(_collector)
    _collector.plugins.add(plugin)
    return True


def unregister(plugin: ServiceSchedulerPlugin) -> None:
    if _collector is not None:
        _collector.plugins.discard(plugin)
