"""Worker processes killed while services run (LocalCluster with nannies)."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import poll_for
from services import PidReporter, SlowSum
from utils import kill

import dask_services
from dask_services._run_state import Phase

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def inc(x):
    return x + 1


@pytest.fixture
def cluster():
    validation = {"distributed.scheduler.validate": True, "distributed.worker.validate": True}
    with dask.config.set(validation), LocalCluster(
        n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        assert cluster.scheduler.validate
        dask_services.install(client)
        yield cluster, client


def plugin_of(cluster):
    return cluster.scheduler.extensions["dask_services"]


def live_run_in(cluster, phase):
    for m in plugin_of(cluster).machines.values():
        run = m.live_run
        if run is not None and run.phase is phase:
            return run
    return None


def lost_worker(reason: str) -> bool:
    """Whether ``reason`` says that a worker was lost.  Which of two reasons comes first
    depends on what the scheduler handles first: the worker leaving, or the service task
    losing an input it was waiting on."""
    return "left the cluster" in reason or "lost with its worker" in reason


def events(client, action):
    return [e for _, e in client.get_events("dask_services") if e["action"] == action]


def test_worker_killed_mid_run_restarts_with_correct_result(cluster):
    cluster, client = cluster
    xs = [dask.delayed(inc)(i) for i in range(12)]
    futures = client.compute(dask_services.service_task(SlowSum, xs, outputs=4, delay=3.0))
    poll_for(lambda: live_run_in(cluster, Phase.INPUTS_DONE), timeout=60)
    run = live_run_in(cluster, Phase.INPUTS_DONE)
    kill(client, run.participants[-1])
    assert client.gather(futures) == [sum(range(1, 13))] * 4
    restarted = events(client, "restarted")
    assert restarted and lost_worker(restarted[0]["detail"]), restarted
    cluster.scheduler.validate_state()
    del futures
    poll_for(lambda: not plugin_of(cluster).machines, timeout=30)


def test_output_lost_after_the_run_is_produced_again(cluster):
    cluster, client = cluster
    outs = dask_services.service_task(PidReporter, [], outputs=6)
    futures = client.compute(outs)
    pids = client.gather(futures)
    holder = next(iter(cluster.scheduler.tasks[futures[0].key].who_has)).address
    started_before = len(events(client, "started"))
    kill(client, holder)
    # the lost outputs come back, produced by a new run, not by a placeholder
    poll_for(lambda: all(f.status == "finished" for f in futures)
             and all(cluster.scheduler.tasks[f.key].state == "memory" for f in futures),
             timeout=60)
    again = client.gather(futures)
    lost = [i for i, p in enumerate(pids) if p == pids[0]]
    assert all(again[i] != pids[0] for i in lost)
    assert [again[i] for i in range(6) if i not in lost] == [
        pids[i] for i in range(6) if i not in lost
    ]
    assert len(events(client, "started")) > started_before
    cluster.scheduler.validate_state()


def test_killed_more_often_than_allowed_is_a_clear_error(cluster):
    cluster, client = cluster
    with dask.config.set({"dask_services.restarts": 1}):
        xs = [dask.delayed(inc)(i) for i in range(6)]
        futures = client.compute(dask_services.service_task(SlowSum, xs, outputs=2, delay=5.0))
        killed = set()
        for _ in range(2):
            poll_for(lambda: (r := live_run_in(cluster, Phase.INPUTS_DONE)) is not None
                     and r.run_id not in killed, timeout=90)
            run = live_run_in(cluster, Phase.INPUTS_DONE)
            killed.add(run.run_id)
            kill(client, run.participants[-1])
        exc = futures[0].exception(timeout=90)
    assert isinstance(exc, dask_services.TooManyRestarts), repr(exc)
    assert lost_worker(str(exc)) and "dask_services.restarts=1" in str(exc)
    cluster.scheduler.validate_state()
