"""The array rechunk as a service.

Every instance slices the chunks handed to it into the pieces each wanted output chunk
needs and sends them, batched per destination instance, through a byte-bounded window.
Receivers count the pieces of each of their output chunks and produce a chunk as soon as
its last piece has arrived, before ``all_inputs_done`` whenever its inputs were handed off
early.  Where the old and new chunkings leave independent regions, the first outputs are
therefore in memory long before the last inputs are handed off.

Where an instance's output chunks fit its buffer budget together, each piece is written
into its output chunk as it arrives (in place), so that a chunk is ready the moment its last
piece is, and the copying overlaps the exchange instead of following it.  Otherwise pieces
are buffered (spilling to disk past the budget, as the shuffle does) and a chunk is
assembled, one at a time, once complete.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import mmap
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from dask.sizeof import sizeof

from dask_services._buffers import ArraysInMemory, Buffers, IncomingBuffers
from dask_services._exchange import PeerExchange
from dask_services._memory import (
    HUGE_PAGE_ADVICE_FROM,
    TrimAfter,
    release_freed_memory,
    without_huge_page_advice,
)
from dask_services.service import ServiceId, rpc

Index = tuple[int, ...]
# (output chunk index, offset of the piece in that chunk, the piece)
Piece = tuple[Index, tuple[int, ...], np.ndarray]
Chunks = tuple[tuple[float, ...], ...]


def axis_overlaps(old: Sequence[float], new: Sequence[float]
                  ) -> list[list[tuple[int, slice, int]]]:
    """For each old chunk along one axis: ``[(new index, slice of the old chunk, offset in
    the new chunk), ...]``.  Axes of unknown size are unchanged (dask refuses anything
    else), so they map one to one and whole."""
    if any(math.isnan(c) for c in old):
        return [[(i, slice(None), 0)] for i in range(len(old))]
    out: list[list[tuple[int, slice, int]]] = [[] for _ in old]
    old_bounds = np.cumsum((0, *old)).astype(int).tolist()
    new_bounds = np.cumsum((0, *new)).astype(int).tolist()
    j = 0
    for i in range(len(old)):
        a0, a1 = old_bounds[i], old_bounds[i + 1]
        while j < len(new) and new_bounds[j + 1] <= a0:
            j += 1
        k = j
        while k < len(new) and new_bounds[k] < a1:
            lo, hi = max(a0, new_bounds[k]), min(a1, new_bounds[k + 1])
            if lo < hi:
                out[i].append((k, slice(lo - a0, hi - a0), lo - new_bounds[k]))
            k += 1
    return out


def axis_regions(old: Sequence[float], new: Sequence[float]) -> list[tuple[range, range]]:
    """Along one axis, the independent regions of a rechunk: ``[(old chunks, new chunks),
    ...]`` as index ranges, such that every new chunk of a region needs only old chunks of
    the same region.  A region ends wherever an old and a new chunk boundary coincide
    (100-row chunks to 150-row chunks: every 300 rows).  Zero-length chunks on such a
    boundary go to the region that starts there (the last one at the end of the axis).
    Axes of unknown size are unchanged: every chunk is a region of its own."""
    if any(math.isnan(c) for c in old):
        return [(range(i, i + 1), range(i, i + 1)) for i in range(len(old))]
    old_bounds = np.cumsum((0, *old)).astype(int).tolist()
    new_bounds = np.cumsum((0, *new)).astype(int).tolist()
    cuts = sorted(set(old_bounds) & set(new_bounds))
    if len(cuts) < 2:  # an axis of length zero
        return [(range(len(old)), range(len(new)))]
    last = len(cuts) - 2

    def region_of(bounds: list[int]) -> list[int]:
        return [min(bisect.bisect_right(cuts, start) - 1, last) for start in bounds[:-1]]

    old_region, new_region = region_of(old_bounds), region_of(new_bounds)
    regions = []
    for r in range(last + 1):
        o = [i for i, x in enumerate(old_region) if x == r]
        n = [j for j, x in enumerate(new_region) if x == r]
        regions.append((range(o[0], o[-1] + 1) if o else range(0),
                        range(n[0], n[-1] + 1) if n else range(0)))
    return regions


def region_boxes(old: Chunks, new: Chunks, max_pairs: int
                 ) -> list[tuple[tuple[range, ...], tuple[range, ...]]]:
    """The rechunk cut into boxes of independent regions: ``[(old chunk ranges per axis,
    new chunk ranges per axis), ...]``; no output of a box needs an input of another box.

    Consecutive regions along each axis are grouped (the last axis first) as long as a box
    keeps at most ``max_pairs`` (inputs x outputs): what ordering a service task's graph
    costs grows with that product, every input reaching every output through the service
    task; ``max_pairs=0`` gives one region per box.
    """
    per_axis = [axis_regions(o, n) for o, n in zip(old, new, strict=True)]
    group = [1] * len(per_axis)

    def pairs(g: list[int]) -> float:
        out = 1.0
        for d, regions in enumerate(per_axis):
            nr = len(regions)
            out *= (g[d] * len(old[d]) / nr) * (g[d] * len(new[d]) / nr)
        return out

    for d in reversed(range(len(per_axis))):
        while group[d] < len(per_axis[d]):
            bigger = [*group]
            bigger[d] = min(2 * group[d], len(per_axis[d]))
            if pairs(bigger) > max_pairs:
                break
            group = bigger
    grouped = []
    for d, regions in enumerate(per_axis):
        axis = []
        for start in range(0, len(regions), group[d]):
            part = regions[start:start + group[d]]
            old_r = [r for r, _ in part if len(r)]
            new_r = [r for _, r in part if len(r)]
            axis.append((
                range(old_r[0].start, old_r[-1].stop) if old_r else range(0),
                range(new_r[0].start, new_r[-1].stop) if new_r else range(0),
            ))
        grouped.append(axis)
    return [(tuple(o for o, _ in combo), tuple(n for _, n in combo))
            for combo in itertools.product(*grouped)]


AFFINITY_MAX_INPUTS = 4  # outputs needing more inputs than this are placed round-robin


def most_needed_inputs(old: Chunks, new: Chunks) -> dict[Index, Index] | None:
    """For every output chunk, the input chunk it takes most of; ``None`` when outputs need
    more than ``AFFINITY_MAX_INPUTS`` inputs each (row to column chunks, say), where being
    near one of them saves nothing."""
    overlaps = [axis_overlaps(o, n) for o, n in zip(old, new, strict=True)]
    if max_inputs_per_output(overlaps, new) > AFFINITY_MAX_INPUTS:
        return None
    best: list[list[int]] = []
    for d, axis in enumerate(overlaps):
        size = [0] * len(new[d])
        choice = [0] * len(new[d])
        for i, pieces in enumerate(axis):
            for j, piece, _ in pieces:
                length = (piece.stop - piece.start) if piece.stop is not None else 1
                if length > size[j]:
                    size[j], choice[j] = length, i
        best.append(choice)
    return {j: tuple(best[d][jd] for d, jd in enumerate(j))
            for j in itertools.product(*(range(len(c)) for c in new))}


def inputs_by_output(axis: list[list[tuple[int, slice, int]]], outputs: int
                     ) -> list[list[tuple[int, slice, int]]]:
    """One axis's overlaps turned around: for each new chunk along it, ``[(old chunk,
    slice of it, offset in the new chunk), ...]`` in old-chunk order."""
    out: list[list[tuple[int, slice, int]]] = [[] for _ in range(outputs)]
    for i, pieces in enumerate(axis):
        for j, piece, offset in pieces:
            out[j].append((i, piece, offset))
    return out


def max_inputs_per_output(overlaps: list[list[list[tuple[int, slice, int]]]],
                          new: Chunks) -> int:
    """The most input chunks that any one output chunk needs."""
    return math.prod(max(c, default=0) for c in pieces_per_output(overlaps, new))


def pieces_per_output(overlaps: list[list[list[tuple[int, slice, int]]]],
                      new: Chunks) -> list[list[int]]:
    """For each axis, how many old chunks overlap each new chunk."""
    counts = [[0] * len(axis) for axis in new]
    for d, axis in enumerate(overlaps):
        for pieces in axis:
            for j, _, _ in pieces:
                counts[d][j] += 1
    return counts


def merge_plan(old: Chunks, new: Chunks
               ) -> dict[Index, list[tuple[tuple[int, ...], Index]]] | None:
    """For a rechunk that only merges neighbouring chunks, each output chunk's input chunks
    and their offsets in it (``{output index: [(offset, input index), ...]}``); ``None``
    for any other rechunk.

    A rechunk only merges when every input chunk lies in one output chunk along every
    axis (each new chunk boundary is an old one): then every input goes, whole, to exactly
    one output, and no output needs an input that another output needs.  Such a rechunk
    moves nothing between outputs, and one task per output (copy the inputs into one new
    array) is all the graph it needs; a service task would add a hand-off per input, the
    service task and a claim per output.  Outputs with no input at all must have a known
    shape (they are empty arrays), or the plan is ``None``.
    """
    overlaps = [axis_overlaps(o, n) for o, n in zip(old, new, strict=True)]
    if any(len(pieces) > 1 for axis in overlaps for pieces in axis):
        return None
    plan: dict[Index, list[tuple[tuple[int, ...], Index]]] = {
        j: [] for j in itertools.product(*(range(len(c)) for c in new))
    }
    for i in itertools.product(*(range(len(c)) for c in old)):
        per_axis = [overlaps[d][id_] for d, id_ in enumerate(i)]
        if all(per_axis):
            j = tuple(p[0][0] for p in per_axis)
            plan[j].append((tuple(p[0][2] for p in per_axis), i))
    for j, pieces in plan.items():
        if not pieces and any(math.isnan(new[d][jd]) for d, jd in enumerate(j)):
            return None
    return plan


def plain_numpy(block: Any, key: Any = None) -> np.ndarray:
    """``block`` as a plain numpy array (a memmap's or other plain subclass's data); a
    clear error for other array types, masked arrays included (their mask would be lost)."""
    if isinstance(block, np.ma.MaskedArray) or not isinstance(block, (np.ndarray, np.generic)):
        chunk = "a chunk" if key is None else f"chunk {key!r}"
        raise TypeError(
            f"the 'service' rechunk handles numpy chunks; {chunk} is a "
            f"{type(block).__name__}. Use method='tasks' (or 'p2p') for other array types"
        )
    return np.asarray(block)


def chunk_dtype(declared: np.dtype, dtypes: Iterable[np.dtype]) -> np.dtype:
    """The dtype of an output chunk made of pieces of ``dtypes``: theirs, not the one the
    graph's meta declares where the two differ (a ``map_blocks`` given a wrong ``dtype=``),
    as ``tasks`` and ``p2p`` keep the chunks' values; numpy's promotion where pieces differ
    among themselves; ``declared`` for a chunk of no pieces."""
    found = set(dtypes)
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
    does not promote together, do not fit, whatever ``np.can_cast`` says."""
    if piece == chunk:
        return True
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
    dtypes = {chunk.dtype, *(piece.dtype for _, piece in aside)}
    dtype = chunk_dtype(declared, dtypes)
    try:
        out = chunk.astype(dtype)
        write_pieces([(out, offset, piece) for offset, piece in aside])
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"rechunk: output chunk {j} is made of input chunks of dtypes "
            f"{sorted(map(str, dtypes))}, which cannot all be written into {dtype} "
            f"({e}). The array's chunks do not all have one dtype (a map_blocks returning "
            "other dtypes than its dtype= says?): make them agree (.astype()) before the "
            "rechunk, or use method='tasks'"
        ) from None
    return out


def merge_blocks(shape: tuple[float, ...], dtype: np.dtype, offsets: list[tuple[int, ...]],
                 *blocks: np.ndarray) -> np.ndarray:
    """One output chunk of a rechunk that only merges: its input chunks, each placed at its
    offset, in one new (C-ordered, writeable) array."""
    pieces = [(o, plain_numpy(b)) for o, b in zip(offsets, blocks, strict=True)]
    return fill(fresh_array(output_shape(shape, pieces), pieces_dtype(dtype, pieces)), pieces)


def copy_pieces(shape: tuple[float, ...], dtype: np.dtype,
                layout: list[tuple[tuple[slice, ...] | None, tuple[int, ...]]],
                *blocks: np.ndarray) -> np.ndarray:
    """One output chunk of a region with no other output: from every input chunk, the
    slice it needs (``layout``: slices and offset in the output, per input; ``None``: the
    block is that slice already), in one new (C-ordered, writeable) array."""
    pieces = [(offset, plain_numpy(block) if slices is None else plain_numpy(block)[slices])
              for (slices, offset), block in zip(layout, blocks, strict=True)]
    return fill(fresh_array(output_shape(shape, pieces), pieces_dtype(dtype, pieces)), pieces)


def copy_part(block: np.ndarray, part: tuple[slice, ...]) -> np.ndarray:
    """One output chunk cut out of a merged region: a C-ordered, writeable copy."""
    return np.array(plain_numpy(block)[part], order="C", copy=True)


def take_slice(block: np.ndarray, slices: tuple[slice, ...]) -> np.ndarray:
    """The part of an input chunk that one output chunk needs (a view: on the input's
    worker it costs nothing; sent to another worker, only its own bytes travel)."""
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


def pieces_by_destination(block: np.ndarray, index: Index,
                          overlaps: list[list[list[tuple[int, slice, int]]]],
                          owner: dict[Index, ServiceId], here: ServiceId
                          ) -> dict[ServiceId, list[Piece | PackedPieces]]:
    """The pieces of the input chunk at ``index`` that wanted outputs need, grouped by the
    instance owning their output.  Pieces stay views of the input chunk: they are sent as
    ``Buffers``, whose strided parts the sender copies as it writes them (``_bulk.py``).
    Small ones are copied into one buffer per peer (``PackedPieces``, or alone where
    there is nothing to pack them with); and where the peers' share is under
    ``VIEWS_FROM_SHARE`` of the chunk (``keeps_views``), or for object arrays, which
    travel pickled, the pieces for peers are copied here, in a worker thread (pickle
    would copy a strided one on the event loop)."""
    out: dict[ServiceId, list[Piece | PackedPieces]] = {}
    small: dict[ServiceId, list[Piece]] = {}
    packs = not block.dtype.hasobject
    pieces = [(owner[j], j, offset, piece)
              for j, offset, piece in slice_block(block, index, overlaps) if j in owner]
    views = packs and keeps_views(
        sum(p.nbytes for sid, _, _, p in pieces if sid != here), block.nbytes)
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


def is_view(item: Piece | PackedPieces) -> bool:
    """Whether ``item`` (of ``pieces_by_destination``) is a view of its input chunk."""
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
            else:
                meta.append(("piece", item[0], item[1]))
                arrays.append(item[2])
    if any(a.dtype.hasobject for a in arrays):
        return meta, arrays
    return meta, Buffers(arrays)


def from_buffers(meta: list[tuple], arrays: list[np.ndarray]) -> list[Piece | PackedPieces]:
    """The batch that ``as_buffers`` sent, from its arrays as received."""
    return [PackedPieces(m[2], m[1], a) if m[0] == "packed" else (m[1], m[2], a)
            for m, a in zip(meta, arrays, strict=True)]


def batch_bytes(batch: list[Piece | PackedPieces]) -> int:
    return sum(item.nbytes if isinstance(item, PackedPieces) else piece_bytes(item[2])
               for item in batch)


def unpacked(batches: list[list[Piece | PackedPieces]], copy: bool) -> list[Piece]:
    """The pieces of ``batches``, those of packed buffers as views into them, or as arrays
    of their own where ``copy``."""
    pieces: list[Piece] = []
    for batch in batches:
        for item in batch:
            if isinstance(item, PackedPieces):
                pieces.extend(item.pieces(copy))
            else:
                pieces.append(item)
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
            else:
                indices.setdefault(item[0], item[2].dtype)
    return indices


def write_into(outputs: dict[Index, np.ndarray], batches: list[list[Piece | PackedPieces]]
               ) -> tuple[list[tuple[Index, int]], list[Piece]]:
    """Every piece of ``batches`` written at its offset into its output chunk; returns
    each piece's output index and bytes, and (copied) the pieces whose dtype does not fit
    their output's (``fits``), to be written once it is promoted (``promoted``)."""
    written, aside = [], []
    for j, offset, piece in unpacked(batches, copy=False):
        out = outputs[j]
        if fits(piece.dtype, out.dtype):
            out[region(offset, piece.shape)] = piece
        else:
            aside.append((j, offset, np.array(piece, copy=True)))
        written.append((j, piece_bytes(piece)))
    return written, aside


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
    covered = sum(piece.size for _, piece in pieces)
    if covered != out.size:
        raise ValueError(
            f"rechunk: an output chunk of shape {out.shape} got {covered} elements from "
            f"its input chunks instead of {out.size}: an input chunk has another shape "
            "than the array's chunks say (a map_blocks returning blocks of other shapes "
            "than its chunks= declares?). Make the blocks match their chunks, or give "
            "map_blocks the right chunks="
        )
    write_pieces([(out, offset, piece) for offset, piece in pieces])
    return out


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
        out[region(offset, piece.shape)] = piece


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


# a batch of at most this many bytes is written into its outputs on the event loop; a larger
# one in a worker thread (a thread hand-over costs about as much as copying this much)
WRITE_ON_LOOP_MAX = 1 << 20
# ... and of at most this many pieces (each write costs a few microseconds of Python)
WRITE_ON_LOOP_PIECES = 64


def piece_bytes(piece: np.ndarray) -> int:
    return int(piece.nbytes) if piece.dtype != object else int(sizeof(piece))


class ArrayRechunk(PeerExchange):
    """Peer-to-peer rechunk of a numpy-backed dask array; see module docstring."""

    config_section = "rechunk"
    # output_keys come in the order of their chunk indices (C order); the names are not read
    outputs_by_position = True
    # the pieces sent are mostly views into input chunks, which stay in memory until every
    # piece of theirs is sent: trimming after sends would give back little, at a cost
    trim_after_sends = False

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader, *,
                    old_chunks: Chunks, new_chunks: Chunks, dtype: np.dtype,
                    old_offset: Index | None = None, new_offset: Index | None = None,
                    **kwargs: Any) -> None:
        # the chunks of this service task's region of the array, whose first input chunk
        # has the index ``old_offset``; ``output_keys`` are its output chunks in C order
        # (``new_offset``, the first one's index in the array, is not needed here)
        self.new_chunks = new_chunks
        self.old_chunks = old_chunks
        self.dtype = dtype
        self.overlaps = [axis_overlaps(o, n) for o, n in zip(old_chunks, new_chunks,
                                                             strict=True)]
        counts = pieces_per_output(self.overlaps, new_chunks)
        offset = old_offset or (0,) * len(new_chunks)
        self.index_of = {k: tuple(a - o for a, o in zip(k[1:], offset, strict=True))
                         for k in input_keys}
        # by position: an output fused with its consumer has the consumer's key
        output_index = dict(zip(output_keys, itertools.product(*map(range, map(
            len, new_chunks))), strict=True))
        self.key_of = {j: k for k, j in output_index.items()}
        self.owner = {output_index[k]: concierge.owner(k) for k in concierge.wanted_outputs}
        self.expected = {j: math.prod(counts[d][jd] for d, jd in enumerate(j))
                         for j, sid in self.owner.items() if sid == id}
        self.received: dict[Index, int] = dict.fromkeys(self.expected, 0)
        self.assembling: set[asyncio.Task] = set()
        # one chunk at a time takes its pieces (perhaps from disk) and is written out, so
        # that many chunks completing together do not all come into memory at once
        self.one_at_a_time = asyncio.Semaphore(1)
        self.trim = TrimAfter()
        self.open_exchange(concierge)
        assert self.buffer is not None and self.stream is not None
        # numbers travel as Buffers (read where they belong), objects pickled
        self.batch_method = "receive_many" if np.dtype(dtype).hasobject else "receive_pieces"
        if self.batch_method == "receive_pieces":
            self.stream.encode = as_buffers
        # in place: the output chunks being written, and the bytes written into each
        self.outputs: dict[Index, np.ndarray] | None = (
            {} if assembles_in_place(new_chunks, self.expected, np.dtype(dtype),
                                     self.buffer.limit) else None
        )
        self.written: dict[Index, int] = {}
        # pieces of output chunks written in place whose dtype did not fit the chunk's
        self.aside: dict[Index, list[tuple[tuple[int, ...], np.ndarray]]] = {}

    async def all_started(self) -> None:
        for j, n in self.expected.items():
            if n == 0:  # an empty output chunk: nothing will arrive for it
                self._complete(j)

    async def add_key(self, key, block: np.ndarray) -> None:
        assert self.stream is not None
        block = plain_numpy(block, key)  # a memmap or other plain subclass: its data
        index = self.index_of[key]
        check_block_shape(block, tuple(self.old_chunks[d][i] for d, i in enumerate(index)),
                          key)
        by_destination = await self.concierge.run_in_executor(
            pieces_by_destination, block, self.index_of[key], self.overlaps, self.owner,
            self.id
        )
        chunk_bytes = int(block.nbytes)
        del block
        # views keep the whole chunk until the last of them is delivered: it is counted
        # in the send window once, for that long (copies count their own bytes)
        with_views = {sid for sid, batch in by_destination.items()
                      if sid != self.id and any(map(is_view, batch))}
        hold = (await self.stream.hold(chunk_bytes, len(with_views))
                if with_views else None)
        for sid, batch in by_destination.items():
            if sid == self.id:
                await self.receive([batch])
                continue
            nbytes = batch_bytes(batch)
            self.sent_bytes += nbytes
            await self.stream.send_batched(sid, nbytes, self.batch_method, batch,
                                           held=own_bytes(batch),
                                           hold=hold if sid in with_views else None)

    @rpc
    async def receive_many(self, batches: list[list[Piece | PackedPieces]]) -> None:
        """Peer RPC: the pieces of several input chunks for this instance.  Pieces for one
        peer go together while an earlier call to it is in flight (``send_batched``): with
        many workers or small chunks, an input's share for each peer is small, and a call
        per input and peer cost more than the pieces it carried."""
        await self.receive(batches)

    @rpc
    async def receive_pieces(self, meta: list[tuple], incoming: IncomingBuffers | list
                             ) -> None:
        """Peer RPC: the pieces of several input chunks for this instance, as ``Buffers``
        (``as_buffers``): written straight into their output chunks where those are
        assembled in place, with no buffer of their own; else received as arrays."""
        if isinstance(incoming, list):  # objects, pickled
            incoming = ArraysInMemory(incoming)
        if self.outputs is None:
            arrays = await incoming.arrays()
            await self.receive([from_buffers(meta, arrays)])
            return
        destinations: list[np.ndarray] = []
        direct: list[tuple[Index, int]] = []
        # a chunk takes the dtype of its first piece (the graph's meta may say another); a
        # later piece of another dtype (chunks of the array that differ) is read into an
        # array of its own and cast on writing where that loses nothing, else set aside
        # until the chunk is complete and promoted
        casts: list[tuple[np.ndarray, np.ndarray]] = []
        aside: list[Piece] = []
        for m, shape, dtype in zip(meta, incoming.shapes, incoming.dtypes, strict=True):
            if m[0] == "piece":
                destination = self._output(m[1], dtype)[region(m[2], shape)]
                if destination.dtype != dtype:
                    piece = np.empty(shape, dtype)
                    if fits(dtype, destination.dtype):
                        casts.append((destination, piece))
                    else:
                        aside.append((m[1], m[2], piece))
                    destination = piece
                direct.append((m[1], int(destination.nbytes)))
            else:
                destination = np.empty(shape, dtype)
            destinations.append(destination)
        await incoming.read_into(destinations)
        for chunk_region, piece in casts:
            chunk_region[...] = piece
        self._set_aside(aside)
        packed = [PackedPieces(m[2], m[1], a)
                  for m, a in zip(meta, destinations, strict=True) if m[0] == "packed"]
        del destinations, casts
        received = direct
        if packed:
            received = received + await self._write([packed], sum(len(p) for p in packed),
                                                    sum(p.nbytes for p in packed))
        self._received(received, incoming.nbytes)

    async def _write(self, batches: list[list[Piece | PackedPieces]], count: int,
                     nbytes: int) -> list[tuple[Index, int]]:
        """``batches`` written into their outputs (in place), on the event loop if small."""
        outputs = {j: self._output(j, dtype) for j, dtype in output_indices(batches).items()}
        if count <= WRITE_ON_LOOP_PIECES and nbytes <= WRITE_ON_LOOP_MAX:
            written, aside = write_into(outputs, batches)
        else:
            written, aside = await self.concierge.run_in_executor(write_into, outputs,
                                                                  batches)
        self._set_aside(aside)
        return written

    def _set_aside(self, aside: list[Piece]) -> None:
        """Pieces whose dtype does not fit their output chunk's, kept until it is complete
        (``promoted``)."""
        for j, offset, piece in aside:
            self.aside.setdefault(j, []).append((offset, piece))

    async def receive(self, batches: list[list[Piece | PackedPieces]]) -> None:
        """Pieces of this instance's output chunks, some of them packed (``PackedPieces``).

        Written into the outputs in place, from views of the packed buffers, or else
        copied out of them (a kept view would hold the whole buffer) into the receive
        buffer.  A batch of many pieces is unpacked and written in a worker thread: at
        1,000 pieces per input chunk, writing on the event loop kept it busy most of the
        run."""
        assert self.buffer is not None
        count = sum(len(item) if isinstance(item, PackedPieces) else 1
                    for batch in batches for item in batch)
        nbytes = sum(map(batch_bytes, batches))
        if self.outputs is None:
            if count <= WRITE_ON_LOOP_PIECES and nbytes <= WRITE_ON_LOOP_MAX:
                pieces = unpacked(batches, copy=True)
            else:
                pieces = await self.concierge.run_in_executor(unpacked, batches, True)
            received = [(j, piece_bytes(piece)) for j, _, piece in pieces]
            await self.buffer.add_batch(
                [(j, (offset, piece), n)
                 for (j, offset, piece), (_, n) in zip(pieces, received, strict=True)])
            del pieces
            del batches
            self.received_bytes += nbytes
            self._count(received)
            return
        received = await self._write(batches, count, nbytes)
        del batches
        self._received(received, nbytes)

    def _received(self, received: list[tuple[Index, int]], nbytes: int) -> None:
        """Pieces written in place: ``received`` gives each one's output and bytes."""
        for j, n in received:
            self.written[j] = self.written.get(j, 0) + n
        self.received_bytes += nbytes
        self._count(received)

    def _count(self, received: list[tuple[Index, int]]) -> None:
        for j, _ in received:
            self.received[j] += 1
            if self.received[j] == self.expected[j]:
                self._complete(j)

    def _complete(self, j: Index) -> None:
        task = asyncio.create_task(self._produce(j))
        self.assembling.add(task)
        task.add_done_callback(self._assembled)

    def _assembled(self, task: asyncio.Task) -> None:
        self.assembling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.concierge.error(task.exception())

    def _output(self, j: Index, dtype: np.dtype | None = None) -> np.ndarray:
        """Output chunk ``j`` being written in place, allocated with its first piece (of
        ``dtype``: the chunks', which a graph's meta may misstate) or, with none, when
        produced empty."""
        assert self.outputs is not None
        chunk = self.outputs.get(j)
        if chunk is None:
            shape = tuple(int(self.new_chunks[d][jd]) for d, jd in enumerate(j))
            chunk = self.outputs[j] = new_array(shape, self.dtype if dtype is None else dtype)
        return chunk

    async def _produce(self, j: Index) -> None:
        if self.outputs is not None:
            chunk = self._output(j)  # allocated here if it has no piece (an empty chunk)
            del self.outputs[j]
            self.written.pop(j, None)
            aside = self.aside.pop(j, None)
            if aside:
                # the chunk, its pieces set aside and its promoted copy: one at a time
                async with self.one_at_a_time:
                    chunk = await self.concierge.run_in_executor(
                        promoted, chunk, aside, np.dtype(self.dtype), j)
                del aside
            await self.concierge.produce_key(self.key_of[j], chunk)
            return
        async with self.one_at_a_time:
            assert self.buffer is not None
            held = self.buffer.memory_bytes
            pieces = await self.buffer.take(j)
            shape = tuple(self.new_chunks[d][jd] for d, jd in enumerate(j))
            # allocated here, written in a worker thread: the received pieces were freed by
            # the event loop's thread, whose allocator arena can hand their memory out again
            # without page faults (measured together with ``new_array``'s change, not apart)
            chunk = new_array(output_shape(shape, pieces), pieces_dtype(self.dtype, pieces))
            chunk = await self.concierge.run_in_executor(fill, chunk, pieces)
            del pieces
            # Freed pieces go back to the OS only under memory pressure (once the buffer has
            # spilled): trimming costs the assembly page faults on the memory it gives back
            # (a 2 GB all-to-all took ~10% longer), and otherwise did not lower the peak.
            if self.trim.freed_bytes(held - self.buffer.memory_bytes) \
                    and self.buffer.spilled_total:
                await self.concierge.run_in_executor(release_freed_memory)
            await self.concierge.produce_key(self.key_of[j], chunk)

    async def all_inputs_done(self) -> None:
        assert self.stream is not None
        await self.stream.finish()
        while self.assembling:
            await asyncio.wait(set(self.assembling))
        missing = [j for j, n in self.received.items() if n != self.expected[j]]
        if missing:
            raise RuntimeError(
                f"rechunk instance {self.id}: output chunks {missing[:5]} did not receive "
                "all their pieces although every input was handed off"
            )

    def __sizeof__(self) -> int:
        return super().__sizeof__() + sum(getattr(self, "written", {}).values())

    async def stop(self) -> None:
        for task in list(getattr(self, "assembling", ())):
            task.cancel()
        if getattr(self, "outputs", None) is not None:
            self.outputs, self.written, self.aside = {}, {}, {}
        await super().stop()

