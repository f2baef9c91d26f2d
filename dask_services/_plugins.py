"""The scheduler plugins that make up dask-services on a cluster, in installation order.

The service-task core (``scheduler.ServiceSchedulerPlugin``) comes first; the extensions
are plugins of their own next to it: replicated services (``replicated/_scheduler.py``)
and the diagnostics (``_observe.py``: status tables, dashboard page, metrics), which
observe the core and so come after it.  ``install()``, ``install_async()`` and the
``--preload dask_services`` hook all install this list.  Each plugin registers its own
worker plugin.
"""

from __future__ import annotations

from distributed.diagnostics.plugin import SchedulerPlugin


def scheduler_plugins() -> list[SchedulerPlugin]:
    """New objects of every scheduler plugin of dask-services, core first."""
    from dask_services._observe import ServiceDiagnostics
    from dask_services.replicated._scheduler import Deployments
    from dask_services.scheduler import ServiceSchedulerPlugin

    return [ServiceSchedulerPlugin(), Deployments(), ServiceDiagnostics()]
