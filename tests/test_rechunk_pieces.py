"""Small pieces of an input chunk for one peer travel packed in one buffer
(``array._pieces.PackedPieces``): the same pieces come out, in one frame, and a receiver
that keeps them gets arrays of their own."""

from __future__ import annotations

import numpy as np
import pytest
from distributed.protocol import deserialize, serialize
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_services.array._pieces import (
    PACK_BELOW,
    PackedPieces,
    batch_bytes,
    is_view,
    output_indices,
    own_bytes,
    pieces_by_destination,
    unpacked,
    write_into,
)
from dask_services.array._plan import axis_overlaps

pytestmark = pytest.mark.timeout(60)

DTYPES = [np.bool_, np.int8, np.uint16, np.float32, np.float64, np.complex128,
          "datetime64[ns]", "U3", np.dtype([("a", "i4"), ("b", "f8")])]


def row_to_column_blocks(rows: int, cols: int, k: int) -> tuple:
    old = ((rows,), (cols,))
    new = ((rows,), tuple(min(k, cols - c) for c in range(0, cols, k)))
    return [axis_overlaps(o, n) for o, n in zip(old, new, strict=True)], new


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 9), st.integers(1, 40), st.integers(1, 7))
def test_packed_pieces_come_out_as_they_went_in(dtype, rows, cols, k):
    block = np.arange(rows * cols).astype(dtype).reshape(rows, cols)
    overlaps, new = row_to_column_blocks(rows, cols, k)
    owner = {(0, j): "peer" for j in range(len(new[1]))}
    (batch,) = pieces_by_destination(block, (0, 0), overlaps, owner, "here").values()
    header, frames = serialize([batch], serializers=("dask", "pickle"))
    assert len(frames) <= 3  # the buffer and the index, not a frame per piece
    (received,) = deserialize(header, frames)
    pieces = unpacked([received], copy=True)
    assert [j for j, _, _ in pieces] == [(0, j) for j in range(len(new[1]))]
    for j, offset, piece in pieces:
        assert offset == (0, 0)
        np.testing.assert_array_equal(piece, block[:, j[1] * k:(j[1] + 1) * k])
        if isinstance(batch[0], PackedPieces):  # (a lone piece travels as it is)
            assert piece.base is None  # its own memory: keeping it keeps no buffer
    assert batch_bytes(batch) == block.nbytes


def test_only_small_pieces_for_peers_are_packed():
    block = np.zeros((PACK_BELOW // 8, 4))  # columns of exactly PACK_BELOW bytes
    overlaps, new = row_to_column_blocks(*block.shape, 1)
    owner = {(0, 0): "here", (0, 1): "here", (0, 2): "peer", (0, 3): "peer"}
    out = pieces_by_destination(block, (0, 0), overlaps, owner, "here")
    assert all(type(item) is tuple and item[2].base is not None for item in out["here"])
    # large pieces for peers stay views too: the lane copies their strided parts as it
    # sends them (_bulk.py)
    assert all(type(item) is tuple and item[2].base is not None for item in out["peer"])
    # ... where the peers' share of the chunk is a quarter or more
    quarter = {(0, 0): "here", (0, 1): "here", (0, 2): "here", (0, 3): "peer"}
    (view,) = pieces_by_destination(block, (0, 0), overlaps, quarter, "here")["peer"]
    assert view[2].base is not None
    # ... and under it they are copied: a view would hold the whole chunk for a small piece
    wide = np.zeros((PACK_BELOW // 8, 5))
    overlaps5, _ = row_to_column_blocks(*wide.shape, 1)
    few = {(0, j): "here" for j in range(4)} | {(0, 4): "peer"}
    (alone,) = pieces_by_destination(wide, (0, 0), overlaps5, few, "here")["peer"]
    assert alone[2].base is None and alone[2].flags.c_contiguous
    small = np.zeros((6, 4))
    out = pieces_by_destination(small, (0, 0), overlaps, owner, "here")
    (packed,) = out["peer"]
    assert isinstance(packed, PackedPieces) and len(packed) == 2
    lone = {(0, 2): "peer", (0, 0): "here", (0, 1): "here"}
    (single,) = pieces_by_destination(small, (0, 0), overlaps, lone, "here")["peer"]
    assert type(single) is tuple and single[2].flags.c_contiguous  # nothing to pack with
    objects = np.empty((2, 4), dtype=object)
    objects[:] = "x"
    # objects travel pickled: a strided piece is copied in the thread that splits
    assert all(type(item) is tuple and item[2].flags.c_contiguous
               for item in pieces_by_destination(objects, (0, 0), overlaps, owner,
                                                 "here")["peer"])


def test_under_a_quarter_for_peers_every_piece_for_them_is_copied():
    """A contiguous view (whole rows) holds its chunk as much as a strided one: where the
    peers' share is small, their pieces are copied whatever their layout, and only the
    copies' bytes are in memory of their own."""
    block = np.arange(1000.0 * 100).reshape(1000, 100)
    overlaps = [axis_overlaps(o, n) for o, n in zip(((1000,), (100,)), ((900, 100), (100,)),
                                                     strict=True)]
    out = pieces_by_destination(block, (0, 0), overlaps, {(0, 0): "here", (1, 0): "peer"},
                                "here")
    (rows,) = out["peer"]
    assert not is_view(rows) and rows[2].flags.c_contiguous
    np.testing.assert_array_equal(rows[2], block[900:])
    assert own_bytes(out["peer"]) == rows[2].nbytes
    assert all(is_view(item) for item in out["here"])
    # a larger share stays views, with no bytes of their own
    out = pieces_by_destination(block, (0, 0), overlaps, {(0, 0): "peer", (1, 0): "here"},
                                "here")
    assert all(is_view(item) for item in out["peer"]) and own_bytes(out["peer"]) == 0
    # a lone small piece (nothing to pack it with) is copied even where contiguous
    rows = [axis_overlaps(o, n) for o, n in zip(((10,), (4,)), ((9, 1), (4,)), strict=True)]
    out = pieces_by_destination(np.zeros((10, 4)), (0, 0), rows,
                                {(0, 0): "here", (1, 0): "peer"}, "here")
    (lone,) = out["peer"]
    assert not is_view(lone) and own_bytes(out["peer"]) == lone[2].nbytes


def test_write_into_writes_every_piece_where_it_goes():
    block = np.arange(60.0).reshape(6, 10)
    overlaps, new = row_to_column_blocks(6, 10, 3)
    owner = {(0, j): "peer" for j in range(4)}
    batches = [pieces_by_destination(block, (0, 0), overlaps, owner, "here")["peer"]]
    outputs = {j: np.full((6, new[1][j[1]]), -1.0) for j in output_indices(batches)}
    written, aside, _ = write_into(outputs, batches)
    assert sorted(written) == [((0, j), 6 * new[1][j] * 8) for j in range(4)]
    assert aside == []
    np.testing.assert_array_equal(np.concatenate([outputs[(0, j)] for j in range(4)], axis=1),
                                  block)


def test_write_into_sets_aside_copies_of_the_pieces_that_do_not_fit_their_chunk():
    """A float piece for an integer chunk is not truncated into it: it is set aside (a copy,
    not a view holding the received buffer) for the chunk's promotion."""
    block = np.arange(60).reshape(6, 10)
    ints = [((0, 0), (0, 0), block[:, :5]), ((0, 1), (0, 0), block[:, 5:])]
    floats = [(j, offset, piece / 2) for j, offset, piece in ints]
    outputs = {j: np.zeros((6, 5), "i8") for j, _, _ in ints}
    written, aside, _ = write_into(outputs, [floats[:1], ints[1:]])
    assert [j for j, _ in written] == [(0, 0), (0, 1)]
    assert len(aside) == 1 and aside[0][0] == (0, 0) and aside[0][2].base is None
    np.testing.assert_array_equal(aside[0][2], floats[0][2])
    assert not outputs[(0, 0)].any()  # nothing truncated into it
    np.testing.assert_array_equal(outputs[(0, 1)], np.arange(60).reshape(6, 10)[:, 5:])


def test_packed_pieces_travel_as_one_frame_where_arrays_travel_as_one_each():
    """The reason for packing: 200 pieces of 400 bytes serialize to a frame each as arrays
    of their own, to one buffer's frames packed."""
    pieces = [((0, j), (0, 0), np.zeros((10, 10), np.float32)) for j in range(200)]
    header, frames = serialize([pieces], serializers=("dask", "pickle"))
    assert len(frames) >= 200
    header, frames = serialize([[PackedPieces.of(pieces)]], serializers=("dask", "pickle"))
    assert len(frames) <= 3


def test_a_dtype_of_no_bytes_rechunks_as_p2p_does():
    """``np.dtype([])`` has itemsize 0: its packed pieces have no bytes to view (the
    receiver failed with numpy's "changing to a smaller dtype" error)."""
    import dask.array as da

    empty = np.dtype([])
    pieces = [((0, j), (0, 0), np.zeros((2, 5), empty)) for j in range(2)]
    out = PackedPieces.of(pieces).pieces(copy=False)
    assert [(j, piece.shape, piece.dtype) for j, _, piece in out] == [
        ((0, 0), (2, 5), empty), ((0, 1), (2, 5), empty)]
    x = da.from_array(np.zeros((12, 10), empty), chunks=(2, 10))
    got = x.rechunk((12, 2), method="service").compute(scheduler="sync")
    assert got.shape == (12, 10) and got.dtype == empty


MIXED = [  # declared dtype, the dtypes of a chunk's three pieces
    ("f8", ["f4", "f8", "f4"]),
    ("i8", ["i8", "f8", "i4"]),
    ("S3", ["S3", "S5", "U2"]),
    ("u8", ["u8", "i8", "u1"]),
    ([("a", "i4")], [[("a", "i4")], [("b", "i4")], [("a", "i4")]]),  # no common dtype
    ("M8[ns]", ["M8[ns]", "f8", "M8[ns]"]),  # none either
]


def assembled_in_every_order(pieces, declared):
    """Output chunk (0, 0) of shape (2, 6) written in place from ``pieces`` (offset, array)
    arriving in every order, as an instance writes them (allocated with the first piece's
    dtype, pieces that do not fit set aside and the chunk promoted once complete), by
    order of arrival, and assembled from them buffered (``"buffered"``)."""
    import itertools

    from dask_services.array._pieces import fill, new_array, pieces_dtype, promoted

    results = {"buffered": fill(new_array((2, 6), pieces_dtype(declared, pieces)), pieces)}
    for order in itertools.permutations(range(len(pieces))):
        outputs = {(0, 0): np.zeros((2, 6), pieces[order[0]][1].dtype)}
        aside = []
        for k in order:
            _, more, _ = write_into(outputs, [[((0, 0), *pieces[k])]])
            aside += [(offset, piece) for _, offset, piece in more]
        results[order] = (promoted(outputs[(0, 0)], aside, declared, (0, 0)) if aside
                          else outputs[(0, 0)])
    return results


@pytest.mark.parametrize("declared, dtypes", MIXED)
def test_a_chunk_written_in_place_gets_the_buffered_chunks_dtype_in_every_order(
        declared, dtypes):
    """An output chunk written in place is allocated with the dtype of its first piece to
    arrive; pieces that do not fit it are set aside and the chunk promoted once complete.
    Whatever the order, it equals the chunk assembled from the same pieces buffered
    (``chunk_dtype``: numpy's promotion, else the declared dtype), values and dtype."""
    pieces = [((0, 2 * k), (np.arange(4) + 4 * k + 1).astype(dt).reshape(2, 2))
              for k, dt in enumerate(map(np.dtype, dtypes))]
    results = assembled_in_every_order(pieces, np.dtype(declared))
    expected = results.pop("buffered")
    assert len(results) == 6
    for order, got in results.items():
        assert got.dtype == expected.dtype, order
        np.testing.assert_array_equal(got, expected)


def test_set_aside_regions_are_not_read_before_they_are_written():
    """``promoted`` copies the chunk into the new dtype before writing the pieces set
    aside: their regions, never written, must not be read (bytes left there by the
    allocator failed the cast of a bytes chunk to str)."""
    from dask_services.array._pieces import promoted

    chunk = np.frombuffer(b"\xff" * 12, "S3").reshape(2, 2).copy()  # garbage, not ASCII
    chunk[:, 0] = [b"ab", b"cd"]
    out = promoted(chunk, [((0, 1), np.array([["x"], ["y"]], "U2"))], np.dtype("S3"), (0, 0))
    assert out.dtype == np.dtype("U3")
    assert out.tolist() == [["ab", "x"], ["cd", "y"]]


MASKED_MIXES = [  # the dtypes of a chunk's three pieces, and which of them are masked
    (["f8", "f8", "f8"], [True, False, True]),
    (["i4", "f8", "i4"], [False, True, False]),
    (["i8", "i8", "f4"], [True, True, True]),
    (["U2", "U4", "U2"], [False, False, True]),
]


@pytest.mark.parametrize("dtypes, masked", MASKED_MIXES)
def test_masked_pieces_among_plain_ones_in_every_order(dtypes, masked):
    """Pieces of masked chunks (as planes) and of plain ones, of one dtype or several: in
    every order of arrival, written in place or buffered, the output chunk is the masked
    array numpy concatenates of them (values promoted, plain pieces unmasked), with the
    fill value the masked pieces share (numpy's concatenation forgets it)."""
    from dask_services.array._masks import as_masked
    from dask_services.array._pieces import plain_numpy

    originals = []
    for k, (dt, is_masked) in enumerate(zip(dtypes, masked, strict=True)):
        values = (np.arange(4) + 4 * k + 1).astype(dt).reshape(2, 2)
        originals.append(np.ma.masked_array(values, mask=[[k % 2, 1], [0, 0]],
                                            fill_value="zz" if dt[0] == "U" else -3)
                         if is_masked else values)
    expected = np.ma.concatenate(originals, axis=1)
    fill_value = next(o.fill_value for o in originals if isinstance(o, np.ma.MaskedArray))
    pieces = [((0, 2 * k), plain_numpy(o)) for k, o in enumerate(originals)]
    results = assembled_in_every_order(pieces, np.dtype(dtypes[0]))
    assert len(results) == 7
    for how, got in results.items():
        got = as_masked(got)
        assert type(got) is np.ma.MaskedArray, how
        assert got.dtype == expected.dtype, how
        np.testing.assert_array_equal(got.mask, np.ma.getmaskarray(expected), err_msg=how)
        np.testing.assert_array_equal(got.data[~got.mask], expected.data[~expected.mask],
                                      err_msg=how)
        assert got.fill_value == fill_value, how


def test_a_masked_chunk_travels_packed_and_pickled_with_its_fill_value():
    """A masked chunk's planes go through packing and pickling (the lane's dtypes, spill
    files) keeping the fill value their dtype carries."""
    import pickle

    from dask_services.array._masks import as_masked, fill_value_of
    from dask_services.array._pieces import plain_numpy

    chunk = np.ma.masked_array(np.arange(12, dtype="f4").reshape(3, 4),
                               mask=np.arange(12).reshape(3, 4) % 3 == 0, fill_value=-9.5)
    planes = plain_numpy(chunk)
    assert fill_value_of(planes.dtype) == -9.5
    overlaps, _ = row_to_column_blocks(3, 4, 1)
    packed = PackedPieces.of([(j, offset, planes[:, offset[1]:offset[1] + 1])
                              for j, offset in [((0, c), (0, c)) for c in range(4)]])
    again = pickle.loads(pickle.dumps(packed, protocol=5))
    column = as_masked(again.pieces(copy=True)[2][2])
    assert column.fill_value == np.float32(-9.5)
    np.testing.assert_array_equal(column.mask, chunk.mask[:, 2:3])
    np.testing.assert_array_equal(column.data, chunk.data[:, 2:3])
