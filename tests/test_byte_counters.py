"""Byte counters that read right: every service's peer calls are counted by the framework,
and summed over a run's instances, bytes sent equal bytes received."""

from __future__ import annotations

import asyncio

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed.utils_test import async_poll_for
from utils import final_rows, no_heartbeats, service_cluster

import dask_services
from dask_services.config import packaged_default
from dask_services.demo_services import Histogram
from dask_services.examples import AllReduce, SampleSort

pytestmark = pytest.mark.timeout(90)


@service_cluster(config={"dask_services.shuffle.buffer-fraction": 1e-12})
async def test_a_shuffle_sends_as_many_bytes_as_it_receives(c, s, a, b):
    no_heartbeats(a, b)
    pdf = pd.DataFrame({"k": range(4000), "x": range(4000)})
    df = dd.from_pandas(pdf, npartitions=8).shuffle("k", shuffle_method="service")
    assert len(await c.compute(df)) == 4000
    (row,) = await final_rows(c, a, b)
    assert row["state"] == "finished"
    # data exchanged with peers, counted alike on both sides (pieces an instance keeps
    # for itself are neither)
    assert row["bytes_sent"] == row["bytes_received"] > 0, row
    assert row["bytes_spilled"] > 0


@service_cluster()
async def test_a_rechunk_sends_as_many_bytes_as_it_receives(c, s, a, b):
    no_heartbeats(a, b)
    x = da.arange(40_000, dtype="f8", chunks=4000).reshape(200, 200).rechunk((20, 200))
    y = x.rechunk((200, 20), method="service")
    np.testing.assert_array_equal(await c.compute(y), np.arange(40_000.0).reshape(200, 200))
    (row,) = await final_rows(c, a, b)
    assert row["bytes_sent"] == row["bytes_received"] > 0, row


@pytest.mark.parametrize("collection", ["dataframe", "array"])
@service_cluster()
async def test_a_buffer_fraction_set_where_the_graph_is_built_travels_with_it(c, s, a, b,
                                                                              collection):
    """``dask.config.set`` around building the graph (in a notebook: around
    ``compute()``) reaches the workers' exchange: the run spills.  (Here the workers share
    the process: the setting is gone again before the graph runs, so only the graph can
    carry it.)"""
    no_heartbeats(a, b)
    section = "shuffle" if collection == "dataframe" else "rechunk"
    with dask.config.set({f"dask_services.{section}.buffer-fraction": 1e-12,
                          "dask_services.rechunk.copy-max-inputs": 0,
                          "dask_services.rechunk.merge-region-max": 0}):
        if collection == "dataframe":
            pdf = pd.DataFrame({"k": range(4000), "x": range(4000)})
            built = dd.from_pandas(pdf, npartitions=8).shuffle("k", shuffle_method="service")
            built = built.optimize()
        else:
            x = da.arange(40_000, dtype="f8", chunks=4000).reshape(200, 200).rechunk((20, 200))
            built = x.rechunk((200, 20), method="service")
    assert dask.config.get(f"dask_services.{section}.buffer-fraction") \
        == packaged_default(f"{section}.buffer-fraction")
    result = await c.compute(built)
    if collection == "dataframe":
        assert sorted(result["k"]) == list(range(4000))
    else:
        np.testing.assert_array_equal(result, np.arange(40_000.0).reshape(200, 200))
    (row,) = await final_rows(c, a, b)
    assert row["bytes_spilled"] > 0, row


@pytest.mark.parametrize("cls, params", [(Histogram, {"bins": 4, "high": 8}),
                                         (AllReduce, {}), (SampleSort, {})])
@service_cluster()
async def test_services_without_counters_report_the_bytes_of_their_peer_calls(
        c, s, a, b, cls, params):
    no_heartbeats(a, b)
    xs = [dask.delayed(np.arange)(i, i + 8) for i in range(4)]
    await c.gather(c.compute(dask_services.service_task(cls, xs, outputs=2, **params)))
    (row,) = await final_rows(c, a, b)
    assert row["service"] == cls.__name__
    assert row["bytes_sent"] == row["bytes_received"] > 0, row


class OwnCount(AllReduce):
    """A service that counts its own bytes sent: its figure wins over the framework's."""

    def counters(self):
        return {"bytes_sent": 1000}


@service_cluster()
async def test_a_service_counters_override_the_framework_counts(c, s, a, b):
    no_heartbeats(a, b)
    xs = [dask.delayed(np.arange)(i, i + 8) for i in range(4)]
    await c.gather(c.compute(dask_services.service_task(OwnCount, xs, outputs=2)))
    (row,) = await final_rows(c, a, b)
    assert row["bytes_sent"] == 2000  # its own, per instance
    assert row["bytes_received"] > 0  # the framework's


@service_cluster()
async def test_live_gauges_per_worker_come_with_the_heartbeat(c, s, a, b):
    """What the dashboard plots of a live run: per worker, inputs handed off, outputs
    produced, bytes held, in flight and on disk."""
    from services import Recorder

    no_heartbeats(a, b)
    xs = [dask.delayed(np.arange)(i, i + 8) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, gate="gauges"))
    diagnostics = next(ext for ext in s.extensions.values() if hasattr(ext, "history"))
    record = None

    def handed_off() -> bool:
        nonlocal record
        live = [r for r in diagnostics.history.records.values() if r.ended is None]
        record = live[0] if live else None
        return record is not None and record.row(0)["state"] == "inputs-done"
    await async_poll_for(handed_off, timeout=10)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    gauges = record.gauges
    assert {g["worker"] for g in gauges.values()} == {a.address, b.address}
    assert sum(g["inputs"] for g in gauges.values()) == 4
    assert all({"memory_bytes", "in_flight_bytes", "disk_bytes", "outputs"} <= g.keys()
               for g in gauges.values())
    Recorder.gates["gauges"].set()
    await c.gather(outs)
    await async_poll_for(lambda: record.ended is not None, timeout=10)
    assert record.gauges == {}  # an ended run has no gauges
    del outs
