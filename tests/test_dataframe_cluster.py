"""The service shuffle on worker processes: larger than memory, and workers killed."""

from __future__ import annotations

import os
import signal
import sys
import time

import pandas as pd
import pytest
from distributed import Event, wait
from distributed.diagnostics import MemorySampler
from distributed.utils_test import poll_for
from utils import assert_lean_run, kill, live_run, pid_of

import dask_services  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.shuffle import frame  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_three_times_memory_completes_under_the_limit(small_cluster):
    cluster, client, tmp = small_cluster
    limit = 600e6
    df = frame(int(3 * 2 * limit), npartitions=192)
    shuffled = df.shuffle("key", shuffle_method="service")

    def summary(d):
        return pd.DataFrame({"rows": [len(d)], "keysum": [int(d.key.sum() % 2**61)]})

    meta = summary(df._meta)
    sampler = MemorySampler()
    with sampler.sample("shuffle", client=client, measure="process", interval=0.2):
        after = shuffled.map_partitions(summary, meta=meta).compute()
    before = df.map_partitions(summary, meta=meta).compute()
    assert after.rows.sum() == before.rows.sum()
    assert after.keysum.sum() % 2**61 == before.keysum.sum() % 2**61
    assert_lean_run(client, sampler.to_pandas()["shuffle"], limit, tmp)
    cluster.scheduler.validate_state()


def test_worker_killed_during_shuffle(small_cluster):
    cluster, client, _ = small_cluster
    df = frame(50_000_000, npartitions=40)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(cluster), timeout=60)
    kill(client, live_run(cluster).participants[0])
    wait(shuffled)
    # gather to this process: compute() would concatenate on one (small) worker
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    expected = pd.concat(client.gather(client.futures_of(client.persist(df))))
    assert len(result) == len(expected)
    assert sorted(result.key.tolist()) == sorted(expected.key.tolist())
    cluster.scheduler.validate_state()


def rows_of(client, collection) -> pd.DataFrame:
    """Gathered to this process: compute() would concatenate on one (small) worker."""
    return pd.concat(client.gather(client.futures_of(client.persist(collection))))


def test_worker_killed_after_some_outputs_were_produced(small_cluster):
    cluster, client, _ = small_cluster
    df = frame(40_000_000, npartitions=40)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service", npartitions=40))
    poll_for(lambda: live_run(cluster, lambda r: len(r.produced) >= 5), timeout=120)
    run = live_run(cluster)
    victim = next(w for w in run.produced.values())
    kill(client, victim)
    wait(shuffled)
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    expected = rows_of(client, df)
    assert sorted(result.key.tolist()) == sorted(expected.key.tolist())
    cluster.scheduler.validate_state()


def test_worker_killed_mid_merge(small_cluster):
    cluster, client, _ = small_cluster
    left = frame(30_000_000, npartitions=30)
    right = frame(10_000_000, npartitions=10).rename(columns={"value": "other"})
    right = right[["key", "other"]]
    joined = client.persist(left.merge(right, on="key", how="left", shuffle_method="service"))
    poll_for(lambda: live_run(cluster, lambda r: len(r.handed_off) >= 5), timeout=120)
    victim = live_run(cluster).participants[-1]
    kill(client, victim)
    wait(joined)
    result = pd.concat(client.gather(client.futures_of(joined)))
    expected = rows_of(client, left).merge(rows_of(client, right), on="key", how="left")
    pd.testing.assert_frame_equal(
        result.sort_values(["key", "value"]).reset_index(drop=True),
        expected.sort_values(["key", "value"]).reset_index(drop=True),
    )
    cluster.scheduler.validate_state()


def _held_back_until_joined(part, partition_info=None):
    if partition_info is not None and partition_info["number"] == 0:
        Event(JOINED).wait(timeout=60)  # the run cannot finish before the worker joined
    return part


JOINED = "dask-services-test-worker-joined"


def test_worker_joining_mid_shuffle_does_no_harm(small_cluster):
    cluster, client, _ = small_cluster
    source = frame(100_000_000, npartitions=60)
    df = source.map_partitions(_held_back_until_joined, meta=source._meta)
    joined = Event(JOINED, client=client)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(cluster, lambda r: len(r.handed_off) >= 3), timeout=120)
    run_id = live_run(cluster).run_id
    cluster.scale(3)
    client.wait_for_workers(3)
    joined_while_running = live_run(cluster) is not None
    joined.set()
    wait(shuffled)
    assert joined_while_running
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    expected = rows_of(client, df)
    assert sorted(result.key.tolist()) == sorted(expected.key.tolist())
    events = [e for _, e in client.get_events("dask_services")]
    assert [e["run_id"] for e in events if e["action"] == "started"] == [run_id], events
    cluster.scheduler.validate_state()


def test_unresponsive_peer_delays_but_does_not_fail_the_shuffle(small_cluster):
    cluster, client, _ = small_cluster
    df = frame(40_000_000, npartitions=40)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(cluster, lambda r: len(r.handed_off) >= 3), timeout=120)
    peer = live_run(cluster).participants[-1]
    pid = pid_of(client, peer)
    os.kill(pid, signal.SIGSTOP)  # frozen: neither answers nor sends
    try:
        time.sleep(3)  # the length of the outage, well within the comm timeouts
    finally:
        os.kill(pid, signal.SIGCONT)
    wait(shuffled)
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    expected = rows_of(client, df)
    assert sorted(result.key.tolist()) == sorted(expected.key.tolist())
    actions = {e["action"] for _, e in client.get_events("dask_services")}
    assert "restarted" not in actions and "failed" not in actions, actions
    cluster.scheduler.validate_state()
