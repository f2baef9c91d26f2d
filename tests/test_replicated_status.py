"""Replicated services in status(), on the dashboard page and in the Prometheus metrics."""

from __future__ import annotations

import asyncio
import math

import pytest
from distributed.utils_test import async_poll_for, poll_for
from replicated_services import GATES, Adder
from tornado.httpclient import AsyncHTTPClient
from utils import DASHBOARD, pull_tables, samples, service_cluster

import dask_services
from dask_services.replicated._table import COLUMNS, ReplicaReports

pytestmark = pytest.mark.timeout(90)

THREE_WORKERS = [("127.0.0.1", 1)] * 3


def replica_rows(s, service: str | None = None) -> list[dict]:
    rows = s.extensions["dask_services_diagnostics"].status(["replicas"])["replicas"]
    return [r for r in rows if service is None or r["service"] == service]


def total(rows: list[dict], figure: str) -> float:
    return sum(r[figure] for r in rows)


@service_cluster(**DASHBOARD)
async def test_dashboard_status_and_metrics_show_replicas_and_their_load(c, s, a, b):
    pytest.importorskip("bokeh")
    pytest.importorskip("prometheus_client")
    url = f"http://127.0.0.1:{s.http_server.port}"
    http = AsyncHTTPClient()
    svc = await Adder.options(replicas=2, name="adder").as_service(1, client=c)
    rows = replica_rows(s)
    assert [(r["service"], r["class"], r["slot"], r["state"]) for r in rows] == [
        ("adder", "Adder", 0, "healthy"), ("adder", "Adder", 1, "healthy")]
    assert {r["worker"] for r in rows} == {a.address, b.address}
    assert [await svc.add.route(i) for i in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="bad input"):
        await svc.fail.route("bad input")
    waiting = svc.wait_for.route("g", 7)  # one call held in flight on its replica
    # The figures come with the workers' heartbeats.
    await async_poll_for(lambda: total(replica_rows(s), "calls") == 6
                         and total(replica_rows(s), "in_flight") == 1, timeout=10)
    rows = replica_rows(s)
    assert total(rows, "errors") == 1 and total(rows, "queued") == 0
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in rows if r["calls"])

    tables = await asyncio.to_thread(pull_tables, url + "/services")
    table = tables["dask-services-replicas"]
    assert table["service"] == ["adder", "adder"] and table["class"] == ["Adder", "Adder"]
    assert table["state"] == ["healthy", "healthy"]
    assert sorted(table["replica"]) == sorted(r["replica"] for r in rows)
    assert sum(table["calls"]) == 6 and sum(table["in_flight"]) == 1
    assert "dask-services-runs" in tables

    # per deployed service: no replica incarnation id or worker address in a label
    metrics = (await http.fetch(url + "/metrics")).body.decode()
    assert not any(r["replica"] in metrics or r["worker"] in metrics for r in rows)
    adder = 'class="Adder",service="adder"'
    assert samples(metrics, "dask_services_replica_calls_total") == {adder: 6.0}
    assert samples(metrics, "dask_services_replica_errors_total") == {adder: 1.0}
    assert samples(metrics, "dask_services_replica_calls_in_flight") == {adder: 1.0}
    assert samples(metrics, "dask_services_replicas")[f'{adder},state="healthy"'] == 2

    GATES["g"].set()
    assert await waiting == 7
    await svc.shutdown()
    GATES.clear()
    assert replica_rows(s) == []
    assert s.extensions["dask_services_replicated"].reports.figures == {}
    metrics = (await http.fetch(url + "/metrics")).body.decode()
    assert samples(metrics, "dask_services_replica_calls_total") == {}


@service_cluster(nthreads=THREE_WORKERS)
async def test_a_moved_replica_shows_its_new_worker_and_nothing_of_the_old(c, s, *workers):
    svc = await Adder.options(replicas=2, name="mover").as_service(client=c)
    await asyncio.gather(*(svc.add.route(i) for i in range(4)))
    await async_poll_for(lambda: total(replica_rows(s), "calls") == 4, timeout=10)
    before = replica_rows(s)[0]
    await next(w for w in workers if w.address == before["worker"]).close()

    def moved() -> bool:
        row = replica_rows(s)[0]
        return row["state"] == "healthy" and row["worker"] not in ("", before["worker"])
    await async_poll_for(moved, timeout=20)
    row = replica_rows(s)[0]
    assert row["slot"] == before["slot"] and row["replica"] != before["replica"]
    assert row["incarnation"] == before["incarnation"] + 1
    assert row["calls"] == 0  # a new incarnation starts counting afresh
    plugin = s.extensions["dask_services_replicated"]
    assert before["replica"] not in plugin.reports.figures
    assert len(replica_rows(s)) == 2
    await svc.shutdown()
    assert replica_rows(s) == [] and plugin.reports.figures == {}


def test_reports_keep_only_current_incarnations_on_their_worker():
    reports = ReplicaReports()
    placed = {"x.0.1": "w1", "x.1.1": "w2"}
    reports.update("w1", [{"id": "x.0.1", "calls": 3, "in_flight": 1},
                          {"id": "x.1.1", "calls": 9},  # reported by the wrong worker
                          {"id": "x.2.1", "calls": 5}], placed)  # not placed at all
    assert list(reports.figures) == ["x.0.1"]
    assert reports.get("x.0.1")["calls"] == 3 and reports.get("x.0.1")["in_flight"] == 1
    assert math.isnan(reports.get("x.0.1")["p50_ms"])  # missing figures are NaN
    fresh = reports.get("x.1.1")  # before its first report
    assert fresh["calls"] == 0 and math.isnan(fresh["p99_ms"])
    reports.update("w2", [{"id": "x.1.1", "calls": 2}], {"x.1.1": "w2"})
    assert list(reports.figures) == ["x.1.1"]  # x.0.1 is no longer placed: forgotten


@pytest.mark.slow
def test_status_dataframe_of_replicas(small_cluster):
    _, client, _ = small_cluster
    svc = Adder.options(replicas=2, name="model").as_service(10, client=client)
    try:
        assert [svc.add.route(i).result(timeout=30) for i in range(3)] == [10, 11, 12]
        poll_for(lambda: dask_services.status(client, table="replicas").calls.sum() == 3,
                 timeout=10)
        df = dask_services.status(client, table="replicas")
        assert list(df.columns) == list(COLUMNS)
        assert df.service.tolist() == ["model", "model"]
        assert df.state.tolist() == ["healthy", "healthy"]
        assert set(df.worker) == set(client.scheduler_info()["workers"])
        assert df.errors.sum() == 0 and (df.last_error == "").all()
    finally:
        svc.shutdown()
    df = dask_services.status(client, table="replicas")
    assert df.empty and list(df.columns) == list(COLUMNS)


def test_status_of_replicas_shows_the_calls_made_just_before(small_cluster):
    # it asked only the workers whose figures were older than 50 ms: calls made within
    # 50 ms of a heartbeat or of the last status() were missed (35 rounds in 40)
    _, client, _ = small_cluster
    svc = Adder.options(replicas=2, name="counted").as_service(0, client=client)
    try:
        made = 0
        for _ in range(20):
            assert [c.result(timeout=30) for c in [svc.add.route(i) for i in range(4)]] \
                == [0, 1, 2, 3]
            made += 4
            assert dask_services.status(client, table="replicas").calls.sum() == made
    finally:
        svc.shutdown()


def test_dashboard_does_not_resend_a_table_with_nan_figures():
    from dask_services.dashboard import _same

    nan = math.nan
    assert _same({"p50_ms": [nan, 1.0], "state": ["a", "b"]},
                 {"p50_ms": [nan, 1.0], "state": ["a", "b"]})
    assert not _same({"p50_ms": [nan, 1.0]}, {"p50_ms": [0.5, 1.0]})
    assert not _same({"p50_ms": [nan]}, {"p50_ms": [nan, 1.0]})
    assert not _same({"p50_ms": [nan]}, {"p99_ms": [nan]})
