"""The rechunk's copies fused with their consumers keep the consumers' keys (``array/_fusion``):
no alias task per output chunk, the same results as numpy."""

from __future__ import annotations

from collections import Counter

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Alias
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_nothing_left, service_cluster

import dask_services  # noqa: F401
from dask_services.array import _fusion

pytestmark = pytest.mark.timeout(120)


def optimized(y) -> dict:
    return dict(y.__dask_optimize__(dict(y.__dask_graph__()), y.__dask_keys__()))


def kinds(graph: dict) -> Counter:
    return Counter(type(v).__name__ for v in graph.values())


def without_the_hook(y) -> dict:
    """The graph dask's own fusion makes of ``y``."""
    from dask._task_spec import fuse_linear_task_spec

    opt = _fusion._optimization
    current = opt.fuse_linear_task_spec
    opt.fuse_linear_task_spec = fuse_linear_task_spec
    try:
        return optimized(y)
    finally:
        opt.fuse_linear_task_spec = current


@pytest.mark.parametrize("slice_saving", [0, "256 KiB"])
def test_copies_fused_with_a_sum_leave_no_alias(slice_saving):
    """100 -> 150 rows then ``.sum()``: every copy is fused with its chunk's sum under the
    sum's key; dask's fusion alone leaves an alias per output chunk."""
    a = np.arange(3000.0).reshape(1500, 2)
    with dask.config.set({"dask_services.rechunk.slice-saving": slice_saving}):
        y = da.from_array(a, chunks=(100, 2)).rechunk((150, 2), method="service").sum()
    ours, dasks = optimized(y), without_the_hook(y)
    assert kinds(dasks)["Alias"] == 10  # one per output chunk
    assert kinds(ours)["Alias"] == 0
    assert len(ours) == len(dasks) - 10
    # the fused tasks carry the sum's keys, which the partial sums name
    sum_keys = {k for k in dasks if isinstance(dasks[k], Alias)}
    assert sum_keys <= set(ours) and all(ours[k].has_subgraph() for k in sum_keys)
    assert dask.compute(y, scheduler="sync")[0] == a.sum()


def test_chains_without_a_copy_keep_dasks_aliases():
    a = np.arange(3000.0).reshape(1500, 2)
    y = da.from_array(a, chunks=(100, 2)).rechunk((150, 2), method="tasks").sum()
    assert kinds(optimized(y)) == kinds(without_the_hook(y))
    assert kinds(optimized(y))["Alias"] > 0


def test_merge_and_split_cuts_fused_with_their_consumer():
    """Small regions merged by a task and cut into outputs (``copy_part``): each cut fused
    with its consumer keeps the consumer's key."""
    a = np.arange(250_000.0).reshape(500, 500)
    y = (da.from_array(a, chunks=(100, 100)).rechunk((500, 5), method="service") + 1).sum(
        axis=0)
    ours = optimized(y)
    assert kinds(without_the_hook(y))["Alias"] == 100 and kinds(ours)["Alias"] == 0
    np.testing.assert_array_equal(dask.compute(y, scheduler="sync")[0], (a + 1).sum(axis=0))


@st.composite
def chains(draw):
    rows = draw(st.integers(1, 40))
    old = draw(st.integers(1, 12))
    new = draw(st.integers(1, 12))
    consumer = draw(st.sampled_from(["sum", "sum0", "plus", "plus-sum", "none"]))
    return rows, old, new, consumer


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from([0, "256 KiB"]))
def test_property_results_as_numpy_and_no_alias_of_a_copy(case, slice_saving):
    rows, old, new, consumer = case
    a = np.arange(rows * 3.0).reshape(rows, 3)
    with dask.config.set({"dask_services.rechunk.slice-saving": slice_saving}):
        y = da.from_array(a, chunks=(old, 3)).rechunk((new, 3), method="service")
    expected = {"sum": a.sum(), "sum0": a.sum(axis=0), "plus": a + 1,
                "plus-sum": (a + 1).sum(axis=1), "none": a}[consumer]
    z = {"sum": lambda: y.sum(), "sum0": lambda: y.sum(axis=0), "plus": lambda: y + 1,
         "plus-sum": lambda: (y + 1).sum(axis=1), "none": lambda: y}[consumer]()
    graph = optimized(z)
    copies = _fusion._copies()
    assert not [k for k, v in graph.items()
                if isinstance(v, Alias) and _fusion.fuses_a_copy(graph.get(v.target), copies)]
    np.testing.assert_array_equal(dask.compute(z, scheduler="sync")[0], expected)


@service_cluster(timeout=90)
async def test_on_a_cluster_the_sums_are_the_fused_tasks(c, s, a, b):
    """A persisted input rechunked and summed per row chunk: the persisted keys are the
    sums' own, each a fused copy and sum (no alias), and the results are numpy's."""
    arr = np.arange(600_000.0).reshape(3000, 200)  # 160 kB per input chunk
    with dask.config.set({"dask_services.rechunk.slice-saving": "1 KiB"}):
        x = c.persist(da.from_array(arr, chunks=(100, 200)))
        y = c.persist(x.rechunk((150, 200), method="service").sum(axis=1))
        await y
    keys = [k for k in y.__dask_keys__()]
    assert len(keys) == 20
    for key in keys:
        assert s.tasks[key].run_spec.has_subgraph(), s.tasks[key].run_spec
    assert not [k for k, ts in s.tasks.items() if isinstance(ts.run_spec, Alias)]
    np.testing.assert_array_equal(await c.compute(y), arr.sum(axis=1))
    s.validate_state()
    del x, y
    await assert_nothing_left(s, [a, b])
