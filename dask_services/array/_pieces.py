"""The pieces of a rechunk: slicing a chunk into the pieces each output needs, packing
small ones for the wire, and writing pieces into output chunks (dtypes promoted as numpy
does, fresh arrays, in-place assembly).

Used by the service's instances (``_service.py``) and by the copies of the graph's
fast paths (``_rechunk.py``, ``_fusion.py``).
"""

from __future__ import annotations

import bisect
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


class Slab:
    """The part of one input chunk inside the box of output chunks an instance owns
    (``_plan.output_blocks``), for every output chunk of the box it overlaps at once.

    It travels as one array, where round-robin ownership sends a piece per output chunk,
    and the receiver writes it with one assignment into the array its box's chunks are
    views of and counts it with one numpy operation (``BoxCount``), where pieces take
    microseconds of Python each on both sides.  ``at``: where it starts along each axis
    (in the service task's region of the array).  ``cut(starts)``, given where each output
    chunk starts along each axis, gives it as the pieces it stands for (for a receiver
    that buffers them, or whose box has another dtype)."""

    __slots__ = ("at", "array", "cuts")

    def __init__(self, at: tuple[int, ...], array: np.ndarray) -> None:
        self.at = at
        self.array = array
        self.cuts: list[list[tuple[int, slice, int]]] | None = None

    @classmethod
    def of(cls, block: np.ndarray, block_at: tuple[int, ...],
           extent: tuple[tuple[int, int], ...]) -> Slab | None:
        """The slab of ``block`` (starting at ``block_at``) inside ``extent`` (a box's
        start and end along each axis); ``None`` where the block does not reach into
        it."""
        slices, at = [], []
        for a0, n, (b0, b1) in zip(block_at, block.shape, extent, strict=True):
            lo, hi = max(a0, b0), min(a0 + n, b1)
            if lo >= hi:
                return None
            slices.append(slice(lo - a0, hi - a0))
            at.append(lo)
        return cls(tuple(at), block[tuple(slices)])

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def __len__(self) -> int:
        return math.prod(map(len, self.cuts)) if self.cuts is not None else 1

    def cut(self, starts: list[list[int]]) -> Slab:
        """Its output chunks and their pieces along each axis (``cuts``), from where each
        output chunk starts (``starts[d]``, with the end of the last); chunks of no
        length get no piece."""
        cuts = []
        for a, n, axis in zip(self.at, self.array.shape, starts, strict=True):
            j = bisect.bisect_right(axis, a) - 1
            along = []
            while j < len(axis) - 1 and axis[j] < a + n:
                lo, hi = max(axis[j], a), min(axis[j + 1], a + n)
                if lo < hi:
                    along.append((j, slice(lo - a, hi - a), lo - axis[j]))
                j += 1
            cuts.append(along)
        self.cuts = cuts
        return self

    def outputs(self) -> list[tuple[Index, int]]:
        """Each output chunk the slab reaches, with the bytes it gives it (after
        ``cut``)."""
        assert self.cuts is not None
        itemsize = self.array.dtype.itemsize
        return [(tuple(j for j, _, _ in combo),
                 math.prod(s.stop - s.start for _, s, _ in combo) * itemsize)
                for combo in itertools.product(*self.cuts)]

    def pieces(self, copy: bool) -> list[Piece]:
        """The pieces it stands for (after ``cut``)."""
        assert self.cuts is not None
        out = []
        for combo in itertools.product(*self.cuts):
            j, slices, offset = zip(*combo, strict=True)
            piece = self.array[slices]
            out.append((j, offset, piece.copy() if copy else piece))
        return out

    def __reduce__(self) -> tuple:
        return (Slab, (self.at, self.array))


class BoxCount:
    """The pieces received and expected by each output chunk of an instance's box
    (``box``: output chunk ranges per axis; ``counts[d][j]``: the input chunks that
    overlap output chunk ``j`` along axis ``d``; ``starts``: where output chunks start),
    counted a slab at a time with numpy: a slab of 500 output chunks is one operation,
    where counting its pieces one by one was ~1 us each."""

    def __init__(self, box: tuple[range, ...], counts: list[list[int]],
                 starts: list[list[int]]) -> None:
        self.box = box
        self.starts = starts
        self.expected = _outer([np.asarray(counts[d][r.start:r.stop], dtype=np.int64)
                                for d, r in enumerate(box)])
        self.received = np.zeros_like(self.expected)

    def __contains__(self, j: Index) -> bool:
        return all(jd in r for jd, r in zip(j, self.box, strict=True))

    def add(self, slab: Slab) -> list[Index]:
        """Count one piece for every output chunk ``slab`` reaches (of some length); the
        output chunks that it completes."""
        where, ones = [], []
        for d, (a, n, axis) in enumerate(zip(slab.at, slab.array.shape, self.starts,
                                             strict=True)):
            j0 = bisect.bisect_right(axis, a) - 1
            j1 = bisect.bisect_left(axis, a + n)
            lengths = np.diff(axis[j0:j1 + 1])
            ones.append((lengths > 0).astype(np.int64))
            where.append(slice(j0 - self.box[d].start, j1 - self.box[d].start))
        where = tuple(where)
        step = _outer(ones)
        received = self.received[where]
        received += step
        done = np.argwhere((received == self.expected[where]) & (step > 0))
        return [tuple(int(x) + s.start + r.start for x, s, r in zip(row, where, self.box,
                                                                     strict=True))
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


def _outer(vectors: list[np.ndarray]) -> np.ndarray:
    out = vectors[0]
    for v in vectors[1:]:
        out = np.multiply.outer(out, v)
    return out


def pieces_by_destination(block: np.ndarray, index: Index,
                          overlaps: list[list[list[tuple[int, slice, int]]]],
                          owner: dict[Index, ServiceId], here: ServiceId,
                          extents: dict[ServiceId, tuple[tuple[int, int], ...]]
                          | None = None,
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

    An instance whose outputs are a box (``extents``: where its box starts and ends along
    each axis) gets one ``Slab`` of the chunk (which starts at ``block_at``) instead of
    its pieces (not for object arrays); ``unboxed``: whether any output's owner has no box
    (if not, no piece is cut at all)."""
    out: dict[ServiceId, list[Piece | PackedPieces | Slab]] = {}
    small: dict[ServiceId, list[Piece]] = {}
    packs = not block.dtype.hasobject
    slabs: list[tuple[ServiceId, Slab]] = []
    if packs and extents:
        for sid, extent in extents.items():
            slab = Slab.of(block, block_at, extent)
            if slab is not None:
                slabs.append((sid, slab))
    else:
        extents, unboxed = {}, True
    pieces = [] if not unboxed else [
        (owner[j], j, offset, piece)
        for j, offset, piece in slice_block(block, index, overlaps)
        if j in owner and owner[j] not in extents]
    views = packs and keeps_views(
        sum(p.nbytes for sid, _, _, p in pieces if sid != here)
        + sum(slab.nbytes for sid, slab in slabs if sid != here), block.nbytes)
    for sid, slab in slabs:
        if sid != here and not views:
            slab.array = slab.array.copy()
        out[sid] = [slab]
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
                if item.cuts is not None:  # (cut: written piece by piece)
                    for j, _ in item.outputs():
                        indices.setdefault(j, item.dtype)
            else:
                indices.setdefault(item[0], item[2].dtype)
    return indices


def write_into(outputs: dict[Index, np.ndarray],
               batches: list[list[Piece | PackedPieces | Slab]],
               box: np.ndarray | None = None, box_at: tuple[int, ...] = (),
               ) -> tuple[list[tuple[Index, int]], list[Piece], list[Slab]]:
    """Every piece of ``batches`` written at its offset into its output chunk; returns
    each piece's output index and bytes, (copied) the pieces whose dtype does not fit
    their output's (``fits``), to be written once it is promoted (``promoted``), and the
    slabs written whole.  A ``Slab`` (``cut`` already) is written into ``box`` (the array
    its outputs are views of, which starts at ``box_at``) at once where its dtype fits,
    else piece by piece."""
    written, aside, whole = [], [], []
    rest: list[list[Piece | PackedPieces | Slab]] = []
    for batch in batches:
        items = []
        for item in batch:
            if type(item) is Slab and box is not None and fits(item.dtype, box.dtype):
                where = tuple(a - o for a, o in zip(item.at, box_at, strict=True))
                write(box, region(where, item.array.shape), item.array)
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
