"""Prometheus metrics of dask-services, on the scheduler's ``/metrics`` endpoint.

distributed's ``/metrics`` handler serves ``prometheus_client``'s global registry, so one
collector registered there (once per process) is enough: it reports on every live
scheduler plugin of the process (normally one).

Every label takes a bounded set of values: a service class name, a deployed service's name
and class, and a state or outcome out of a small fixed set.  Nothing per run, per service
task key, per replica incarnation or per worker is a label, so a long-lived scheduler
serving any number of runs exports a fixed number of series per service class (per-run
detail is in ``dask_services.status()``, the dashboard and the event log).

Runs (per service class):

* ``dask_services_runs{service, state}``: gauge, live runs per phase (``starting``,
  ``running``, ``inputs-done``);
* ``dask_services_runs_started_total{service}`` and
  ``dask_services_runs_ended_total{service, outcome}`` (``finished``, ``failed``,
  ``restarted``, ``cancelled``), ``dask_services_restarts_total{service}``;
* ``dask_services_inputs_handed_off_total``, ``dask_services_outputs_produced_total``,
  ``dask_services_sent_bytes_total``, ``dask_services_received_bytes_total``,
  ``dask_services_spilled_bytes_total`` (all ``{service}``);
* ``dask_services_run_duration_seconds{service, outcome}``: histogram of ended runs'
  durations, buckets :data:`DURATION_BUCKETS`.

The counters are cumulative totals kept on the scheduler (:class:`RunTotals`, fed by
``_status.RunHistory``), so they never go down when a run leaves the bounded history of
recent runs.  Replicated services (per deployed service): ``dask_services_replicas{service,
class, state}``, calls in flight and queued, calls, errors and overloaded calls as
counters summed over every incarnation (:class:`ReplicaTotals`), and the highest p50/p99
latency of the replicas.  Any other registered status table keeps one gauge per figure,
``dask_services_<table>_<figure>``, labelled by its label columns (which must take few
values).  Without ``prometheus_client`` nothing is registered and nothing fails.
"""

from __future__ import annotations

import bisect
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_services._observe import ServiceDiagnostics
    from dask_services._status import RunHistory, StatusTable

logger = logging.getLogger("dask_services")
PREFIX = "dask_services"

LIVE_STATES = ("starting", "running", "inputs-done")  # phases of a live run
OUTCOMES = ("finished", "failed", "restarted", "cancelled")  # how a run ends
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0,
                    3600.0, 7200.0)  # seconds; +Inf is implied
RUN_FIGURES = ("inputs_handed_off", "outputs_produced")  # of a run, frozen when it ends
BYTE_FIGURES = ("bytes_sent", "bytes_received", "bytes_spilled")  # reported by workers
COUNTER_NAMES = {  # figure -> counter family (without the _total suffix)
    "inputs_handed_off": "inputs_handed_off",
    "outputs_produced": "outputs_produced",
    "bytes_sent": "sent_bytes",
    "bytes_received": "received_bytes",
    "bytes_spilled": "spilled_bytes",
}


# ---------------------------------------------------------------- aggregates of runs


@dataclass
class ServiceTotals:
    """Cumulative figures of every run of one service class."""

    started: int = 0
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    figures: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(RUN_FIGURES + BYTE_FIGURES, 0))
    # per outcome: runs per duration bucket (not cumulative; the last one is +Inf), and sum
    buckets: dict[str, list[int]] = field(default_factory=lambda: {
        o: [0] * (len(DURATION_BUCKETS) + 1) for o in OUTCOMES})
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0.0))

    def merge(self, other: ServiceTotals) -> None:
        """Add ``other``'s figures (of another scheduler plugin) to these."""
        self.started += other.started
        for o in OUTCOMES:
            self.ended[o] += other.ended[o]
            self.buckets[o] = [x + y for x, y in zip(self.buckets[o], other.buckets[o],
                                                     strict=True)]
            self.seconds[o] += other.seconds[o]
        for f in self.figures:
            self.figures[f] += other.figures[f]


class RunTotals:
    """Runs started and ended, their figures and durations, per service class.

    Only ever added to: a run's figures are added when it ends (those of workers' reports
    as they arrive), so nothing here depends on how many ended runs the history keeps.
    """

    def __init__(self) -> None:
        self.services: dict[str, ServiceTotals] = {}

    def _of(self, service: str) -> ServiceTotals:
        found = self.services.get(service)
        if found is None:
            found = self.services[service] = ServiceTotals()
        return found

    def started(self, service: str) -> None:
        self._of(service).started += 1

    def ended(self, service: str, outcome: str, duration: float | None,
              figures: Mapping[str, int]) -> None:
        """A run ended with ``outcome``, after ``duration`` seconds (None: unknown), with
        its final ``figures`` (inputs handed off, outputs produced)."""
        totals = self._of(service)
        if outcome not in totals.ended:
            return
        totals.ended[outcome] += 1
        for name in RUN_FIGURES:
            totals.figures[name] += max(0, int(figures.get(name, 0)))
        if duration is not None:
            duration = max(0.0, duration)
            totals.buckets[outcome][bisect.bisect_left(DURATION_BUCKETS, duration)] += 1
            totals.seconds[outcome] += duration

    def add(self, service: str, figure: str, amount: int) -> None:
        """``amount`` more of a worker-reported figure (bytes sent, received, spilled)."""
        if amount > 0 and figure in BYTE_FIGURES:
            self._of(service).figures[figure] += amount

    def clear(self) -> None:
        self.services.clear()


def _live(history: RunHistory) -> dict[str, dict[str, int]]:
    """Per service class: live runs per state, and the figures of live runs so far."""
    out: dict[str, dict[str, int]] = {}
    for record in history.records.values():
        run = record.run
        if record.ended is not None or run is None:
            continue
        state = run.phase.value
        if state not in LIVE_STATES:
            continue
        live = out.setdefault(record.service, dict.fromkeys(LIVE_STATES + RUN_FIGURES, 0))
        live[state] += 1
        live["inputs_handed_off"] += run.inputs_handed_off
        live["outputs_produced"] += run.outputs_produced
    return out


def run_families(histories: Iterable[RunHistory]) -> Iterator[Any]:
    """The run metric families, summed over ``histories`` (one per scheduler plugin)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.utils import floatToGoString

    totals: dict[str, ServiceTotals] = {}
    live: dict[str, dict[str, int]] = {}
    for history in histories:
        for service, t in history.aggregates.services.items():
            totals.setdefault(service, ServiceTotals()).merge(t)
        for service, figures in _live(history).items():
            mine_live = live.setdefault(service, dict.fromkeys(LIVE_STATES + RUN_FIGURES, 0))
            for name, n in figures.items():
                mine_live[name] += n
    services = sorted(set(totals) | set(live))
    empty = ServiceTotals()
    no_live = dict.fromkeys(LIVE_STATES + RUN_FIGURES, 0)

    runs = GaugeMetricFamily(f"{PREFIX}_runs", "live service runs, by phase",
                             labels=["service", "state"])
    started = CounterMetricFamily(f"{PREFIX}_runs_started", "service runs started",
                                  labels=["service"])
    ended = CounterMetricFamily(f"{PREFIX}_runs_ended", "service runs ended, by outcome",
                                labels=["service", "outcome"])
    restarts = CounterMetricFamily(f"{PREFIX}_restarts", "service runs restarted",
                                   labels=["service"])
    counters = {
        figure: CounterMetricFamily(
            f"{PREFIX}_{name}", f"{figure.replace('_', ' ')} by service runs",
            labels=["service"])
        for figure, name in COUNTER_NAMES.items()
    }
    durations = HistogramMetricFamily(
        f"{PREFIX}_run_duration_seconds", "durations of ended service runs, by outcome",
        labels=["service", "outcome"])
    for service in services:
        t = totals.get(service, empty)
        now = live.get(service, no_live)
        for state in LIVE_STATES:
            runs.add_metric([service, state], now[state])
        started.add_metric([service], t.started)
        for outcome in OUTCOMES:
            ended.add_metric([service, outcome], t.ended[outcome])
        restarts.add_metric([service], t.ended["restarted"])
        for figure, family in counters.items():
            family.add_metric([service], t.figures[figure] + now.get(figure, 0))
        for outcome in OUTCOMES:
            cumulative, buckets = 0, []
            for le, n in zip((*DURATION_BUCKETS, math.inf), t.buckets[outcome], strict=True):
                cumulative += n
                buckets.append((floatToGoString(le), cumulative))
            durations.add_metric([service, outcome], buckets, sum_value=t.seconds[outcome])
    yield runs
    yield started
    yield ended
    yield restarts
    yield from counters.values()
    yield durations


# ---------------------------------------------------------------- replicated services

CALL_FIGURES = ("calls", "errors", "overloaded")  # counted per incarnation by its worker
REPLICA_STATES = ("uninitialized", "healthy", "recovering", "unhealthy")  # not stopped


class ReplicaTotals:
    """Calls, errors and overloaded calls per deployed service, over all incarnations.

    A replica's worker counts from zero for each incarnation, and a replaced incarnation's
    figures leave the ``replicas`` table; this keeps what every incarnation counted, as of
    the last time the table was read.  The totals belong to a deployment: they go on
    while the service is scaled to zero (no replica row), start from zero when it is shut
    down and deployed again under its name, and are forgotten once it is not deployed.
    """

    def __init__(self) -> None:
        self.last: dict[str, dict[str, float]] = {}  # incarnation id -> figures seen
        self.totals: dict[str, dict[str, float]] = {}  # service -> cumulative figures
        # service -> its facts as last given (``deployment``: whose totals these are; what
        # a scrape whose list failed goes on with)
        self.facts: dict[str, Mapping[str, Any]] = {}

    def update(self, rows: Iterable[Mapping[str, Any]],
               deployed: Mapping[str, Mapping[str, Any]]) -> None:
        """Take the ``replicas`` rows, and ``deployed``: every deployed service (rows or
        not) -> its facts, ``deployment`` among them."""
        before, self.facts = self.facts, dict(deployed)
        for service, facts in deployed.items():
            if service not in self.totals or \
                    before.get(service, {}).get("deployment") != facts.get("deployment"):
                self.totals[service] = dict.fromkeys(CALL_FIGURES, 0.0)
        seen: set[str] = set()
        for row in rows:
            service, rid = str(row.get("service")), str(row.get("replica"))
            totals = self.totals.get(service)
            if totals is None:
                continue  # shut down since the rows were read
            seen.add(rid)
            before = self.last.setdefault(rid, dict.fromkeys(CALL_FIGURES, 0.0))
            for name in CALL_FIGURES:
                value = _number(row.get(name))
                if value is None or value <= before[name]:
                    continue
                totals[name] += value - before[name]
                before[name] = value
        for rid in [r for r in self.last if r not in seen]:
            del self.last[rid]
        for service in [s for s in self.totals if s not in deployed]:
            del self.totals[service]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def replica_families(parts: Iterable[tuple[list[Mapping[str, Any]], ReplicaTotals,
                                            Mapping[str, Mapping[str, Any]] | None]]
                     ) -> Iterator[Any]:
    """The replicated-service metric families, from the rows of the ``replicas`` table of
    each scheduler plugin (normally one), the plugin's :class:`ReplicaTotals` and its
    deployed services (name -> class and deployment: one at zero has no row, but its
    families go on)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    by_service: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    cumulative: dict[str, dict[str, float]] = {}
    for rows, totals, deployed in parts:
        if deployed is None:  # the list of deployments failed: the last one stands
            deployed = totals.facts
        totals.update(rows, deployed)
        for service, facts in deployed.items():
            by_service.setdefault((service, str(facts.get("class"))), [])
        for row in rows:
            if str(row.get("service")) in deployed:
                by_service.setdefault((str(row.get("service")), str(row.get("class"))),
                                      []).append(row)
        for service, figures in totals.totals.items():
            mine = cumulative.setdefault(service, dict.fromkeys(CALL_FIGURES, 0.0))
            for name in CALL_FIGURES:
                mine[name] += figures[name]
    labels = ["service", "class"]
    replicas = GaugeMetricFamily(f"{PREFIX}_replicas", "replicas of deployed services, by "
                                 "state", labels=[*labels, "state"])
    in_flight = GaugeMetricFamily(f"{PREFIX}_replica_calls_in_flight",
                                  "calls running on the replicas", labels=labels)
    queued = GaugeMetricFamily(f"{PREFIX}_replica_calls_queued",
                               "calls waiting on the replicas", labels=labels)
    counters = {
        "calls": CounterMetricFamily(f"{PREFIX}_replica_calls", "calls answered by the "
                                     "replicas (all incarnations)", labels=labels),
        "errors": CounterMetricFamily(f"{PREFIX}_replica_errors", "calls whose endpoint "
                                      "raised (all incarnations)", labels=labels),
        "overloaded": CounterMetricFamily(f"{PREFIX}_replica_overloaded", "calls refused "
                                          "as overloaded (all incarnations)", labels=labels),
    }
    latency = GaugeMetricFamily(f"{PREFIX}_replica_latency_seconds", "the highest, over "
                                "the replicas, of their call latency quantile (recent calls)",
                                labels=[*labels, "quantile"])
    for (service, cls), mine in sorted(by_service.items()):
        for state in REPLICA_STATES:
            replicas.add_metric([service, cls, state],
                                sum(1 for r in mine if r.get("state") == state))
        in_flight.add_metric([service, cls], sum(_number(r.get("in_flight")) or 0
                                                 for r in mine))
        queued.add_metric([service, cls], sum(_number(r.get("queued")) or 0 for r in mine))
        for name, family in counters.items():
            family.add_metric([service, cls], cumulative.get(service, {}).get(name, 0.0))
        for quantile, column in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
            values = [v for r in mine if (v := _number(r.get(column))) is not None]
            latency.add_metric([service, cls, quantile],
                               max(values) / 1000 if values else math.nan)
    yield replicas
    yield in_flight
    yield queued
    yield from counters.values()
    yield latency


# ---------------------------------------------------------------- the collector

AGGREGATED = frozenset({"runs", "replicas"})  # tables exported as aggregates, not per row


class ServicesCollector:
    """A ``prometheus_client`` collector reading the plugins' run history and tables."""

    def __init__(self) -> None:
        self.plugins: weakref.WeakSet[ServiceDiagnostics] = weakref.WeakSet()
        self.replica_totals: weakref.WeakKeyDictionary[ServiceDiagnostics,
                                                       ReplicaTotals] = (
            weakref.WeakKeyDictionary())

    def describe(self) -> list:
        return []  # names vary with the registered tables: skip the registry's check

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from dask_services import _status

        plugins = list(self.plugins)
        yield from _guarded("runs", run_families, (p.history for p in plugins))
        replica_table = _status.TABLES.get("replicas")
        if replica_table is not None:
            parts = [(_safe_rows(replica_table, p),
                      self.replica_totals.setdefault(p, ReplicaTotals()),
                      _safe_subjects(replica_table, p)) for p in plugins]
            yield from _guarded("replicas", replica_families, parts)
        for table in _status.TABLES.values():
            if table.name in AGGREGATED:
                continue
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


def _guarded(what: str, families: Callable[..., Iterator[Any]], *args: Any) -> list:
    """All the families ``families(*args)`` yields, or none if it fails."""
    try:
        return list(families(*args))
    except Exception:
        logger.exception("dask_services: the %s metrics failed", what)
        return []


def _safe_rows(table: StatusTable, plugin: ServiceDiagnostics) -> list[dict]:
    try:
        return table.rows(plugin)
    except Exception:
        logger.exception("dask_services: status table %s failed", table.name)
        return []


def _safe_subjects(table: StatusTable, plugin: ServiceDiagnostics
                   ) -> dict[str, dict] | None:
    """What ``table``'s rows belong to, rows or not: every service named in its rows, at
    least (a table without ``subjects``: the rows are all there is); None if
    ``subjects`` failed."""
    if table.subjects is not None:
        try:
            return dict(table.subjects(plugin))
        except Exception:
            logger.exception("dask_services: status table %s failed", table.name)
            return None  # the deployments known from the last scrape stand
    return {str(r.get("service")): {"class": r.get("class"), "deployment": None}
            for r in _safe_rows(table, plugin)}


_collector: ServicesCollector | None = None


def register(plugin: ServiceDiagnostics) -> bool:
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


def unregister(plugin: ServiceDiagnostics) -> None:
    if _collector is not None:
        _collector.plugins.discard(plugin)
        _collector.replica_totals.pop(plugin, None)
