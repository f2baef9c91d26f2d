"""Small pieces of an input chunk for one peer travel packed in one buffer
(``array._service.PackedPieces``): the same pieces come out, in one frame, and a receiver
that keeps them gets arrays of their own."""

from __future__ import annotations

import numpy as np
import pytest
from distributed.protocol import deserialize, serialize
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_services.array._service import (
    PACK_BELOW,
    VIEWS_FROM_SHARE,
    PackedPieces,
    axis_overlaps,
    batch_bytes,
    held_by_sends,
    keeps_views,
    output_indices,
    pieces_by_destination,
    unpacked,
    write_into,
)

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


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**9), st.lists(st.integers(0, 10**8), min_size=1, max_size=16))
def test_views_charge_their_whole_chunk_to_the_sends_that_hold_it(chunk, batches):
    peers = sum(batches)
    if peers > chunk:
        chunk = peers
    charged = [held_by_sends(n, peers, chunk) for n in batches]
    assert all(c >= n for c, n in zip(charged, batches, strict=True))
    if keeps_views(peers, chunk):
        # the chunk, held by its views until the last is sent, is charged in full (no more
        # than one byte too much per batch, from rounding up) ...
        assert chunk <= sum(charged) <= chunk + len(batches)
        assert all(c <= n / VIEWS_FROM_SHARE + 1 for c, n in zip(charged, batches,
                                                                strict=True))
    else:  # ... and copied pieces hold only themselves
        assert charged == batches


def test_write_into_writes_every_piece_where_it_goes():
    block = np.arange(60.0).reshape(6, 10)
    overlaps, new = row_to_column_blocks(6, 10, 3)
    owner = {(0, j): "peer" for j in range(4)}
    batches = [pieces_by_destination(block, (0, 0), overlaps, owner, "here")["peer"]]
    outputs = {j: np.full((6, new[1][j[1]]), -1.0) for j in output_indices(batches)}
    written = write_into(outputs, batches)
    assert sorted(written) == [((0, j), 6 * new[1][j] * 8) for j in range(4)]
    np.testing.assert_array_equal(np.concatenate([outputs[(0, j)] for j in range(4)], axis=1),
                                  block)


def test_packed_pieces_travel_as_one_frame_where_arrays_travel_as_one_each():
    """The reason for packing: 200 pieces of 400 bytes serialize to a frame each as arrays
    of their own, to one buffer's frames packed."""
    pieces = [((0, j), (0, 0), np.zeros((10, 10), np.float32)) for j in range(200)]
    header, frames = serialize([pieces], serializers=("dask", "pickle"))
    assert len(frames) >= 200
    header, frames = serialize([[PackedPieces.of(pieces)]], serializers=("dask", "pickle"))
    assert len(frames) <= 3
