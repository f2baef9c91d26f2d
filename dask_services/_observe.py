"""The diagnostics as a scheduler plugin of their own: run history, status tables, the
dashboard page and the Prometheus metrics.

:class:`ServiceDiagnostics` is installed next to the service-task core by
``dask_services.install()`` (and ``--preload dask_services``).  It observes the core only
through :class:`~dask_services.scheduler.RunObserver` (runs logged, instance counters from
heartbeats): the core names none of it.  It serves the ``service_status`` handler behind
``dask_services.status()``; each optional piece (no dashboard, no ``prometheus_client``)
is skipped, and a failure in one never stops the plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_services import _status
from dask_services._run_model import RunSnapshot
from dask_services.scheduler import RunLogEntry, RunObserver
from dask_services.worker import EXTENSION as CORE

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

logger = logging.getLogger("dask_services")
EXTENSION = "dask_services_diagnostics"


class ServiceDiagnostics(SchedulerPlugin, RunObserver):
    """Run history, status tables, dashboard page and metrics of one scheduler."""

    name = EXTENSION
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler = None  # type: ignore[assignment]  # set by start()
        self.history = _status.RunHistory()  # figures of live and recent runs

    async def start(self, scheduler: Scheduler) -> None:
        from dask_services import _metrics, dashboard

        self.scheduler = scheduler
        scheduler.extensions[EXTENSION] = self
        scheduler.handlers["service_status"] = self.current_status
        core = scheduler.extensions.get(CORE)
        if core is not None and self not in core.observers:
            core.observers.append(self)
        else:
            logger.warning("dask_services: the diagnostics were installed before the core "
                           "plugin; runs will not be shown")
        try:
            dashboard.add_page(scheduler)
        except Exception:
            logger.exception("dask_services: could not add the /services dashboard page")
        try:
            _metrics.register(self)
        except Exception:
            logger.exception("dask_services: could not register the Prometheus metrics")

    async def close(self) -> None:
        from dask_services import _metrics

        _metrics.unregister(self)
        core = self.scheduler.extensions.get(CORE) if self.scheduler is not None else None
        if core is not None and self in core.observers:
            core.observers.remove(self)
        if self.scheduler is not None:
            if self.scheduler.extensions.get(EXTENSION) is self:
                del self.scheduler.extensions[EXTENSION]
            if self.scheduler.handlers.get("service_status") == self.current_status:
                del self.scheduler.handlers["service_status"]
        self.history.clear()

    def status(self, tables: list[str] | None = None) -> dict[str, list[dict]]:
        """Rows of the status tables (``_status.py``), as of the last heartbeats."""
        return _status.collect(self, tables)

    async def current_status(self, tables: list[str] | None = None
                             ) -> dict[str, list[dict]]:
        """The ``service_status`` handler behind ``dask_services.status()``: the rows once
        the tables have refreshed figures older than a moment (``collect_current``)."""
        return await _status.collect_current(self, tables)

    # ------------------------------------------------------------- RunObserver

    def run_logged(self, entry: RunLogEntry) -> None:
        self.history.logged(entry.service, entry.key, entry.action, entry.run_id,
                            entry.detail, entry.run, entry.inputs, entry.restarts)

    def counters_reported(self, worker: str, records: Sequence[Mapping[str, Any]]) -> None:
        self.history.worker_report(worker, records)

    def run_progressed(self, key: Key, run: RunSnapshot) -> None:
        record = self.history.records.get(run.run_id)
        if record is not None and record.ended is None:
            record.run = run
