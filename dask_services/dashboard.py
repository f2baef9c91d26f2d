"""The ``/services`` page of the scheduler's dashboard.

A Bokeh document with one table per status table (``_status.TABLES``: the live and recent
runs of service tasks, and whatever other tables are registered), refreshed every
500 ms from the scheduler plugin's own state.  The scheduler plugin adds the page at
``start`` when the scheduler runs distributed's Bokeh dashboard (bokeh installed, a
dashboard address): it serves a second Bokeh application from the scheduler's HTTP server
at the dashboard's prefix, and adds "Services" to the dashboard's navigation bar.  Without
a dashboard nothing is added; ``dask_services.status()`` gives the same figures.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dask_services import _status

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

    from dask_services._observe import ServiceDiagnostics

logger = logging.getLogger("dask_services")
PAGE = "services"
REFRESH_MS = 500


class ServicesPage:
    """The widgets of one browser session of the page."""

    def __init__(self, plugin: ServiceDiagnostics) -> None:
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, DataTable, Div, TableColumn

        self.plugin = plugin
        self.sources: dict[str, ColumnDataSource] = {}
        children: list[Any] = []
        for table in _status.TABLES.values():
            source = ColumnDataSource({c: [] for c in table.columns})
            self.sources[table.name] = source
            children.append(Div(text=f"<h2>{table.title}</h2>"))
            children.append(DataTable(
                source=source, name=f"dask-services-{table.name}",
                columns=[TableColumn(field=c, title=c.replace("_", " ")) for c in table.columns],
                sizing_mode="stretch_width", height=400, index_position=None,
            ))
        self.root = column(children, sizing_mode="stretch_width")
        self.update()

    def update(self) -> None:
        tables = _status.collect(self.plugin, list(self.sources))
        for name, rows in tables.items():
            columns = _status.TABLES[name].columns
            data = {c: [_cell(row.get(c)) for row in rows] for c in columns}
            if not _same(data, dict(self.sources[name].data)):
                self.sources[name].data = data


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str)) else str(value)


def _same(new: dict[str, list], old: dict[str, Any]) -> bool:
    """Equal columns, NaN equal to NaN (a replica's latency before its first call): an
    unchanged table is not sent to the browser again."""
    if new.keys() != old.keys():
        return False
    for name, values in new.items():
        before = list(old[name])
        if len(values) != len(before):
            return False
        for x, y in zip(values, before, strict=True):
            if x != y and not (x != x and y != y):  # NaN is the only value unequal to itself
                return False
    return True


def services_doc(scheduler: Scheduler, extra: dict, doc: Any) -> None:
    """Bokeh application function of the page (distributed's signature for dashboard docs)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    from dask_services._observe import EXTENSION

    plugin = scheduler.extensions[EXTENSION]
    page = ServicesPage(plugin)
    doc.add_periodic_callback(page.update, REFRESH_MS)
    doc.title = "Dask: Services"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def add_page(scheduler: Scheduler) -> bool:
    """Serve the page from the scheduler's dashboard; False when there is no dashboard."""
    try:
        from bokeh.server.server import BokehTornado
        from distributed.dashboard import scheduler as dashboard
        from distributed.dashboard.core import BokehApplication
        from tornado.ioloop import IOLoop
    except ImportError:
        return False
    http = getattr(scheduler, "http_application", None)
    if http is None:
        return False
    apps = [a for a in http.applications if isinstance(a, BokehTornado)]
    main = next((a for a in apps if "/status" in a.app_paths), None)
    if main is None or any(f"/{PAGE}" in a.app_paths for a in apps):
        return False  # no dashboard here, or the page is already served
    variables = dashboard.template_variables(scheduler)  # memoized: the pages' own dict
    if PAGE not in variables["pages"]:
        variables["pages"].append(PAGE)  # the navigation bar of every dashboard page
    app = BokehApplication({f"/{PAGE}": services_doc}, scheduler, prefix=main.prefix,
                           template_variables=variables)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return True
