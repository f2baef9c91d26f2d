"""A service shuffle's outputs run their lone blockwise consumer in their claims
(``dataframe/_claim_fusion.py``): one task per output partition, pandas' results, and
nothing fused that must stay a task of its own."""

from __future__ import annotations

from collections import Counter

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask._expr import FinalizeCompute
from dask.base import collections_to_expr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services  # noqa: F401
from dask_services.graph import ConsumingClaimSpec, OutputClaimSpec, ServiceTaskSpec

pytestmark = pytest.mark.timeout(120)


def make(i: int, rows: int = 40) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame({"key": rng.integers(0, 30, rows), "value": rng.random(rows)})


def source(npartitions: int = 5) -> dd.DataFrame:
    return dd.from_map(make, range(npartitions), meta=make(0).iloc[:0],
                       enforce_metadata=False)


def expected_frame(npartitions: int = 5) -> pd.DataFrame:
    return pd.concat([make(i) for i in range(npartitions)])


def graph_of(*collections) -> dict:
    """The graph ``dask.compute(*collections)`` sends to a scheduler."""
    return FinalizeCompute(collections_to_expr(list(collections))).optimize().__dask_graph__()


def claims(graph: dict) -> Counter:
    return Counter(type(v).__name__ for v in graph.values() if isinstance(v, OutputClaimSpec))


def service_tasks(graph: dict) -> list[ServiceTaskSpec]:
    return [v for v in graph.values() if isinstance(v, ServiceTaskSpec)]


def group_sums(df: pd.DataFrame) -> pd.Series:
    return df.groupby("key").value.sum()


def test_a_step_per_partition_runs_in_the_claims():
    shuffled = source().shuffle("key", shuffle_method="service", npartitions=4)
    total = shuffled.map_partitions(len).sum()
    graph = graph_of(total)
    assert claims(graph) == {"ConsumingClaimSpec": 4}
    (service,) = service_tasks(graph)
    # the outputs are the consumers' keys, and the service task is not the unfused one's
    assert all(isinstance(graph[k], ConsumingClaimSpec)
               for k in service.definition.output_keys)
    with dask.config.set({"dask_services.fuse-consumers": False}):
        unfused = graph_of(total)
    assert claims(unfused) == {"OutputClaimSpec": 4}
    assert service.key not in unfused
    assert dask.compute(total, scheduler="sync") == (len(expected_frame()),)


@pytest.mark.parametrize("case", ["two-consumers", "merge", "asked-for", "repartition"])
def test_what_is_not_fused(case):
    src = source()
    shuffled = src.shuffle("key", shuffle_method="service")
    collections = {
        # the shuffle's outputs feed two steps
        "two-consumers": [shuffled.map_partitions(len).sum(), shuffled.value.sum()],
        # each join partition needs an output of each side
        "merge": [dd.merge(src, src.rename(columns={"value": "v2"}), on="key",
                           shuffle_method="service")],
        # the outputs themselves are the result
        "asked-for": [shuffled],
        # a step over several output partitions at once
        "repartition": [shuffled.repartition(npartitions=2)],
    }[case]
    graph = graph_of(*collections)
    assert not claims(graph)["ConsumingClaimSpec"], claims(graph)
    results = dask.compute(*collections, scheduler="sync")
    pdf = expected_frame()
    expected = {
        "two-consumers": (len(pdf), pytest.approx(pdf.value.sum())),
        "merge": (len(pdf.merge(pdf.rename(columns={"value": "v2"}), on="key")),),
        "asked-for": (len(pdf),),
        "repartition": (len(pdf),),
    }[case]
    if case in ("merge", "asked-for", "repartition"):
        results = tuple(map(len, results))
    assert results == expected


def test_a_chain_of_steps_is_one_consumer():
    shuffled = source().shuffle("key", shuffle_method="service")
    result = shuffled.map_partitions(group_sums, meta=("value", "f8")) * 2 + 1
    graph = graph_of(result)
    assert claims(graph) == {"ConsumingClaimSpec": 5}
    (got,) = dask.compute(result, scheduler="sync")
    pd.testing.assert_series_equal(got.sort_index(),
                                   group_sums(expected_frame()).sort_index() * 2 + 1)


def _fails_on_a_third_partition(df: pd.DataFrame, partition_info=None) -> pd.DataFrame:
    if partition_info["number"] == 2:
        raise ValueError("partition 2 refused")
    return df


def test_a_consumers_error_is_the_computations_error():
    shuffled = source().shuffle("key", shuffle_method="service")
    bad = shuffled.map_partitions(_fails_on_a_third_partition, meta=shuffled._meta)
    bad = bad.map_partitions(len).sum()
    assert claims(graph_of(bad)) == {"ConsumingClaimSpec": 5}
    with pytest.raises(ValueError, match="partition 2 refused"):
        dask.compute(bad, scheduler="sync")


@st.composite
def cases(draw):
    nin = draw(st.integers(1, 6))
    nout = draw(st.integers(1, 7))
    rows = draw(st.integers(0, 30))
    consumer = draw(st.sampled_from(["len", "group-sums", "head", "sort"]))
    return nin, nout, rows, consumer


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_property_fused_consumers_give_pandas_results(case):
    nin, nout, rows, consumer = case
    pdf = pd.concat([make(i, rows) for i in range(nin)]).reset_index(drop=True)
    df = dd.from_pandas(pdf, npartitions=nin, sort=False)
    shuffled = df.shuffle("key", shuffle_method="service", npartitions=nout)
    reference = df.shuffle("key", shuffle_method="tasks", npartitions=nout)
    step = {
        "len": lambda d: d.map_partitions(len).sum(),
        "group-sums": lambda d: d.map_partitions(group_sums, meta=("value", "f8")),
        "head": lambda d: d.map_partitions(lambda p: p.head(2)),
        "sort": lambda d: d.map_partitions(lambda p: p.sort_values(["key", "value"])),
    }[consumer]
    (got,), (want,) = (dask.compute(step(d), scheduler="sync")
                       for d in (shuffled, reference))
    if consumer == "len":
        assert got == want == len(pdf)
    elif consumer == "group-sums":
        pd.testing.assert_series_equal(got.sort_index(), want.sort_index())
    else:
        pd.testing.assert_frame_equal(got, want)


@service_cluster(timeout=90)
async def test_on_a_cluster_the_claims_run_the_steps(c, s, a, b):
    shuffled = source(8).shuffle("key", shuffle_method="service")
    sums = shuffled.map_partitions(group_sums, meta=("value", "f8"))
    got = await c.compute(sums)
    pd.testing.assert_series_equal(got.sort_index(),
                                   group_sums(expected_frame(8)).sort_index())
    kinds = Counter(type(ts.run_spec).__name__ for ts in s.tasks.values())
    assert kinds["ConsumingClaimSpec"] == 8 and not kinds["OutputClaimSpec"], kinds
    s.validate_state()
    bad = c.compute(shuffled.map_partitions(_fails_on_a_third_partition, meta=shuffled._meta)
                    .map_partitions(len).sum())
    await assert_errs(bad, ValueError, "partition 2 refused")
    del bad
    # the same shuffle consumed two ways at once: two service tasks, pandas' results
    lengths = c.compute(shuffled.map_partitions(len).sum())
    frame = c.compute(shuffled)
    assert await lengths == len(expected_frame(8))
    assert len(await frame) == len(expected_frame(8))
    del lengths, frame
    await assert_nothing_left(s, [a, b])
