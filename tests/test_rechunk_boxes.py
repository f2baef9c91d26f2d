"""Outputs owned in boxes: where every output chunk of a rechunk needs many input chunks,
each worker owns a box of neighbouring output chunks (``_plan.output_blocks``), an input
chunk's share for it travels as one ``Slab`` and is written into the box with one
assignment and counted with one numpy operation (``BoxCount``).  numpy is the oracle."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from unittest import mock

import dask
import dask.array as da
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_nothing_left, service_cluster

import dask_services  # noqa: F401
from dask_services import _run_placement as placement
from dask_services import _spill
from dask_services.array import _bands, _pieces, _service
from dask_services.array._bands import Bands, assemble_band, band_parts
from dask_services.array._pieces import (
    BoxCount,
    Slab,
    TiledBox,
    TileLayout,
    slabs_of,
    slice_block,
    write_into,
)
from dask_services.array._plan import (
    axis_overlaps,
    chunk_starts,
    merge_plan,
    output_blocks,
    owned_boxes,
    pieces_per_output,
)
from dask_services.graph import ServiceDefinition
from dask_services.service import Service, rpc

pytestmark = pytest.mark.timeout(120)


def chunking(draw, size: int, most: int) -> tuple[int, ...]:
    """A random chunking of ``size`` into at most ``most`` chunks (zero-length allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=most - 1)))
    bounds = [0, *cuts, size]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def starts_of(chunks) -> list[list[int]]:
    return [chunk_starts(axis) for axis in chunks]


def box_of(j: tuple[int, ...], blocks: list[int], grid: tuple[int, ...]) -> int:
    return blocks[int(np.ravel_multi_index(j, grid))]


# ----------------------------------------------------------------- the layout


def shares_imbalance(chunks: int, parts: int) -> float:
    return math.inf if chunks < parts else math.ceil(chunks / parts) / (chunks // parts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(1, 12))
def test_output_blocks_give_every_worker_one_box_of_neighbours(grid, parts):
    new = tuple((1,) * n for n in grid)
    old = tuple((n,) for n in grid)  # (one region along every axis)
    blocks = output_blocks(old, new, parts)
    # boxes within 4/3 of each other: split along one axis, or two
    one = [d for d, n in enumerate(grid) if shares_imbalance(n, parts) <= 4 / 3]
    two = [(d1, d2, p) for d1, d2 in itertools.combinations(range(len(grid)), 2)
           for p in range(2, parts) if parts % p == 0
           and shares_imbalance(grid[d1], p) * shares_imbalance(grid[d2], parts // p) <= 4 / 3]
    if parts < 2 or not (one or two):
        assert blocks is None
        return
    assert blocks is not None and len(blocks) == math.prod(grid)
    owned: dict[int, list] = {}
    for j in itertools.product(*map(range, grid)):
        owned.setdefault(box_of(j, blocks, tuple(grid)), []).append(j)
    assert set(owned) == set(range(parts))  # nobody left without outputs
    for indices in owned.values():  # a box: every index between its corners
        corners = [range(min(x), max(x) + 1) for x in zip(*indices, strict=True)]
        assert sorted(indices) == list(itertools.product(*corners))
    sizes = [len(indices) for indices in owned.values()]
    assert max(sizes) / min(sizes) <= 4 / 3 + 1e-9
    if one:  # one axis where one does: the evenest split, then the most chunks, the outer
        axis = min(one, key=lambda d: (shares_imbalance(grid[d], parts), -grid[d], d))
        assert all(len({j[d] for j in indices}) == grid[d] for indices in owned.values()
                   for d in range(len(grid)) if d != axis)


def test_output_blocks_split_the_axis_of_most_chunks_that_splits_evenly():
    # 1 x 20 x 20 tiles on 2 workers: rows of tiles 0-9 and 10-19, each a box of 200
    blocks = output_blocks(((1,) * 1000, (500,), (500,)), ((1000,), (25,) * 20, (25,) * 20), 2)
    assert blocks == [0] * 200 + [1] * 200
    # 3 chunks on 2 workers would be 2 and 1 (7 would be 4 and 3): round robin instead
    assert output_blocks(((1,) * 10, (10,)), ((10,), (4, 4, 2)), 2) is None
    # an axis of unknown size, or one worker: round robin
    assert output_blocks(((np.nan,), (40,)), ((np.nan,), (5,) * 8), 2) is None
    assert output_blocks(((40,),), ((5,) * 8,), 1) is None
    # 10 chunks on 8 workers: 1 or 2 each is too uneven; the next axis, 64, is not
    blocks = output_blocks(((10,), (64,)), ((1,) * 10, (1,) * 64), 8)
    assert blocks is not None and blocks[:64] == [p for p in range(8) for _ in range(8)]
    # 20 x 20 tiles on 8 workers: 2 or 3 rows (or columns) each is too uneven; 2 x 4
    # boxes of 10 x 5 tiles
    blocks = output_blocks(((1,) * 1000, (500,), (500,)), ((1000,), (25,) * 20, (25,) * 20), 8)
    assert blocks is not None
    assert blocks[:20] == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5 and blocks[200] == 4
    assert sorted(blocks) == [p for p in range(8) for _ in range(50)]
    # 100-row chunks to 150 rows are regions of 300 rows (each completes as its inputs
    # are in), column blocks to single columns one region: split the columns, though the
    # rows have more chunks
    blocks = output_blocks(((100,) * 6, (8,)), ((150,) * 4, (1,) * 8), 2)
    assert blocks == [0, 0, 0, 0, 1, 1, 1, 1] * 4


def test_owned_boxes_are_whole_boxes_of_two_or_more():
    owner = {(0, 0): "a", (0, 1): "a", (1, 0): "a", (1, 1): "b", (2, 0): "c", (2, 1): "c"}
    # a's outputs are an L, b's one chunk, c's a row of two
    assert owned_boxes(owner) == {"c": (range(2, 3), range(0, 2))}
    # a box with a hole (an output not wanted) is not a box
    assert owned_boxes({(0, 0): "a", (0, 2): "a"}) == {}


class LaidOut(Service):
    answer: object = None

    @classmethod
    def output_owners(cls, params, outputs, workers):
        if isinstance(cls.answer, Exception):
            raise cls.answer
        return cls.answer


@pytest.mark.parametrize("answer, warned", [
    ([1, 0, 1], None),
    (np.array([1, 1, 0]), None),
    (None, None),
    ([0, 1], "3 outputs"),
    ([0, 1, 2], "from 0 to 1"),
    (["a", "b", "c"], "TypeError"),
    (ZeroDivisionError("oops"), "ZeroDivisionError: oops"),
])
def test_a_services_layout_is_taken_where_it_is_one_worker_per_output(answer, warned,
                                                                      caplog):
    definition = ServiceDefinition(LaidOut, {}, (), (), ("x", "y", "z"))
    with mock.patch.object(LaidOut, "answer", answer), caplog.at_level(logging.WARNING):
        got = placement.owned_as_the_service_says(definition, ["w0", "w1"])
    if warned is None:
        expected = (None if answer is None
                    else {k: f"w{o}" for k, o in zip("xyz", answer, strict=True)})
        assert got == expected and not caplog.records
    else:
        assert got is None
        assert "LaidOut.output_owners failed" in caplog.text and warned in caplog.text
        assert "round robin" in caplog.text


# ----------------------------------------------------------------- slabs and counts


@st.composite
def boxed_rechunks(draw):
    """Old and new chunkings of a small array, a box of the new chunks, and the inputs in
    an order of arrival."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    old = tuple(chunking(draw, s, 5) for s in shape)
    new = tuple(chunking(draw, s, 4) for s in shape)
    box = []
    for axis in new:
        lo = draw(st.integers(0, len(axis) - 1))
        hi = draw(st.integers(lo + 1, len(axis)))
        box.append(range(lo, hi))
    inputs = list(itertools.product(*(range(len(c)) for c in old)))
    order = draw(st.permutations(inputs))
    return shape, old, new, tuple(box), order


def boxed_setup(case):
    """For a ``boxed_rechunks`` case: the array, the overlaps along each axis, the pieces
    each output chunk expects along each axis, where output chunks start, the box's
    layout."""
    shape, old, new, box, _ = case
    overlaps = [axis_overlaps(o, n) for o, n in zip(old, new, strict=True)]
    new_starts = starts_of(new)
    return (np.arange(math.prod(shape), dtype="f8").reshape(shape), overlaps,
            pieces_per_output(overlaps, new), new_starts, TileLayout(box, new_starts))


def arriving_blocks(a, old, order):
    """Each input chunk of ``a`` (chunked ``old``) in ``order``: its index, where it
    starts and the chunk."""
    old_starts = starts_of(old)
    for i in order:
        at = tuple(old_starts[d][x] for d, x in enumerate(i))
        yield i, at, a[tuple(slice(s, s + n) for s, n in zip(
            at, (old[d][x] for d, x in enumerate(i)), strict=True))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(boxed_rechunks())
def test_slabs_stand_for_the_pieces_of_their_box_and_count_as_them(case):
    """An input chunk's slabs for a box (at most a few, cut where the box's chunks change
    size or the input chunk ends inside one) are the pieces its output chunks need from
    it; written in, every output chunk of the box is a C-ordered tile with numpy's
    values, and completes once, when its last piece arrives."""
    shape, old, new, box, order = case
    a, overlaps, counts, new_starts, layout = boxed_setup(case)
    tiles = TiledBox(layout, np.dtype("f8"))
    count = BoxCount(box, counts)
    in_box = set(itertools.product(*box))
    completed = []
    for i, at, block in arriving_blocks(a, old, order):
        wanted = {(j, offset): piece for j, offset, piece in slice_block(block, i, overlaps)
                  if j in in_box}
        slabs = slabs_of(block, at, layout)
        assert len(slabs) <= 3 ** len(shape) * math.prod(map(len, layout.runs))
        got = {}
        for slab in slabs:
            for j, offset, piece in Slab(slab.at, slab.array).placed(
                    layout, whole=False).pieces(copy=True):
                assert (j, offset) not in got
                got[j, offset] = piece
        assert got.keys() == wanted.keys()
        for k, piece in wanted.items():
            np.testing.assert_array_equal(got[k], piece)
        for slab in slabs:
            slab.placed(layout, whole=True)
        written, aside, whole = write_into({}, [slabs], tiles)
        assert (written, aside, whole) == ([], [], slabs)
        for slab in slabs:
            completed += count.add(slab)
    # every output chunk of the box that has pieces completes once, when its last arrives
    expected = {j: math.prod(counts[d][jd] for d, jd in enumerate(j)) for j in in_box}
    assert sorted(completed) == sorted(j for j, n in expected.items() if n)
    assert count.missing() == []
    for j in in_box:
        chunk = tiles.chunk(j)
        where = tuple(slice(new_starts[d][jd], new_starts[d][jd + 1]) for d, jd in enumerate(j))
        assert chunk.flags.c_contiguous and chunk.flags.writeable
        assert chunk.shape == a[where].shape
        if expected[j]:
            np.testing.assert_array_equal(chunk, a[where])


def test_a_regular_box_is_one_array_and_a_smaller_last_chunk_makes_a_few_more():
    starts = starts_of(((1000,), (25,) * 20, (25,) * 20))
    layout = TileLayout((range(1), range(10), range(20)), starts)
    assert layout.parts() == {(0, 0, 0): (1, 10, 20, 1000, 25, 25)}
    # a time step's part for the box: one slab of 200 tiles
    (slab,) = slabs_of(np.zeros((1, 500, 500), "f4"), (7, 0, 0), layout)
    assert slab.at == (7, 0, 0) and slab.array.shape == (1, 10, 20, 1, 25, 25)
    starts = starts_of(((10,), (4, 4, 4, 3)))
    layout = TileLayout((range(1), range(4)), starts)
    assert layout.parts() == {(0, 0): (1, 3, 10, 4), (0, 1): (1, 1, 10, 3)}
    # a chunk of rows 2-5 of every column: a slab per run of the row chunk
    slabs = slabs_of(np.zeros((4, 15)), (2, 0), layout)
    assert [(s.at, s.array.shape) for s in slabs] == [((2, 0), (1, 3, 4, 4)),
                                                      ((2, 12), (1, 1, 4, 3))]


def test_a_slab_of_another_dtype_than_its_box_is_written_piece_by_piece():
    starts = starts_of(((4,), (2, 2)))
    layout = TileLayout((range(1), range(2)), starts)
    tiles = TiledBox(layout, np.dtype("i8"))
    tiles.parts[(0, 0)][...] = 0
    (slab,) = slabs_of(np.full((4, 4), 0.5), (0, 0), layout)
    slab.placed(layout, whole=False)
    outputs = {(0, 0): tiles.chunk((0, 0)), (0, 1): tiles.chunk((0, 1))}
    written, aside, whole = write_into(outputs, [[slab]], tiles)
    assert whole == [] and [j for j, _ in written] == [(0, 0), (0, 1)]
    assert [j for j, _, _ in aside] == [(0, 0), (0, 1)]  # kept until promoted
    assert not tiles.parts[(0, 0)].any()


# ----------------------------------------------------------------- on a cluster


def recorded_kinds(kinds: list):
    """``receive_pieces`` of every instance, noting what kinds of items it received."""
    receive = _service.ArrayRechunk.receive_pieces

    async def noted(self, meta, incoming):
        kinds.extend(m[0] for m in meta)
        return await receive(self, meta, incoming)

    return mock.patch.object(_service.ArrayRechunk, "receive_pieces", rpc(noted))


@pytest.mark.parametrize("fraction", [None, 1e-9])
@service_cluster(timeout=90)
async def test_a_time_series_into_tiles_travels_as_one_slab_per_step_and_worker(
        c, s, a, b, fraction):
    """Steps of a grid into whole time series of tiles: each worker owns a box of tiles,
    and a step's share for the other worker is one slab (it was a piece per tile: 48 per
    step here), written into the box in place or, past the buffer budget, cut into pieces
    and buffered; numpy's values either way, and the outputs as dask declares them."""
    rng = np.random.default_rng(5)
    base = rng.random((30, 24, 36)).astype("f4")
    x = da.from_array(base, chunks=(1, 24, 36))
    kinds: list[str] = []
    settings = {} if fraction is None else {"dask_services.rechunk.buffer-fraction": fraction}
    with dask.config.set(settings), recorded_kinds(kinds):
        y = x.rechunk((30, 4, 6), method="service")
        got = await c.compute(y)
        np.testing.assert_array_equal(got, base)
        assert await c.compute(y.sum()) == pytest.approx(base.sum(), rel=1e-5)
    # 30 steps, each held by one worker: its slab for the other worker, and nothing else
    assert set(kinds) == {"slab"} and len(kinds) == 2 * 30
    blocks = await c.gather(c.compute(y.to_delayed().ravel().tolist()))
    assert {blk.shape for blk in blocks} == {(30, 4, 6)} and len(blocks) == 36
    del got, blocks
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_before_the_boxes_the_same_rechunk_sent_a_piece_per_tile(c, s, a, b):
    """Without the service's layout (outputs dealt round robin), the same rechunk sends
    its pieces packed, many to a call: what the slabs replace, and still numpy's values."""
    base = np.random.default_rng(6).random((30, 24, 36)).astype("f4")
    kinds: list[str] = []
    with recorded_kinds(kinds), mock.patch.object(
            _service.ArrayRechunk, "output_owners", classmethod(lambda *_: None)):
        got = await c.compute(da.from_array(base, chunks=(1, 24, 36))
                              .rechunk((30, 4, 6), method="service"))
    np.testing.assert_array_equal(got, base)
    assert "slab" not in kinds and "packed" in kinds
    del got
    await assert_nothing_left(s, [a, b])


def _f4_where_even(block, block_info=None):
    step = block_info[0]["chunk-location"][0]
    return block.astype("f4") if step % 2 == 0 else block.astype("f8") / 3


@pytest.mark.parametrize("fraction", [None, 1e-9, "bands in place"])
@service_cluster(timeout=90)
async def test_steps_of_mixed_dtypes_are_promoted_in_a_box(c, s, a, b, fraction):
    """Steps of float32 and float64 (a map_blocks that says one dtype): a box takes the
    dtype of its first slab, and a slab that does not fit it is written piece by piece
    and the chunk promoted; every output chunk float64, with numpy's values."""
    base = np.arange(12 * 8 * 10, dtype="f8").reshape(12, 8, 10)
    x = da.from_array(base, chunks=(1, 8, 10)).map_blocks(_f4_where_even, dtype="f8")
    expected = np.concatenate([base[i:i + 1].astype("f4").astype("f8") if i % 2 == 0
                               else base[i:i + 1] / 3 for i in range(12)])
    settings = ({} if fraction in (None, "bands in place")
                else {"dask_services.rechunk.buffer-fraction": fraction})
    # (buffering, with every band of one chunk held in place)
    bands = (mock.patch.object(_service, "assembles_in_place", return_value=False)
             if fraction == "bands in place" else contextlib.nullcontext())
    with dask.config.set(settings), bands, mock.patch.object(_service, "MAX_BAND_BYTES", 1):
        for _ in range(2):
            blocks = await c.gather(c.compute(
                x.rechunk((12, 2, 5), method="service").to_delayed().ravel().tolist()))
            assert {blk.dtype for blk in blocks} == {np.dtype("f8")}
            got = np.concatenate([np.concatenate(blocks[r * 2:(r + 1) * 2], axis=2)
                                  for r in range(4)], axis=1)
            np.testing.assert_array_equal(got, expected)
    del blocks
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_a_masked_time_series_keeps_masks_values_and_fill_value_in_a_box(c, s, a, b):
    values = np.random.default_rng(7).integers(0, 100, (20, 12, 12)).astype("i4")
    base = np.ma.masked_array(values, mask=values % 7 == 0, fill_value=-3)
    kinds: list[str] = []
    with recorded_kinds(kinds):
        got = await c.compute(da.from_array(base, chunks=(1, 12, 12))
                              .rechunk((20, 3, 3), method="service"))
    assert "slab" in kinds
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(base))
    np.testing.assert_array_equal(got.filled(0), base.filled(0))
    assert got.fill_value == -3
    del got
    await assert_nothing_left(s, [a, b])


@st.composite
def time_series_cases(draw):
    """Steps of a grid (a few per chunk) into whole time series of tiles of any chunking
    (zero-length chunks too): outputs that need many inputs each, in one region (one
    service task)."""
    steps = draw(st.integers(5, 12))
    grid = (draw(st.integers(1, 12)), draw(st.integers(1, 12)))
    ones = [1] * steps
    for at in draw(st.lists(st.integers(0, steps), max_size=2)):
        ones.insert(at, 0)  # (a zero-length chunk here and there)
    old = (tuple(ones), *((n,) for n in grid))
    new = ((steps,), *(chunking(draw, n, 8) for n in grid))
    dtype = draw(st.sampled_from(["f4", "i8", "u1", "c16", "M8[ns]"]))
    return (steps, *grid), old, new, dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(time_series_cases(), st.booleans(), st.sampled_from([1, 100, 1 << 26]),
       st.sampled_from([0.0, 0.75]))
def test_property_boxed_rechunks_match_numpy_in_process(case, in_place, band_bytes, share):
    """Under dask's local scheduler too (the same layout), written in place or buffered
    (in bands of one chunk, a few, or the whole box; kept or written in place)."""
    shape, old, new, dtype = case
    a = (np.arange(math.prod(shape)) % 251).astype(dtype).reshape(shape)
    with dask.config.set({"dask_services.rechunk.merge-region-max": 0,
                          "dask_services.rechunk.copy-max-inputs": 0}):
        y = da.from_array(a, chunks=old).rechunk(new, method="service")
    buffered = mock.patch.object(_service, "assembles_in_place", return_value=False)
    slabs = mock.patch.object(_pieces, "slabs_of", wraps=slabs_of)
    with contextlib.nullcontext() if in_place else buffered, slabs as made, \
            mock.patch.object(_service, "MAX_BAND_BYTES", band_bytes), \
            mock.patch.object(_service, "IN_PLACE_BANDS_SHARE", share):
        got = y.compute(scheduler="sync")
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, a)
    # slabs where the rechunk is a service task (not a merge of whole input chunks), and
    # the layout gives a worker a box of two or more outputs that need more than four
    # inputs each
    overlaps = [axis_overlaps(o, n) for o, n in zip(old, new, strict=True)]
    blocks = output_blocks(old, new, 2)
    grid = tuple(map(len, new))
    boxes = {} if blocks is None else owned_boxes(
        {j: box_of(j, blocks, grid) for j in itertools.product(*map(range, grid))})
    few_sizes = [box for box in boxes.values()
                 if len(TileLayout(box, starts_of(new)).parts()) <= 2 ** len(new)]
    many = math.prod(max(c) for c in pieces_per_output(overlaps, new)) > 4
    assert made.called == bool(few_sizes and many and merge_plan(old, new) is None)


def test_a_box_of_chunks_of_many_sizes_takes_pieces():
    """Chunks of many sizes would make a slab per output chunk, each its own frame:
    such a box takes packed pieces as before; one of a regular grid and a smaller last
    chunk takes slabs."""
    a = np.arange(10 * 60, dtype="f8").reshape(10, 60)
    x = da.from_array(a, chunks=(1, 60))
    for new, boxed in [((10, (1, 2, 3, 4, 5, 6, 7, 8, 9, 15)), False),
                       ((10, (7,) * 8 + (4,)), True)]:
        y = x.rechunk(new, method="service")
        with mock.patch.object(_pieces, "slabs_of", wraps=slabs_of) as made:
            np.testing.assert_array_equal(y.compute(scheduler="sync"), a)
        assert made.called == boxed, new


# ----------------------------------------------------------------- buffered: bands


@st.composite
def boxes_and_limits(draw):
    ndim = draw(st.integers(1, 3))
    new = tuple(chunking(draw, draw(st.integers(1, 12)), 6) for _ in range(ndim))
    box = []
    for axis in new:
        lo = draw(st.integers(0, len(axis) - 1))
        box.append(range(lo, draw(st.integers(lo + 1, len(axis)))))
    return new, tuple(box), draw(st.sampled_from([1, 2, 8])), draw(st.integers(1, 4000))


@settings(max_examples=300, deadline=None)
@given(boxes_and_limits())
def test_bands_cover_the_box_once_each_within_its_limit(case):
    """Every output chunk of the box is in one band, which is a sub-box of at most the
    limit (one chunk where a chunk is larger), the innermost axes whole where they fit."""
    new, box, itemsize, limit = case
    starts = starts_of(new)
    bands = Bands(TileLayout(box, starts), itemsize, limit)
    biggest = itemsize * math.prod(max((starts[d][k + 1] - starts[d][k] for k in r),
                                       default=0) for d, r in enumerate(box))
    seen: list[tuple[int, ...]] = []
    for band, left in bands.left.items():
        chunks = list(itertools.product(*bands.box(band)))
        assert chunks and left == len(chunks)
        assert all(bands.of(j) == band for j in chunks)
        assert len(chunks) == 1 or len(chunks) * biggest <= limit
        seen += chunks
    assert sorted(seen) == sorted(itertools.product(*box))
    # an axis is cut only where every axis inside it is whole
    cut = [d for d, (step, r) in enumerate(zip(bands.steps, box, strict=True))
           if step < len(r)]
    if cut:
        assert all(bands.steps[d] == len(box[d]) for d in range(max(cut) + 1, len(box)))
        assert all(bands.steps[d] == 1 for d in range(max(cut)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(boxed_rechunks(), st.integers(1, 600), st.integers(0, 2000))
def test_parts_of_slabs_for_bands_make_numpys_chunks_when_the_band_completes(
        case, limit, in_place_budget):
    """A buffering instance keeps each slab as its parts for the bands it reaches (one
    part per band), but for the first bands that fit a share of its budget, whose parts
    are written into their boxes; a band completes once, when its last chunk has all its
    pieces, and assembled then from the parts kept so far (or its box's tiles), each
    chunk is a C-ordered tile with numpy's values."""
    shape, old, new, box, order = case
    a, overlaps, counts, new_starts, layout = boxed_setup(case)
    bands = Bands(layout, 8, limit)
    in_place = bands.fitting(in_place_budget)
    assert sum(map(bands.nbytes, in_place)) <= in_place_budget
    assert in_place == list(bands.left)[:len(in_place)]
    boxes: dict[tuple[int, ...], TiledBox] = {}
    count = BoxCount(box, counts)
    kept: dict[tuple[int, ...], list] = {}
    assembled: dict[tuple[int, ...], np.ndarray] = {}

    def completed(j):
        band = bands.completes(j)
        if band is not None:
            assert not set(itertools.product(*bands.box(band))) & set(assembled)
            band_layout = bands.layout_of(band)
            if band in boxes:
                assert band not in kept
                assembled.update((j, boxes[band].chunk(j))
                                 for j in itertools.product(*band_layout.box))
            else:
                assembled.update(assemble_band(band_layout, kept.pop(band, []),
                                               np.dtype("f8"), {}))

    for j in itertools.product(*box):  # (no piece to wait for: complete at the start)
        if not math.prod(counts[d][jd] for d, jd in enumerate(j)):
            completed(j)
    for _, at, block in arriving_blocks(a, old, order):
        slabs = [slab.placed(layout, whole=False) for slab in slabs_of(block, at, layout)]
        for slab in slabs:
            reached = set(bands.reached(slab))
            for band in reached & set(in_place) - set(boxes):
                boxes[band] = TiledBox(bands.layout_of(band), slab.dtype)
            parts, aside = band_parts(bands, [slab], boxes)
            assert aside == []
            assert len({band for band, _, _ in parts}) == len(parts)
            assert {band for band, _, _ in parts} == reached - set(in_place)
            written = sum(math.prod(p.shape) for band, (_, p) in bands.cut(slab)
                          if band in boxes) * 8
            assert sum(n for _, _, n in parts) == slab.nbytes - written
            for band, part, _ in parts:
                assert part[1].base is None  # (a copy of its own)
                kept.setdefault(band, []).append(part)
        for slab in slabs:
            for j in count.add(slab):
                completed(j)
    assert not kept and set(bands.left.values()) == {0}
    assert sorted(assembled) == sorted(itertools.product(*box))
    for j, chunk in assembled.items():
        where = tuple(slice(new_starts[d][jd], new_starts[d][jd + 1]) for d, jd in enumerate(j))
        assert chunk.flags.c_contiguous and chunk.shape == a[where].shape
        np.testing.assert_array_equal(chunk, a[where])


def test_a_band_of_mixed_dtypes_or_loose_pieces_is_filled_chunk_by_chunk():
    """Parts of several dtypes, or pieces that came as pieces: each chunk filled from its
    own pieces, its dtype promoted from theirs alone, as buffered pieces are."""
    starts = starts_of(((2,), (2, 2)))
    layout = TileLayout((range(1), range(2)), starts)
    parts = [((0, 0), np.array([[[[1, 2]], [[3, 4]]]], "f4")),  # row 0 of both chunks
             ((1, 0), np.array([[[[5.5, 6.5]]]], "f8")),  # row 1 of chunk 0
             ((1, 2), np.array([[[[7, 8]]]], "f4"))]  # row 1 of chunk 1
    got = assemble_band(layout, parts, np.dtype("f8"), {})
    assert got[0, 0].dtype == np.dtype("f8") and got[0, 1].dtype == np.dtype("f4")
    np.testing.assert_array_equal(got[0, 0], [[1, 2], [5.5, 6.5]])
    np.testing.assert_array_equal(got[0, 1], [[3, 4], [7, 8]])
    loose = {(0, 1): [((1, 0), np.array([[7, 8]], "i8"))]}
    got = assemble_band(layout, parts[:2], np.dtype("f8"), loose)
    assert got[0, 1].dtype == np.dtype("f8")
    np.testing.assert_array_equal(got[0, 1], [[3, 4], [7, 8]])


def test_a_part_that_does_not_fit_its_band_held_in_place_is_set_aside_as_pieces():
    starts = starts_of(((2,), (2, 2)))
    layout = TileLayout((range(1), range(2)), starts)
    bands = Bands(layout, 8, 32)  # one chunk per band
    assert bands.steps == (1, 1) and bands.fitting(32) == [(0, 0)]
    boxes = {(0, 0): TiledBox(bands.layout_of((0, 0)), np.dtype("i8"))}
    (ints,) = slabs_of(np.array([[1, 2, 3, 4]], "i4"), (0, 0), layout)
    parts, aside = band_parts(bands, [ints.placed(layout, whole=False)], boxes)
    # the band in place: written (i4 fits i8); the other kept as a copy
    assert aside == [] and [(b, at) for b, (at, _), _ in parts] == [((0, 1), (0, 2))]
    np.testing.assert_array_equal(boxes[0, 0].chunk((0, 0))[0], [1, 2])
    (floats,) = slabs_of(np.array([[0.5, 1.5, 2.5, 3.5]]), (1, 0), layout)
    parts, aside = band_parts(bands, [floats.placed(layout, whole=False)], boxes)
    assert [(j, offset) for j, offset, _ in aside] == [((0, 0), (1, 0))]
    np.testing.assert_array_equal(aside[0][2], [[0.5, 1.5]])
    assert aside[0][2].base is None


def test_a_band_missing_elements_says_which_chunks_and_why():
    starts = starts_of(((2,), (2, 2)))
    layout = TileLayout((range(1), range(2)), starts)
    with pytest.raises(ValueError, match=r"output chunks \(0, 0\) to \(0, 1\) together got "
                                         r"4 elements .* instead of 8.*chunks="):
        assemble_band(layout, [((0, 0), np.zeros((1, 2, 1, 2), "f4"))], np.dtype("f4"), {})


def recorded_buffered(partitions: list):
    """``SpillBuffer.add_batch`` of every instance, noting the partitions kept."""
    add_batch = _spill.SpillBuffer.add_batch

    async def noted(self, pieces):
        pieces = list(pieces)
        partitions.extend(p for p, _, _ in pieces)
        return await add_batch(self, pieces)

    return mock.patch.object(_spill.SpillBuffer, "add_batch", noted)


def first_half(bands, budget):
    return list(bands.left)[:len(bands.left) // 2]


@pytest.mark.parametrize("mode", ["spilled", "buffered", "half in place"])
@service_cluster(timeout=90)
async def test_a_buffered_time_series_keeps_a_part_per_band_not_a_piece_per_tile(
        c, s, a, b, mode):
    """Outputs that do not fit the buffer budget together: each worker keeps a step's
    slab as its part for each band of its box (three tiles here), not a piece per tile
    (it kept 18 per step and worker before), in memory or spilled to disk, but for the
    bands held in place, written into as their parts arrive (it kept every band before);
    numpy's values, and nothing left on the workers."""
    base = np.random.default_rng(8).random((30, 24, 36)).astype("f4")
    partitions: list = []
    tile_bytes = 30 * 4 * 6 * 4
    settings = {"dask_services.rechunk.buffer-fraction": 1e-9} if mode == "spilled" else {}
    in_place = (mock.patch.object(_bands.Bands, "fitting", first_half)
                if mode == "half in place"
                else mock.patch.object(_service, "IN_PLACE_BANDS_SHARE", 0.0))
    with dask.config.set(settings), recorded_buffered(partitions), in_place, \
            mock.patch.object(_service, "assembles_in_place", return_value=False), \
            mock.patch.object(_service, "MAX_BAND_BYTES", 3 * tile_bytes):
        y = da.from_array(base, chunks=(1, 24, 36)).rechunk((30, 4, 6), method="service")
        got = await c.compute(y)
        np.testing.assert_array_equal(got, base)
        assert await c.compute(y.sum()) == pytest.approx(base.sum(), rel=1e-5)
    # (6 x 6 tiles, a box of 18 per worker, in bands of one chunk when every byte spills;
    # two runs, each step's slabs for both workers)
    per_step = {"spilled": 36, "buffered": 36 // 3, "half in place": 36 // 6}[mode]
    assert all(p[0] == "band" for p in partitions)
    assert len(partitions) == 2 * 30 * per_step
    del got
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("in_place_share", [0.0, 0.75])
@service_cluster(timeout=90)
async def test_a_buffered_masked_time_series_keeps_masks_values_and_fill_value(
        c, s, a, b, in_place_share):
    values = np.random.default_rng(9).integers(0, 100, (20, 12, 12)).astype("i4")
    base = np.ma.masked_array(values, mask=values % 7 == 0, fill_value=-3)
    with mock.patch.object(_service, "assembles_in_place", return_value=False), \
            mock.patch.object(_service, "IN_PLACE_BANDS_SHARE", in_place_share), \
            mock.patch.object(_service, "MAX_BAND_BYTES", 2 * 20 * 3 * 3 * 5):
        got = await c.compute(da.from_array(base, chunks=(1, 12, 12))
                              .rechunk((20, 3, 3), method="service"))
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(base))
    np.testing.assert_array_equal(got.filled(0), base.filled(0))
    assert got.fill_value == -3
    del got
    await assert_nothing_left(s, [a, b])
