"""A box of output chunks kept by an instance that buffers (its outputs do not fit its
buffer budget together, so they cannot be written in place as they arrive).

The box is cut into bands: sub-boxes of neighbouring output chunks of at most a few tens
of megabytes, taken along the innermost axes first.  A slab received for the box (the
part of one input chunk for it, in tile order) is kept as its part for each band it
reaches, a slice or two of it, and a band is assembled, as tiles of a few arrays
(``TiledBox``), once every chunk in it has all its pieces.  Cutting every slab into a
piece per output chunk instead cost microseconds of Python for each piece on its way in,
to disk and back (a 1 GB time series into 20 x 20 tiles is 400,000 pieces).

The first bands that fit a share of the budget are held in place instead: their boxes
are allocated as their first slabs arrive and their parts written into them, so that a
box a little larger than the budget is mostly written in place rather than all spilled.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from dask_services.array._masks import write
from dask_services.array._pieces import (
    Index,
    Piece,
    Slab,
    TiledBox,
    TileLayout,
    check_covered,
    chunk_dtype,
    fill,
    fits,
    new_array,
    pieces_dtype,
)

Band = tuple[int, ...]
# where a slab's part for a band starts (as ``Slab.at``), and that part in tile order
BandPart = tuple[tuple[int, ...], np.ndarray]


class Bands:
    """``layout``'s box cut into bands of at most ``limit`` bytes (chunks of
    ``itemsize``-byte elements; one chunk where a chunk is larger), counting the chunks
    of each band still to be completed."""

    def __init__(self, layout: TileLayout, itemsize: int, limit: int) -> None:
        self.layout = layout
        self.itemsize = itemsize
        box, starts = layout.box, layout.starts
        biggest = itemsize * math.prod(
            max((starts[d][k + 1] - starts[d][k] for k in r), default=0)
            for d, r in enumerate(box))
        per_band = max(1, limit // max(biggest, 1))
        steps = [1] * len(box)
        inner = 1
        for d in reversed(range(len(box))):
            n = max(len(box[d]), 1)
            if inner * n > per_band:
                steps[d] = max(1, per_band // inner)
                break
            steps[d] = n
            inner *= n
        self.steps = tuple(steps)
        self.left: dict[Band, int] = {
            band: math.prod(map(len, self.box(band)))
            for band in itertools.product(*(range(-(-len(r) // s))
                                            for r, s in zip(box, self.steps, strict=True)))}

    def __len__(self) -> int:
        return len(self.left)

    def of(self, j: Index) -> Band:
        """The band of output chunk ``j``."""
        return tuple((jd - r.start) // s
                     for jd, r, s in zip(j, self.layout.box, self.steps, strict=True))

    def box(self, band: Band) -> tuple[range, ...]:
        """The output chunks of ``band``, as ranges per axis."""
        return tuple(range(r.start + b * s, min(r.start + (b + 1) * s, r.stop))
                     for b, r, s in zip(band, self.layout.box, self.steps, strict=True))

    def layout_of(self, band: Band) -> TileLayout:
        """How ``band``'s chunks are held as tiles (its own ``TileLayout``)."""
        return TileLayout(self.box(band), self.layout.starts)

    def nbytes(self, band: Band) -> int:
        """The bytes of ``band``'s chunks together."""
        starts = self.layout.starts
        return self.itemsize * math.prod(starts[d][r.stop] - starts[d][r.start]
                                         for d, r in enumerate(self.box(band)))

    def fitting(self, budget: int) -> list[Band]:
        """The first bands (in C order) whose chunks fit ``budget`` together."""
        out, total = [], 0
        for band in self.left:
            total += self.nbytes(band)
            if total > budget:
                break
            out.append(band)
        return out

    def completes(self, j: Index) -> Band | None:
        """Count output chunk ``j`` as having all its pieces; its band if that was the
        band's last."""
        band = self.of(j)
        self.left[band] -= 1
        return band if not self.left[band] else None

    def reached(self, slab: Slab) -> Iterator[Band]:
        """The bands that ``slab`` (placed in the layout) reaches."""
        return itertools.product(*(
            range((first - r.start) // step, (first + count - 1 - r.start) // step + 1)
            for first, count, step, r in zip(slab.first, slab.counts, self.steps,
                                             self.layout.box, strict=True)))

    def cut(self, slab: Slab) -> Iterator[tuple[Band, BandPart]]:
        """``slab`` (placed in the layout) as its part for each band it reaches: views of
        its array."""
        per_axis = []
        for d, (first, count, step) in enumerate(zip(slab.first, slab.counts, self.steps,
                                                     strict=True)):
            lo = self.layout.box[d].start
            along, k = [], first
            while k < first + count:
                b = (k - lo) // step
                end = min(first + count, lo + (b + 1) * step)
                at = slab.at[d] if k == first else self.layout.starts[d][k]
                along.append((b, slice(k - first, end - first), at))
                k = end
            per_axis.append(along)
        for combo in itertools.product(*per_axis):
            yield (tuple(b for b, _, _ in combo),
                   (tuple(at for _, _, at in combo),
                    slab.array[tuple(where for _, where, _ in combo)]))


def band_parts(bands: Bands, slabs: list[Slab], boxes: dict[Band, TiledBox] | None = None,
               ) -> tuple[list[tuple[Band, BandPart, int]], list[Piece]]:
    """The parts of ``slabs`` for their bands: those for a band held in place (``boxes``)
    written into its box, or where their dtype does not fit the box's, returned as the
    pieces of its chunks (copied, to be set aside until the chunk is promoted); the others
    returned, each a copy of its own (a view would keep the whole received message in
    memory, and spill it whole), with its bytes."""
    boxes = boxes or {}
    kept: list[tuple[Band, BandPart, int]] = []
    aside: list[Piece] = []
    for slab in slabs:
        for band, (at, part) in bands.cut(slab):
            box = boxes.get(band)
            if box is None:
                kept.append((band, (at, np.array(part, copy=True)), int(part.nbytes)))
            elif fits(part.dtype, box.dtype):
                write(box.destination(at, part.shape), ..., part)
            else:
                aside.extend(Slab(at, part).placed(box.layout, whole=False).pieces(copy=True))
    return kept, aside


def assemble_band(layout: TileLayout, parts: list[BandPart], declared: np.dtype,
                  loose: dict[Index, list[tuple[tuple[int, ...], np.ndarray]]]
                  ) -> dict[Index, np.ndarray]:
    """A band's output chunks (``layout``: its box) from the parts of slabs kept for it
    (in order of arrival) and the ``loose`` pieces of its chunks (that came as pieces,
    not in a slab).  Where all came as slabs of one dtype, the chunks are the tiles
    of one ``TiledBox`` written a part at a time; else every chunk is filled from its
    pieces as a chunk of buffered pieces is, its dtype promoted from theirs alone."""
    dtypes = {part.dtype for _, part in parts}
    chunks = list(itertools.product(*layout.box))

    def shape(j: Index) -> tuple[int, ...]:
        return tuple(layout.starts[d][jd + 1] - layout.starts[d][jd]
                     for d, jd in enumerate(j))

    if not loose and len(dtypes) <= 1:
        box = TiledBox(layout, chunk_dtype(declared, [part.dtype for _, part in parts]))
        check_covered(f"output chunks {chunks[0]} to {chunks[-1]} together",
                      sum(math.prod(shape(j)) for j in chunks),
                      sum(part.size for _, part in parts))
        for at, part in parts:
            write(box.destination(at, part.shape), ..., part)
        # (a chunk of no element has no piece, and the declared dtype, as buffered)
        return {j: box.chunk(j) if math.prod(shape(j)) else np.empty(shape(j), declared)
                for j in chunks}
    pieces = {j: [] for j in chunks}
    for at, part in parts:
        for j, offset, piece in Slab(at, part).placed(layout, whole=False).pieces(copy=False):
            pieces[j].append((offset, piece))
    out = {}
    for j in chunks:
        each = pieces[j] + loose.get(j, [])
        out[j] = fill(new_array(shape(j), pieces_dtype(declared, each)), each)
    return out
