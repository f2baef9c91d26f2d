"""Stale-run refusal, preload installation, the CLI."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time

import dask
import pytest
from distributed.comm.core import CommClosedError
from distributed.core import Status
from distributed.utils_test import async_poll_for, gen_cluster
from services import Recorder
from utils import assert_nothing_left, events_of, service_cluster

import dask_services
from dask_services.examples import AllReduce

pytestmark = pytest.mark.timeout(120)


def inc(x):
    return x + 1


@service_cluster()
async def test_message_for_an_old_run_is_refused(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, restart_runs=1,
                                                gate="second-run"))
    # wait for the second run to be live (all its instances past all_inputs_done)
    await async_poll_for(lambda: len({e[4]["run_id"] for e in events_of("start")}) == 2
                         and len(events_of("all_inputs_done")) == 4, timeout=10)
    first, second = sorted({e[4]["run_id"] for e in events_of("start")})
    old = {e[3]: e[1] for e in events_of("start") if e[4]["run_id"] == first}
    new = {e[3]: e[1] for e in events_of("start") if e[4]["run_id"] == second}
    sender = a.extensions["dask_services"].host.env
    with pytest.raises(dask_services.StaleRunError, match="no longer current"):
        await sender.send_rpc(b.address, old[b.address], old[a.address], first, 0,
                              "receive_partial", (old[a.address], [1000]), {})
    # the message did not reach the live instance of the new run
    inst = b.extensions["dask_services"].host.instances[new[b.address]]
    assert old[a.address] not in inst.service.received
    Recorder.gates["second-run"].set()
    assert await c.gather(outs) == [10, 10]
    del outs
    await assert_nothing_left(s, [a, b])


class _LostConnection:
    """``worker.rpc`` of a worker whose first peer call to ``address`` finds the
    connection gone, as when the peer's worker dies while the call is sent."""

    def __init__(self, pool, address: str) -> None:
        self.pool, self.address, self.failed = pool, address, 0

    def __call__(self, address: str):
        if address != self.address or self.failed:
            return self.pool(address)
        owner, real = self, self.pool(address)

        class Broken:
            async def service_rpc(self, **kwargs):
                owner.failed += 1
                raise CommClosedError("in <TCP (closed)>: ConnectionResetError: [Errno 104] "
                                      "Connection reset by peer")

            def __getattr__(self, name: str):  # inputs pushed to b, say: as they are
                return getattr(real, name)

        return Broken()

    def __getattr__(self, name: str):
        return getattr(self.pool, name)


@service_cluster()
async def test_a_peer_call_whose_connection_breaks_restarts_the_run(c, s, a, b):
    """A peer's worker dying mid-call breaks the caller's connection before the scheduler
    hears of the loss: the hook's peer call raises, and the run restarts (it failed, for
    good, with the CommClosedError, whenever the call lost that race)."""
    a.rpc = _LostConnection(a.rpc, b.address)
    try:
        xs = [c.submit(inc, i, workers=[w.address]) for i, w in enumerate([a, b, a, b])]
        outs = dask_services.submit(AllReduce, xs, outputs=2)
        assert await c.gather(outs) == [10, 10]
        assert a.rpc.failed == 1
    finally:
        a.rpc = a.rpc.pool
    events = [e for _, e in await c.get_events("dask_services")]
    restarts = [e for e in events if e["action"] == "restarted"]
    assert len(restarts) == 1, events
    (restarted,) = restarts
    assert "PeerUnreachableError" not in restarted["detail"]
    assert f"the connection to {b.address} failed" in restarted["detail"]
    assert "Connection reset by peer" in restarted["detail"]
    del outs, xs
    await assert_nothing_left(s, [a, b])


RELEASE = threading.Event()
# the tests pause workers themselves: distributed's memory monitor must not resume them
PAUSED_BY_HAND = {"distributed.worker.memory.pause": False}


def blocked() -> None:
    RELEASE.wait(30)


class ProducesThenRestarts(dask_services.Service):
    """In the first run the instance on ``restart_on`` produces its outputs, then restarts
    the run; every other instance, and every instance of later runs, produces once
    ``GATE`` is set (so the first run cannot finish before its restart: a restart after
    the last output was produced comes too late to count)."""

    GATE: asyncio.Event | None = None
    restarted: set = set()

    async def start(self, *args, restart_on: str = "", **kwargs):
        self.restart_on = restart_on

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        first = self.key not in self.restarted
        restarts = first and self.concierge.address == self.restart_on
        if not restarts:
            await self.GATE.wait()
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, self.concierge.run_id)
        if restarts:
            self.restarted.add(self.key)
            self.concierge.restart("once, after producing")


@service_cluster()
async def test_a_restart_drops_the_outputs_its_run_produced_and_nobody_took(c, s, a, b):
    """A restarted run's produced outputs whose claims had not run are produced again by
    the next run, maybe on another worker: where they were, they are let go (they stayed,
    outside distributed's memory management, until the worker closed)."""
    ProducesThenRestarts.GATE = asyncio.Event()
    RELEASE.clear()
    busy = c.submit(blocked, workers=[a.address], pure=False)  # claims on a wait
    await async_poll_for(lambda: a.state.executing_count == 1, timeout=20)
    xs = [c.submit(inc, i, workers=[b.address]) for i in range(2)]
    outs = dask_services.submit(ProducesThenRestarts, xs, outputs=4, restart_on=a.address)
    produced_on_a = a.extensions["dask_services"].produced
    await async_poll_for(lambda: any(e["action"] == "restarted" for _, e in
                                     s.get_events("dask_services")), timeout=10)
    await async_poll_for(lambda: not produced_on_a, timeout=20)
    assert busy.status == "pending"  # the claims on a never ran
    RELEASE.set()
    ProducesThenRestarts.GATE.set()
    assert len(set(await c.gather(outs))) == 1  # all from the second run
    del outs, xs, busy
    await assert_nothing_left(s, [a, b])


@service_cluster(config=PAUSED_BY_HAND)
async def test_produced_outputs_go_to_disk_while_their_worker_is_paused(c, s, a, b):
    """A paused worker runs no claim, so the outputs produced there would keep it paused
    (distributed cannot spill them): they are written to disk until their claims run."""
    RELEASE.clear()
    busy = c.submit(blocked, workers=[a.address], pure=False)  # claims on a wait
    await async_poll_for(lambda: a.state.executing_count == 1, timeout=20)
    xs = [c.submit(inc, i, workers=[b.address]) for i in range(4)]  # hand-offs on b
    outs = dask_services.submit(AllReduce, xs, outputs=4)
    ext = a.extensions["dask_services"]
    await async_poll_for(lambda: ext.produced and not ext.host.instances, timeout=10)
    a.status = Status.paused
    RELEASE.set()
    await busy
    await ext._check_memory()
    directory = ext.host.env.local_directory
    assert ext.produced.in_memory() == 0
    assert len([f for f in os.listdir(directory) if f.startswith("produced-")]) == len(
        ext.produced) > 0
    a.status = Status.running
    assert await c.gather(outs) == [10] * 4
    del outs, xs, busy
    await assert_nothing_left(s, [a, b])  # the files too


class ProducesOnCue(AllReduce):
    """An all-reduce whose instances exchange and produce once ``GO`` is set."""

    GO: asyncio.Event | None = None

    async def all_inputs_done(self):
        await self.GO.wait()
        await super().all_inputs_done()


@service_cluster(config=PAUSED_BY_HAND)
async def test_an_instance_produces_on_a_paused_worker_to_disk(c, s, a, b):
    """produce_key on a paused worker writes what was produced to disk and returns: waiting
    for the worker to resume never ended when the instance's own memory was what kept it
    paused (a service holding 200 MB on a 400 MB worker stayed paused, its run with it)."""
    ProducesOnCue.GO = asyncio.Event()
    xs = [c.submit(inc, i, workers=[b.address]) for i in range(4)]
    outs = dask_services.submit(ProducesOnCue, xs, outputs=4)
    ext = a.extensions["dask_services"]
    await async_poll_for(lambda: ext.host.instances, timeout=10)
    a.status = Status.paused
    ProducesOnCue.GO.set()
    await async_poll_for(lambda: not ext.host.instances, timeout=30)  # the run is over
    # (the run may end while the last output's write, in a thread, is still under way)
    await async_poll_for(lambda: ext.produced.in_memory() == 0, timeout=10)
    assert len(ext.produced) > 0
    a.status = Status.running
    assert await c.gather(outs) == [10] * 4
    del outs, xs
    await assert_nothing_left(s, [a, b])


@gen_cluster(client=True, scheduler_kwargs={"preload": ["dask_services"]},
             nthreads=[("127.0.0.1", 1)] * 2)
async def test_preload_installs_the_plugin(c, s, a, b):
    assert "dask_services" in s.plugins
    assert all("dask_services" in w.extensions for w in (a, b))
    xs = [dask.delayed(inc)(i) for i in range(3)]
    assert await c.gather(c.compute(dask_services.service_task(AllReduce, xs, outputs=2))) \
        == [6, 6]
    s.validate_state()


@pytest.mark.slow
def test_cli_demo_runs(capsys):
    from dask_services.cli import main

    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "total count: 160,000 (expected 160,000)" in out
    assert "sorted: True" in out
    assert "same result as on the cluster: True" in out
    assert "rows after each shuffle: {'service': 3200000, 'p2p': 3200000, 'tasks': 3200000}" \
        in out


@pytest.mark.slow
def test_cli_bench_overhead_json(capsys):
    from dask_services.cli import main

    assert main(["bench", "overhead", "--repeat", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["service_task_median_s"] > 0 and result["client_submit_median_s"] > 0
    assert result["inputs_on_two_workers_median_s"] == {}  # two workers: none is idle


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_bench_overhead_with_workers_holding_nothing(capsys):
    from dask_services.cli import main

    assert main(["bench", "overhead", "--workers", "3", "--repeat", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    for case in ("service task, every worker", "service task, workers involved",
                 "shuffle, every worker", "shuffle, workers involved"):
        assert f"{case} (inputs on 2)" in out, out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("what, sizes", [("shuffle", "2MB"), ("rechunk", "2MB")])
def test_cli_bench_json_on_restarted_workers(capsys, what, sizes):
    from dask_services.cli import main

    methods = "service,p2p,noop" if what == "shuffle" else "service,p2p"
    args = ["bench", what, "--sizes", sizes, "--repeat", "1", "--methods", methods, "--json"]
    args += (["--consumer", "none,sum", "--local-size", "1MB", "--pieces", "8"]
             if what == "rechunk" else ["--consumer", "none,len", "--partitions", "8"])
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    cases = {row["case"] for row in rows}
    if what == "shuffle":
        # tiny, and 8 partitions of 200 rows and 2MB, each persisted and followed by len
        assert cases == {"tiny (10 x 1,000 rows)", "8 x 200 rows", "8 x 200 rows + len",
                         "2MB", "2MB + len"}
        for row in rows:
            if row["case"].startswith("8 x"):  # the cost per partition, the scheduler's share
                assert row["per_part_ms"] > 0 and row["update_graph_s"] > 0
                # CPU time counts in clock ticks: a task per partition (noop) may take less
                # than one in every process
                assert row["cpu_s"] > 0 if row["method"] != "noop" else row["cpu_s"] >= 0
    else:  # all-to-all, local and many pieces, each persisted and followed by .sum()
        assert len(cases) == 6 and sum(case.endswith(" +sum") for case in cases) == 3
        assert {"64 pieces of 400 B", "64 pieces of 400 B +sum"} <= cases
    for case in cases:
        by_method = {row["method"]: row for row in rows if row["case"] == case}
        # ``noop``, a task per partition and no shuffle, only in the many-partition case
        noop = {"noop"} if case == "8 x 200 rows" else set()
        assert set(by_method) == {"service", "p2p"} | noop
        assert by_method["p2p"]["ratio_to_p2p"] == 1.0
        for row in by_method.values():
            assert row["median_s"] > 0 and row["peak_worker_memory_MB"] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_bench_rechunk_of_masked_arrays(capsys):
    from dask_services.cli import main

    args = ["bench", "rechunk", "--sizes", "1MB", "--local-size", "", "--masked",
            "--consumer", "sum", "--repeat", "1", "--methods", "service,p2p", "--json",
            "--reuse-workers"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["case"], row["method"]) for row in rows} == {
        ("all-to-all 1MB masked +sum", "service"), ("all-to-all 1MB masked +sum", "p2p")}
    for row in rows:
        assert row["median_s"] > 0 and row["failed"] == 0


def test_the_time_series_case_cuts_the_grid_into_twenty_by_twenty_tiles():
    from benchmarks.rechunk import time_series

    assert time_series(10**9) == ((1000, 500, 500), (1, 500, 500), (1000, 25, 25))
    shape, old, new = time_series(10**6)  # small: tiles of one element at the least
    assert shape == (1000, 20, 20) and old == (1, 20, 20) and new == (1000, 1, 1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_bench_rechunk_of_a_time_series(capsys):
    from dask_services.cli import main

    args = ["bench", "rechunk", "--sizes", "", "--local-size", "", "--time-series", "4MB",
            "--consumer", "none,sum", "--repeat", "1", "--methods", "service,tasks",
            "--json", "--reuse-workers"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["case"], row["method"]) for row in rows} == {
        (case, method) for case in ("time series 4MB", "time series 4MB +sum")
        for method in ("service", "tasks")}
    for row in rows:
        assert row["median_s"] > 0 and row["failed"] == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_bench_shuffle_of_an_input_made_in_the_measured_graph(capsys):
    from dask_services.cli import main

    args = ["bench", "shuffle", "--sizes", "2MB", "--input", "made", "--no-tiny",
            "--consumer", "len", "--repeat", "1", "--methods", "service,p2p", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["case"], row["method"]) for row in rows} == {("2MB + len", "service"),
                                                             ("2MB + len", "p2p")}
    for row in rows:  # nothing went wrong, and the report says so
        assert row["median_s"] > 0 and row["peak_worker_memory_MB"] > 0
        assert (row["failed"], row["restarts"], row["paused_s"]) == (0, 0, 0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_bench_shuffle_measures_a_merge_of_many_partitions(capsys):
    """``--consumer merge``: the frame joined with itself on its key (both sides
    shuffled), then len per partition; its count is the pandas self-join's."""
    import pandas as pd
    from distributed import Client, LocalCluster

    from benchmarks import shuffle
    from dask_services.cli import main

    args = ["bench", "shuffle", "--partitions", "12", "--sizes", "", "--no-tiny",
            "--consumer", "merge", "--repeat", "1", "--methods", "service,p2p", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["case"], row["method"]) for row in rows} == {
        ("12 x 200 rows + merge", "service"), ("12 x 200 rows + merge", "p2p")}
    assert all(row["median_s"] > 0 and row["per_part_ms"] > 0 for row in rows)
    parts = [shuffle.make_partition(i, shuffle.SMALL_ROWS) for i in range(12)]
    whole = pd.concat(parts)
    expected = len(whole.merge(whole, on="key"))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster):
        import dask.dataframe as dd

        df = dd.from_pandas(whole, npartitions=12)
        for method in ("service", "tasks"):
            assert shuffle.operated(df, method, "merge").compute() == expected


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_bench_reports_a_run_that_fails_and_goes_on(capsys, monkeypatch):
    import pandas as pd

    from benchmarks import shuffle
    from dask_services.cli import main

    def frame(nbytes, npartitions):
        import dask.dataframe as dd

        def explode(i):  # pickled by value: the workers cannot import this module
            raise ValueError(f"partition {i} cannot be made")

        meta = pd.DataFrame({"key": pd.Series([], dtype="int64")})
        return dd.from_map(explode, range(npartitions), meta=meta, enforce_metadata=False)

    monkeypatch.setattr(shuffle, "frame", frame)
    args = ["bench", "shuffle", "--sizes", "1MB", "--input", "made", "--input-partitions",
            "4", "--no-tiny", "--consumer", "none,len", "--repeat", "1", "--methods",
            "service,p2p", "--json"]
    start = time.monotonic()
    assert main(args) == 0  # every run fails, and the command still reports them
    # a failed run's graph is cancelled, not waited out by the settling between runs
    assert time.monotonic() - start < 4 * 30
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    # persisted outputs that fail are failed runs too, not runs that ended early
    assert sorted((row["case"], row["method"]) for row in rows) == [
        ("1MB", "p2p"), ("1MB", "service"), ("1MB + len", "p2p"), ("1MB + len", "service")]
    for row in rows:
        assert row["failed"] == 1 and math.isnan(row["median_s"])
    assert "cannot be made" in captured.err


class _Events:
    """A scheduler as ``_worker_troubles`` reads it: only its events."""

    def __init__(self, events: dict):
        self.events = events

    def get_events(self, topic=None):
        return self.events if topic is None else self.events.get(topic, ())


def test_worker_troubles_counts_restarts_and_paused_seconds_within_the_run():
    from benchmarks.common import _worker_troubles

    def status(prev, new):
        return {"action": "worker-status-change", "prev-status": prev, "status": new}

    scheduler = _Events({
        "all": ((5.0, {"action": "remove-worker", "worker": "tcp://a"}),  # before the run
                (12.0, {"action": "remove-worker", "worker": "tcp://b"}),
                (13.0, {"action": "add-worker", "worker": "tcp://c"})),
        # paused from before the run until 11: counted from the run's start, 10
        "tcp://a": ((8.0, status("running", "paused")), (11.0, status("paused", "running")),
                    # and again from 14 to the end of the run, 20
                    (14.0, status("running", "paused"))),
        "tcp://c": ((15.0, status("running", "paused")), (16.5, status("paused", "running")),
                    (25.0, status("running", "paused"))),  # after the run
        "scheduler": ((12.0, {"action": "update-graph"}),),
    })
    troubles = _worker_troubles(scheduler, since=10.0, until=20.0)
    assert troubles == {"restarts": 1.0, "paused_s": 1.0 + 6.0 + 1.5}


def test_new_workers_brings_back_as_many_as_the_cluster_runs_after_workers_died():
    """A method that killed every worker (p2p through 0.5 GB workers) left the scheduler
    counting none while the nannies restarted them: the next run's fresh workers were
    asked for as zero, and the benchmark stopped with a ValueError."""
    from benchmarks import common

    calls = []

    class Cluster:
        worker_spec = {0: "spec", 1: "spec"}

        def scale(self, n):
            calls.append(("scale", n))

    class Client:
        cluster = Cluster()

        def run_on_scheduler(self, fn):
            return 0  # every worker gone for the moment

        def wait_for_workers(self, n, timeout):
            calls.append(("wait", n))

    common.new_workers(Client())
    assert calls == [("scale", 0), ("scale", 2), ("wait", 2)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_bench_queries_checks_every_result_against_tasks(capsys):
    from dask_services.cli import main

    # two of the six queries (a chain of merges, a merge with a groupby): with ``tasks``
    # each takes 10-16 s here, and the expected results are computed with it too
    assert main(["bench", "queries", "--scale", "0.01", "--repeat", "1",
                 "--methods", "service,tasks", "--queries", "q3,brand_volume",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    queries = {row["query"] for row in rows}
    assert queries == {"q3", "brand_volume", "total"}
    for row in rows:
        assert row["median_s"] > 0 and row["x_p2p"] is None
        if row["method"] == "tasks":
            assert row["x_tasks"] == 1.0
    total = {row["method"]: row["median_s"] for row in rows if row["query"] == "total"}
    by_method = {m: sum(r["median_s"] for r in rows if r["method"] == m and r["query"] != "total")
                 for m in ("service", "tasks")}
    assert total == pytest.approx(by_method)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_bench_replicated_splits_the_time_of_a_call(capsys):
    """Throughput rows give the endpoint's own time, measured inside it, next to the
    calls per second, so the framework's overhead per call can be read off."""
    from dask_services.cli import main

    assert main(["bench", "replicated", "--cases", "calls", "--calls", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["throughput"]
    assert [(r["replicas"], r["method"]) for r in rows] == [
        (1, "work"), (2, "work"), (4, "work"), (4, "work_sync")]
    for row in rows:
        assert row["endpoint_ms"] >= 5.0  # each call sleeps 5 ms inside the endpoint
        assert row["calls_per_s"] <= row["ideal_for_endpoint_calls_per_s"]
        assert row["overhead_ms_per_call"] >= 0


def test_rechunk_task_costs_refuse_a_truncated_task_stream():
    from benchmarks.rechunk import _task_costs

    record = {"key": ("rechunk-copy-6a1c0b0e7b2c4e0f9d8a7b6c5d4e3f21", 0),
              "startstops": [{"action": "compute", "start": 2.0, "stop": 2.5}]}
    with dask.config.set({"distributed.scheduler.dashboard.tasks.task-stream-length": 3}):
        costs = _task_costs([record] * 2, start=1.0, chunks=10)
        assert costs["first_task_s"] == pytest.approx(1.0)
        assert costs["per_chunk_ms:rechunk-copy"] == pytest.approx(100.0)
        # as many records as the scheduler keeps: the run's first ones may be gone
        truncated = _task_costs([record] * 3, start=1.0, chunks=10)
        assert math.isnan(truncated["first_task_s"]) and len(truncated) == 1


@service_cluster()
async def test_an_output_produced_after_its_service_task_was_forgotten_is_dropped(
        c, s, a, b):
    """A run's last outputs can be made (in a service thread, say) while the scheduler
    forgets the service task: a consumer failed and the computation was let go of. The
    ``service-produced`` message then found no machine and was ignored, and the value
    stayed on the worker for good (a failing consumer after a spilling service rechunk: 4
    outputs of 1.3 MB left by 10 runs). The scheduler now tells the worker to drop it."""
    produced = a.extensions["dask_services"].produced
    key = ("rechunk-output-forgotten", 0)
    produced.put(key, b"x" * 1_000_000)
    plugin = s.plugins["dask_services"]
    assert "service-forgotten" not in plugin.machines
    # as the worker's stream delivers it (``_worker_environment.produced``)
    s.stream_handlers["service-produced"](service_key="service-forgotten", run_id=1,
                                          key=key, worker=a.address)
    await async_poll_for(lambda: key not in produced, timeout=10)
