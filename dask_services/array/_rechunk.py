"""dask.array wiring: the ``"service"`` rechunk method.

``dask.array.rechunk`` (the function behind ``Array.rechunk``, which imports it at call
time, and ``da.rechunk``) picks an implementation by method name (argument, then the
``array.rechunk.method`` config) and refuses unknown names.  Importing ``dask_services``
wraps it so that ``"service"`` builds one :class:`ArrayRechunk` service task; every other
name goes to dask unchanged.  ``tests/test_array_hooks.py`` fails loudly if a dask upgrade
moves this hook or the helpers the wrapper uses.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.array.core import Array, normalize_chunks
from dask.array.utils import validate_axis
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.utils import parse_bytes

from dask_services._config_check import check_config
from dask_services._exchange import graph_settings
from dask_services.array._culling import RechunkLayer
from dask_services.config import setting
from dask_services.graph import ServiceDefinition, build_service_graph

METHOD = "service"
_module = importlib.import_module("dask.array.rechunk")
_dask_rechunk = _module.rechunk


def handles(x: Array) -> bool:
    """Whether the service rechunk handles ``x``'s chunks: numpy arrays, masked or not, not
    cupy or sparse ones (their devices or formats would be lost)."""
    return type(x._meta) in (np.ndarray, np.ma.MaskedArray)


# the settings that decide how a rechunk is cut into tasks
_CUT_BY = ("pairs-per-task", "copy-max-inputs", "slice-saving", "merge-region-max")


def service_rechunk(x: Array, chunks: Any = "auto", block_size_limit: Any = None,
                    balance: bool = False) -> Array:
    """``x`` rechunked by one :class:`ArrayRechunk` service task.

    Accepts what ``Array.rechunk`` accepts: a tuple, a dict by axis, ``-1``, ``None``,
    ``"auto"``, and ``balance=True``.
    """
    check_config()
    if x.ndim > 0 and all(s == 0 for s in x.shape):
        return x  # as dask does: an array with no element along every axis stays as it is
    chunks = _normalize(x, chunks, block_size_limit, balance)
    if not balance and chunks == x.chunks:
        return x
    _module._validate_rechunk(x.chunks, chunks)
    if x.ndim == 0 or chunks == x.chunks:
        return x
    if not handles(x):
        raise TypeError(
            "the 'service' rechunk handles numpy-backed arrays, masked or not; this "
            "array's chunks are "
            f"{type(x._meta).__module__}.{type(x._meta).__name__}. Use method='tasks' "
            "(or 'p2p') for other array types"
        )
    if x.size == 0:
        # no element to move: new empty chunks, without the inputs (as ``tasks`` does)
        empty = da.empty(x.shape, chunks=chunks, dtype=x.dtype)
        if isinstance(x._meta, np.ma.MaskedArray):
            return empty.map_blocks(np.ma.masked_array, meta=x._meta)
        return empty
    from dask_services.array._plan import merge_plan

    # the settings that cut the rechunk into tasks are part of its name: the same rechunk
    # cut another way must not share keys with the first (a service task of one graph
    # taken for the other's waited for ever)
    token = tokenize(x, chunks, METHOD, [setting(f"rechunk.{name}") for name in _CUT_BY])
    name = f"rechunk-service-{token}"
    plan = merge_plan(x.chunks, chunks)
    if plan is not None:
        return _merge_rechunk(x, chunks, name, plan)
    layer = _region_graph(x, chunks, name, token)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[x])
    return Array(graph, name, chunks, meta=x._meta)


def _region_graph(x: Array, chunks: tuple, name: str, token: str) -> RechunkLayer:
    """The tasks of a rechunk, one independent region (or box of regions) at a time.

    Regions (``region_boxes``) share no input: a region with one output chunk is one task
    that copies the pieces of its inputs into it, and so is every output when none needs
    more than ``copy-max-inputs`` inputs; when there are several regions and all are small
    (``merge-region-max``), each is merged by a task and its outputs cut out of it; every
    other region (or box of neighbouring regions) is a service task of its own.  Several
    service tasks instead of one keep the scheduler's ordering cheap (it
    walks every pair of an input and an output that the service task connects) and let
    dask order each region's consumers right after it, as for any other task.  Culled to
    some of a service task's outputs, the layer takes only the inputs those need
    (``RechunkLayer``).
    """
    from dask_services.array._plan import (
        axis_overlaps,
        chunk_starts,
        inputs_by_output,
        max_inputs_per_output,
        most_needed_inputs,
        region_boxes,
    )
    from dask_services.array._service import ArrayRechunk

    # Neighbouring regions share a service task while it connects at most this many
    # (input, output) pairs: each service task costs a run (an instance on every worker
    # holding its inputs, a barrier), and ordering costs per pair.  One region of 3 inputs
    # and 2 outputs per service task made a 0.25 GB local rechunk-then-sum 1.60x p2p's
    # time, groups of 8 regions 1.07x (one run each, load 15).
    max_pairs = int(setting("rechunk.pairs-per-task"))
    overlaps = [axis_overlaps(o, n) for o, n in zip(x.chunks, chunks, strict=True)]
    layer: dict = {}
    # Where no output chunk needs more than ``copy-max-inputs`` input chunks (100-row chunks
    # to 150-row chunks: at most 2), every output chunk is one task that copies from its
    # inputs, as a region with a single output always is: no hand-offs, no claims, and the
    # consumer of an output (a ``.sum()``) follows it as the next task of a chain.
    copy_max = int(setting("rechunk.copy-max-inputs"))
    by_output = [inputs_by_output(axis, len(chunks[d])) for d, axis in enumerate(overlaps)]
    saving = parse_bytes(setting("rechunk.slice-saving"))
    copy = _CopyTasks(x, name, token, chunks, by_output, saving)
    result = RechunkLayer(layer, {}, x.name, name, by_output)
    if 0 < max_inputs_per_output(overlaps, chunks) <= copy_max:
        for j in itertools.product(*(range(len(c)) for c in chunks)):
            layer.update(copy(j))
        return result
    merge_max = parse_bytes(setting("rechunk.merge-region-max"))
    boxes = list(region_boxes(x.chunks, chunks, max_pairs))
    if len(boxes) > 1 and largest_region_bytes(x.chunks, chunks, x.dtype) <= merge_max:
        # many service runs, each moving little (every region's data fits one task): merge
        # each region in a task and cut its outputs out of it instead, as ``tasks`` does;
        # the runs' fixed costs (hand-offs, barrier, claims) outweighed the data
        starts = ([chunk_starts(c) for c in x.chunks], [chunk_starts(c) for c in chunks])
        result.split_region = functools.partial(_merge_and_split_tasks, x.name, x.dtype,
                                                name, starts)
        for r, (old_box, new_box) in enumerate(region_boxes(x.chunks, chunks, 0)):
            outputs = list(itertools.product(*new_box))
            if len(outputs) == 1:
                layer.update(copy(outputs[0]))
            elif outputs:
                region_key = (f"rechunk-region-{token}", r)
                result.regions[region_key] = (old_box, outputs)
                layer.update(result.split_region(region_key, old_box, outputs))
        return result
    carried: dict[str, Any] = dict(graph_settings("rechunk"))
    if isinstance(x._meta, np.ma.MaskedArray):  # (its outputs of no piece: masked too)
        carried["masked"] = True
    for b, (old_box, new_box) in enumerate(boxes):
        outputs = list(itertools.product(*new_box))
        inputs = list(itertools.product(*old_box))
        if len(outputs) == 1:
            (j,) = outputs
            layer.update(copy(j))
            continue
        old_offset = tuple(r.start for r in old_box)
        new_offset = tuple(r.start for r in new_box)
        sub_old = tuple(tuple(x.chunks[d][k] for k in r) for d, r in enumerate(old_box))
        sub_new = tuple(tuple(chunks[d][k] for k in r) for d, r in enumerate(new_box))
        input_keys = [(x.name, *i) for i in inputs]
        nearest = most_needed_inputs(sub_old, sub_new)
        definition = ServiceDefinition(
            service_class=ArrayRechunk,
            params={"old_chunks": sub_old, "new_chunks": sub_new, "dtype": x.dtype,
                    "old_offset": old_offset, "new_offset": new_offset, **carried},
            input_keys=tuple(input_keys),
            handoff_keys=tuple((f"rechunk-handoff-{token}", *i) for i in inputs),
            output_keys=tuple((name, *j) for j in outputs),
            name="rechunk",
            # an output next to the input it takes most of: less data between workers
            affinity=None if nearest is None else {
                (name, *_shift(j, new_offset)): (x.name, *_shift(i, old_offset))
                for j, i in nearest.items()
            },
            # one of several regions: its run takes place where its inputs are, not on
            # every worker (an instance, a start and a barrier each); one region: where its
            # inputs are and its outputs go
            participants="input-holders" if len(boxes) > 1 else "involved",
        )
        service_key = f"rechunk-service-task-{token}-{b}"
        result.services[service_key] = definition
        layer.update(build_service_graph(definition, service_key, input_keys))
    return result


class _CopyTasks:
    """The tasks that build an output chunk ``j`` from the slices of the inputs it needs
    (``by_output``: per axis, per output index, ``[(input index, slice, offset), ...]``),
    called once per output chunk.

    An input chunk that the output takes whole is an argument of the copy itself; so is
    one shared with other outputs when the part this output does not need is smaller than
    ``saving`` bytes.  Otherwise the shared chunk gets a slice task for this output, run
    where the input is: when the copy runs on another worker only the slice travels, and
    it is forgotten with the copy.  Workers fetch the dependencies of every task assigned
    to them as early as they can, so whole shared chunks would be held (twice) long before
    their copies run; a slice task costs the scheduler a task, more than moving a small
    chunk whole (``design/array-rechunk.md``, "Slices of shared inputs").

    The lengths of the inputs and of their slices are computed once per axis, not per
    output (40,000 chunks of 100 x 100 to 125 x 80: the graph in 1.44-1.46 s -> 1.23 s).
    """

    def __init__(self, x: Array, name: str, token: str, chunks: tuple, by_output: list,
                 saving: int) -> None:
        self.input_name, self.name, self.chunks = x.name, name, chunks
        self.slice_name = f"rechunk-slice-{token}"
        self.dtype = x.dtype
        self.by_output = by_output
        # per axis, per output index, per input it needs: (the input's length, the length
        # of its slice); an axis of unknown size, which slices cover whole, counts as one
        # element (the bytes an output does not need: a lower bound)
        self.lengths = [
            [[(1, 1) if math.isnan(old[i]) else (int(old[i]), len(range(
                *sl.indices(int(old[i]))))) for i, sl, _ in needed] for needed in axis]
            for old, axis in zip(x.chunks, by_output, strict=True)]
        self.min_saving = max(saving, 1) / self.dtype.itemsize if self.dtype.itemsize \
            else math.inf

    def __call__(self, j: tuple) -> dict:
        from dask._task_spec import Task, TaskRef

        from dask_services.array._pieces import copy_pieces, take_slice

        tasks: dict = {}
        layout = []
        blocks = []
        needed = [self.by_output[d][jd] for d, jd in enumerate(j)]
        lengths = [self.lengths[d][jd] for d, jd in enumerate(j)]
        for combo, sizes in zip(itertools.product(*needed), itertools.product(*lengths),
                                strict=True):
            i, slices, offset = zip(*combo, strict=True)
            whole, part = zip(*sizes, strict=True)
            if math.prod(whole) - math.prod(part) < self.min_saving:
                layout.append((slices, offset))
                blocks.append(TaskRef((self.input_name, *i)))
                continue
            key = (self.slice_name, *i, *j)
            tasks[key] = Task(key, take_slice, TaskRef((self.input_name, *i)), slices)
            layout.append((None, offset))
            blocks.append(TaskRef(key))
        shape = tuple(self.chunks[d][jd] for d, jd in enumerate(j))
        tasks[(self.name, *j)] = Task((self.name, *j), copy_pieces, shape, self.dtype,
                                      layout, *blocks)
        return tasks


def largest_region_bytes(old: tuple, new: tuple, dtype: np.dtype) -> float:
    """The bytes of the largest independent region of a rechunk (``inf`` with an axis of
    unknown size)."""
    from dask_services.array._plan import axis_regions

    size = float(dtype.itemsize)
    for o, n in zip(old, new, strict=True):
        if any(math.isnan(c) for c in o):
            return math.inf
        size *= max((sum(o[i] for i in r) for r, _ in axis_regions(o, n)), default=0)
    return size


def _merge_and_split_tasks(input_name: str, dtype: np.dtype, name: str,
                           starts: tuple[list[list[int]], list[list[int]]], region_key: tuple,
                           old_box: tuple[range, ...], outputs: list[tuple[int, ...]]
                           ) -> dict:
    """The tasks of one small independent region: one task (``region_key``) that merges
    its input chunks (``old_box``) into one array, and a task per output chunk
    (``outputs``) that copies its part out of it (``starts``: where every old and every new
    chunk starts, per axis, ``_starts``)."""
    from dask._task_spec import Task, TaskRef

    from dask_services.array._pieces import copy_part, merge_blocks

    old_at, new_at = starts
    origin = [old_at[d][box.start] for d, box in enumerate(old_box)]
    shape = tuple(old_at[d][box.stop] - origin[d] for d, box in enumerate(old_box))
    inputs = list(itertools.product(*old_box))
    tasks: dict = {region_key: Task(
        region_key, merge_blocks, shape, dtype,
        [tuple(old_at[d][id_] - origin[d] for d, id_ in enumerate(i)) for i in inputs],
        *(TaskRef((input_name, *i)) for i in inputs),
    )}
    for j in outputs:
        part = tuple(slice(new_at[d][jd] - origin[d], new_at[d][jd + 1] - origin[d])
                     for d, jd in enumerate(j))
        tasks[(name, *j)] = Task((name, *j), copy_part, TaskRef(region_key), part)
    return tasks


def _shift(index: tuple, offset: tuple) -> tuple:
    return tuple(a + o for a, o in zip(index, offset, strict=True))


def _merge_rechunk(x: Array, chunks: tuple, name: str, plan: dict) -> Array:
    """``x`` rechunked by one task per output chunk, which copies its (whole, neighbouring)
    input chunks into one new array: what a rechunk that only merges chunks needs, in a
    graph no larger than the ``tasks`` method's (``merge_plan``)."""
    from dask._task_spec import Task, TaskRef

    from dask_services.array._pieces import merge_blocks

    layer = {}
    for j, pieces in plan.items():
        shape = tuple(chunks[d][jd] for d, jd in enumerate(j))
        layer[(name, *j)] = Task(
            (name, *j), merge_blocks, shape, x.dtype, [offset for offset, _ in pieces],
            *(TaskRef((x.name, *i)) for _, i in pieces),
        )
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[x])
    return Array(graph, name, chunks, meta=x._meta)


def _normalize(x: Array, chunks: Any, block_size_limit: Any, balance: bool) -> tuple:
    """The new chunks as a tuple of tuples, as ``dask.array.rechunk`` computes them."""
    if isinstance(chunks, dict):
        chunks = {validate_axis(c, x.ndim): v for c, v in chunks.items()}
        chunks = tuple(x.chunks[i] if chunks.get(i) is None else chunks[i]
                       for i in range(x.ndim))
    if isinstance(chunks, (tuple, list)):
        # as dask does: zipped with the current chunks (a longer tuple is cut to ndim)
        chunks = tuple(rc if lc is None else lc
                       for lc, rc in zip(chunks, x.chunks, strict=False))
    chunks = normalize_chunks(chunks, x.shape, limit=block_size_limit, dtype=x.dtype,
                              previous_chunks=x.chunks)
    if len(chunks) != x.ndim:
        raise ValueError("Provided chunks are not consistent with shape")
    for axis, sizes in enumerate(chunks):
        negative = [c for c in sizes if c < 0]  # NaN (unknown) compares False
        if negative:
            raise ValueError(
                f"rechunk: chunk sizes must be >= 0, axis {axis} has {negative[0]} in "
                f"{sizes}; give sizes that add up to the axis' length ({x.shape[axis]})")
    if balance:
        chunks = tuple(_module._balance_chunksizes(c) for c in chunks)
    return chunks


def _method(method: str | None) -> str | None:
    return method or dask.config.get("array.rechunk.method", None)


@functools.wraps(_dask_rechunk)
def _rechunk(x, chunks="auto", threshold=None, block_size_limit=None, balance=False,
             method=None):
    if _method(method) == METHOD:
        if method is None and not handles(x):
            # the session's method, set for numpy arrays, reached by another array type
            # (a cupy or sparse array's reshape or rechunk): dask's tasks, rather than an error
            return _dask_rechunk(x, chunks, threshold=threshold,
                                 block_size_limit=block_size_limit, balance=balance,
                                 method="tasks")
        from dask_services.client import _maybe_install_default_client

        _maybe_install_default_client()
        return service_rechunk(x, chunks, block_size_limit=block_size_limit, balance=balance)
    return _dask_rechunk(x, chunks, threshold=threshold, block_size_limit=block_size_limit,
                         balance=balance, method=method)


_rechunk.__wrapped__ = _dask_rechunk  # type: ignore[attr-defined]


def register() -> None:
    """Make ``"service"`` a rechunk method of dask.array, and its copies fuse with their
    consumers under the consumers' keys (``_fusion``) (idempotent)."""
    from dask_services.array import _fusion

    _fusion.install()
    if _module.rechunk is not _rechunk:
        _module.rechunk = _rechunk
    if da.rechunk is not _rechunk:
        da.rechunk = _rechunk

