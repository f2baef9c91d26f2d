"""The "service" rechunk method against numpy and dask's own ``tasks`` method."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from unittest import mock

import dask
import dask.array as da
import numpy as np
import pytest
from dask.core import flatten
from distributed import wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_nothing_left, final_rows, no_heartbeats, service_cluster

import dask_services

pytestmark = pytest.mark.timeout(120)

# rechunks whose outputs need few inputs each are copy tasks by default, and rechunks of many
# small regions merge-and-split tasks; these settings make them service tasks, to test the
# service's regions on them
def service_for_local_rechunks():
    return dask.config.set({"dask_services.rechunk.copy-max-inputs": 0,
                            "dask_services.rechunk.merge-region-max": 0})

DTYPES = [
    np.bool_, np.int8, np.uint16, np.int32, np.uint64, np.float16, np.float32, np.float64,
    np.complex64, np.complex128, "datetime64[ns]", "timedelta64[s]", "U5", "S3",
    np.dtype([("a", "i4"), ("b", "f8")]), object,
]


def sample(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        flat = rng.random(n) > 0.5
    elif dtype.kind in "iu":
        flat = rng.integers(0, 100, n)
    elif dtype.kind in "fc":
        flat = rng.random(n) * 100
    elif dtype.kind in "mM":
        flat = rng.integers(0, 10**6, n)
    elif dtype.kind in "US":
        flat = np.array([f"v{i % 999}" for i in range(n)])
    elif dtype.kind == "V":
        flat = np.zeros(n, dtype=dtype)
        flat["a"] = np.arange(n)
        flat["b"] = rng.random(n)
    else:
        flat = np.empty(n, dtype=object)
        flat[:] = [(i, "x") if i % 3 else i for i in range(n)]
    return flat.astype(dtype).reshape(shape)


def slow_inc(block: np.ndarray) -> np.ndarray:
    time.sleep(0.02)  # an input that takes a while to compute
    return block + 1


def chunking(draw, size: int) -> tuple[int, ...]:
    """A random chunking of ``size`` (zero-length chunks allowed)."""
    if size == 0:
        return (0,)
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=4)))
    bounds = [0, *cuts, size]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))


@st.composite
def rechunk_cases(draw):
    ndim = draw(st.integers(1, 5))
    shape = tuple(draw(st.integers(0, 7 if ndim < 4 else 3)) for _ in range(ndim))
    old = tuple(chunking(draw, s) for s in shape)
    new = tuple(chunking(draw, s) for s in shape)
    dtype = draw(st.sampled_from(DTYPES))
    return shape, old, new, dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rechunk_cases(), st.sampled_from([0, 16, "256 KiB"]), st.sampled_from([0, "16 MiB"]),
       st.booleans())
def test_property_matches_numpy_and_tasks(case, slice_saving, merge_region_max, in_place):
    """Any chunking; shared input chunks taken through slice tasks always (0), for some
    (16 bytes) or for none (the default, on these small arrays); regions as service tasks
    (0) or, the default on small arrays of several regions, merged and split by tasks;
    service tasks writing pieces into their outputs as they arrive, or buffering them (as
    when the outputs do not fit the buffer budget)."""
    from dask_services.array import _service

    shape, old, new, dtype = case
    a = sample(shape, dtype)
    x = da.from_array(a, chunks=old)
    with dask.config.set({"dask_services.rechunk.slice-saving": slice_saving,
                          "dask_services.rechunk.merge-region-max": merge_region_max}):
        ours = x.rechunk(new, method="service")
    assert ours.chunks == x.rechunk(new, method="tasks").chunks
    buffered = mock.patch.object(_service, "assembles_in_place", return_value=False)
    with contextlib.nullcontext() if in_place else buffered:
        result = ours.compute(scheduler="sync")
    assert result.dtype == a.dtype and result.shape == a.shape
    np.testing.assert_array_equal(result, a)


def test_merging_neighbouring_chunks_needs_no_larger_graph_than_tasks():
    x = da.ones(16, chunks=2)
    y = x.rechunk(8, method="service")
    assert len(y.__dask_graph__()) == len(x.rechunk(8, method="tasks").__dask_graph__()) == 10
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.ones(16))
    # a rechunk that is not only a merge (12-element chunks need parts of 2-element ones
    # that other outputs need too, along no axis) stays one service task
    z = da.ones((16, 6), chunks=(2, 6)).rechunk((16, 3), method="service")
    assert any(str(k).startswith("rechunk-service-task") for k in z.__dask_graph__())


@st.composite
def merge_cases(draw):
    """Old chunks, and new chunks whose boundaries are some of the old ones."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(0, 9 if ndim < 3 else 4)) for _ in range(ndim))
    old = tuple(chunking(draw, s) for s in shape)
    new = []
    for size, chunks in zip(shape, old, strict=True):
        inner = sorted(set(np.cumsum(chunks)[:-1].tolist()) - {0, size})
        keep = sorted(draw(st.sets(st.sampled_from(inner))) if inner else [])
        bounds = [0, *keep, size]
        new.append(tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)) or (0,))
    dtype = draw(st.sampled_from(DTYPES))
    return shape, old, tuple(new), dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(merge_cases())
def test_property_merges_match_numpy_in_a_graph_no_larger_than_tasks(case):
    shape, old, new, dtype = case
    a = sample(shape, dtype)
    x = da.from_array(a, chunks=old)
    ours = x.rechunk(new, method="service")
    tasks = x.rechunk(new, method="tasks")
    assert ours.chunks == tasks.chunks
    assert len(ours.__dask_graph__()) <= len(tasks.__dask_graph__())
    if ours is not x:
        assert not any(str(k).startswith("rechunk-service-task") for k in ours.__dask_graph__())
    blocks = [ours.blocks[i].compute(scheduler="sync") for i in np.ndindex(*ours.numblocks)]
    if ours is not x:
        assert all(b.flags.writeable and b.flags.c_contiguous for b in blocks)
        assert not any(np.shares_memory(b, a) for b in blocks)
    result = ours.compute(scheduler="sync")
    assert result.dtype == a.dtype and result.shape == a.shape
    np.testing.assert_array_equal(result, a)


@pytest.mark.parametrize("chunks,kwargs", [
    ("auto", {}), ({0: 7}, {}), ({1: -1}, {}), ((-1, None), {}), ((None, 9), {}),
    ((13, 5), {"balance": True}), (-1, {}),
])
def test_chunk_forms_as_dask_accepts_them(chunks, kwargs):
    a = sample((40, 30), np.float64)
    x = da.from_array(a, chunks=(10, 6))
    ours = x.rechunk(chunks, method="service", **kwargs)
    assert ours.chunks == x.rechunk(chunks, method="tasks", **kwargs).chunks
    np.testing.assert_array_equal(ours.compute(scheduler="sync"), a)


def test_config_and_public_function():
    a = sample((20, 20), np.int64)
    x = da.from_array(a, chunks=(5, 20))
    with dask.config.set({"array.rechunk.method": "service"}):
        y = x.rechunk((20, 5))
    assert any(str(k[0] if isinstance(k, tuple) else k).startswith("rechunk-service")
               for k in y.dask)
    z = dask_services.array.rechunk(x, (20, 5))
    assert z.name == y.name
    np.testing.assert_array_equal(da.rechunk(x, (4, 4), method="service").compute(
        scheduler="sync"), a)


def test_zero_dimensional_and_unchanged_arrays_are_returned_as_they_are():
    x = da.from_array(np.array(5.0))
    assert x.rechunk((), method="service") is x
    y = da.ones((4, 4), chunks=2)
    assert y.rechunk(2, method="service") is y


def test_negative_chunk_sizes_are_refused_when_the_graph_is_built():
    # they were taken: a culled output then held uninitialized memory, with no error
    x = da.from_array(np.arange(40.0), chunks=10)
    with pytest.raises(ValueError, match="chunk sizes must be >= 0, axis 0 has -10"):
        x.rechunk(((50, -10),), method="service")


def _a_row_short(block, block_info=None):
    return block[:-1] if block_info[0]["chunk-location"][0] == 1 else block


FORCED_EXCHANGE = {"dask_services.rechunk.copy-max-inputs": 0,
                   "dask_services.rechunk.merge-region-max": 0}


@pytest.mark.parametrize("new, settings", [
    ((40, 3), {}),  # copy tasks
    ((20, 12), {}),  # merge tasks
    ((40, 3), FORCED_EXCHANGE),  # a service task, in place
    ((40, 3), {**FORCED_EXCHANGE, "dask_services.rechunk.buffer-fraction": 1e-12}),
])
def test_a_chunk_of_another_shape_than_declared_fails_clearly(new, settings):
    # a block a row short was padded with uninitialized memory, with no error
    base = np.arange(40 * 12, dtype="f8").reshape(40, 12)
    x = da.from_array(base, chunks=(10, 12)).map_blocks(_a_row_short, dtype="f8")
    with dask.config.set(settings), \
            pytest.raises(ValueError, match="another shape than the array's chunks say|"
                                            "has shape .9, 12., but the array's chunks say"):
        x.rechunk(new, method="service").compute(scheduler="sync")


def test_unknown_chunk_sizes():
    a = sample((30, 8), np.float64)
    x = da.from_array(a, chunks=(10, 4))
    masked = x[x[:, 0] > 50]  # unknown sizes along axis 0
    ours = masked.rechunk({1: 8}, method="service")
    np.testing.assert_array_equal(ours.compute(scheduler="sync"), a[a[:, 0] > 50])
    with pytest.raises(ValueError, match="unchanging along dimensions with missing"):
        masked.rechunk({0: (5, 5)}, method="service")


def test_fortran_ordered_and_read_only_inputs_give_writeable_results():
    a = np.asfortranarray(sample((12, 9), np.float64))
    a.setflags(write=False)
    x = da.from_array(a, chunks=(4, 3))
    y = x.rechunk((6, 9), method="service")
    blocks = [y.blocks[i, 0].compute(scheduler="sync") for i in range(2)]
    assert all(b.flags.writeable and b.flags.c_contiguous for b in blocks)
    np.testing.assert_array_equal(np.concatenate(blocks), a)


def test_other_array_types_are_refused_at_graph_construction():
    x = da.from_array(np.rec.array(np.zeros((4, 4), dtype=[("a", "i4")])), chunks=2)
    with pytest.raises(TypeError, match="numpy-backed arrays, masked or not.*recarray.*"
                                        "method='tasks'"):
        x.rechunk(4, method="service")


def _masked_variously(block: np.ndarray, block_info=None) -> np.ndarray:
    """Chunks of one array of several kinds: plain, masked without a mask (``nomask``),
    masked with a fill value of their own."""
    i = block_info[0]["chunk-location"][0]
    if i % 3 == 0:
        return block
    if i % 3 == 1:
        return np.ma.masked_array(block, fill_value=-999)
    return np.ma.masked_array(block, mask=block % 7 < 3, fill_value=-999)


def _masked_anywhere(a) -> np.ndarray:
    """Where ``a`` is masked (in any field of a structured one)."""
    mask = np.ma.getmaskarray(a)
    if mask.dtype.names is None:
        return mask
    return np.logical_or.reduce([mask[name] for name in mask.dtype.names] or [
        np.zeros(mask.shape, bool)])


def assert_masked_equal(got, expected, fill_value=True):
    assert type(got) is type(expected)
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(expected))
    np.testing.assert_array_equal(np.ma.getdata(got)[~_masked_anywhere(got)],
                                  np.ma.getdata(expected)[~_masked_anywhere(expected)])
    assert got.dtype == expected.dtype
    if fill_value and isinstance(expected, np.ma.MaskedArray):
        assert got.fill_value == expected.fill_value


def test_masked_arrays_under_the_session_method_take_the_service():
    """``array.rechunk.method: service`` set for a session reaches masked arrays too, in
    rechunks dask makes itself (a reshape, an elementwise step unifying chunks): they are
    service rechunks, masks kept; other array types (a recarray) get dask's tasks rather
    than an error."""
    data = np.arange(8 * 12, dtype="f8").reshape(8, 12)
    x = da.ma.masked_greater(da.from_array(data, chunks=(3, 5)), 60)
    other = da.from_array(data, chunks=(4, 6))
    cases = {"rechunk": lambda: x.rechunk((4, 4)), "reshape": lambda: x.reshape(96),
             "where": lambda: da.where(x > 10, x, other), "add": lambda: x + other}
    for name, make in cases.items():
        with dask.config.set({"array.rechunk.method": "tasks"}):
            expected = make().compute(scheduler="sync")
        with dask.config.set({"array.rechunk.method": "service"}):
            made = make()
            got = made.compute(scheduler="sync")
        assert any("rechunk-service" in str(k) for k in made.__dask_graph__()), name
        assert_masked_equal(got, expected)
    assert np.ma.getmaskarray(x.compute(scheduler="sync")).any()  # the case has masks
    # nothing to move: the array as it is, whatever its type (as dask does)
    assert x.rechunk(x.chunks, method="service") is x
    rec = da.from_array(np.rec.array(np.zeros((4, 4), dtype=[("a", "i4")])), chunks=2)
    with dask.config.set({"array.rechunk.method": "service"}):  # dask's tasks graph
        assert rec.rechunk((4, 1)).name == rec.rechunk((4, 1), method="tasks").name


# paths of the 20 x 18 array in (5, 6) chunks below: copies, merges, merges of small
# regions split into outputs, service tasks (in place or buffered)
MASKED_PATHS = [((20, 2), {}), ((10, 18), {}), ((4, 9), {}),
                ((7, 18), {"dask_services.rechunk.merge-region-max": 0}),
                # an output chunk of no element, which no piece reaches
                (((7, 0, 13), (9, 9)), {"dask_services.rechunk.merge-region-max": 0})]


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("meta", ["masked", "numpy"])
@pytest.mark.parametrize("new, settings", MASKED_PATHS)
def test_masked_chunks_on_every_path_match_tasks(new, settings, meta, in_place):
    """Chunks plain, masked without a mask and masked (one array), its meta masked or
    numpy (a ``map_blocks`` that does not say): every output chunk as ``tasks`` gives it
    (type, mask, values, fill value); they were refused with a ``TypeError``."""
    from dask_services.array import _service

    a = np.arange(20 * 18, dtype="f8").reshape(20, 18)
    given = np.ma.masked_array(np.empty((0, 0))) if meta == "masked" else np.empty((0, 0))
    x = da.from_array(a, chunks=(5, 6)).map_blocks(_masked_variously, meta=given)
    with dask.config.set(settings):
        ours = x.rechunk(new, method="service")
    theirs = x.rechunk(new, method="tasks")
    assert type(ours._meta) is type(theirs._meta)
    buffered = mock.patch.object(_service, "assembles_in_place", return_value=False)
    with contextlib.nullcontext() if in_place else buffered:
        got = dask.compute(*ours.to_delayed().ravel(), scheduler="sync")
    expected = dask.compute(*theirs.to_delayed().ravel(), scheduler="sync")
    assert any(np.ma.getmaskarray(b).any() for b in got)  # the case has masks
    # a service task's masked outputs take the meta's fill value (numpy's default for a
    # numpy meta); copies and merges the one their masked inputs share, as dask's do
    service = "rechunk-service-task" in str(dict(ours.__dask_graph__()))
    for g, e in zip(got, expected, strict=True):
        if service and g.size == 0:
            # no piece reaches it: masked where the meta says so (numpy's fill value), as
            # ``tasks`` gives it from a slice of an input chunk
            assert (type(g) is np.ma.MaskedArray) == (meta == "masked")
            continue
        assert_masked_equal(g, e, fill_value=not service or meta == "masked")


@st.composite
def masked_cases(draw):
    shape, old, new, dtype = draw(rechunk_cases())
    mask_share = draw(st.sampled_from([0.0, 0.3, 1.0]))
    return shape, old, new, dtype, mask_share


# dask's own concatenation of the computed chunks reads float16's default fill value
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masked_cases(), st.sampled_from([0, "16 MiB"]), st.booleans())
def test_property_masked_arrays_match_numpy(case, merge_region_max, in_place):
    """Any chunking and dtype of a masked array, with no element, some or all of them
    masked: the mask and the values under no mask as numpy has them, on every path."""
    from dask_services.array import _service

    shape, old, new, dtype, mask_share = case
    values = sample(shape, dtype)
    rng = np.random.default_rng(1)
    a = np.ma.masked_array(values, mask=rng.random(shape) < mask_share, fill_value=values[
        (0,) * len(shape)] if values.size else None)
    x = da.from_array(a, chunks=old)
    with dask.config.set({"dask_services.rechunk.merge-region-max": merge_region_max}):
        ours = x.rechunk(new, method="service")
    buffered = mock.patch.object(_service, "assembles_in_place", return_value=False)
    with contextlib.nullcontext() if in_place else buffered:
        result = ours.compute(scheduler="sync")
    assert result.shape == a.shape
    assert_masked_equal(result, a, fill_value=False)


@pytest.mark.parametrize("spec", [(10, 40), (10, None), (20, 30)])
def test_a_flat_tuple_of_chunk_sizes_is_read_as_dask_reads_it(spec):
    v = da.from_array(np.arange(50), chunks=7)
    ours, theirs = (v.rechunk(spec, method=m) for m in ("service", "tasks"))
    assert ours.chunks == theirs.chunks
    np.testing.assert_array_equal(ours.compute(scheduler="sync"), np.arange(50))
    x = da.ones((4, 6), chunks=2)  # a longer tuple than the array has axes
    assert x.rechunk((2, 3, None), method="service").chunks == \
        x.rechunk((2, 3, None), method="tasks").chunks


@service_cluster(timeout=90)
async def test_every_dtype_on_a_cluster_and_culled_outputs(c, s, a, b):
    for dtype in DTYPES:
        arr = sample((24, 10), dtype)
        x = da.from_array(arr, chunks=(4, 10))
        y = x.rechunk((24, 5), method="service")
        np.testing.assert_array_equal(await c.compute(y), arr)
        del y
    arr = sample((30, 20), np.float64)
    x = da.from_array(arr, chunks=(5, 20))
    y = x.rechunk((10, 10), method="service")
    block = await c.compute(y.blocks[2, 1])
    np.testing.assert_array_equal(block, arr[20:30, 10:20])
    del block, y
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=60)
async def test_one_rechunk_cut_two_ways_by_the_settings_shares_no_key(c, s, a, b):
    # the same rechunk built under two pairs-per-task settings named its service tasks
    # alike: computed one after the other, the second waited for ever
    arr = np.arange(300 * 90, dtype="f8").reshape(300, 90)
    x = da.from_array(arr, chunks=(7, 90))
    with dask.config.set(FORCED_EXCHANGE):
        y1 = x.rechunk((13, 90), method="service")
    with dask.config.set({**FORCED_EXCHANGE, "dask_services.rechunk.pairs-per-task": 1}):
        y2 = x.rechunk((13, 90), method="service")
    assert y1.name != y2.name
    np.testing.assert_array_equal(await c.compute(y1), arr)
    np.testing.assert_array_equal(await asyncio.wait_for(c.compute(y2), 20), arr)
    both = c.compute([y1, y2])  # at once too
    for got in await asyncio.wait_for(c.gather(both), 20):
        np.testing.assert_array_equal(got, arr)
    del both
    await assert_nothing_left(s, [a, b])


def _plus_half(block: np.ndarray) -> np.ndarray:
    return block + 0.5


def _halved_where_odd(block: np.ndarray, block_info=None) -> np.ndarray:
    return block / 2 if block_info[0]["chunk-location"][0] % 2 else block


@pytest.mark.parametrize("fraction", [None, 1e-9])
@pytest.mark.parametrize("lane", [True, False])
@service_cluster(timeout=90)
async def test_chunks_of_another_dtype_than_the_graph_says_keep_their_values(c, s, a, b, lane,
                                                                            fraction):
    """Chunks that are float64 in a graph that says int64 (a map_blocks given the wrong
    dtype): every piece, packed or not, on the lane or not, in place or buffered, keeps its
    dtype and value (as with ``tasks``), never cast to the graph's dtype nor its bits read
    as it."""
    base = np.arange(400 * 1200, dtype="f8").reshape(400, 1200) / 3
    settings = {"dask_services.bulk-lane": lane,  # an exchange, not copy or merge tasks
                "dask_services.rechunk.copy-max-inputs": 0,
                "dask_services.rechunk.merge-region-max": 0}
    if fraction is not None:
        settings["dask_services.rechunk.buffer-fraction"] = fraction
    with dask.config.set(settings):
        x = da.from_array(base, chunks=(100, 1200)).map_blocks(_plus_half, dtype="i8")
        # 100 x 100 pieces of 80 kB travel alone, 100 x 10 ones of 8 kB packed
        for new in [(400, 100), (400, 10)]:
            got = await c.compute(x.rechunk(new, method="service"))
            ref = await c.compute(x.rechunk(new, method="tasks"))
            assert got.dtype == ref.dtype == np.float64
            np.testing.assert_array_equal(got, base + 0.5)
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("new", [(60, 4), (90, 48)])
def test_copy_and_merge_tasks_keep_the_chunks_dtype_and_promote_mixed_ones(new):
    """Copy tasks (an output from a few inputs) and merge tasks (whole inputs merged) keep
    the chunks' dtype where the graph says another, and promote chunks of different dtypes
    as numpy does, under the local scheduler as on a cluster."""
    base = np.arange(180 * 48).reshape(180, 48)
    x = da.from_array(base, chunks=(30, 48))
    declared_wrong = x.map_blocks(_plus_half, dtype="i8").rechunk(new, method="service")
    got = declared_wrong.compute(scheduler="sync")
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, base + 0.5)
    mixed = x.map_blocks(_halved_where_odd, dtype="i8").rechunk(new, method="service")
    got = mixed.compute(scheduler="sync")
    expected = np.concatenate([base[i:i + 30] / (2 if i // 30 % 2 else 1)
                               for i in range(0, 180, 30)])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("tiny_buffer", [False, True])
@service_cluster(timeout=90)
async def test_chunks_of_mixed_dtypes_are_promoted_on_a_cluster(c, s, a, b, tiny_buffer):
    """Chunks of int64 and float64 pieces, written in place or buffered: every output chunk
    is float64, with the values (in place it failed the run, or not, depending on which
    piece came first; every order is in ``test_rechunk_pieces``)."""
    base = np.arange(120 * 48).reshape(120, 48)
    settings = {"dask_services.rechunk.buffer-fraction": 1e-9} if tiny_buffer else {}
    with service_for_local_rechunks(), dask.config.set(settings):
        y = da.from_array(base, chunks=(12, 8)).map_blocks(_halved_where_odd, dtype="i8")
        expected = np.concatenate([base[i:i + 12] / (2 if i // 12 % 2 else 1)
                                   for i in range(0, 120, 12)])
        for _ in range(3):
            blocks = await c.gather(c.compute(list(
                y.rechunk((120, 1), method="service").to_delayed().ravel())))
            assert {b.dtype for b in blocks} == {np.dtype("f8")}
            np.testing.assert_array_equal(np.concatenate(blocks, axis=1), expected)
        del blocks
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("fraction", [None, 1e-9])
@pytest.mark.parametrize("lane", [True, False])
@service_cluster(timeout=90)
async def test_masked_arrays_on_a_cluster(c, s, a, b, lane, fraction):
    """A masked array's all-to-all rechunk on two workers, on the lane or not, written in
    place or buffered and spilled: masks, values and fill value as numpy has them, and the
    chunks' planes leave nothing behind."""
    no_heartbeats(a, b)
    rng = np.random.default_rng(3)
    values = rng.integers(0, 1000, (240, 180)).astype("i4")
    base = np.ma.masked_array(values, mask=values % 5 == 0, fill_value=-7)
    settings = {"dask_services.bulk-lane": lane}
    if fraction is not None:
        settings["dask_services.rechunk.buffer-fraction"] = fraction
    with dask.config.set(settings):
        y = da.from_array(base, chunks=(12, 180)).rechunk((240, 9), method="service")
        assert any(isinstance(k, str) and k.startswith("rechunk-service-task")
                   for k in y.__dask_graph__())
        got = await c.compute(y)
        assert_masked_equal(got, base)
        del got
        rows = await final_rows(c, a, b)
        assert await c.compute(y.sum()) == base.sum()
    assert (rows[0]["bytes_spilled"] > 0) == (fraction is not None), rows
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("lane", [True, False])
@service_cluster(timeout=90)
async def test_input_chunks_larger_than_the_send_window_go_through(c, s, a, b, lane):
    """An input chunk larger than the send window holds it alone while its views are on
    their way; its batches, with packed pieces of their own, must not wait for room only
    their delivery makes (a 2 GB rechunk through 0.5 GB workers, whose window is 1/32 of
    the memory limit, hung at its first chunk)."""
    base = np.arange(800 * 321, dtype="f8").reshape(800, 321)
    settings = {"dask_services.bulk-lane": lane,
                "dask_services.rechunk.bytes-in-flight": "100 kB",
                "dask_services.rechunk.copy-max-inputs": 0,
                "dask_services.rechunk.merge-region-max": 0}
    with dask.config.set(settings):
        x = da.from_array(base, chunks=(200, 321))  # 513 kB chunks
        # 200 x 64 pieces (102 kB) travel as views, 200 x 1 ones (1.6 kB) packed
        new = (800, (64, 64, 1, 1, 64, 64, 1, 1, 61))  # each owner gets wide and thin
        got = await asyncio.wait_for(c.compute(x.rechunk(new, method="service")), 30)
    np.testing.assert_array_equal(got, base)
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_outputs_stream_before_the_last_input_is_handed_off(c, s, a, b):
    # 100-row chunks to 150-row chunks: independent regions of 300 rows
    arr = np.arange(6000.0).reshape(3000, 2)
    x = da.from_array(arr, chunks=(100, 2)).map_blocks(slow_inc)
    with service_for_local_rechunks():
        y = x.rechunk((150, 2), method="service")
    result = await c.compute(y)
    np.testing.assert_array_equal(result, arr + 1)
    memory_at = {}
    for key, _, finish, *_, stamp in s.transition_log:
        if finish == "memory" and key not in memory_at:
            memory_at[key] = stamp
    outputs = [t for k, t in memory_at.items() if isinstance(k, tuple) and k[0] == y.name]
    handoffs = [t for k, t in memory_at.items()
                if isinstance(k, tuple) and str(k[0]).startswith("rechunk-handoff")]
    assert len(outputs) == 20 and len(handoffs) == 30
    assert min(outputs) < max(handoffs)
    del result
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("fraction", [None, 1e-9])
@service_cluster(timeout=90)
async def test_outputs_are_written_in_place_when_they_fit_the_buffer_budget(c, s, a, b,
                                                                            fraction):
    """Within the budget no output is assembled after its last piece (each piece was
    written into it on arrival); past it, pieces are buffered (and spilled), and every
    output assembled from them once complete.  numpy's result either way."""
    from dask_services.array import _service

    arr = np.random.default_rng(0).random((96, 96))
    x = da.from_array(arr, chunks=(8, 96))
    assembled = []
    fill, assemble_band = _service.fill, _service.assemble_band

    def counted_fill(out, pieces):
        assembled.append(out.shape)
        return fill(out, pieces)

    def counted_band(*args):  # (a worker's columns are a box: kept in bands)
        chunks = assemble_band(*args)
        assembled.extend(chunk.shape for chunk in chunks.values())
        return chunks

    settings = {} if fraction is None else {"dask_services.rechunk.buffer-fraction": fraction}
    with dask.config.set(settings), mock.patch.object(_service, "fill", counted_fill), \
            mock.patch.object(_service, "assemble_band", counted_band):
        y = x.rechunk((96, 8), method="service")
        np.testing.assert_array_equal(await c.compute(y), arr)
    assert assembled == ([] if fraction is None else [(96, 8)] * 12)
    del y
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_pieces_for_a_peer_wait_for_its_call_in_flight_and_go_together(c, s, a, b):
    """While a call to a peer is in flight, the pieces of later inputs for it wait, and go
    as one call once it is answered: an instance receives at most two calls from its peer
    here, not one per input (the first call is held until every input has been handed
    off)."""
    import asyncio
    from collections import Counter

    from distributed.utils_test import async_poll_for

    from dask_services.array import _service
    from dask_services.service import rpc

    arr = np.random.default_rng(1).random((96, 96))
    x = da.from_array(arr, chunks=(4, 96))  # 24 inputs, each with pieces for both
    y = x.rechunk((96, 4), method="service")
    release = asyncio.Event()
    calls_received: Counter = Counter()
    batches_received = 0
    receive_pieces = _service.ArrayRechunk.receive_pieces

    @rpc
    async def held(self, meta, incoming):
        nonlocal batches_received
        calls_received[self.id] += 1
        batches_received += len(meta)  # an input's small pieces for a peer: one packed item
        await release.wait()
        await receive_pieces(self, meta, incoming)

    def handed_off() -> int:
        runs = [m.live_run for m in s.extensions["dask_services"].machines.values()]
        return max((len(r.handed_off) for r in runs if r is not None), default=0)

    with mock.patch.object(_service.ArrayRechunk, "receive_pieces", held):
        result = c.compute(y)
        await async_poll_for(lambda: handed_off() == 24, timeout=30)
        release.set()
        np.testing.assert_array_equal(await result, arr)
    assert calls_received and max(calls_received.values()) <= 2, calls_received
    assert batches_received == 24  # one batch per input, for the instance it is not on
    del result, y
    await assert_nothing_left(s, [a, b])


def test_outputs_are_written_in_place_only_when_their_shapes_are_known_and_fit():
    from dask_services.array._pieces import assembles_in_place

    chunks = ((4, 4), (10,))
    f8 = np.dtype("f8")
    assert assembles_in_place(chunks, [(0, 0), (1, 0)], f8, budget=2 * 4 * 10 * 8)
    assert not assembles_in_place(chunks, [(0, 0), (1, 0)], f8, budget=2 * 4 * 10 * 8 - 1)
    assert assembles_in_place(chunks, [(1, 0)], f8, budget=4 * 10 * 8)
    assert assembles_in_place(chunks, [], f8, budget=0)
    assert not assembles_in_place(((4, 4), (math.nan,)), [(0, 0)], f8, budget=2**62)
    assert not assembles_in_place(chunks, [(0, 0)], np.dtype(object), budget=2**62)


@settings(max_examples=80, deadline=None)
@given(old=st.lists(st.integers(0, 7), min_size=1, max_size=12),
       new_sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_most_needed_input_is_the_largest_overlap(old, new_sizes):
    from dask_services.array._plan import AFFINITY_MAX_INPUTS, most_needed_inputs

    total = sum(old)
    new, left = [], total
    for size in new_sizes:  # a chunking of the same length
        if left <= 0:
            break
        new.append(min(size, left))
        left -= new[-1]
    if left > 0:
        new.append(left)
    old_c, new_c = (tuple(old), (3,)), (tuple(new) or (0,), (3,))
    got = most_needed_inputs(old_c, new_c)
    old_bounds = np.cumsum((0, *old_c[0]))
    new_bounds = np.cumsum((0, *new_c[0]))

    def overlap(i, j):
        return max(0, min(old_bounds[i + 1], new_bounds[j + 1]) - max(old_bounds[i], new_bounds[j]))

    most = max(sum(overlap(i, j) > 0 for i in range(len(old))) for j in range(len(new_c[0])))
    if most > AFFINITY_MAX_INPUTS:
        assert got is None
        return
    assert got is not None and set(got) == {(j, 0) for j in range(len(new_c[0]))}
    for (j, _), (i, i1) in got.items():
        assert i1 == 0
        assert overlap(i, j) == max(overlap(k, j) for k in range(len(old)))


def test_all_to_all_rechunk_has_no_affinity():
    from dask_services.array._plan import most_needed_inputs

    assert most_needed_inputs(((10,) * 8, (80,)), ((80,), (10,) * 8)) is None


@service_cluster(timeout=90)
async def test_outputs_are_placed_near_their_inputs_and_hand_offs_run_in_order(c, s, a, b):
    from distributed import wait

    from dask_services.array._plan import most_needed_inputs

    # persisted 100-row chunks to 150-row chunks: every output needs one or two inputs
    arr = np.arange(12000.0).reshape(6000, 2)
    x = c.persist(da.from_array(arr, chunks=(100, 2)))
    await wait(x)
    with service_for_local_rechunks():
        y = c.persist(x.rechunk((150, 2), method="service"))
    await wait(y)

    def worker_of(key):
        (ws,) = s.tasks[key].who_has
        return ws.address

    nearest = most_needed_inputs(x.chunks, y.chunks)
    placed = {j: worker_of((y.name, *j)) for j in nearest}
    # every output chunk lands on the worker holding the input it needs most; every
    # independent region (300 rows, two outputs) is a service task of its own, within
    # which no worker gets more than its share plus one, and the inputs are spread
    near = sum(placed[j] == worker_of((x.name, *i)) for j, i in nearest.items())
    counts = [list(placed.values()).count(w.address) for w in (a, b)]
    assert max(counts) <= 0.7 * len(placed), counts
    assert near >= 0.8 * len(placed), (near, len(placed))
    # the hand-offs of a region (3 inputs) run one after the other, in input order
    handoffs = sorted((ts.priority, k[1]) for k, ts in s.tasks.items()
                      if isinstance(k, tuple) and str(k[0]).startswith("rechunk-handoff"))
    assert len(handoffs) == 60
    ordered = [i for _, i in handoffs]
    assert sorted(ordered) == list(range(60))
    for start in range(0, 60, 3):
        assert ordered[start:start + 3] == list(range(ordered[start], ordered[start] + 3))
        assert ordered[start] % 3 == 0
    np.testing.assert_array_equal(await c.compute(y), arr)
    del x, y
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 4, timeout=90)
async def test_a_region_runs_only_on_the_workers_holding_its_inputs(c, s, a, b, w3, w4):
    """A rechunk of several regions: each region's run takes part only where its inputs
    are (an instance, a start and a barrier per participant); a region whose inputs are not
    placed yet still runs on every worker."""
    from distributed import wait

    arr = np.arange(12000.0).reshape(6000, 2)
    holders = {a.address, b.address}
    x = c.persist(da.from_array(arr, chunks=(100, 2)), workers=list(holders))
    await wait(x)
    with service_for_local_rechunks():
        y = c.persist(x.rechunk((150, 2), method="service"))
    await wait(y)
    rows = [r for r in s.extensions["dask_services_diagnostics"].status()["runs"]
            if r["service"] == "ArrayRechunk"]
    assert len(rows) > 1
    for row in rows:
        assert set(row["worker_addresses"].split(", ")) <= holders, row
        assert row["state"] == "finished" and row["restarts"] == 0
    assert {ws.address for k in y.__dask_keys__() for (k,) in [k]
            for ws in s.tasks[k].who_has} <= holders
    np.testing.assert_array_equal(await c.compute(y), arr)
    del y

    # inputs not computed yet when the runs start: every worker may hold them
    with service_for_local_rechunks():
        z = x.map_blocks(lambda block: block + 1).rechunk((150, 2), method="service")
    np.testing.assert_array_equal(await c.compute(z), arr + 1)
    del x
    await assert_nothing_left(s, [a, b, w3, w4])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 5, timeout=90,
                 config={"distributed.scheduler.active-memory-manager.start": False})
async def test_the_runs_of_many_regions_spread_their_outputs_over_the_workers(c, s, *workers):
    """A rechunk cut into ten service tasks of four output chunks each, on five workers:
    each run's round-robin starts where the last one's stopped, so the 40 outputs land 8
    on each worker, as p2p's, instead of the first workers of every run getting more."""
    addresses = sorted(w.address for w in workers)
    arr = np.arange(400 * 400, dtype="f8").reshape(400, 400)
    # every region (a row of ten input chunks) has inputs on every worker
    columns = [c.persist(da.from_array(arr[:, k * 40:(k + 1) * 40], chunks=40),
                         workers=[addresses[k % 5]]) for k in range(10)]
    await wait(columns)
    x = da.concatenate(columns, axis=1)
    with dask.config.set({"dask_services.rechunk.merge-region-max": 0,
                          "dask_services.rechunk.pairs-per-task": 40}):
        y = x.rechunk((10, -1), method="service")
    assert sum(str(k).startswith("rechunk-service-task") for k in y.__dask_graph__()) == 10
    y = c.persist(y)
    await wait(y)
    out = set(flatten(y.__dask_keys__()))
    counts = sorted(len(w.data.keys() & out) for w in workers)
    assert counts == [8] * 5, counts
    np.testing.assert_array_equal(await c.compute(y), arr)
    del x, y, columns
    await assert_nothing_left(s, list(workers))


@pytest.mark.parametrize("allocate", ["new_array", "fresh_array"])
@pytest.mark.parametrize("dtype", ["f8", "bool", "c16", "M8[ns]", "m8[s]", "S7", "U3",
                                   [("a", "i4"), ("b", "f8")]])
def test_large_output_chunks_are_plain_writeable_arrays(dtype, allocate):
    """Both ways output chunks are allocated (the service's assembly, the copy tasks')."""
    from dask_services._memory import HUGE_PAGE_ADVICE_FROM
    from dask_services.array import _pieces
    from dask_services.array._pieces import fill, output_shape

    new = getattr(_pieces, allocate)
    dtype = np.dtype(dtype)
    rows = HUGE_PAGE_ADVICE_FROM // (dtype.itemsize * 8) + 3  # above the size that maps
    source = np.zeros((rows, 8), dtype=dtype)
    out = new(source.shape, dtype)
    assert out.flags.writeable and out.flags.c_contiguous and out.dtype == dtype
    assert out.nbytes >= HUGE_PAGE_ADVICE_FROM
    pieces = [((0, 0), source[: rows // 2]), ((rows // 2, 0), source[rows // 2:])]
    got = fill(new(output_shape(source.shape, pieces), dtype), pieces)
    np.testing.assert_array_equal(got, source)
    assert got.flags.writeable and got.flags.c_contiguous
    assert type(new((3, 2), np.dtype(object))) is np.ndarray  # small or object: numpy's


def test_large_output_chunks_leave_numpys_huge_page_advice_as_it_was():
    """``new_array`` turns numpy's process-wide huge-page advice off around its own
    allocation only, also when several threads allocate at once, whichever way it was set."""
    from concurrent.futures import ThreadPoolExecutor

    from dask_services._memory import (
        HUGE_PAGE_ADVICE_FROM,
        _get_madvise_hugepage,
        _set_madvise_hugepage,
    )
    from dask_services.array._pieces import new_array

    shape = (HUGE_PAGE_ADVICE_FROM // 8 + 1,)
    before = _get_madvise_hugepage()
    try:
        for setting in (True, False):
            _set_madvise_hugepage(setting)
            with ThreadPoolExecutor(8) as pool:
                arrays = list(pool.map(lambda _: new_array(shape, np.dtype("f8")), range(64)))
            assert all(a.shape == shape and a.flags.writeable for a in arrays)
            assert _get_madvise_hugepage() is setting
    finally:
        _set_madvise_hugepage(before)


@service_cluster(timeout=90)
async def test_outputs_needing_few_inputs_are_copy_tasks_and_feed_their_consumer(c, s, a, b):
    """100-row chunks to 150-row chunks (each output needs at most 2 inputs): one copy task
    per output chunk, no service task; with ``copy-max-inputs: 0`` service tasks again.
    Both give numpy's result, alone and with a ``.sum()``."""
    arr = np.arange(12000.0).reshape(6000, 2)
    x = da.from_array(arr, chunks=(100, 2))
    y = x.rechunk((150, 2), method="service")
    keys = [str(k) for k in dict(y.__dask_graph__())]
    assert not [k for k in keys if "service-task" in k or "handoff" in k]
    assert len([k for k in dict(y.__dask_graph__()) if k[0] == y.name]) == 40
    # input chunks 1, 4, 7, ... go half to one output, half to the next: small, they are
    # taken whole; with ``slice-saving: 0`` through a slice task per output
    assert not [k for k in keys if "rechunk-slice" in k]
    with dask.config.set({"dask_services.rechunk.slice-saving": 0}):
        v = x.rechunk((150, 2), method="service")
    assert len([k for k in dict(v.__dask_graph__()) if "rechunk-slice" in str(k)]) == 2 * 20
    np.testing.assert_array_equal(await c.compute(v), arr)
    assert await c.compute(v.sum()) == arr.sum()
    np.testing.assert_array_equal(await c.compute(y), arr)
    assert await c.compute(y.sum()) == arr.sum()
    with service_for_local_rechunks():
        z = x.rechunk((150, 2), method="service")
    assert any("service-task" in str(k) for k in dict(z.__dask_graph__()))
    np.testing.assert_array_equal(await c.compute(z), arr)
    # a 2-d rechunk whose outputs need 9 inputs each stays a service task by default
    arr2 = np.arange(250_000.0).reshape(500, 500)
    w = da.from_array(arr2, chunks=(100, 100)).rechunk((250, 250), method="service")
    assert any("service-task" in str(k) for k in dict(w.__dask_graph__()))
    np.testing.assert_array_equal(await c.compute(w), arr2)
    del y, z, w, v
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("saving, sliced", [(0, [0, 1, 2]), (48, [0, 1, 2]),
                                             (49, [0, 1]), (57, [])])
def test_a_slice_task_is_made_where_the_bytes_an_output_leaves_reach_slice_saving(
        saving, sliced):
    """One 10-element float64 chunk into outputs of 3, 3 and 4: they leave 56, 56 and 48
    bytes of it unneeded, so a slice task is made for those leaving at least
    ``slice-saving`` bytes (at least one), the others take the chunk whole; an axis of
    unknown size counts as one element."""
    x = da.from_array(np.arange(10.0), chunks=10)
    with dask.config.set({"dask_services.rechunk.slice-saving": saving}):
        y = x.rechunk(((3, 3, 4),), method="service")
    keys = [k for k in dict(y.__dask_graph__()) if "rechunk-slice" in str(k[0])]
    assert sorted(k[-1] for k in keys) == sliced
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.arange(10.0))
    # two axes, one of unknown size: the bytes left counted along the known one
    a = np.arange(40.0).reshape(4, 10)
    z = da.from_array(a, chunks=(2, 10))
    unknown = z[z[:, 0] >= 0]
    with dask.config.set({"dask_services.rechunk.slice-saving": saving}):
        w = unknown.rechunk({1: (3, 3, 4)}, method="service")
    keys = [k for k in dict(w.__dask_graph__()) if "rechunk-slice" in str(k[0])]
    assert sorted({k[-1] for k in keys}) == sliced
    np.testing.assert_array_equal(w.compute(scheduler="sync"), a)


@service_cluster(timeout=90)
async def test_a_copy_fetches_only_the_slice_it_needs_from_another_worker(c, s, a, b):
    """A persisted input spread over two workers, 100-row chunks alternating between
    them, rechunked to 150 rows and summed: an output that needs half of a chunk on the
    other worker fetches that half, which is then forgotten: no shared input chunk (1, 4,
    7, ...: half to one output, half to the next) ends up held twice, where a whole chunk
    fetched for half of it would stay as long as the input does.  (Chunks that one output
    takes whole may still be fetched whole: where a copy runs is the scheduler's choice.)"""
    arr = np.arange(3000.0 * 1000).reshape(3000, 1000)  # 800 kB per input chunk
    parts = [
        c.persist(da.from_array(arr[k * 100:(k + 1) * 100], chunks=(100, 1000)),
                  workers=[(a, b)[k % 2].address])
        for k in range(30)
    ]
    x = c.persist(da.concatenate(parts))
    await x
    keys = list(flatten(x.__dask_keys__()))
    holders = [{ws.address for ws in s.tasks[k].who_has} for k in keys]
    assert {h for one in holders for h in one} == {a.address, b.address}
    assert await c.compute(x.rechunk((150, 1000), method="service").sum()) == arr.sum()
    assert [len(s.tasks[k].who_has) for k in keys[1::3]] == [1] * 10
    del x, parts
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_many_small_regions_are_merged_and_split_by_tasks(c, s, a, b):
    """100 x 100 chunks to 2000 x 5 (each output needs 20 inputs, each input feeds 20
    outputs): 10 independent regions of 2000 x 100, 800 kB each.  By default every region
    is one task merging its 20 inputs and a task per output cutting it out (no service
    run); above ``merge-region-max`` they are service tasks.  Both give numpy's result,
    alone and with a ``.sum()``, in fresh C-ordered, writeable output chunks."""
    arr = np.random.default_rng(0).random((2000, 1000)).astype("f4")
    x = da.from_array(arr, chunks=(100, 100))
    y = x.rechunk((2000, 5), method="service")
    keys = [str(k) for k in dict(y.__dask_graph__())]
    assert not [k for k in keys if "service-task" in k or "handoff" in k]
    assert len([k for k in keys if "rechunk-region" in k]) == 10
    assert len(dict(y.__dask_graph__())) == 200 + 10 + 200  # inputs, regions, outputs
    np.testing.assert_array_equal(await c.compute(y), arr)
    assert np.isclose(await c.compute(y.sum()), arr.sum(dtype="f4"), rtol=1e-5)
    block = await c.compute(y.blocks[0, 7])
    assert block.flags.c_contiguous and block.flags.writeable
    with dask.config.set({"dask_services.rechunk.merge-region-max": "100 kB"}):
        z = x.rechunk((2000, 5), method="service")
    assert any("service-task" in str(k) for k in dict(z.__dask_graph__()))
    np.testing.assert_array_equal(await c.compute(z), arr)
    # rows to columns, one region (every output needs a part of every input): one service
    # task, however small
    w = da.from_array(arr, chunks=(100, 1000)).rechunk((2000, 50), method="service")
    assert any("service-task" in str(k) for k in dict(w.__dask_graph__()))
    np.testing.assert_array_equal(await c.compute(w), arr)
    del y, z, w
    await assert_nothing_left(s, [a, b])


def test_largest_region_bytes():
    from dask_services.array._rechunk import largest_region_bytes

    f4 = np.dtype("f4")
    # 100-row chunks to 150 rows: regions of 300 rows x 2 columns
    assert largest_region_bytes(((100,) * 6, (2,)), ((150,) * 4, (2,)), f4) == 300 * 2 * 4
    # rows to columns: one region, the whole array
    assert largest_region_bytes(((10,) * 4, (40,)), ((40,), (10,) * 4), f4) == 40 * 40 * 4
    assert largest_region_bytes(((np.nan, np.nan), (4,)), ((np.nan, np.nan), (2, 2)),
                                f4) == float("inf")
