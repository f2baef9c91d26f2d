"""What users see of runs: status(), the dashboard page, Prometheus metrics, events, logs,
progress bars."""

from __future__ import annotations

import asyncio
import logging
import re

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import progress, span
from distributed.metrics import time
from distributed.utils_test import async_poll_for, poll_for
from services import Recorder
from tornado.httpclient import AsyncHTTPClient
from utils import DASHBOARD, assert_nothing_left, pull_tables, samples, service_cluster

import dask_services
from dask_services import _metrics, _status
from dask_services._run_model import Run
from dask_services.examples import AllReduce
from dask_services.service import ServiceId

pytestmark = pytest.mark.timeout(90)

def inc(x):
    return x + 1


def runs(s) -> list[dict]:
    return s.extensions["dask_services_diagnostics"].status()["runs"]


def run_row(s, key) -> dict | None:
    return next((r for r in runs(s) if r["key"] == str(key)), None)


# ------------------------------------------------------------------ figures


@service_cluster(config={"dask_services.shuffle.buffer-fraction": 1e-12})
async def test_status_counts_inputs_outputs_and_bytes_of_a_shuffle(c, s, a, b):
    pdf = pd.DataFrame({"k": range(4000), "x": range(4000)})
    df = dd.from_pandas(pdf, npartitions=8).shuffle("k", shuffle_method="service")
    result = await c.compute(df)
    assert len(result) == 4000
    assert len(runs(s)) == 1

    # The final counters arrive with each worker's first heartbeat after its instance
    # stopped (an instance leaves host.instances just before its final counters are queued):
    # wait until the scheduler has handled a heartbeat of each worker sent after that.
    await async_poll_for(lambda: not any(w.extensions["dask_services"].host.instances
                                         for w in (a, b)), timeout=10)
    stopped = time()
    await async_poll_for(lambda: all(s.workers[w.address].last_seen > stopped
                                     for w in (a, b)), timeout=10)
    row = runs(s)[0]
    assert row["service"] == "DataFrameShuffle", row
    assert row["state"] == "finished"
    assert row["workers"] == 2 and a.address in row["worker_addresses"]
    assert row["inputs"] == row["inputs_handed_off"] == 8
    assert row["outputs_wanted"] == row["outputs_produced"] == 8
    # received counts the pieces an instance keeps for itself too
    assert row["bytes_received"] >= row["bytes_sent"] > 0
    assert row["bytes_spilled"] > 0
    assert row["restarts"] == 0 and row["duration_s"] > 0
    await assert_nothing_left(s, [a, b])
    for w in (a, b):  # the final counters were taken by a heartbeat
        await async_poll_for(lambda w=w: not w.extensions["dask_services"]
                             .counter_reports.final, timeout=5)


@service_cluster()
async def test_restarts_and_failures_in_status_events_and_logs(c, s, a, b, caplog):
    caplog.set_level(logging.INFO, logger="dask_services")
    xs = [dask.delayed(inc)(i) for i in range(4)]
    restarted = dask_services.service_task(Recorder, xs, outputs=2, restart_runs=1)
    assert await c.gather(c.compute(restarted)) == [10, 10]
    failing = c.compute(dask_services.service_task(Recorder, xs[:2], outputs=1,
                                                   fail_in="add_key"))
    assert isinstance(await failing[0].exception(), ValueError)

    events = [e for _, e in await c.get_events("dask_services")]
    key = str(events[0]["key"])
    mine = [(e["action"], e["run_id"]) for e in events if e["key"] == key]
    first, second = mine[0][1], mine[-1][1]
    assert mine == [("started", first), ("restarted", first), ("started", second),
                    ("finished", second)]
    assert all(e["service"] == "Recorder" for e in events)
    assert "asked by the test" in events[1]["detail"]
    failed = [e for e in events if e["action"] == "failed"]
    assert len(failed) == 1 and "boom in add_key" in failed[0]["detail"]

    lines = [r.getMessage() for r in caplog.records if r.name == "dask_services"]
    for action, run_id in mine:
        assert any(f"run {run_id} {action}" in line and "Recorder" in line and key in line
                   for line in lines), (action, lines)
    assert any("failed" in line and "boom in add_key" in line for line in lines)

    by_run = {r["run_id"]: r for r in runs(s)}
    assert by_run[first]["state"] == "restarted"
    assert by_run[first]["detail"] == "asked by the test"
    assert by_run[second]["state"] == "finished" and by_run[second]["restarts"] == 1
    (failed_row,) = [r for r in by_run.values() if r["state"] == "failed"]
    assert "boom in add_key" in failed_row["detail"]
    del failing
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_a_run_forgotten_while_live_is_shown_cancelled(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, gate="never"))
    await async_poll_for(lambda: runs(s) and runs(s)[0]["state"] == "inputs-done", timeout=10)
    del outs
    await async_poll_for(lambda: runs(s)[0]["state"] == "cancelled", timeout=10)
    events = [e["action"] for _, e in await c.get_events("dask_services")]
    assert events == ["started", "cancelled"]
    await assert_nothing_left(s, [a, b])


@service_cluster(config={"dask_services.status.recent-runs": 2})
async def test_recent_runs_are_bounded_by_config(c, s, a, b):
    for i in range(4):
        await c.gather(dask_services.submit(AllReduce, [c.submit(inc, i)], outputs=1))
    rows = runs(s)
    assert [r["state"] for r in rows] == ["finished", "finished"]
    assert len(s.extensions["dask_services_diagnostics"].history.records) == 2
    started = [e for _, e in await c.get_events("dask_services") if e["action"] == "started"]
    assert [r["run_id"] for r in rows] == [e["run_id"] for e in started][:-3:-1]


def test_history_keeps_live_runs_and_ignores_unknown_counters():
    history = _status.RunHistory(keep=1)
    live = [Run(i, ("w1",), {"w1": ServiceId(f"x-{i}.0")}, ("o",), {}, ServiceId(f"x-{i}.0"))
            for i in range(3)]
    for run in live:
        history.logged("S", f"k{run.run_id}", "started", run.run_id, "", run, 1, 0)
    history.logged("S", "k0", "finished", 0, "done", None, 1, 0)
    history.logged("S", "k1", "failed", 1, "boom", None, 1, 0)
    history.worker_report("w1", [{"id": "x-2.0", "run_id": 2, "bytes_sent": 5},
                                 {"id": "gone", "run_id": 0, "bytes_sent": 7}])
    rows = history.rows()
    assert [(r["run_id"], r["state"]) for r in rows] == [(2, "starting"), (1, "failed")]
    assert rows[0]["bytes_sent"] == 5 and rows[1]["detail"] == "boom"
    assert history.totals == {("S", "started"): 3, ("S", "finished"): 1, ("S", "failed"): 1}


# ------------------------------------------------------------------ dashboard and metrics


@service_cluster(**DASHBOARD)
async def test_dashboard_page_and_metrics_show_a_running_service(c, s, a, b):
    pytest.importorskip("bokeh")
    pytest.importorskip("prometheus_client")
    url = f"http://127.0.0.1:{s.http_server.port}"
    http = AsyncHTTPClient()
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, gate="g"))
    await async_poll_for(lambda: runs(s) and runs(s)[0]["state"] == "inputs-done", timeout=10)
    key = runs(s)[0]["key"]

    status_page = (await http.fetch(url + "/status")).body.decode()
    assert 'href="services"' in status_page  # in the navigation bar
    page = await http.fetch(url + "/services")
    assert page.code == 200
    tables = await asyncio.to_thread(pull_tables, url + "/services")
    table = tables["dask-services-runs"]
    i = table["key"].index(key)
    assert table["service"][i] == "Recorder"
    assert table["state"][i] == "inputs-done"
    assert table["inputs_handed_off"][i] == 4 and table["outputs_produced"][i] == 0

    # per service class, never per run: no key or run id in any label
    metrics = (await http.fetch(url + "/metrics")).body.decode()
    assert key not in metrics and "run_id=" not in metrics
    assert samples(metrics, "dask_services_runs") == {
        'service="Recorder",state="starting"': 0.0,
        'service="Recorder",state="running"': 0.0,
        'service="Recorder",state="inputs-done"': 1.0}
    assert samples(metrics, "dask_services_inputs_handed_off_total") == {
        'service="Recorder"': 4.0}
    assert samples(metrics, "dask_services_runs_started_total") == {'service="Recorder"': 1.0}

    Recorder.gates["g"].set()
    assert await c.gather(outs) == [10, 10]
    metrics = (await http.fetch(url + "/metrics")).body.decode()
    assert samples(metrics, "dask_services_outputs_produced_total") == {
        'service="Recorder"': 2.0}
    assert samples(metrics, "dask_services_runs_ended_total")[
        'outcome="finished",service="Recorder"'] == 1
    assert samples(metrics, "dask_services_runs")['service="Recorder",state="inputs-done"'] == 0
    assert samples(metrics, "dask_services_run_duration_seconds_count") == {
        f'outcome="{o}",service="Recorder"': float(o == "finished") for o in _metrics.OUTCOMES}
    del outs
    await assert_nothing_left(s, [a, b])


def core_of(plugin):
    """The service-task core's plugin, next to the diagnostics plugin ``plugin``."""
    return plugin.scheduler.extensions["dask_services"]


@service_cluster(**DASHBOARD)
async def test_a_registered_table_shows_everywhere(c, s, a, b):
    pytest.importorskip("bokeh")
    pytest.importorskip("prometheus_client")
    table = _status.StatusTable(
        name="deployed", title="Deployed things", columns=("name", "state", "load"),
        labels=("name", "state"), figures=("load",),
        rows=lambda plugin: [{"name": f"n{len(core_of(plugin).machines)}", "state": "up",
                              "load": 7}],
    )
    _status.register_table(table)
    try:
        url = f"http://127.0.0.1:{s.http_server.port}"
        result = await c.scheduler.service_status(tables=["deployed"])
        assert [dict(r) for r in result["deployed"]] == [{"name": "n0", "state": "up", "load": 7}]
        tables = await asyncio.to_thread(pull_tables, url + "/services")
        assert tables["dask-services-deployed"] == {"name": ["n0"], "state": ["up"],
                                                    "load": [7]}
        assert "dask-services-runs" in tables
        metrics = (await AsyncHTTPClient().fetch(url + "/metrics")).body.decode()
        assert samples(metrics, "dask_services_deployed_load") == {
            'name="n0",state="up"': 7.0}
    finally:
        _status.TABLES.pop("deployed")


@service_cluster()
async def test_no_dashboard_and_no_prometheus_client_are_fine(c, s, a, b, monkeypatch):
    plugin = s.extensions["dask_services_diagnostics"]
    url = f"http://127.0.0.1:{s.http_server.port}"
    http = AsyncHTTPClient()
    assert (await http.fetch(url + "/health")).code == 200  # the scheduler serves HTTP...
    page = await http.fetch(url + "/services", raise_error=False)
    assert page.code == 404, page.code  # ... but no dashboard, so no /services page
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    assert _metrics.register(plugin) is False
    await c.gather(dask_services.submit(AllReduce, [c.submit(inc, 1)], outputs=1))
    assert runs(s)[0]["state"] == "finished"


SCHEDULER_WITHOUT_DASHBOARD = """
import sys
import dask
from distributed import Client, LocalCluster
import dask_services
from dask_services.examples import AllReduce

if __name__ == "__main__":
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \\
            Client(cluster) as client:
        assert "bokeh.server.server" not in sys.modules
        out, = dask_services.service_task(AllReduce, [dask.delayed(1), dask.delayed(2)], outputs=1)
        assert out.compute() == 3
        assert "dask_services_diagnostics" in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.extensions))
        print("bokeh server imported:", "bokeh.server.server" in sys.modules)
"""


@pytest.mark.timeout(120)
def test_a_scheduler_without_a_dashboard_does_not_import_bokeh(tmp_path):
    """Installing on a scheduler that serves no dashboard adds no page, and does not
    import bokeh's server to find that out (most of a second of its event loop)."""
    import subprocess
    import sys

    pytest.importorskip("bokeh.server.server")  # (without bokeh there is nothing to test)
    script = tmp_path / "no_dashboard.py"
    script.write_text(SCHEDULER_WITHOUT_DASHBOARD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bokeh server imported: False" in done.stdout, done.stdout


# ------------------------------------------------------------------ client side


@pytest.mark.slow
def test_status_dataframe_and_progress_bar(small_cluster, capsys):
    _, client, _ = small_cluster
    futures = dask_services.submit(AllReduce, client.map(inc, range(6)), outputs=3)
    progress(futures, notebook=False)  # outputs are ordinary keys: waits, draws the bar
    out = capsys.readouterr().out
    assert "100% Completed" in out
    assert client.gather(futures) == [21, 21, 21]
    poll_for(lambda: dask_services.status(client).state.tolist() == ["finished"], timeout=10)
    df = dask_services.status(client)
    assert list(df.columns) == list(_status.RUN_COLUMNS)
    (row,) = df.to_dict("records")
    assert row["service"] == "AllReduce" and row["workers"] == 2
    assert row["inputs_handed_off"] == 6 and row["outputs_produced"] == 3
    with pytest.raises(KeyError, match=r"no status table 'nope'; tables: \[.*'runs'"):
        dask_services.status(client, table="nope")
    with pytest.raises(TypeError, match="takes a table's name, got 3"):
        dask_services.status(client, table=3)


@pytest.mark.slow
def test_bench_progress_bar_on_a_terminal_keeps_json_clean(capsys, monkeypatch):
    import json

    from dask_services.cli import main

    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(["bench", "overhead", "--repeat", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["repeat"] == 2  # stdout is only the JSON
    assert re.search(r"service task \[#{30}\] 2/2", captured.err), captured.err


def test_progress_bar_only_on_a_terminal_and_not_quiet(monkeypatch):
    from dask_services.cli import main, show_progress

    parsed = {}
    monkeypatch.setattr("dask_services.cli.bench", lambda args: parsed.update(a=args) or 0)
    for tty, flags, expected in [(True, [], True), (True, ["--quiet"], False),
                                 (False, [], False)]:
        monkeypatch.setattr("sys.stderr.isatty", lambda tty=tty: tty)
        assert main(["bench", "shuffle", *flags]) == 0
        assert show_progress(parsed["a"]) is expected, (tty, flags)


@service_cluster()
async def test_status_with_an_asynchronous_client_is_awaited(c, s, a, b):
    """``status()`` with an asynchronous client failed with "argument of type 'coroutine'
    is not iterable"; awaited, it gives the frame, as ``story()`` does."""
    xs = [dask.delayed(lambda i: i + 1)(i) for i in range(4)]
    assert await c.gather(c.compute(dask_services.service_task(AllReduce, xs, outputs=2))) \
        == [10, 10]
    df = await dask_services.status(c)
    assert df.state.tolist() == ["finished"] and df.service.tolist() == ["AllReduce"]
    with pytest.raises(KeyError, match="no status table 'nope'"):
        await dask_services.status(c, table="nope")


# dask's own warning for a DataFrame built under ``span()``, with every shuffle method
@pytest.mark.filterwarnings("ignore:Dask annotations .* detected:UserWarning")
@pytest.mark.parametrize("collection", ["dataframe", "array"])
@service_cluster()
async def test_the_time_of_a_runs_thread_jobs_is_reported_under_its_span(c, s, a, b,
                                                                         collection):
    """The shuffle's split and the rechunk's assembly run in service threads, outside
    any task: distributed's spans (Fine Performance Metrics) saw none of their time, so
    a run looked free there where p2p's work shows.  Now it is reported under the service
    task's span and prefix."""
    with span("the-run") as span_id:
        if collection == "dataframe":
            pdf = pd.DataFrame({"k": range(4000), "x": range(4000)})
            built = dd.from_pandas(pdf, npartitions=8).shuffle("k", shuffle_method="service")
            assert len(await c.compute(built)) == 4000
        else:
            x = da.arange(40_000, dtype="f8", chunks=4000).reshape(200, 200)
            built = x.rechunk((20, 200)).rechunk((200, 20), method="service")
            assert (await c.compute(built)).sum() == np.arange(40_000.0).sum()
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    metrics = s.extensions["spans"].spans[span_id].cumulative_worker_metrics
    prefix = "shuffle-service" if collection == "dataframe" else "rechunk-service-task"
    timed = {activity: seconds for (context, pre, activity, unit), seconds
             in metrics.items() if context == "execute" and pre == prefix}
    assert timed.get("service-thread-cpu", 0) + timed.get("service-thread-noncpu", 0) > 0, \
        sorted(metrics)
    del built
    await assert_nothing_left(s, [a, b])
