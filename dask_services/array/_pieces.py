"""The pieces of a rechunk: slicing a chunk into the pieces each output needs, packing
small ones for the wire, and writing pieces into output chunks (dtypes promoted as numpy
does, fresh arrays, in-place assembly).

Used by the service's instances (``_service.py``) and by the copies of the graph's
fast paths (``_rechunk.py``, ``_fusion.py``).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import mmap
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np
from dask.sizeof import sizeof

from dask_services._buffers import Buffers
from dask_services._memory import HUGE_PAGE_ADVICE_FROM, without_huge_page_advice
from dask_services.array._masks import (
    as_planes,
    converted,
    data_dtype,
    fill_value_of,
    fill_value_of_masked,
    has_planes,
    planes_dtype,
    write,
)
from dask_services.service import ServiceId

Index = tuple[int, ...]
# (output chunk index, offset of the piece in that chunk, the piece)
Piece = tuple[Index, tuple[int, ...], np.ndarray]
Chunks = tuple[tuple[float, ...], ...]


def plain_numpy(block: Any, key: Any = None) -> np.ndarray:
    """``block`` as a plain numpy array (a memmap's or other plain subclass's data; a
    masked array's data and mask as planes, ``_masks.py``); a clear error for other array
    types (cupy's, sparse ones: their devices or formats would be lost)."""
    if isinstance(block, np.ma.MaskedArray):
        return as_planes(block)
    if not isinstance(block, (np.ndarray, np.generic)):
        chunk = "a chunk" if key is None else f"chunk {key!r}"
        raise TypeError(
            f"the 'service' rechunk handles numpy chunks, masked or not; {chunk} is a "
            f"{type(block).__module__}.{type(block).__name__}. Use method='tasks' (or "
            "'p2p') for other array types; under the array.rechunk.method setting they get "
            "'tasks' when the array's meta says so, and this array's meta says numpy: give "
            "its true type where the array is made (from_delayed(..., meta=...), "
            "map_blocks(..., meta=...))"
        )
    return np.asarray(block)


def chunk_dtype(declared: np.dtype, dtypes: Iterable[np.dtype]) -> np.dtype:
    """The dtype of an output chunk made of pieces of ``dtypes``: theirs, not the one the
    graph's meta declares where the two differ (a ``map_blocks`` given a wrong ``dtype=``),
    as ``tasks`` and ``p2p`` keep the chunks' values; numpy's promotion where pieces differ
    among themselves; ``declared`` for a chunk of no pieces.  Masked pieces (planes): the
    values' dtype so found, with a mask and the first masked piece's fill value."""
    dtypes = list(dtypes)
    found = set(dtypes)  # (dtypes that differ in their metadata only are one)
    masked = next((d for d in dtypes if has_planes(d)), None)
    if masked is not None:
        if len(found) == 1:
            return masked
        return planes_dtype(chunk_dtype(data_dtype(declared), map(data_dtype, found)),
                            fill_value_of(masked))
    if not found or found == {declared}:
        return declared
    if len(found) == 1:
        return found.pop()
    try:
        return np.result_type(*found)
    except TypeError:  # no common dtype (structured ones): the declared one decides
        return declared


def pieces_dtype(declared: Any, pieces: list[tuple[tuple[int, ...], np.ndarray]]) -> np.dtype:
    """:func:`chunk_dtype` of ``pieces`` (offset, array)."""
    return chunk_dtype(np.dtype(declared), (piece.dtype for _, piece in pieces))


def fits(piece: np.dtype, chunk: np.dtype) -> bool:
    """Whether a piece of dtype ``piece`` is written straight into an output chunk of
    dtype ``chunk`` (allocated with the dtype of its first piece to arrive): where numpy
    promotes the two to ``chunk`` (the cast loses nothing, and the chunk's dtype is the
    one all its pieces would get).  Structured dtypes of other fields, and dtypes numpy
    does not promote together, do not fit, whatever ``np.can_cast`` says.  A chunk with
    planes (masked) takes a plain piece whose values fit (unmasked); a chunk without takes
    no piece with planes."""
    if piece == chunk:
        return True
    if has_planes(chunk):
        return fits(data_dtype(piece), data_dtype(chunk))
    if has_planes(piece):
        return False
    try:
        return np.result_type(piece, chunk) == chunk
    except TypeError:
        return False


def promoted(chunk: np.ndarray, aside: list[tuple[tuple[int, ...], np.ndarray]],
             declared: np.dtype, j: Index) -> np.ndarray:
    """Output chunk ``j``, written in place, with the pieces set aside because they did
    not fit its dtype (``fits``): a copy of it in the dtype a chunk of all its pieces
    gets when they are buffered (``chunk_dtype``: numpy's promotion, or where there is
    none the ``declared`` one), whichever piece arrived first, with them written in; a
    clear error where a piece cannot be written into that dtype."""
    for offset, piece in aside:  # never written: the copy must not read what is there
        chunk[region(offset, piece.shape)] = np.zeros((), chunk.dtype)
    dtypes = [chunk.dtype, *(piece.dtype for _, piece in aside)]
    dtype = chunk_dtype(declared, dtypes)
    try:
        out = converted(chunk, dtype)
        write_pieces([(out, offset, piece) for offset, piece in aside])
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"rechunk: output chunk {j} is made of input chunks of dtypes "
            f"{sorted(set(map(str, dtypes)))}, which cannot all be written into {dtype} "
            f"({e}). The array's chunks do not all have one dtype (a map_blocks returning "
            "other dtypes than its dtype= says?): make them agree (.astype()) before the "
            "rechunk, or use method='tasks'"
        ) from None
    return out


def merge_blocks(shape: tuple[float, ...], dtype: np.dtype, offsets: list[tuple[int, ...]],
                 *blocks: np.ndarray) -> np.ndarray:
    """One output chunk of a rechunk that only merges: its input chunks, each placed at its
    offset, in one new (C-ordered, writeable) array (masked if any of them is)."""
    if any(isinstance(b, np.ma.MaskedArray) for b in blocks):
        return assembled_apart(merge_blocks, shape, dtype, offsets, blocks)
    pieces = [(o, plain_numpy(b)) for o, b in zip(offsets, blocks, strict=True)]
    return fill(fresh_array(output_shape(shape, pieces), pieces_dtype(dtype, pieces)), pieces)


def copy_pieces(shape: tuple[float, ...], dtype: np.dtype,
                layout: list[tuple[tuple[slice, ...] | None, tuple[int, ...]]],
                *blocks: np.ndarray) -> np.ndarray:
    """One output chunk of a region with no other output: from every input chunk, the
    slice it needs (``layout``: slices and offset in the output, per input; ``None``: the
    block is that slice already), in one new (C-ordered, writeable) array (masked if any
    of them is)."""
    if any(isinstance(b, np.ma.MaskedArray) for b in blocks):
        return assembled_apart(copy_pieces, shape, dtype, layout, blocks)
    pieces = [(offset, plain_numpy(block) if slices is None else plain_numpy(block)[slices])
              for (slices, offset), block in zip(layout, blocks, strict=True)]
    return fill(fresh_array(output_shape(shape, pieces), pieces_dtype(dtype, pieces)), pieces)


def assembled_apart(assemble: Any, shape: tuple[float, ...], dtype: np.dtype, layout: Any,
                    blocks: tuple[np.ndarray, ...]) -> np.ma.MaskedArray:
    """An output chunk of a copy or a merge (``assemble``) with masked input chunks among
    ``blocks``: the values assembled, then the masks (``False`` where a block has none),
    each copied once as ``tasks`` copies them; the fill value of the first masked block
    (as a service task's output gets it, ``_masks.py``)."""
    values = assemble(shape, dtype, layout, *map(np.ma.getdata, blocks))
    mask = assemble(shape, np.ma.make_mask_descr(values.dtype), layout,
                    *map(np.ma.getmaskarray, blocks))
    first = next(b for b in blocks if isinstance(b, np.ma.MaskedArray))
    return np.ma.MaskedArray(values, mask=mask, fill_value=fill_value_of_masked(first))


def copy_part(block: np.ndarray, part: tuple[slice, ...]) -> np.ndarray:
    """One output chunk cut out of a merged region: a C-ordered, writeable copy."""
    if isinstance(block, np.ma.MaskedArray):
        return block[part].copy(order="C")
    return np.array(plain_numpy(block)[part], order="C", copy=True)


def take_slice(block: np.ndarray, slices: tuple[slice, ...]) -> np.ndarray:
    """The part of an input chunk that one output chunk needs (a view: on the input's
    worker it costs nothing; sent to another worker, only its own bytes travel)."""
    if isinstance(block, np.ma.MaskedArray):  # a view of data and mask, with its fill value
        return block[slices]
    return plain_numpy(block)[slices]


def slice_block(block: np.ndarray, index: Index,
                overlaps: list[list[list[tuple[int, slice, int]]]]) -> list[Piece]:
    """The pieces of the input chunk at ``index``: one per output chunk it overlaps."""
    per_axis = [overlaps[d][i] for d, i in enumerate(index)]
    pieces = []
    for combo in itertools.product(*per_axis):
        j, slices, offset = zip(*combo, strict=True)
        pieces.append((j, offset, block[slices]))
    return pieces


# pieces for a peer smaller than this travel copied into one buffer per input and peer
# (``PackedPieces``); larger ones as arrays of their own
PACK_BELOW = 64 * 1024
# an input chunk's pieces for peers stay views where the peers' share of the chunk is at
# least this; views hold their whole chunk until the last is delivered, so the send window
# counts the chunk's bytes for that long (at most 1 / this times what the pieces carry);
# under it, the few bytes for peers are copied and the chunk let go
VIEWS_FROM_SHARE = 0.25


class PackedPieces:
    """The small pieces of one input chunk for one peer, copied into one buffer.

    Sent as arrays of their own, pieces travel as a frame and a header each: distributed's
    serialization took ~20 us a piece to write and ~9 us to read back, more than copying a
    64 kB piece, and a rechunk of 1,000 x 1,000 chunks (400-byte pieces) took 3.5x p2p's
    time.  One buffer travels as one frame.  ``pieces(copy=True)`` gives each piece an
    array of its own, for a receiver that keeps them (a view would keep the whole buffer).
    """

    __slots__ = ("dtype", "index", "buffer")

    def __init__(self, dtype: np.dtype, index: list[tuple[Index, tuple[int, ...],
                                                          tuple[int, ...]]],
                 buffer: np.ndarray) -> None:
        self.dtype = dtype
        self.index = index  # (output index, offset in the output, shape) per piece
        self.buffer = buffer

    @classmethod
    def of(cls, pieces: list[Piece]) -> PackedPieces:
        dtype = pieces[0][2].dtype
        typed = np.empty(sum(piece.size for _, _, piece in pieces), dtype)
        index = []
        start = 0
        for j, offset, piece in pieces:
            end = start + piece.size
            typed[start:end].reshape(piece.shape)[...] = piece
            index.append((j, offset, piece.shape))
            start = end
        return cls(dtype, index, typed.view(np.uint8))

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def __len__(self) -> int:
        return len(self.index)

    def pieces(self, copy: bool) -> list[Piece]:
        out = []
        start = 0
        typed = (self.buffer.view(self.dtype) if self.dtype.itemsize
                 # a dtype of no bytes (np.dtype([])): nothing to view, nothing to read
                 else np.empty(sum(math.prod(shape) for _, _, shape in self.index),
                               self.dtype))
        for j, offset, shape in self.index:
            end = start + math.prod(shape)
            piece = typed[start:end].reshape(shape)
            out.append((j, offset, piece.copy() if copy else piece))
            start = end
        return out

    def __reduce__(self) -> tuple:
        return (PackedPieces, (self.dtype, self.index, self.buffer))


class TileLayout:
    """How an instance holds its box of output chunks (``box``: chunk ranges per axis;
    ``starts[d][k]``: where chunk ``k`` starts along axis ``d``, with the end of the
    last): along each axis the box's chunks fall in runs of one size, and every
    combination of runs (a ``part``) is one array of shape (chunks along each axis...,
    chunk size along each axis...), in which each output chunk is one C-ordered tile.
    A regular grid is one part; its last, smaller chunks make a few more.

    The part of an input chunk for the box, cut at the runs' and chunks' boundaries
    (``segments``), is a few blocks of whole or partial tiles; each, viewed in tile
    order, is a ``Slab`` that goes into its part with one assignment (or one read from
    the socket)."""

    def __init__(self, box: tuple[range, ...], starts: list[list[int]]) -> None:
        self.box = box
        self.starts = starts
        self.runs: list[list[tuple[int, int, int]]] = []  # per axis: (first, end, size)
        for d, r in enumerate(box):
            runs: list[tuple[int, int, int]] = []
            for k in r:
                size = starts[d][k + 1] - starts[d][k]
                if runs and runs[-1][2] == size:
                    runs[-1] = (runs[-1][0], k + 1, size)
                else:
                    runs.append((k, k + 1, size))
            self.runs.append(runs)
        self.run_firsts = [[first for first, _, _ in runs] for runs in self.runs]
        self.extent = tuple((starts[d][r.start], starts[d][r.stop])
                            for d, r in enumerate(box))

    def parts(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Every part (run index per axis) and its array's shape."""
        return {part: (*(self.runs[d][i][1] - self.runs[d][i][0] for d, i in enumerate(part)),
                       *(self.runs[d][i][2] for d, i in enumerate(part)))
                for part in itertools.product(*(range(len(r)) for r in self.runs))}

    def tile(self, j: Index) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The part that output chunk ``j`` is in, and its index there."""
        part, at = [], []
        for d, jd in enumerate(j):
            i = bisect.bisect_right(self.run_firsts[d], jd) - 1
            part.append(i)
            at.append(jd - self.runs[d][i][0])
        return tuple(part), tuple(at)

    def locate(self, at: tuple[int, ...]) -> tuple[Index, tuple[int, ...]]:
        """For a slab starting at ``at``: the output chunk it starts in, and where in
        that chunk."""
        first, offset = [], []
        for d, a in enumerate(at):
            k = bisect.bisect_right(self.starts[d], a) - 1
            while self.starts[d][k + 1] == self.starts[d][k]:  # (past chunks of no length)
                k += 1
            first.append(k)
            offset.append(a - self.starts[d][k])
        return tuple(first), tuple(offset)

    def segments(self, at: tuple[int, ...], shape: tuple[int, ...]
                 ) -> list[tuple[tuple[int, ...], tuple[slice, ...], tuple[int, ...]]]:
        """The block of the array starting at ``at`` of ``shape`` (inside the box) cut at
        the runs' and chunks' boundaries: for each segment, where it starts, the slices
        of the block it is, and its shape in tile order (chunks..., lengths...)."""
        per_axis = []
        for d, (a0, n) in enumerate(zip(at, shape, strict=True)):
            a1, along = a0 + n, []
            for first, end, size in self.runs[d]:
                if not size:
                    continue
                base = self.starts[d][first]
                lo, hi = max(a0, base), min(a1, self.starts[d][end])
                while lo < hi:
                    offset = (lo - base) % size
                    if offset or hi - lo < size:  # a part of one chunk
                        length = min(size - offset, hi - lo)
                        along.append((lo, length, 1, length))
                    else:  # whole chunks
                        count = (hi - lo) // size
                        length = count * size
                        along.append((lo, length, count, size))
                    lo += length
            per_axis.append(along)
        out = []
        for combo in itertools.product(*per_axis):
            out.append((tuple(lo for lo, _, _, _ in combo),
                        tuple(slice(lo - a0, lo - a0 + length)
                              for (lo, length, _, _), a0 in zip(combo, at, strict=True)),
                        (*(c for _, _, c, _ in combo), *(s for _, _, _, s in combo))))
        return out


def in_tile_order(block: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``block`` (chunks x lengths along each axis) viewed as ``shape`` (chunks...,
    lengths...): each tile one index of the first half (a view; no copy)."""
    ndim = block.ndim
    split = [n for pair in zip(shape[:ndim], shape[ndim:], strict=True) for n in pair]
    return block.reshape(split).transpose(*range(0, 2 * ndim, 2), *range(1, 2 * ndim, 2))


class Slab:
    """The part of one input chunk for a block of whole or partial output chunks of the
    same size in an instance's box (``TileLayout.segments``), in tile order: travels as
    one array and goes into its part of the box with one assignment (or is read into it
    from the socket), and is counted with one numpy operation (``BoxCount``), where a
    piece per output chunk took microseconds of Python each on both sides.  ``at``: where
    it starts along each axis (in the service task's region of the array); its array has
    the shape (chunks along each axis..., length along each axis...)."""

    __slots__ = ("at", "array", "first", "offset", "whole")

    def __init__(self, at: tuple[int, ...], array: np.ndarray) -> None:
        self.at = at
        self.array = array
        self.first: Index = ()
        self.offset: tuple[int, ...] = ()
        # written into the receiver's box at once (else piece by piece: a box of another
        # dtype, or a receiver that buffers its pieces)
        self.whole = False

    def placed(self, layout: TileLayout, whole: bool) -> Slab:
        """With its first output chunk and offset in it found in ``layout``, and whether
        it is written into the box ``whole``."""
        self.first, self.offset = layout.locate(self.at)
        self.whole = whole
        return self

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def counts(self) -> tuple[int, ...]:
        return self.array.shape[:self.array.ndim // 2]

    def __len__(self) -> int:
        return math.prod(self.counts)

    def pieces(self, copy: bool) -> list[Piece]:
        """The pieces it stands for, one per output chunk (after ``placed``)."""
        out = []
        for c in itertools.product(*map(range, self.counts)):
            piece = self.array[c]
            j = tuple(f + x for f, x in zip(self.first, c, strict=True))
            out.append((j, self.offset, piece.copy() if copy else piece))
        return out

    def outputs(self) -> list[tuple[Index, int]]:
        """Each output chunk it reaches, with its bytes (after ``placed``)."""
        each = self.nbytes // max(len(self), 1)
        return [(tuple(f + x for f, x in zip(self.first, c, strict=True)), each)
                for c in itertools.product(*map(range, self.counts))]

    def __reduce__(self) -> tuple:
        return (Slab, (self.at, self.array))


class TiledBox:
    """An instance's box of output chunks as ``layout`` lays it out: an array per part,
    of ``dtype``; each output chunk a C-ordered tile of one of them."""

    def __init__(self, layout: TileLayout, dtype: np.dtype) -> None:
        self.layout = layout
        self.dtype = np.dtype(dtype)
        self.parts = {part: new_array(shape, self.dtype)
                      for part, shape in layout.parts().items()}

    def chunk(self, j: Index) -> np.ndarray:
        part, at = self.layout.tile(j)
        return self.parts[part][at]

    def destination(self, at: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """Where a slab starting at ``at`` of ``shape`` (in tile order) goes: a view of
        its part, of that shape."""
        first, offset = self.layout.locate(at)
        part, tile_at = self.layout.tile(first)
        ndim = len(at)
        return self.parts[part][
            (*(slice(t, t + c) for t, c in zip(tile_at, shape[:ndim], strict=True)),
             *(slice(o, o + n) for o, n in zip(offset, shape[ndim:], strict=True)))]


def slabs_of(block: np.ndarray, block_at: tuple[int, ...], layout: TileLayout
             ) -> list[Slab]:
    """The slabs of ``block`` (an input chunk starting at ``block_at``) for the box of
    ``layout``: views of it, in tile order."""
    at, shape = [], []
    for a0, n, (b0, b1) in zip(block_at, block.shape, layout.extent, strict=True):
        lo, hi = max(a0, b0), min(a0 + n, b1)
        if lo >= hi:
            return []
        at.append(lo)
        shape.append(hi - lo)
    inside = block[tuple(slice(lo - a0, lo - a0 + n)
                         for lo, n, a0 in zip(at, shape, block_at, strict=True))]
    return [Slab(start, in_tile_order(inside[where], tiles))
            for start, where, tiles in layout.segments(tuple(at), tuple(shape))]


class BoxCount:
    """The pieces received and expected by each output chunk of an instance's box
    (``box``: output chunk ranges per axis; ``counts[d][j]``: the input chunks that
    overlap output chunk ``j`` along axis ``d``), counted a slab at a time with numpy: a
    slab of 200 output chunks is one operation, where counting its pieces one by one
    took ~1 us each."""

    def __init__(self, box: tuple[range, ...], counts: list[list[int]]) -> None:
        self.box = box
        self.expected = functools.reduce(np.multiply.outer, (
            np.asarray(counts[d][r.start:r.stop], dtype=np.int64) for d, r in enumerate(box)))
        self.received = np.zeros_like(self.expected)

    def add(self, slab: Slab) -> list[Index]:
        """Count one piece for every output chunk ``slab`` reaches (after ``placed``);
        the output chunks that it completes."""
        where = tuple(slice(f - r.start, f - r.start + c)
                      for f, c, r in zip(slab.first, slab.counts, self.box, strict=True))
        received = self.received[where]
        received += 1
        done = np.argwhere(received == self.expected[where])
        return [tuple(int(x) + f for x, f in zip(row, slab.first, strict=True))
                for row in done]

    def add_one(self, j: Index) -> bool:
        """Count one piece of output chunk ``j``; whether that completes it."""
        at = tuple(jd - r.start for jd, r in zip(j, self.box, strict=True))
        self.received[at] += 1
        return bool(self.received[at] == self.expected[at])

    def missing(self) -> list[Index]:
        """The output chunks that did not receive every piece."""
        return [tuple(int(x) + r.start for x, r in zip(row, self.box, strict=True))
                for row in np.argwhere(self.received != self.expected)]


def pieces_by_destination(block: np.ndarray, index: Index,
                          overlaps: list[list[list[tuple[int, slice, int]]]],
                          owner: dict[Index, ServiceId], here: ServiceId,
                          layouts: dict[ServiceId, TileLayout] | None = None,
                          block_at: tuple[int, ...] = (),
                          unboxed: bool = True,
                          ) -> dict[ServiceId, list[Piece | PackedPieces | Slab]]:
    """The pieces of the input chunk at ``index`` that wanted outputs need, grouped by the
    instance owning their output.  Pieces stay views of the input chunk: they are sent as
    ``Buffers``, whose strided parts the sender copies as it writes them (``_bulk.py``).
    Small ones are copied into one buffer per peer (``PackedPieces``, or alone where
    there is nothing to pack them with); and where the peers' share is under
    ``VIEWS_FROM_SHARE`` of the chunk (``keeps_views``), or for object arrays, which
    travel pickled, the pieces for peers are copied here, in a worker thread (pickle
    would copy a strided one on the event loop).

    An instance whose outputs are a box (``layouts``: how it holds its box) gets the
    chunk's ``Slab``s for it (the chunk starts at ``block_at``) instead of its pieces (not
    for object arrays); ``unboxed``: whether any output's owner has no box (if not, no
    piece is cut at all)."""
    out: dict[ServiceId, list[Piece | PackedPieces | Slab]] = {}
    small: dict[ServiceId, list[Piece]] = {}
    packs = not block.dtype.hasobject
    slabs: list[tuple[ServiceId, Slab]] = []
    if packs and layouts:
        for sid, layout in layouts.items():
            slabs.extend((sid, slab) for slab in slabs_of(block, block_at, layout))
    else:
        layouts, unboxed = {}, True
    pieces = [] if not unboxed else [
        (owner[j], j, offset, piece)
        for j, offset, piece in slice_block(block, index, overlaps)
        if j in owner and owner[j] not in layouts]
    views = packs and keeps_views(
        sum(p.nbytes for sid, _, _, p in pieces if sid != here)
        + sum(slab.nbytes for sid, slab in slabs if sid != here), block.nbytes)
    for sid, slab in slabs:
        if sid != here and not views:
            slab.array = slab.array.copy()
        out.setdefault(sid, []).append(slab)
    for sid, j, offset, piece in pieces:
        if sid != here:
            if packs and piece.nbytes < PACK_BELOW:
                small.setdefault(sid, []).append((j, offset, piece))
                continue
            if not views:  # (a contiguous view would hold the chunk as well)
                piece = piece.copy()
        out.setdefault(sid, []).append((j, offset, piece))
    for sid, pieces in small.items():
        out.setdefault(sid, []).append(
            PackedPieces.of(pieces) if len(pieces) > 1
            else (pieces[0][0], pieces[0][1], pieces[0][2].copy()))  # (no view: small)
    return out


def keeps_views(peers_bytes: int, chunk_bytes: int) -> bool:
    """Whether an input chunk's pieces for peers stay views (``True`` where the peers'
    share of it is at least ``VIEWS_FROM_SHARE``; else they are copied)."""
    return peers_bytes >= VIEWS_FROM_SHARE * chunk_bytes


def is_view(item: Piece | PackedPieces | Slab) -> bool:
    """Whether ``item`` (of ``pieces_by_destination``) is a view of its input chunk."""
    if type(item) is Slab:
        return item.array.base is not None
    return type(item) is tuple and item[2].base is not None


def own_bytes(batch: list[Piece | PackedPieces]) -> int:
    """The bytes of ``batch`` in memory of their own (packed or copied pieces), not
    views of their input chunk."""
    return batch_bytes([item for item in batch if not is_view(item)])


def as_buffers(batches: list[list[Piece | PackedPieces]]) -> tuple[list, Buffers | list]:
    """The pieces of ``batches`` as the arguments of ``receive_pieces``: what each array
    is (an output index and offset, or a packed buffer's index) and the arrays, as
    ``Buffers`` (a plain list, pickled, if a chunk of objects came in an array that says
    another dtype)."""
    meta: list[tuple] = []
    arrays: list[np.ndarray] = []
    for batch in batches:
        for item in batch:
            if isinstance(item, PackedPieces):
                meta.append(("packed", item.index, item.dtype))
                arrays.append(item.buffer)
            elif isinstance(item, Slab):
                meta.append(("slab", item.at))
                arrays.append(item.array)
            else:
                meta.append(("piece", item[0], item[1]))
                arrays.append(item[2])
    if any(a.dtype.hasobject for a in arrays):
        return meta, arrays
    return meta, Buffers(arrays)


def from_buffers(meta: list[tuple], arrays: list[np.ndarray]) -> list[Piece | PackedPieces]:
    """The batch that ``as_buffers`` sent, from its arrays as received."""
    return [PackedPieces(m[2], m[1], a) if m[0] == "packed"
            else Slab(m[1], a) if m[0] == "slab" else (m[1], m[2], a)
            for m, a in zip(meta, arrays, strict=True)]


def batch_bytes(batch: list[Piece | PackedPieces | Slab]) -> int:
    return sum(piece_bytes(item[2]) if type(item) is tuple else item.nbytes
               for item in batch)


def unpacked(batches: list[list[Piece | PackedPieces]], copy: bool) -> list[Piece]:
    """The pieces of ``batches``, those of packed buffers as views into them, or as arrays
    of their own where ``copy``."""
    pieces: list[Piece] = []
    for batch in batches:
        for item in batch:
            if type(item) is tuple:
                pieces.append(item)
            else:
                pieces.extend(item.pieces(copy))
    return pieces


def output_indices(batches: list[list[Piece | PackedPieces]]) -> dict[Index, np.dtype]:
    """The output chunks that the pieces of ``batches`` belong to, each with the dtype of
    its first piece there."""
    indices: dict[Index, np.dtype] = {}
    for batch in batches:
        for item in batch:
            if isinstance(item, PackedPieces):
                for j, _, _ in item.index:
                    indices.setdefault(j, item.dtype)
            elif isinstance(item, Slab):
                if not item.whole:  # (written piece by piece)
                    for j, _ in item.outputs():
                        indices.setdefault(j, item.dtype)
            else:
                indices.setdefault(item[0], item[2].dtype)
    return indices


def write_into(outputs: dict[Index, np.ndarray],
               batches: list[list[Piece | PackedPieces | Slab]],
               box: TiledBox | None = None,
               ) -> tuple[list[tuple[Index, int]], list[Piece], list[Slab]]:
    """Every piece of ``batches`` written at its offset into its output chunk; returns
    each piece's output index and bytes, (copied) the pieces whose dtype does not fit
    their output's (``fits``), to be written once it is promoted (``promoted``), and the
    slabs written whole.  A ``Slab`` placed ``whole`` is written into ``box`` at once
    (the caller checked that its dtype fits), any other piece by piece."""
    written, aside, whole = [], [], []
    rest: list[list[Piece | PackedPieces | Slab]] = []
    for batch in batches:
        items = []
        for item in batch:
            if type(item) is Slab and item.whole:
                assert box is not None
                write(box.destination(item.at, item.array.shape), ..., item.array)
                whole.append(item)
            else:
                items.append(item)
        rest.append(items)
    for j, offset, piece in unpacked(rest, copy=False):
        out = outputs[j]
        if fits(piece.dtype, out.dtype):
            write(out, region(offset, piece.shape), piece)
        else:
            aside.append((j, offset, np.array(piece, copy=True)))
        written.append((j, piece_bytes(piece)))
    return written, aside, whole


def output_shape(shape: tuple[float, ...], pieces: list[tuple[tuple[int, ...], np.ndarray]]
                 ) -> tuple[int, ...]:
    """The shape of the output chunk made of ``pieces`` (axes of unknown size, NaN in
    ``shape``, are unchanged by a rechunk: every piece spans them whole)."""
    if pieces and any(math.isnan(s) for s in shape):
        first = pieces[0][1]
        shape = tuple(first.shape[d] if math.isnan(s) else s for d, s in enumerate(shape))
    return tuple(int(s) for s in shape)


def fill(out: np.ndarray, pieces: list[tuple[tuple[int, ...], np.ndarray]]) -> np.ndarray:
    """``out`` with every piece written at its offset; the pieces must cover it exactly
    (they cannot overlap: each is the part of one input chunk that the output takes)."""
    check_covered(f"an output chunk of shape {out.shape}", out.size,
                  sum(piece.size for _, piece in pieces))
    write_pieces([(out, offset, piece) for offset, piece in pieces])
    return out


def check_covered(what: str, size: int, covered: int) -> None:
    """A clear error where the pieces of an output chunk (or of several, ``what``) of
    ``size`` elements have ``covered`` elements instead."""
    if covered != size:
        raise ValueError(
            f"rechunk: {what} got {covered} elements from "
            f"its input chunks instead of {size}: an input chunk has another shape "
            "than the array's chunks say (a map_blocks returning blocks of other shapes "
            "than its chunks= declares?). Make the blocks match their chunks, or give "
            "map_blocks the right chunks="
        )


def check_block_shape(block: np.ndarray, declared: tuple[float, ...], key: Any) -> None:
    """A clear error where input chunk ``key`` does not have the shape the array's chunks
    declare (axes of unknown size, NaN, are not checked)."""
    if block.ndim != len(declared) or any(
            not math.isnan(d) and n != d for n, d in zip(block.shape, declared, strict=True)):
        shape = tuple(d if math.isnan(d) else int(d) for d in declared)
        raise ValueError(
            f"rechunk: input chunk {key!r} has shape {block.shape}, but the array's chunks "
            f"say {shape} (a map_blocks returning blocks of other shapes than its chunks= "
            "declares?). Make the blocks match their chunks, or give map_blocks the right "
            "chunks="
        )


def region(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The slices of the part at ``offset`` of size ``shape``."""
    return tuple(map(slice, offset, map(operator.add, offset, shape)))


def write_pieces(writes: list[tuple[np.ndarray, tuple[int, ...], np.ndarray]]) -> None:
    """Every piece written at its offset into its output chunk."""
    for out, offset, piece in writes:
        write(out, region(offset, piece.shape), piece)


def new_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized, writeable, C-ordered array, allocated without huge-page advice
    (``_memory.py``): assembling a 31 MB output chunk of a 2 GB all-to-all rechunk took ~70
    ms of kernel time with the advice, ~20 ms on fresh plain pages, and with the allocator
    handing back memory that freed pieces left in the process (no page faults) the 1 GB
    rechunks took 5-19% less time than on fresh pages of an anonymous ``mmap``."""
    with without_huge_page_advice():
        return np.empty(shape, dtype=dtype)


def fresh_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized, writeable, C-ordered array; a large one on fresh pages of an
    anonymous ``mmap`` (no huge-page advice, and back to the OS as soon as it is freed).

    For the output chunks that tasks copy (``copy_pieces``, ``merge_blocks``): they are
    allocated in task threads, whose allocator arenas hold no freed pieces to reuse, and on
    fresh pages their memory leaves with them (1 GB 100 -> 150 rows, outputs persisted:
    peak 0.96x p2p's with these, 1.07x with ``new_array``'s).
    """
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < HUGE_PAGE_ADVICE_FROM or dtype.hasobject:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).reshape(shape)


def assembles_in_place(new_chunks: Chunks, outputs: Iterable[Index], dtype: np.dtype,
                       budget: int) -> bool:
    """Whether an instance writes pieces straight into its ``outputs`` as they arrive: when
    their shapes are known and they fit ``budget`` together (partly written chunks cannot be
    spilled), and not for object arrays, whose size in memory is not their shape's."""
    if dtype.hasobject:
        return False
    total = 0
    for j in outputs:
        shape = [new_chunks[d][jd] for d, jd in enumerate(j)]
        if any(math.isnan(s) for s in shape):
            return False
        total += math.prod(int(s) for s in shape) * dtype.itemsize
        if total > budget:
            return False
    return True


def piece_bytes(piece: np.ndarray) -> int:
    return int(piece.nbytes) if piece.dtype != object else int(sizeof(piece))
