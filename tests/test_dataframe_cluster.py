"""The service shuffle on worker processes: larger than memory, and workers killed."""

from __future__ import annotations

import os
import signal
import sys
import time

import pandas as pd
import pytest
from distributed import Event, wait
from distributed.utils_test import poll_for
from utils import (
    WorkerWatch,
    assert_lean_run,
    kill,
    live_run,
    lost_worker,
    pid_of,
    service_events,
    validate_scheduler,
)

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
    with WorkerWatch(client) as watch:
        after = shuffled.map_partitions(summary, meta=meta).compute()
    before = df.map_partitions(summary, meta=meta).compute()
    assert after.rows.sum() == before.rows.sum()
    assert after.keysum.sum() % 2**61 == before.keysum.sum() % 2**61
    assert_lean_run(watch, limit, tmp)
    validate_scheduler(client)


def rows_of(client, collection) -> pd.DataFrame:
    """Gathered to this process: compute() would concatenate on one (small) worker."""
    return pd.concat(client.gather(client.futures_of(client.persist(collection))))


def assert_same_rows(result: pd.DataFrame, expected: pd.DataFrame) -> None:
    """The same rows, index and every column included, in whatever order."""

    def ordered(frame: pd.DataFrame) -> pd.DataFrame:
        frame = frame.reset_index()
        return frame.sort_values(list(frame.columns)).reset_index(drop=True)

    assert len(result) == len(expected) > 0
    pd.testing.assert_frame_equal(ordered(result), ordered(expected))


def assert_restarted_for(client, victim: str, *also: str) -> None:
    """The worker killed was a participant of a live run: that run was restarted, for the
    worker's loss or for one of the reasons ``also`` lists."""
    restarted = service_events(client, "restarted")
    assert any(lost_worker(e["detail"], victim) or e["detail"] in also
               for e in restarted), (victim, service_events(client))


def test_worker_killed_during_shuffle(small_cluster):
    cluster, client, _ = small_cluster
    df = frame(50_000_000, npartitions=40)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(client), timeout=60)
    victim = live_run(client).participants[0]
    kill(client, victim)
    wait(shuffled)
    # gather to this process: compute() would concatenate on one (small) worker
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    assert_same_rows(result, rows_of(client, df))
    assert_restarted_for(client, victim)
    validate_scheduler(client)


def test_worker_killed_after_some_outputs_were_produced(small_cluster):
    cluster, client, _ = small_cluster
    df = frame(40_000_000, npartitions=40)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service", npartitions=40))
    poll_for(lambda: live_run(client, lambda r: len(r.produced) >= 5), timeout=120)
    run = live_run(client, lambda r: len(r.produced) >= 5)
    victim = next(w for w in run.produced.values())
    kill(client, victim)
    wait(shuffled)
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    assert_same_rows(result, rows_of(client, df))
    # The scheduler takes the worker out of its running set, then finds the outputs it
    # held lost (they are wanted again: the run restarts for them, on the workers left),
    # and only then tells plugins the worker left, when the new run no longer includes it.
    # Where the run had produced an output on the victim that had not landed yet, the
    # loss of that output is what restarts it.  Where the run had produced its last
    # output before the kill landed, it finished, and a run of its own recovers the
    # outputs the victim held.
    runs = [(e["action"], e["run_id"]) for e in service_events(client)
            if e["action"] in ("finished", "started", "restarted")]
    if runs[:3] == [("started", 1), ("finished", 1), ("started", 2)]:
        assert ("finished", 2) in runs, runs
    else:
        assert_restarted_for(client, victim, "more outputs were asked for",
                             "a produced output was lost")
    validate_scheduler(client)


def test_worker_killed_mid_merge(small_cluster):
    cluster, client, _ = small_cluster
    left = frame(30_000_000, npartitions=30)
    right = frame(10_000_000, npartitions=10).rename(columns={"value": "other"})
    right = right[["key", "other"]]
    joined = client.persist(left.merge(right, on="key", how="left", shuffle_method="service"))
    poll_for(lambda: live_run(client, lambda r: len(r.handed_off) >= 5), timeout=120)
    victim = live_run(client, lambda r: len(r.handed_off) >= 5).participants[-1]
    kill(client, victim)
    wait(joined)
    result = pd.concat(client.gather(client.futures_of(joined)))
    expected = rows_of(client, left).merge(rows_of(client, right), on="key", how="left")
    pd.testing.assert_frame_equal(
        result.sort_values(["key", "value"]).reset_index(drop=True),
        expected.sort_values(["key", "value"]).reset_index(drop=True),
    )
    assert_restarted_for(client, victim)
    validate_scheduler(client)


def _first_held_back(part, event: str, others_take: float = 0.0, partition_info=None):
    """Partition 0 waits for the distributed ``Event`` named ``event`` (so the run cannot
    have every input before the test sets it); the others take ``others_take`` seconds."""
    if partition_info is not None and partition_info["number"] == 0:
        Event(event).wait(timeout=120)
    else:
        time.sleep(others_take)
    return part


JOINED = "dask-services-test-worker-joined"


def test_worker_joining_mid_shuffle_does_no_harm(small_cluster):
    cluster, client, _ = small_cluster
    source = frame(100_000_000, npartitions=60)
    df = source.map_partitions(_first_held_back, JOINED, meta=source._meta)
    joined = Event(JOINED, client=client)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(client, lambda r: len(r.handed_off) >= 3), timeout=120)
    run_id = live_run(client).run_id
    cluster.scale(3)
    client.wait_for_workers(3)
    joined_while_running = live_run(client) is not None
    joined.set()
    wait(shuffled)
    assert joined_while_running
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    assert_same_rows(result, rows_of(client, df))
    events = service_events(client)
    assert [e["run_id"] for e in events if e["action"] == "started"] == [run_id], events
    validate_scheduler(client)


KILLED = "dask-services-test-joined-worker-killed"


def test_a_worker_joining_mid_shuffle_then_killed_counts_no_row_twice(small_cluster):
    """The joined worker takes no part in the run: its hand-offs push their inputs to
    participants.  Killed, it loses their results, and they run again elsewhere, where
    another instance would take the same rows a second time: the run restarts instead."""
    cluster, client, _ = small_cluster
    source = frame(60_000_000, npartitions=60)
    # inputs are still being made when the third worker joins
    df = source.map_partitions(_first_held_back, KILLED, 0.3, meta=source._meta)
    killed = Event(KILLED, client=client)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(client, lambda r: len(r.handed_off) >= 3), timeout=120)
    participants = set(live_run(client).participants)
    cluster.scale(3)
    client.wait_for_workers(3)
    (joined,) = set(client.scheduler_info()["workers"]) - participants

    def hand_offs_held_by(address, dask_scheduler=None) -> int:
        return sum(1 for ts in dask_scheduler.workers[address].has_what
                   if "handoff" in str(ts.key))

    poll_for(lambda: client.run_on_scheduler(hand_offs_held_by, joined) >= 3, timeout=120)
    assert live_run(client) is not None  # still waiting for partition 0
    kill(client, joined)
    poll_for(lambda: joined not in client.scheduler_info()["workers"], timeout=60)
    killed.set()
    wait(shuffled)
    result = pd.concat(client.gather(client.futures_of(shuffled)))
    assert_same_rows(result, rows_of(client, df))
    validate_scheduler(client)


def test_unresponsive_peer_delays_but_does_not_fail_the_shuffle(small_cluster):
    cluster, client, _ = small_cluster
    df = frame(40_000_000, npartitions=40)
    shuffled = client.persist(df.shuffle("key", shuffle_method="service"))
    poll_for(lambda: live_run(client, lambda r: len(r.handed_off) >= 3), timeout=120)
    peer = live_run(client).participants[-1]
    pid = pid_of(client, peer)
    futures = client.futures_of(shuffled)
    os.kill(pid, signal.SIGSTOP)  # frozen: neither answers nor sends
    try:
        time.sleep(3)  # the length of the outage, well within the comm timeouts
        # the frozen peer holds back the shuffle: its share of outputs cannot be produced
        assert not all(f.done() for f in futures)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait(shuffled)
    result = pd.concat(client.gather(futures))
    assert_same_rows(result, rows_of(client, df))
    actions = {e["action"] for e in service_events(client)}
    assert "restarted" not in actions and "failed" not in actions, actions
    validate_scheduler(client)
