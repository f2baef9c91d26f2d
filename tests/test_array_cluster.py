"""The service rechunk on worker processes: larger than memory, and a worker killed."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
from distributed import wait
from distributed.utils_test import poll_for
from utils import (
    WorkerWatch,
    assert_lean_run,
    kill,
    live_run,
    lost_worker,
    service_events,
    validate_scheduler,
)

import dask_services  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def block_sums(y: da.Array) -> np.ndarray:
    """One number per block, so that checking a large result moves little data."""
    return y.map_blocks(lambda b: np.array([[b.sum()]]), chunks=(1, 1)).compute()


def test_three_times_memory_completes_under_the_limit(small_cluster):
    cluster, client, tmp = small_cluster
    limit = 600e6
    n = int(np.sqrt(3 * 2 * limit / 8))  # float64: about 3x the memory of both workers
    x = da.random.RandomState(0).random_sample((n, n), chunks=(n // 192, n))
    y = x.rechunk((n, n // 192), method="service")
    with WorkerWatch(client) as watch:
        ours = block_sums(y)
    # the same column blocks, summed from a reduction of the original chunks
    column_sums = x.sum(axis=0).compute()
    bounds = np.cumsum((0, *y.chunks[1]))
    expected = [[column_sums[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]]
    np.testing.assert_allclose(ours, expected)
    assert_lean_run(watch, limit, tmp)
    validate_scheduler(client)


def test_worker_killed_mid_rechunk(small_cluster):
    cluster, client, _ = small_cluster
    x = da.random.RandomState(1).random_sample((4000, 2000), chunks=(100, 2000))
    y = client.persist(x.rechunk((4000, 100), method="service"))
    poll_for(lambda: live_run(client, lambda r: len(r.handed_off) >= 5), timeout=60)
    victim = live_run(client, lambda r: len(r.handed_off) >= 5).participants[-1]
    kill(client, victim)
    wait(y)
    np.testing.assert_array_equal(y.compute(), x.compute())
    restarted = service_events(client, "restarted")
    assert any(lost_worker(e["detail"], victim) for e in restarted), service_events(client)
    validate_scheduler(client)
