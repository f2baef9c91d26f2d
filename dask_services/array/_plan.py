"""The plan of a rechunk: which pieces of which old chunks make each new chunk, the
independent regions of the two chunkings, and which inputs decide an output's place.

Pure functions of the old and new chunks (no arrays), used where the graph is built
(``_rechunk.py``) and by the service's instances (``_service.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np

from dask_services.array._pieces import Chunks, Index


def chunk_starts(sizes: Sequence[float]) -> list[int]:
    """Where every chunk along an axis starts, and (last) the axis's length."""
    return [0, *itertools.accumulate(int(c) for c in sizes)]


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


# the output chunks are split among the workers into boxes only where the largest box
# has at most this many times the chunks of the smallest (7 chunks on 2 workers: 4 and 3)
MAX_BOX_IMBALANCE = 4 / 3


def _imbalance(chunks: int, parts: int) -> float:
    """Largest over smallest share of ``chunks`` split into ``parts`` contiguous runs."""
    return math.inf if chunks < parts else -(-chunks // parts) / (chunks // parts)


def output_blocks(old: Chunks, new: Chunks, parts: int) -> list[int] | None:
    """For each output chunk in C order, which of ``parts`` workers owns it, such that
    each worker owns a box of neighbouring chunks: the grid split into contiguous ranges
    along one axis, or along two (8 workers: 2 x 4), all chunks along the others; ``None``
    where no such split keeps the boxes within ``MAX_BOX_IMBALANCE`` of each other, or an
    axis has an unknown size (the framework then deals the outputs round robin).

    Preferred, in order: splitting no axis along which the rechunk has independent
    regions (each region's outputs complete as its inputs are in: one worker would take
    all of a region's pieces while the others wait), one axis rather than two, the
    evener split, more chunks along the split axes, the outer axes.

    An input chunk's share for a worker is then one slab of it, or a few (``Slab``), and
    the worker writes it into its box with one assignment, where round-robin ownership
    cuts it into a piece per output chunk it overlaps (400 pieces of 2.5 kB for a 500 x
    500 time step cut into 20 x 20 tiles), each costing microseconds of Python on both
    sides."""
    if parts < 2 or any(math.isnan(c) for axis in (*old, *new) for c in axis):
        return None
    grid = [len(axis) for axis in new]
    regions = [len(axis_regions(o, n)) > 1 for o, n in zip(old, new, strict=True)]
    splits: list[tuple[tuple, dict[int, int]]] = []
    for d, n in enumerate(grid):
        ratio = _imbalance(n, parts)
        if ratio <= MAX_BOX_IMBALANCE:
            splits.append(((regions[d], 1, ratio, -n, d), {d: parts}))
    for d1, d2 in itertools.combinations(range(len(grid)), 2):
        for p1 in range(2, parts // 2 + 1):
            if parts % p1:
                continue
            p2 = parts // p1
            ratio = _imbalance(grid[d1], p1) * _imbalance(grid[d2], p2)
            if ratio <= MAX_BOX_IMBALANCE:
                splits.append(((regions[d1] + regions[d2], 2, ratio,
                                -grid[d1] * grid[d2], d1, d2), {d1: p1, d2: p2}))
    if not splits:
        return None
    split = min(splits, key=lambda s: s[0])[1]
    # each chunk's share along each split axis (contiguous, balanced), the shares numbered
    # across the split axes in C order
    owner = np.zeros(grid, dtype=np.int64)
    stride = 1
    for d in sorted(split, reverse=True):
        share = np.arange(grid[d]) * split[d] // grid[d] * stride
        owner += share.reshape([-1 if e == d else 1 for e in range(len(grid))])
        stride *= split[d]
    return owner.ravel().tolist()


Box = tuple[range, ...]  # output chunk indices per axis


def owned_boxes(owner: dict[Index, object]) -> dict[object, Box]:
    """The owners (of ``owner``: output chunk index -> owner) whose output chunks are a box
    of at least two chunks and nothing else: each such owner's box."""
    spans: dict[object, list[list[int]]] = {}
    counts: dict[object, int] = {}
    for j, who in owner.items():
        span = spans.get(who)
        if span is None:
            spans[who] = [[x, x] for x in j]
        else:
            for d, x in enumerate(j):
                if x < span[d][0]:
                    span[d][0] = x
                elif x > span[d][1]:
                    span[d][1] = x
        counts[who] = counts.get(who, 0) + 1
    boxes = {}
    for who, span in spans.items():
        size = math.prod(hi - lo + 1 for lo, hi in span)
        if size == counts[who] and size >= 2:
            boxes[who] = tuple(range(lo, hi + 1) for lo, hi in span)
    return boxes
