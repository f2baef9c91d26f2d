"""Workers without a memory limit size their buffers from the memory ``"auto"`` would
have given them, rather than holding every received byte in memory."""

from __future__ import annotations

from unittest import mock

import dask
import dask.array as da
import dask.dataframe as dd
import dask.system
import numpy as np
import pandas as pd
import pytest
from distributed import system
from utils import final_rows, no_heartbeats, service_cluster

from dask_services._memory_share import memory_to_plan_on
from dask_services._sending import window_size

pytestmark = pytest.mark.timeout(90)


def test_a_limit_is_taken_as_it_is():
    assert memory_to_plan_on(600_000_000, nthreads=1) == 600_000_000


@pytest.mark.parametrize("limit", [None, 0])
def test_without_a_limit_the_share_auto_would_give(limit):
    with mock.patch.object(system, "MEMORY_LIMIT", 8_000_000_000), \
            mock.patch.object(dask.system, "CPU_COUNT", 4):
        assert memory_to_plan_on(limit, nthreads=1) == 2_000_000_000
        assert memory_to_plan_on(limit, nthreads=4) == 8_000_000_000
        assert memory_to_plan_on(limit, nthreads=16) == 8_000_000_000  # never more
        # the hand-off buffer and the bytes in flight: at most a 32nd of it
        assert window_size(2**30, memory_to_plan_on(limit, nthreads=1)) == 62_500_000


@pytest.fixture
def small_host():
    """A host of 64 kB, for the workers' buffers (the workers are made after this)."""
    with mock.patch.object(system, "MEMORY_LIMIT", 64_000):
        yield


@pytest.mark.parametrize("collection", ["dataframe", "array"])
@service_cluster(worker_kwargs={"memory_limit": 0})
async def test_a_worker_without_a_memory_limit_spills_past_its_share(c, s, a, b,
                                                                      collection,
                                                                      small_host):
    """On workers without a limit, a run's buffer held every byte it received in memory
    (a budget of 2**62): a shuffle larger than the host's memory was killed where p2p
    spills.  Here the host is made small: the run spills."""
    assert a.memory_manager.memory_limit is None
    no_heartbeats(a, b)
    if collection == "dataframe":
        pdf = pd.DataFrame({"k": range(40_000), "x": range(40_000)})
        built = dd.from_pandas(pdf, npartitions=8).shuffle("k", shuffle_method="service")
        result = await c.compute(built)
        pd.testing.assert_frame_equal(result.sort_values("k"), pdf)
    else:
        x = da.arange(400_000, dtype="f8", chunks=40_000).reshape(200, 2000)
        x = x.rechunk((20, 2000))
        with dask.config.set({"dask_services.rechunk.copy-max-inputs": 0,
                              "dask_services.rechunk.merge-region-max": 0}):
            built = x.rechunk((200, 200), method="service")
        np.testing.assert_array_equal(await c.compute(built),
                                      np.arange(400_000.0).reshape(200, 2000))
    (row,) = await final_rows(c, a, b)
    assert row["state"] == "finished"
    assert row["bytes_spilled"] > 0, row
