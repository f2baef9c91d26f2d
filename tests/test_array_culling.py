"""A service rechunk culled to some of its outputs takes only the inputs those need."""

from __future__ import annotations

import itertools

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Alias
from distributed.diagnostics.plugin import SchedulerPlugin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_nothing_left, service_cluster

import dask_services  # noqa: F401
from dask_services.graph import HandOffSpec, ServiceTaskSpec

pytestmark = pytest.mark.timeout(120)

# regions as service tasks (0) or, the default for small arrays of several regions, merged
# and split by tasks
REGION_PATHS = [0, "16 MiB"]


def input_keys_of(graph, name: str) -> set:
    return {k for k in graph if isinstance(k, tuple) and k[0] == name}


def culled_graph(y: da.Array, fuse: bool = True) -> dict:
    with dask.config.set({"optimization.fuse.active": None if fuse else False}):
        (optimized,) = dask.optimize(y)
    return dict(optimized.__dask_graph__())


def extents(chunks: tuple) -> list[tuple[int, int]]:
    bounds = np.cumsum((0, *chunks)).tolist()
    return list(itertools.pairwise(bounds))


def inputs_needed(old: tuple, new: tuple, outputs) -> set:
    """The input chunk indices whose elements lie in the output chunks ``outputs``,
    from the chunks' extents alone."""
    old_extents = [extents(c) for c in old]
    new_extents = [extents(c) for c in new]
    needed = set()
    for j in outputs:
        per_axis = []
        for d, jd in enumerate(j):
            lo, hi = new_extents[d][jd]
            per_axis.append([i for i, (a, b) in enumerate(old_extents[d])
                             if max(a, lo) < min(b, hi)])
        needed.update(itertools.product(*per_axis))
    return needed


def test_an_overlapping_region_culled_to_one_output_takes_a_quarter_of_its_inputs():
    """Chunks of 5 to chunks of 3 join every input along that axis into one region; the
    slice wants the inputs of the first five rows and the first input along it."""
    a = np.random.default_rng(0).uniform(0, 1, 500).reshape((10, 10, 5))
    x = da.from_array(a, chunks=(1, 5, 1))
    for merge_region_max in REGION_PATHS:
        with dask.config.set({"dask_services.rechunk.merge-region-max": merge_region_max}):
            y = x.rechunk((5, 3, -1), method="service")
        full = culled_graph(y)
        culled = culled_graph(y[:5, :2])
        assert len(input_keys_of(full, x.name)) == 100
        assert len(input_keys_of(culled, x.name)) == 25
        assert len(culled) < len(full) / 4
        np.testing.assert_array_equal(y[:5, :2].compute(scheduler="sync"), a[:5, :2])


@st.composite
def culled_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))

    def chunking(size: int) -> tuple[int, ...]:
        cuts = sorted(set(draw(st.lists(st.integers(1, size - 1), max_size=4))
                          if size > 1 else []))
        bounds = [0, *cuts, size]
        return tuple(b - a for a, b in itertools.pairwise(bounds))

    old = tuple(chunking(s) for s in shape)
    new = tuple(chunking(s) for s in shape)
    # a slice along every axis: start and stop inside it
    slices = []
    for s in shape:
        start = draw(st.integers(0, s - 1))
        slices.append(slice(start, draw(st.integers(start + 1, s))))
    return shape, old, new, tuple(slices)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(culled_cases(), st.sampled_from(REGION_PATHS))
def test_property_a_slice_takes_exactly_the_inputs_its_output_chunks_need(case,
                                                                           merge_region_max):
    shape, old, new, slices = case
    a = np.arange(np.prod(shape), dtype="f8").reshape(shape)
    x = da.from_array(a, chunks=old)
    with dask.config.set({"dask_services.rechunk.merge-region-max": merge_region_max,
                          "dask_services.rechunk.copy-max-inputs": 0}):
        y = x.rechunk(new, method="service")
    part = y[slices]
    np.testing.assert_array_equal(part.compute(scheduler="sync"), a[slices])
    # the output chunks the slice touches, and the input chunks those take pieces from
    touched = itertools.product(*(
        [j for j, (a, b) in enumerate(extents(c)) if max(a, sl.start) < min(b, sl.stop)]
        for c, sl in zip(new, slices, strict=True)))
    needed = {(x.name, *i) for i in inputs_needed(old, new, touched)}
    # (not fused, so that every input chunk keeps its key)
    assert input_keys_of(culled_graph(part, fuse=False), x.name) == needed


def test_a_culled_service_task_has_keys_of_its_own_and_the_outputs_keep_theirs():
    a = np.arange(400.0).reshape(20, 20)
    x = da.from_array(a, chunks=(5, 20))
    with dask.config.set({"dask_services.rechunk.merge-region-max": 0,
                          "dask_services.rechunk.copy-max-inputs": 0}):
        y = x.rechunk((3, 20), method="service")
    full = dict(y.__dask_graph__())
    (service_key,) = (k for k, v in full.items() if isinstance(v, ServiceTaskSpec))
    graph = culled_graph(y.blocks[0], fuse=False)
    (culled_key,) = (k for k, v in graph.items() if isinstance(v, ServiceTaskSpec))
    assert culled_key != service_key
    definition = graph[culled_key].definition
    assert definition.input_keys == ((x.name, 0, 0),)
    assert len(definition.output_keys) == len(y.chunks[0])  # the region's, by position
    assert not set(definition.output_keys) & set(full)  # renamed: no key claimed twice
    handoffs = [k for k, v in graph.items() if isinstance(v, HandOffSpec)]
    assert handoffs == list(definition.handoff_keys)
    assert isinstance(graph[(y.name, 0, 0)], Alias)


class ComputedKeys(SchedulerPlugin):
    """The keys of a collection that a scheduler had computed."""

    name = "computed-keys"

    def __init__(self, collection_name: str) -> None:
        self.collection_name = collection_name
        self.keys: set = set()

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish == "memory" and isinstance(key, tuple) and key[0] == self.collection_name:
            self.keys.add(key)


@pytest.mark.parametrize("merge_region_max", REGION_PATHS)
@service_cluster(timeout=90)
async def test_culled_and_whole_rechunks_of_one_array_at_once_on_a_cluster(
        c, s, a, b, merge_region_max):
    """A slice computed while the whole rechunk is (each of them first): the slice's
    service task takes its inputs only; both results right, nothing left behind."""
    arr = np.random.default_rng(1).uniform(0, 1, 500).reshape((10, 10, 5))
    x = da.from_array(arr, chunks=(1, 5, 1)).map_blocks(np.copy)  # inputs computed
    with dask.config.set({"dask_services.rechunk.merge-region-max": merge_region_max}):
        y = x.rechunk((5, 3, -1), method="service")
    computed = ComputedKeys(x.name)
    s.add_plugin(computed)
    np.testing.assert_array_equal(await c.compute(y[:5, :2]), arr[:5, :2])
    assert len(computed.keys) == 25  # of 100
    s.remove_plugin(computed.name)
    for first, second in ((y[:5, :2], y), (y, y[:5, :2])):
        f1 = c.compute(first)
        f2 = c.compute(second)
        r1, r2 = await c.gather([f1, f2])
        for result, collection in ((r1, first), (r2, second)):
            expected = arr[:5, :2] if collection is not y else arr
            np.testing.assert_array_equal(result, expected)
        del f1, f2
    np.testing.assert_array_equal(await c.compute(y.blocks[1, 2]), arr[5:10, 6:9])
    await assert_nothing_left(s, [a, b])
