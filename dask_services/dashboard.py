"""The ``/services`` page of the scheduler's dashboard.

A Bokeh document, refreshed every 500 ms from the diagnostics plugin's own state:

* **Runs in progress**: per worker, the bytes the live runs' instances hold in memory,
  have in flight to peers and keep on disk, and the inputs handed off to them and outputs
  they produced (the gauges of ``_counters.py``, which come with the workers' heartbeats);
* **Recent runs**: a timeline per service class, one bar per run from its start to its
  end, coloured by outcome (a restart ends a run and starts the next);
* **Replicated services**: calls per second and p50/p99 latency over time per deployed
  service, and its replicas by state;
* one table per status table (``_status.TABLES``: the runs, the replicas, and whatever
  other tables are registered), with byte counts in kB/MB/GB, latencies in ms with one
  decimal, and every cell's full text on hover.

The diagnostics plugin adds the page at ``start`` when the scheduler runs distributed's
Bokeh dashboard (bokeh installed, a dashboard address): it serves a second Bokeh
application from the scheduler's HTTP server at the dashboard's prefix, and adds
"Services" to the dashboard's navigation bar.  Without a dashboard nothing is added;
``dask_services.status()`` gives the same figures.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from dask_services import _status

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

    from dask_services._observe import ServiceDiagnostics

logger = logging.getLogger("dask_services")
PAGE = "services"
REFRESH_MS = 500
SAMPLE_S = 1.0  # one point of the replicated services' time series per second
WINDOW_S = 300.0  # of which the last five minutes are kept

STATE_COLORS = {
    "starting": "#9ecae1", "running": "#4292c6", "inputs-done": "#2171b5",
    "finished": "#41ab5d", "failed": "#cb181d", "restarted": "#fd8d3c",
    "cancelled": "#969696",
}
REPLICA_STATES = ("healthy", "uninitialized", "recovering", "unhealthy")
REPLICA_COLORS = ("#41ab5d", "#9ecae1", "#fd8d3c", "#cb181d")
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")

BYTE_COLUMNS = frozenset({"bytes_sent", "bytes_received", "bytes_spilled"})
MS_COLUMNS = frozenset({"p50_ms", "p99_ms"})
WIDE_COLUMNS = {"key": 230, "detail": 170, "worker_addresses": 220, "replica": 200,
                "last_error": 200, "service": 130, "class": 110, "worker": 170}
NARROW_COLUMNS = {"run_id": 50, "workers": 60, "slot": 40, "healthy": 60, "state": 80,
                  "incarnation": 80, "in_flight": 60, "queued": 60, "restarts": 60,
                  "inputs": 55, "calls": 65, "errors": 55, "overloaded": 75}
TITLES = {"inputs_handed_off": "handed off", "outputs_wanted": "outputs",
          "outputs_produced": "produced", "worker_addresses": "worker addresses"}

# underscore.js templates (Bokeh's HTMLTemplateFormatter): the raw value stays in the
# table's data (sorting, tests), the browser shows it readable, the full text on hover.
TEXT_TEMPLATE = '<span title="<%- value %>"><%- value %></span>'
BYTES_TEMPLATE = """<%
var v = Number(value), units = ["B", "kB", "MB", "GB", "TB"], i = 0;
while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
var text = i == 0 ? String(v) + " B" : v.toFixed(1) + " " + units[i];
%><span title="<%- value %> bytes"><%= text %></span>"""
BYTES_TICK = """
let v = tick, i = 0;
const units = ["B", "kB", "MB", "GB", "TB"];
while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
return i == 0 ? v.toFixed(0) + " B" : v.toFixed(1) + " " + units[i];
"""


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.2 MB'`` (decimal units, as the table shows them)."""
    units = ("B", "kB", "MB", "GB", "TB")
    v, i = float(n), 0
    while abs(v) >= 1000 and i < len(units) - 1:
        v /= 1000
        i += 1
    return f"{int(v)} B" if i == 0 else f"{v:.1f} {units[i]}"


def short_address(address: str) -> str:
    """``tcp://127.0.0.1:40123`` -> ``127.0.0.1:40123``."""
    return address.split("://", 1)[-1]


# ---------------------------------------------------------------- figures of the page


def live_workers(plugin: ServiceDiagnostics) -> dict[str, dict[str, int]]:
    """Per worker (every worker of the scheduler, then any other a live run reported
    from): the gauges of the live runs' instances there, summed."""
    names = ("memory_bytes", "in_flight_bytes", "disk_bytes", "inputs", "outputs")
    out: dict[str, dict[str, int]] = {}
    scheduler = getattr(plugin, "scheduler", None)
    for address in getattr(scheduler, "workers", {}) or {}:
        out[address] = dict.fromkeys(names, 0)
    for record in list(plugin.history.records.values()):
        if record.ended is not None:
            continue
        for gauges in list(record.gauges.values()):
            row = out.setdefault(str(gauges.get("worker")), dict.fromkeys(names, 0))
            for name in names:
                row[name] += int(gauges.get(name, 0))
    return out


def timeline(plugin: ServiceDiagnostics, now: float) -> list[dict[str, Any]]:
    """One bar per kept run: service class, start and end (now while live), in ms."""
    bars = []
    for row in plugin.history.rows():
        start = float(row.get("started", now))
        end = start + float(row.get("duration_s", 0))
        bars.append({
            "service": row["service"], "key": row["key"], "run_id": row["run_id"],
            "state": row["state"], "detail": row["detail"] or "",
            "restarts": row["restarts"], "duration": f"{row['duration_s']:.3f} s",
            "left": start * 1000, "right": max(end, start + 0.001) * 1000,
            "color": STATE_COLORS.get(row["state"], "#969696"),
        })
    return bars


class ReplicaHistory:
    """Calls per second and p50/p99 latency of every deployed service over the last
    :data:`WINDOW_S` seconds, sampled from the replicas table at most every
    :data:`SAMPLE_S` (shared by every browser session of one scheduler's page)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[str, dict[str, float]]]] = deque()
        self.last_calls: dict[str, int] = {}  # replica incarnation -> calls seen
        self.last = -math.inf

    def sample(self, rows: list[dict[str, Any]], now: float) -> None:
        if now - self.last < SAMPLE_S:
            return
        dt = now - self.last if self.last > -math.inf else None
        self.last = now
        per: dict[str, dict[str, float]] = {}
        seen: dict[str, int] = {}
        for row in rows:
            service = str(row["service"])
            calls = int(row.get("calls") or 0)
            new = calls - self.last_calls.get(str(row["replica"]), 0)
            seen[str(row["replica"])] = calls
            entry = per.setdefault(service, {"calls": 0.0, "p50": math.nan, "p99": math.nan})
            entry["calls"] += max(new, 0)
            for q in ("p50", "p99"):
                value = row.get(f"{q}_ms")
                if isinstance(value, (int, float)) and not math.isnan(value):
                    entry[q] = value if math.isnan(entry[q]) else max(entry[q], value)
        self.last_calls = seen
        for entry in per.values():
            entry["rate"] = entry["calls"] / dt if dt else math.nan
        self.samples.append((now, per))
        while self.samples and self.samples[0][0] < now - WINDOW_S:
            self.samples.popleft()

    def lines(self, figure: str) -> dict[str, list]:
        """``multi_line`` data: one line per service (``figure``: rate, p50 or p99)."""
        services = sorted({s for _, per in self.samples for s in per})
        xs, ys, colors, names = [], [], [], []
        for i, service in enumerate(services):
            points = [(t * 1000, per[service][figure]) for t, per in self.samples
                      if service in per and not math.isnan(per[service][figure])]
            xs.append([p[0] for p in points])
            ys.append([p[1] for p in points])
            colors.append(PALETTE[i % len(PALETTE)])
            names.append(service)
        return {"xs": xs, "ys": ys, "color": colors, "service": names}


_HISTORIES: weakref.WeakKeyDictionary[Any, ReplicaHistory] = weakref.WeakKeyDictionary()


def replica_history(plugin: ServiceDiagnostics) -> ReplicaHistory:
    history = _HISTORIES.get(plugin)
    if history is None:
        history = _HISTORIES[plugin] = ReplicaHistory()
    return history


def replica_states(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Per deployed service, its replicas by state (``hbar_stack`` data)."""
    services = sorted({str(r["service"]) for r in rows})
    data: dict[str, list] = {"service": services}
    for state in REPLICA_STATES:
        data[state] = [sum(1 for r in rows if r["service"] == s and r["state"] == state)
                       for s in services]
    return data


# ---------------------------------------------------------------- the page


class ServicesPage:
    """The widgets of one browser session of the page."""

    def __init__(self, plugin: ServiceDiagnostics) -> None:
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, DataTable, Div

        self.plugin = plugin
        self.sources: dict[str, ColumnDataSource] = {}
        self.workers = ColumnDataSource({"worker": [], "address": [], "memory_bytes": [],
                                         "in_flight_bytes": [], "disk_bytes": [],
                                         "inputs": [], "outputs": []})
        self.runs = ColumnDataSource({k: [] for k in (
            "service", "key", "run_id", "state", "detail", "restarts", "duration", "left",
            "right", "color")})
        self.rate = ColumnDataSource({"xs": [], "ys": [], "color": [], "service": []})
        self.p50 = ColumnDataSource({"xs": [], "ys": [], "color": [], "service": []})
        self.p99 = ColumnDataSource({"xs": [], "ys": [], "color": [], "service": []})
        self.states = ColumnDataSource({"service": [], **{s: [] for s in REPLICA_STATES}})

        self.bytes_fig = self._worker_figure(
            "Runs in progress: bytes per worker", "bytes",
            [("memory_bytes", "held in memory", "#4292c6"),
             ("in_flight_bytes", "in flight to peers", "#fd8d3c"),
             ("disk_bytes", "spilled to disk", "#756bb1")], "0.0 b")
        self.count_fig = self._worker_figure(
            "Runs in progress: inputs and outputs per worker", "keys",
            [("inputs", "inputs handed off", "#41ab5d"),
             ("outputs", "outputs produced", "#e6550d")], "0,0")
        self.timeline_fig = self._timeline_figure()
        self.rate_fig, self.latency_fig = self._replica_figures()
        self.states_fig = self._states_figure()
        self.age = Div(text="", name="dask-services-replica-age")

        tables: list[Any] = []
        self.tables: dict[str, DataTable] = {}
        for table in _status.TABLES.values():
            source = ColumnDataSource({c: [] for c in table.columns})
            self.sources[table.name] = source
            tables.append(Div(text=f"<h3>{table.title}</h3>"))
            tables.append(self.tables.setdefault(table.name, DataTable(
                source=source, name=f"dask-services-{table.name}",
                columns=[_column(c) for c in table.columns],
                sizing_mode="stretch_width", height=260, index_position=None,
                autosize_mode="force_fit", row_height=24, reorderable=False,
            )))
        self.root = column([
            Div(text="<h2>Services</h2><p>Live runs of service tasks per worker (figures "
                     "come with the workers' heartbeats), recent runs, deployed replicated "
                     "services, and the status tables (hover a cell for its full text)."
                     "</p>"),
            row([self.bytes_fig, self.count_fig], sizing_mode="stretch_width"),
            self.timeline_fig,
            Div(text="<h3>Replicated services</h3>"),
            row([self.rate_fig, self.latency_fig, self.states_fig],
                sizing_mode="stretch_width"),
            self.age,
            *tables,
        ], sizing_mode="stretch_width")
        self.update()

    # ------------------------------------------------------------ figures

    def _worker_figure(self, title: str, unit: str, series: list[tuple[str, str, str]],
                       tick_format: str) -> Any:
        from bokeh.models import (
            CustomJSTickFormatter,
            FactorRange,
            HoverTool,
            NumeralTickFormatter,
        )
        from bokeh.plotting import figure
        from bokeh.transform import dodge

        fig = figure(title=title, y_range=FactorRange(), height=260,
                     sizing_mode="stretch_width", tools="", toolbar_location=None,
                     name=f"dask-services-{unit}-per-worker")
        height = 0.8 / len(series)
        for i, (field, label, color) in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * height
            fig.hbar(y=dodge("worker", offset, range=fig.y_range), right=field,
                     height=height * 0.9, source=self.workers, color=color,
                     legend_label=label)
        fig.x_range.start = 0
        if unit == "keys":
            fig.xaxis.formatter = NumeralTickFormatter(format=tick_format)
            fig.xaxis.ticker.min_interval = 1  # whole inputs and outputs
        else:
            fig.xaxis.formatter = CustomJSTickFormatter(code=BYTES_TICK)
        _legend_right(fig)
        fig.add_tools(HoverTool(tooltips=[("worker", "@address")] + [
            (label, f"@{{{field}}}{{{tick_format}}}") for field, label, _ in series]))
        return fig

    def _timeline_figure(self) -> Any:
        from bokeh.models import FactorRange, HoverTool
        from bokeh.plotting import figure

        fig = figure(title="Recent runs per service class (start to end; colour: state)",
                     x_axis_type="datetime", y_range=FactorRange(), height=220,
                     sizing_mode="stretch_width", tools="xpan,xwheel_zoom,reset",
                     name="dask-services-timeline")
        fig.hbar(y="service", left="left", right="right", height=0.6, color="color",
                 alpha=0.75, line_color="white", source=self.runs)
        fig.add_tools(HoverTool(tooltips=[
            ("service", "@service"), ("key", "@key"), ("run", "@run_id"),
            ("state", "@state"), ("duration", "@duration"), ("restarts before", "@restarts"),
            ("detail", "@detail")]))
        return fig

    def _replica_figures(self) -> tuple[Any, Any]:
        from bokeh.models import HoverTool
        from bokeh.plotting import figure

        rate = figure(title="Calls per second", x_axis_type="datetime", height=240,
                      sizing_mode="stretch_width", tools="", toolbar_location=None,
                      name="dask-services-calls-per-second")
        rate.multi_line("xs", "ys", color="color", line_width=2, source=self.rate,
                        legend_field="service")
        rate.y_range.start = 0
        rate.add_tools(HoverTool(tooltips=[("service", "@service")]))
        latency = figure(title="Latency, ms (p50 dashed, p99 solid)", x_axis_type="datetime",
                         height=240, sizing_mode="stretch_width", tools="",
                         toolbar_location=None, name="dask-services-latency")
        latency.multi_line("xs", "ys", color="color", line_width=2, line_dash="dashed",
                           source=self.p50)
        latency.multi_line("xs", "ys", color="color", line_width=2, source=self.p99,
                           legend_field="service")
        latency.y_range.start = 0
        latency.add_tools(HoverTool(tooltips=[("service", "@service")]))
        for fig in (rate, latency):
            fig.legend.location = "top_left"
            fig.legend.label_text_font_size = "9pt"
        return rate, latency

    def _states_figure(self) -> Any:
        from bokeh.models import FactorRange, HoverTool
        from bokeh.plotting import figure

        fig = figure(title="Replicas by state", y_range=FactorRange(), height=240,
                     sizing_mode="stretch_width", tools="", toolbar_location=None,
                     name="dask-services-replica-states")
        fig.hbar_stack(list(REPLICA_STATES), y="service", height=0.6, source=self.states,
                       color=list(REPLICA_COLORS), line_width=0,
                       legend_label=list(REPLICA_STATES))
        fig.x_range.start = 0
        fig.xaxis.ticker.min_interval = 1
        _legend_right(fig)
        fig.add_tools(HoverTool(tooltips=[("service", "@service")] + [
            (s, f"@{s}") for s in REPLICA_STATES]))
        return fig

    # ------------------------------------------------------------ refresh

    def update(self) -> None:
        now = time.time()
        tables = _status.collect(self.plugin, list(self.sources))
        for name, rows in tables.items():
            columns = _status.TABLES[name].columns
            data = {c: [_cell(row.get(c)) for row in rows] for c in columns}
            _set(self.sources[name], data)
            height = min(32 + 25 * max(len(rows), 1), 420)  # no empty half page
            if self.tables[name].height != height:
                self.tables[name].height = height

        workers = live_workers(self.plugin)
        order = sorted(workers)
        labels = [short_address(a) for a in order]
        _set(self.workers, {
            "worker": labels, "address": order,
            **{k: [workers[a][k] for a in order] for k in (
                "memory_bytes", "in_flight_bytes", "disk_bytes", "inputs", "outputs")}})
        for fig in (self.bytes_fig, self.count_fig):
            if list(fig.y_range.factors) != labels:
                fig.y_range.factors = labels

        bars = timeline(self.plugin, now)
        _set(self.runs, {k: [b[k] for b in bars] for k in self.runs.data})
        classes = sorted({b["service"] for b in bars})
        if list(self.timeline_fig.y_range.factors) != classes:
            self.timeline_fig.y_range.factors = classes

        replicas = tables.get("replicas", [])
        history = replica_history(self.plugin)
        history.sample(replicas, now)
        _set(self.rate, history.lines("rate"))
        _set(self.p50, history.lines("p50"))
        _set(self.p99, history.lines("p99"))
        states = replica_states(replicas)
        _set(self.states, states)
        if list(self.states_fig.y_range.factors) != states["service"]:
            self.states_fig.y_range.factors = states["service"]
        self.age.text = _age_text(self.plugin, bool(replicas))


def _legend_right(fig: Any) -> None:
    """The legend beside the plot, where it hides no bar."""
    legend = fig.legend[0]
    legend.label_text_font_size = "9pt"
    legend.border_line_alpha = 0
    fig.add_layout(legend, "right")


def _age_text(plugin: ServiceDiagnostics, any_replica: bool) -> str:
    if not any_replica:
        return "<p><i>No replicated service is deployed.</i></p>"
    try:
        from dask_services.replicated._table import _deployments

        deployments = _deployments(plugin)
        age = deployments.reports.age(deployments.placed()) if deployments else math.inf
    except Exception:
        age = math.inf
    when = "not reported yet" if math.isinf(age) else f"{age:.1f} s old"
    return (f"<p><i>Replica call figures come with the workers' heartbeats: now {when} "
            "(<code>dask_services.status(client, table=\"replicas\")</code> asks the workers "
            "and is current).</i></p>")


def _column(name: str) -> Any:
    from bokeh.models import HTMLTemplateFormatter, NumberFormatter, TableColumn

    title = name.replace("_", " ")
    if name in BYTE_COLUMNS:
        return TableColumn(field=name, title=title, width=90,
                           formatter=HTMLTemplateFormatter(template=BYTES_TEMPLATE))
    if name in MS_COLUMNS:
        return TableColumn(field=name, title=title, width=70,
                           formatter=NumberFormatter(format="0.0", nan_format="–",
                                                     text_align="right"))
    if name == "duration_s":
        return TableColumn(field=name, title="duration (s)", width=80,
                           formatter=NumberFormatter(format="0.00", text_align="right"))
    width = WIDE_COLUMNS.get(name) or NARROW_COLUMNS.get(name) or 80
    return TableColumn(field=name, title=TITLES.get(name, title), width=width,
                       formatter=HTMLTemplateFormatter(template=TEXT_TEMPLATE))


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str)) else str(value)


def _set(source: Any, data: dict[str, list]) -> None:
    """Replace ``source``'s data unless it is unchanged (nothing is sent then)."""
    if not _same(data, dict(source.data)):
        source.data = data


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
            if isinstance(x, list) or isinstance(y, list):
                if not isinstance(x, list) or not isinstance(y, list) or \
                        not _same({"v": x}, {"v": y}):
                    return False
            elif x != y and not (x != x and y != y):  # NaN is the only value unequal to itself
                return False
    return True


def services_doc(scheduler: Scheduler, extra: dict, doc: Any) -> None:
    """Bokeh application function of the page (distributed's signature for dashboard docs)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    from dask_services._observe import EXTENSION

    plugin = scheduler.extensions[EXTENSION]
    page = ServicesPage(plugin)
    doc.add_periodic_callback(page.update, REFRESH_MS)
    # the story of a selected run (``_story_view.py``), under the page
    from dask_services._story_view import StoryView

    story = StoryView(scheduler)
    page.root.children.append(story.root)
    doc.add_periodic_callback(story.update, REFRESH_MS)
    doc.title = "Dask: Services"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def add_page(scheduler: Scheduler) -> bool:
    """Serve the page from the scheduler's dashboard; False when there is no dashboard.

    A scheduler serving its dashboard has imported bokeh's server; one without (started
    with ``dashboard_address=None``, or bokeh not installed) has not, and importing it
    here would block its event loop for most of a second to add a page nothing serves."""
    if "bokeh.server.server" not in sys.modules:
        return False
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
