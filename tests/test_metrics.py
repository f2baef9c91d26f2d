"""The Prometheus metrics: per service class aggregates with bounded labels, and counters
that only go up however many runs the scheduler serves or forgets."""

from __future__ import annotations

import math
from collections import Counter

import dask
import pytest
from distributed.utils_test import async_poll_for
from services import Recorder
from utils import service_cluster

import dask_services
from dask_services import _metrics, _status
from dask_services._run_model import Phase, Run
from dask_services.examples import AllReduce
from dask_services.service import ServiceId

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.timeout(60)

COUNTED = {"bytes_sent": 3, "bytes_received": 5, "bytes_spilled": 7}  # per instance


class Counted(AllReduce):
    """An all-reduce whose every instance reports the same byte counters."""

    def counters(self) -> dict[str, int]:
        return dict(COUNTED)


def inc(x):
    return x + 1


def scrape(*plugins) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of the project's series, as a scraper
    reads them: through ``prometheus_client``'s text format and its parser."""
    collector = _metrics.ServicesCollector()
    for plugin in plugins:
        collector.plugins.add(plugin)
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("dask_services")
        for sample in family.samples
    }


def value(series: dict, name: str, **labels: str) -> float:
    return series[name, tuple(sorted(labels.items()))]


def labels_of(series: dict) -> set[str]:
    return {k for _, labels in series for k, _ in labels}


# ------------------------------------------------------------------ on a cluster


@service_cluster(config={"dask_services.status.recent-runs": 5})
async def test_series_stay_fixed_and_counters_count_every_run(c, s, a, b):
    plugin = s.extensions["dask_services_diagnostics"]
    batches, size = 5, 50
    first: set | None = None
    for batch in range(batches):
        outs = [o for i in range(size) for o in dask_services.service_task(
            Counted, [dask.delayed(inc)(batch * size + i)], outputs=1)]
        futures = c.compute(outs)
        assert await c.gather(futures) == [batch * size + i + 1 for i in range(size)]
        del futures
        series = scrape(plugin)
        assert {"key", "run_id", "replica", "worker"}.isdisjoint(labels_of(series))
        if first is None:
            first = set(series)
        assert set(series) == first, set(series) ^ first  # no new series, none gone
        done = (batch + 1) * size
        assert value(series, "dask_services_runs_started_total", service="Counted") == done
        assert value(series, "dask_services_runs_ended_total", service="Counted",
                     outcome="finished") == done
    assert len(plugin.history.records) == 5  # the status history forgot the rest

    total = batches * size
    instances = total * 2  # one per worker and run
    # the final byte counters come with the heartbeats after each run stopped
    await async_poll_for(lambda: value(scrape(plugin), "dask_services_spilled_bytes_total",
                                       service="Counted") == instances * 7, timeout=10)
    series = scrape(plugin)
    assert set(series) == first
    expected = {
        "dask_services_runs_started_total": total,
        "dask_services_inputs_handed_off_total": total,
        "dask_services_outputs_produced_total": total,
        "dask_services_restarts_total": 0,
        "dask_services_sent_bytes_total": instances * 3,
        "dask_services_received_bytes_total": instances * 5,
        "dask_services_spilled_bytes_total": instances * 7,
    }
    for name, n in expected.items():
        assert value(series, name, service="Counted") == n, name
    for outcome in _metrics.OUTCOMES:
        assert value(series, "dask_services_runs_ended_total", service="Counted",
                     outcome=outcome) == (total if outcome == "finished" else 0)
    for state in _metrics.LIVE_STATES:
        assert value(series, "dask_services_runs", service="Counted", state=state) == 0
    assert value(series, "dask_services_run_duration_seconds_count", service="Counted",
                 outcome="finished") == total
    assert value(series, "dask_services_run_duration_seconds_bucket", service="Counted",
                 outcome="finished", le="+Inf") == total
    assert 0 < value(series, "dask_services_run_duration_seconds_sum", service="Counted",
                     outcome="finished") < 60 * total


@service_cluster()
async def test_restarted_and_failed_runs_are_counted_by_outcome(c, s, a, b):
    plugin = s.extensions["dask_services_diagnostics"]
    xs = [dask.delayed(inc)(i) for i in range(4)]
    restarted = dask_services.service_task(Recorder, xs, outputs=2, restart_runs=1)
    assert await c.gather(c.compute(restarted)) == [10, 10]
    failing = c.compute(dask_services.service_task(Recorder, xs[:2], outputs=1,
                                                   fail_in="add_key"))
    assert isinstance(await failing[0].exception(), ValueError)
    del failing
    series = scrape(plugin)
    actions = Counter(e["action"] for _, e in await c.get_events("dask_services"))
    assert actions["restarted"] >= 1 and actions["failed"] == 1 and actions["finished"] == 1
    assert value(series, "dask_services_runs_started_total",
                 service="Recorder") == actions["started"]
    for outcome in _metrics.OUTCOMES:
        assert value(series, "dask_services_runs_ended_total", service="Recorder",
                     outcome=outcome) == actions[outcome]
        assert value(series, "dask_services_run_duration_seconds_count", service="Recorder",
                     outcome=outcome) == actions[outcome]
    assert value(series, "dask_services_restarts_total",
                 service="Recorder") == actions["restarted"]


# ------------------------------------------------------------------ without a cluster


class FakePlugin:
    def __init__(self, history: _status.RunHistory) -> None:
        self.history = history


def new_run(run_id: int) -> Run:
    sid = ServiceId(f"x-{run_id}.0")
    return Run(run_id, ("w1",), {"w1": sid}, ("o",), {}, sid)


def run_many(history: _status.RunHistory, first: int, n: int, service: str = "S") -> None:
    for run_id in range(first, first + n):
        run = new_run(run_id)
        history.logged(service, f"k{run_id}", "started", run_id, "", run, 1, 0)
        run.handed_off.add(f"i{run_id}")
        run.produced[f"o{run_id}"] = "w1"
        history.worker_report("w1", [{"id": f"x-{run_id}.0", "run_id": run_id,
                                      "bytes_sent": 10}])
        history.logged(service, f"k{run_id}", "finished", run_id, "", None, 1, 0)


def test_series_do_not_depend_on_how_many_runs_there_were():
    history = _status.RunHistory(keep=3)
    plugin = FakePlugin(history)
    run_many(history, 0, 2)
    few = scrape(plugin)
    run_many(history, 2, 500)
    many = scrape(plugin)
    assert set(few) == set(many)
    assert labels_of(many) == {"service", "state", "outcome", "le"}
    assert value(many, "dask_services_runs_ended_total", service="S",
                 outcome="finished") == 502
    assert value(many, "dask_services_sent_bytes_total", service="S") == 5020
    assert value(many, "dask_services_outputs_produced_total", service="S") == 502
    assert len(history.records) == 3
    # a second service class adds its own fixed set of series, no more
    run_many(history, 502, 1, service="T")
    both = scrape(plugin)
    per_class = {k for k in both if ("service", "T") in k[1]}
    assert len(per_class) == len(many) and set(both) == set(many) | per_class


def test_counters_keep_what_forgotten_runs_counted_and_count_late_reports():
    history = _status.RunHistory(keep=1)
    plugin = FakePlugin(history)
    runs = [new_run(i) for i in range(3)]
    for run in runs:
        history.logged("S", f"k{run.run_id}", "started", run.run_id, "", run, 2, 0)
    runs[0].handed_off.update({"a", "b"})
    runs[0].produced["o"] = "w1"
    runs[1].handed_off.add("a")
    runs[1].phase = Phase.RUNNING
    history.worker_report("w1", [{"id": "x-0.0", "run_id": 0, "bytes_sent": 4}])
    before = scrape(plugin)
    # live runs count as they go
    assert value(before, "dask_services_inputs_handed_off_total", service="S") == 3
    assert value(before, "dask_services_runs", service="S", state="starting") == 2
    assert value(before, "dask_services_runs", service="S", state="running") == 1

    history.logged("S", "k0", "finished", 0, "", None, 2, 0)
    history.logged("S", "k1", "restarted", 1, "lost a worker", None, 2, 0)  # forgets run 0
    assert 0 not in history.records
    # the same cumulative report twice counts once; a forgotten run's final report counts
    history.worker_report("w1", [{"id": "x-0.0", "run_id": 0, "bytes_sent": 4},
                                 {"id": "x-0.0", "run_id": 0, "bytes_sent": 9,
                                  "bytes_spilled": 2},
                                 {"id": "x-1.0", "run_id": 1, "bytes_sent": 1},
                                 {"id": "?", "run_id": 77, "bytes_sent": 1000}])
    after = scrape(plugin)
    assert set(after) == set(before)
    assert value(after, "dask_services_sent_bytes_total", service="S") == 10
    assert value(after, "dask_services_spilled_bytes_total", service="S") == 2
    assert value(after, "dask_services_inputs_handed_off_total", service="S") == 3
    assert value(after, "dask_services_outputs_produced_total", service="S") == 1
    assert value(after, "dask_services_runs", service="S", state="starting") == 1
    assert value(after, "dask_services_runs", service="S", state="running") == 0
    assert value(after, "dask_services_restarts_total", service="S") == 1
    for key in before:  # counters never went down
        if key[0].endswith(("_total", "_count", "_bucket")):
            assert after[key] >= before[key], key
    # a run that ends twice (it cannot, but) is counted once
    history.logged("S", "k1", "failed", 1, "", None, 2, 0)
    assert value(scrape(plugin), "dask_services_runs_ended_total", service="S",
                 outcome="failed") == 0


def test_durations_fall_in_fixed_buckets():
    totals = _metrics.RunTotals()
    for seconds in (0.003, 0.01, 12.0, 10_000.0):
        totals.ended("S", "finished", seconds, {})
    totals.ended("S", "failed", None, {})  # duration unknown: counted, not timed
    t = totals.services["S"]
    assert t.ended["finished"] == 4 and t.ended["failed"] == 1
    assert sum(t.buckets["failed"]) == 0
    history = _status.RunHistory()
    history.aggregates = totals
    series = scrape(FakePlugin(history))

    def bucket(le: str) -> float:
        return value(series, "dask_services_run_duration_seconds_bucket", service="S",
                     outcome="finished", le=le)

    assert [bucket(le) for le in ("0.01", "0.05", "10.0", "30.0", "7200.0", "+Inf")] == [
        2, 2, 2, 3, 3, 4]
    assert math.isclose(value(series, "dask_services_run_duration_seconds_sum", service="S",
                              outcome="finished"), 10_012.013)
    les = {dict(labels)["le"] for name, labels in series
           if name == "dask_services_run_duration_seconds_bucket"}
    assert len(les) == len(_metrics.DURATION_BUCKETS) + 1


def test_clear_forgets_everything():
    history = _status.RunHistory(keep=0)
    run_many(history, 0, 3)
    assert history.forgotten and history.aggregates.services
    history.clear()
    assert not history.forgotten and not history.aggregates.services
    assert not history.records


def replica(service: str, rid: str, state: str = "healthy", **figures) -> dict:
    row = {"service": service, "class": "Model", "slot": 0, "replica": rid,
           "worker": f"tcp://{rid}:1", "state": state, "in_flight": 0, "queued": 0,
           "calls": 0, "errors": 0, "overloaded": 0, "p50_ms": math.nan,
           "p99_ms": math.nan}
    row.update(figures)
    return row


def replica_series(rows: list[dict], totals: _metrics.ReplicaTotals,
                   deployed: dict | None | str = "from rows") -> dict:
    """The series scraped; ``deployed``: the services deployed (by default those of the
    rows, each in its first deployment; None: their list failed)."""
    registry = prometheus_client.CollectorRegistry()
    if deployed == "from rows":
        deployed = {r["service"]: {"class": r["class"], "deployment": "d1"} for r in rows}

    class One:
        def collect(self):
            return _metrics.replica_families([(rows, totals, deployed)])

    registry.register(One())
    text = prometheus_client.generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_replica_metrics_are_per_service_and_count_every_incarnation():
    totals = _metrics.ReplicaTotals()
    rows = [replica("m", "r1", calls=5, errors=1, in_flight=2, p50_ms=2.0, p99_ms=8.0),
            replica("m", "r2", calls=3, queued=4, p50_ms=4.0, p99_ms=6.0)]
    first = replica_series(rows, totals)
    assert labels_of(first) == {"service", "class", "state", "quantile"}
    assert value(first, "dask_services_replica_calls_total", service="m", **{"class": "Model"}) == 8
    assert value(first, "dask_services_replica_calls_in_flight", service="m",
                 **{"class": "Model"}) == 2
    assert value(first, "dask_services_replica_calls_queued", service="m",
                 **{"class": "Model"}) == 4
    assert value(first, "dask_services_replicas", service="m", state="healthy",
                 **{"class": "Model"}) == 2
    assert value(first, "dask_services_replica_latency_seconds", service="m", quantile="0.99",
                 **{"class": "Model"}) == 0.008

    # r2's worker died: a new incarnation r3 counts from zero elsewhere, r1 answered more
    rows = [replica("m", "r1", calls=6, errors=1),
            replica("m", "r3", state="recovering")]
    second = replica_series(rows, totals)
    assert set(second) == set(first)  # new incarnation, new worker: no new series
    assert value(second, "dask_services_replica_calls_total", service="m",
                 **{"class": "Model"}) == 9
    assert value(second, "dask_services_replica_errors_total", service="m",
                 **{"class": "Model"}) == 1
    assert value(second, "dask_services_replicas", service="m", state="recovering",
                 **{"class": "Model"}) == 1
    assert math.isnan(value(second, "dask_services_replica_latency_seconds", service="m",
                            quantile="0.5", **{"class": "Model"}))
    rows = [replica("m", "r1", calls=6, errors=1), replica("m", "r3", calls=2)]
    assert value(replica_series(rows, totals), "dask_services_replica_calls_total",
                 service="m", **{"class": "Model"}) == 11
    assert set(totals.last) == {"r1", "r3"}

    assert replica_series([], totals) == {}  # shut down: nothing left, nothing kept
    assert totals.totals == {} and totals.last == {}


def test_replica_counters_go_on_at_zero_and_start_again_with_a_new_deployment():
    totals = _metrics.ReplicaTotals()
    model = {"class": "Model"}
    first = {"m": {"class": "Model", "deployment": "d1"}}
    series = replica_series([replica("m", "r1", calls=50)], totals, first)
    assert value(series, "dask_services_replica_calls_total", service="m", **model) == 50
    # scaled to zero: no replica row, but the service is deployed: its series stay
    series = replica_series([], totals, first)
    assert value(series, "dask_services_replica_calls_total", service="m", **model) == 50
    assert value(series, "dask_services_replicas", service="m", state="healthy",
                 **model) == 0
    assert value(series, "dask_services_replica_calls_in_flight", service="m",
                 **model) == 0
    # woken again: a new incarnation counts on from the total, not from zero
    series = replica_series([replica("m", "r2", calls=5)], totals, first)
    assert value(series, "dask_services_replica_calls_total", service="m", **model) == 55
    # the list of deployments failing once changes nothing (no reset, series stay)
    series = replica_series([replica("m", "r2", calls=6)], totals, None)
    assert value(series, "dask_services_replica_calls_total", service="m", **model) == 56
    series = replica_series([], totals, None)
    assert value(series, "dask_services_replica_calls_total", service="m", **model) == 56
    # shut down and deployed again under the name, no scrape in between: from zero
    again = {"m": {"class": "Model", "deployment": "d2"}}
    series = replica_series([replica("m", "r3", calls=2)], totals, again)
    assert value(series, "dask_services_replica_calls_total", service="m", **model) == 2


def test_a_failing_part_does_not_hide_the_others(caplog):
    class Broken:
        @property
        def history(self):
            raise RuntimeError("no history")

    series = scrape(Broken())
    assert not any(name.startswith("dask_services_runs") for name, _ in series)
    assert "the runs metrics failed" in caplog.text


def test_two_schedulers_in_one_process_are_summed_into_one_family_each():
    first, second = _status.RunHistory(), _status.RunHistory()
    run_many(first, 0, 2)
    run_many(second, 10, 3)
    collector = _metrics.ServicesCollector()
    plugins = [FakePlugin(first), FakePlugin(second)]
    for plugin in plugins:
        collector.plugins.add(plugin)
    names = [family.name for family in collector.collect()]
    assert len(names) == len(set(names))
    series = scrape(*plugins)
    assert value(series, "dask_services_runs_ended_total", service="S",
                 outcome="finished") == 5
    assert value(series, "dask_services_run_duration_seconds_count", service="S",
                 outcome="finished") == 5
