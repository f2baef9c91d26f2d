"""What the scheduler knows about service runs, as tables of rows: for ``status()``, the
dashboard page and the Prometheus metrics alike.

The scheduler plugin keeps one :class:`RunHistory`.  It is fed by the plugin's log lines (a
run started, finished, failed, was restarted or cancelled) and by the workers' heartbeats,
which carry each live instance's byte counters (``Service.counters()``) and, once, the final
counters of every instance stopped since the previous heartbeat.  Live runs are read from
the latest snapshots of the runs (sent by the core after every event); ended runs are
kept, up to ``dask_services.status.recent-runs`` of them, the oldest forgotten first.

Every table is a :class:`StatusTable` in :data:`TABLES`: a name, its columns, which columns
label a Prometheus sample and which are figures, and a function ``rows(plugin)``.  Another
table (say, of deployed long-lived services) is one more ``register_table(...)`` call: the
dashboard page shows it, ``status(client, table=name)`` returns it and ``/metrics`` exports
its figures, with no change anywhere else.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask_services._counters import COUNTERS, GAUGES
from dask_services._metrics import RunTotals
from dask_services._run_model import RunSnapshot
from dask_services.config import setting

if TYPE_CHECKING:
    import pandas as pd

    from dask_services._observe import ServiceDiagnostics

Key = Hashable


@dataclass(frozen=True)
class StatusTable:
    """One table of the status page: ``rows(plugin)`` returns a list of dicts.

    ``labels`` name a row in Prometheus (string columns), ``figures`` are exported as one
    gauge each (``dask_services_<name>_<figure>``); every column is shown on the page.
    Label columns must take a bounded set of values (every new value is a new series): the
    ``runs`` and ``replicas`` tables, whose rows are runs and replica incarnations, are
    exported as aggregates per service instead (``_metrics.py``).
    """

    name: str
    title: str
    columns: tuple[str, ...]
    labels: tuple[str, ...]
    figures: tuple[str, ...]
    rows: Callable[[ServiceDiagnostics], list[dict[str, Any]]]
    # brings figures that come with heartbeats up to date before status() reads them
    refresh: Callable[[ServiceDiagnostics], Awaitable[None]] | None = None
    # what the rows belong to, by name, rows or not (a replicated service scaled to zero
    # has no replica row but is deployed): name -> facts (``/metrics`` aggregates)
    subjects: Callable[[ServiceDiagnostics], dict[str, dict[str, Any]]] | None = None


TABLES: dict[str, StatusTable] = {}


def register_table(table: StatusTable) -> StatusTable:
    """Add (or replace) a table shown by ``status()``, the dashboard and ``/metrics``."""
    TABLES[table.name] = table
    return table


# ---------------------------------------------------------------- runs


@dataclass(eq=False)
class RunRecord:
    """One run of one service task, live or ended."""

    service: str
    key: str
    run_id: int
    workers: tuple[str, ...]
    inputs: int
    restarts: int
    started: float
    run: RunSnapshot | None  # while live: the latest snapshot of the run
    state: str = "running"
    detail: str = ""
    ended: float | None = None
    inputs_handed_off: int = 0
    outputs_wanted: int = 0
    outputs_produced: int = 0
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # instance -> counters
    # instance -> its worker and gauges of the moment (_counters.GAUGES), while live
    gauges: dict[str, dict[str, Any]] = field(default_factory=dict)

    def row(self, now: float) -> dict[str, Any]:
        run = self.run
        if run is not None:
            self.inputs_handed_off = run.inputs_handed_off
            self.outputs_wanted = run.outputs_wanted
            self.outputs_produced = run.outputs_produced
        state = self.state
        if run is not None and state == "running":
            state = run.phase.value
        totals = {c: sum(int(v.get(c, 0)) for v in self.counters.values()) for c in COUNTERS}
        return {
            "service": self.service,
            "key": self.key,
            "run_id": self.run_id,
            "state": state,
            "workers": len(self.workers),
            "worker_addresses": ", ".join(self.workers),
            "inputs": self.inputs,
            "inputs_handed_off": self.inputs_handed_off,
            "outputs_wanted": self.outputs_wanted,
            "outputs_produced": self.outputs_produced,
            **totals,
            "restarts": self.restarts,
            "detail": self.detail,
            "started": self.started,
            "duration_s": round((self.ended or now) - self.started, 3),
        }


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


ENDED = frozenset({"finished", "failed", "restarted", "cancelled"})  # actions ending a run


LATE_REPORTS = 1000  # forgotten runs whose final counters may still come with a heartbeat


class RunHistory:
    """Records of the live runs and of the ``recent-runs`` most recently ended ones.

    ``aggregates`` (``_metrics.RunTotals``) keeps cumulative figures of every run per
    service class, for the Prometheus counters: what a run counted stays counted after its
    record is forgotten.
    """

    def __init__(self, keep: int | None = None) -> None:
        if keep is None:
            keep = int(setting("status.recent-runs"))
        self.keep = max(0, keep)
        self.records: OrderedDict[int, RunRecord] = OrderedDict()  # run id -> record
        self.ended: OrderedDict[int, None] = OrderedDict()  # ended run ids, oldest first
        self.totals: dict[tuple[str, str], int] = {}  # (service, action) -> count
        self.aggregates = RunTotals()  # per service class, only ever added to
        # forgotten ended runs, for the final counters their instances still report
        self.forgotten: OrderedDict[int, RunRecord] = OrderedDict()

    def logged(self, service: str, key: Key, action: str, run_id: int, detail: str,
               run: RunSnapshot | None, inputs: int, restarts: int) -> None:
        """A log line of the state machine (see ``_run_events.Log``)."""
        self.totals[service, action] = self.totals.get((service, action), 0) + 1
        if action == "started":
            self.aggregates.started(service)
        if action == "started" and run is not None and run.run_id == run_id:
            self.records[run_id] = RunRecord(
                service=service, key=str(key), run_id=run_id, workers=run.participants,
                inputs=inputs, restarts=restarts, started=time.time(), run=run,
            )
            return
        record = self.records.get(run_id)
        if action not in ENDED or (record is not None and record.ended is not None):
            return
        if record is None:  # never recorded: count it all the same
            self.aggregates.ended(service, action, None, {})
            return
        record.row(time.time())  # freeze the live figures
        record.run = None
        record.gauges.clear()
        record.state = action
        record.detail = detail
        record.ended = time.time()
        self.aggregates.ended(service, action, record.ended - record.started, {
            "inputs_handed_off": record.inputs_handed_off,
            "outputs_produced": record.outputs_produced,
        })
        self.ended[run_id] = None
        while len(self.ended) > self.keep:
            old, _ = self.ended.popitem(last=False)
            forgotten = self.records.pop(old, None)
            if forgotten is not None:
                self.forgotten[old] = forgotten
        while len(self.forgotten) > LATE_REPORTS:
            self.forgotten.popitem(last=False)

    def worker_report(self, worker: str, instances: Iterable[Mapping[str, Any]]) -> None:
        """Counters of instances on ``worker`` (from its heartbeat)."""
        for item in instances:
            run_id = int(item.get("run_id", -1))
            record = self.records.get(run_id) or self.forgotten.get(run_id)
            if record is not None:
                instance = str(item.get("id"))
                before = record.counters.get(instance, {})
                now = record.counters[instance] = {c: int(item.get(c, 0)) for c in COUNTERS}
                for c in COUNTERS:  # counters are cumulative: add what is new
                    self.aggregates.add(record.service, c, now[c] - before.get(c, 0))
                if record.ended is None:
                    record.gauges[instance] = {"worker": worker, **{
                        g: _int(item.get(g, 0)) for g in GAUGES}}

    def rows(self) -> list[dict[str, Any]]:
        """Live runs first (newest first), then ended runs (most recent first)."""
        now = time.time()
        live = [r for r in self.records.values() if r.ended is None]
        ended = [r for r in self.records.values() if r.ended is not None]
        live.sort(key=lambda r: -r.run_id)
        ended.sort(key=lambda r: -(r.ended or 0))
        return [r.row(now) for r in live + ended]

    def clear(self) -> None:
        self.records.clear()
        self.ended.clear()
        self.totals.clear()
        self.aggregates.clear()
        self.forgotten.clear()


RUN_COLUMNS = (
    "service", "key", "run_id", "state", "workers", "inputs", "inputs_handed_off",
    "outputs_wanted", "outputs_produced", "bytes_sent", "bytes_received", "bytes_spilled",
    "restarts", "detail", "duration_s", "worker_addresses",
)

register_table(StatusTable(
    name="runs",
    title="Service runs (live, then recent)",
    columns=RUN_COLUMNS,
    labels=("service", "key", "run_id", "state"),
    figures=("workers", "inputs", "inputs_handed_off", "outputs_wanted", "outputs_produced",
             "bytes_sent", "bytes_received", "bytes_spilled", "restarts", "duration_s"),
    rows=lambda plugin: plugin.history.rows(),
))


def collect(plugin: ServiceDiagnostics, tables: Sequence[str] | None = None
            ) -> dict[str, list[dict[str, Any]]]:
    """The rows of every table (or of ``tables``), as the scheduler handler returns them."""
    names = list(TABLES) if tables is None else [t for t in tables if t in TABLES]
    return {name: TABLES[name].rows(plugin) for name in names}


async def collect_current(plugin: ServiceDiagnostics, tables: Sequence[str] | None = None
                          ) -> dict[str, list[dict[str, Any]]]:
    """:func:`collect`, once the tables asked for have refreshed their figures (the
    ``status()`` handler: figures as of the moment it is asked, not of the last
    heartbeat)."""
    import logging

    names = list(TABLES) if tables is None else [t for t in tables if t in TABLES]
    for name in names:
        refresh = TABLES[name].refresh
        if refresh is not None:
            try:
                await refresh(plugin)
            except Exception:  # the heartbeat figures are still there
                logging.getLogger("dask_services").exception(
                    "dask_services: could not refresh the %s table", name)
    return collect(plugin, names)


# ---------------------------------------------------------------- client side


def status(client: Any = None, table: str = "runs") -> pd.DataFrame:
    """The live and recent service runs on ``client``'s cluster, as a DataFrame.

    One row per run: service class, service task key, run id, state (``starting``,
    ``running``, ``inputs-done``, ``finished``, ``failed``, ``restarted``, ``cancelled``),
    participating workers, inputs handed off, outputs produced, bytes sent, received and
    spilled (summed over the run's instances, as of the workers' last heartbeat), restarts
    of the service task before this run, the error or restart reason, and the duration.
    ``table`` picks another registered table.  The same figures are on the dashboard's
    ``/services`` page; the scheduler's Prometheus metrics sum them up per service class.
    With an asynchronous client, await the result.
    """
    from distributed import default_client

    from dask_services.client import install

    if not isinstance(table, str):
        raise TypeError(f"status(table=...) takes a table's name, got {table!r}; "
                        "e.g. table='runs' or table='replicas'")
    client = client or default_client()
    if not client.asynchronous:
        install(client)
    # with an asynchronous client ``sync`` gives a coroutine: awaited, it installs first
    # (as ``install()`` does for a synchronous one) and gives the frame
    return client.sync(_status_frame, client, table, install_first=client.asynchronous)


async def _status_frame(client: Any, table: str, install_first: bool = False
                        ) -> pd.DataFrame:
    import pandas as pd

    from dask_services.client import install_async

    if install_first:
        await install_async(client)
    result = await client.scheduler.service_status(tables=[table])
    if table not in result:
        known = await client.scheduler.service_status(tables=None)
        raise KeyError(f"no status table {table!r}; tables: {sorted(known)}")
    columns = TABLES[table].columns if table in TABLES else None
    return pd.DataFrame(result[table], columns=columns)
