"""The service rechunk on worker processes: larger than memory, and a worker killed."""

from __future__ import annotations

import os
import signal

import dask.array as da
import numpy as np
import pytest
from distributed import wait
from distributed.diagnostics import MemorySampler
from distributed.utils_test import poll_for
from utils import spill_files

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
    sampler = MemorySampler()
    with sampler.sample("rechunk", client=client, measure="process", interval=0.2):
        ours = block_sums(y)
    # the same column blocks, summed from a reduction of the original chunks
    column_sums = x.sum(axis=0).compute()
    bounds = np.cumsum((0, *y.chunks[1]))
    expected = [[column_sums[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]]
    np.testing.assert_allclose(ours, expected)
    per_worker_peak = sampler.to_pandas()["rechunk"].max() / 2
    assert per_worker_peak < limit, per_worker_peak
    restarts = [e for _, e in client.get_events("dask_services") if e["action"] == "restarted"]
    assert not restarts, restarts  # no worker was killed for memory on the way
    poll_for(lambda: not spill_files(tmp), timeout=30)
    cluster.scheduler.validate_state()


def test_worker_killed_mid_rechunk(small_cluster):
    cluster, client, _ = small_cluster
    x = da.random.RandomState(1).random_sample((4000, 2000), chunks=(100, 2000))
    y = client.persist(x.rechunk((4000, 100), method="service"))
    plugin = cluster.scheduler.extensions["dask_services"]

    def handing_off():
        return any(m.live_run is not None and len(m.live_run.handed_off) >= 5
                   for m in plugin.machines.values())

    poll_for(handing_off, timeout=60)
    run = next(m.live_run for m in plugin.machines.values() if m.live_run)
    victim = run.participants[-1]
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)
    wait(y)
    np.testing.assert_array_equal(y.compute(), x.compute())
    cluster.scheduler.validate_state()
