"""The DataFrame shuffle as a service.

Every instance splits the partitions handed to it by each row's output partition (computed
as dask's ``tasks`` method computes it, ``_partitioning.py``, so rows land in the same output
partitions) into one frame per destination instance and group of that instance's
partitions (``shuffle.groups``; small groups travel in one frame).  Messages to a peer
that is still receiving an earlier one wait and go together (``PeerStream.send_batched``).
Sends run in the background within
``shuffle.bytes-in-flight``, so a hand-off returns as soon as its data is on its way.
Receivers buffer each frame under its group, cut at group boundaries where it holds
several (spilling to disk past their budget).  Once all inputs are handed off, every
instance delivers what it still has in flight and tells each peer so; when it has heard
that from every peer it assembles its outputs group by group, in a worker thread (so a
group's received frames are freed before the next group is read): rows in input-partition
order, as ``tasks`` gives them."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import pandas as pd

from dask_services._exchange import PeerExchange
from dask_services._memory import TrimAfter, release_freed_memory
from dask_services.config import setting
from dask_services.dataframe._frame_size import frame_sizeof, object_cell_bytes
from dask_services.dataframe._partitioning import Assign, target_partitions
from dask_services.dataframe._rows import (
    ColumnWay,
    FrameRows,
    RowSource,
    concat_frames,
    concat_rows,
    rows_nbytes,
    rows_of_arrays,
    sliced,
    take_rows,
)
from dask_services.service import ServiceId, rpc

Key = Hashable


# (frame, partitions, bounds, bytes) per group; the frame a DataFrame, or all rows of a
# FrameRows whose source takes the column way (the group of an input split as arrays)
Batch = list[tuple[pd.DataFrame | FrameRows, list[int], list[int], int]]
MIN_GROUP_BYTES = 2**19  # smaller groups of one input partition are sent together


ASSEMBLY_BATCH_BYTES = 4 * 2**20  # large outputs are assembled a few at a time
WINDOW_BYTES = 32 * 2**20  # small frames of more groups are assembled together up to this
# smaller inputs are split on the event loop: a hop to a worker thread and back costs about
# as much as splitting them (distributed deserializes messages up to 10 MiB there too)
INLINE_SPLIT_BYTES = 2**18
EXACT_SIZE_ROWS = 10_000  # groups of more rows are measured with sizeof; smaller ones estimated


class Routing:
    """Where each output partition goes, as arrays.  ``targets`` lists each instance's
    groups ``(instance, group)`` consecutively and in group order; a partition's *code* is
    the number of its target in that list.

    ``rank[p]`` is partition ``p``'s place when the wanted partitions are ordered by
    ``(code, partition)`` (``-1``: not wanted), and ``part_of_rank`` / ``code_of_rank`` go
    back: sorting rows by rank sorts them by destination, then partition, with keys below
    the number of partitions (a 16-bit radix sort for up to 65,536 of them, several times
    faster than sorting 64-bit keys).
    """

    def __init__(self, destination: dict[int, tuple[ServiceId, int]]) -> None:
        self.targets = sorted(set(destination.values()), key=lambda t: (str(t[0]), t[1]))
        number = {t: i for i, t in enumerate(self.targets)}
        ranked = sorted(destination, key=lambda p: (number[destination[p]], p))
        self.part_of_rank = np.asarray(ranked, dtype=np.int64)
        self.code_of_rank = np.asarray([number[destination[p]] for p in ranked],
                                       dtype=np.int64)
        self.rank = np.full(max(destination, default=-1) + 1, -1, dtype=np.int64)
        self.rank[self.part_of_rank] = np.arange(len(ranked))
        self.rank_dtype = np.uint16 if len(ranked) <= 2**16 else np.int64
        # the sort keys of every partition from 0 on, where all of them are wanted
        self.every_rank = (self.rank.astype(self.rank_dtype) if (self.rank >= 0).all()
                           else None)


def split_by_destination(
    data: pd.DataFrame, parts: np.ndarray, destination: dict[int, tuple[ServiceId, int]],
    nbytes: int, routing: Routing | None = None, own: ServiceId | None = None,
    arrays: tuple[list[Any], Any, Any] | None = None,
) -> dict[ServiceId, Batch]:
    """Rows of ``data`` grouped per destination instance, then per group of partitions.

    ``parts`` holds every row's output partition; ``destination`` maps a wanted output
    partition to ``(instance, group)`` (``routing``, the same as arrays, saves building
    them per call).  Returns ``{sid: [(frame, partitions, bounds, frame_bytes), ...]}``,
    one entry per group: ``frame`` holds that group's rows sorted by target partition
    (stable, so rows keep their order within a partition); partition ``partitions[j]`` is
    ``frame.iloc[bounds[j]:bounds[j + 1]]``; ``frame_bytes`` is the size of ``frame``: its
    ``sizeof`` for large groups, else ``data``'s size in proportion to the rows plus the
    index a taken frame materializes where ``data`` had a ``RangeIndex`` (without it the
    estimate was 28% low on the benchmark frame, and buffers held more than their budget).
    The groups for instance ``own`` (the caller's, buffered without serialization) are
    each their own copy, so that a group's memory is freed once its partitions are
    assembled; the rows for every other instance are taken in one copy and its groups are
    slices of it (serializing a slice writes only its rows, and one ``take`` costs less
    than one per group).  An input smaller than ``MIN_GROUP_BYTES`` is taken in one copy
    for every other instance.  Consecutive groups smaller than ``MIN_GROUP_BYTES`` (as estimated
    from ``nbytes``) are merged.  Rows for unwanted partitions are dropped.

    ``arrays``: ``data``'s columns' values, index values and index name where ``data``
    takes the column way (``ColumnWay.values_of``).  The input is then taken column by
    column and its groups are :class:`FrameRows` of those arrays (slices of one take per
    instance, or of one take in all for a small input, for the groups sent; a take of its
    own for each of the caller's): no frame is built, a group sent to a peer is pickled as
    its arrays, and a large group is measured from its arrays (a pandas ``take``, a slice
    per group and a copy of the own group cost ~0.5 ms for a 200-row frame, and pickling a
    frame and reading it back twice what its arrays cost; for an 8 MB frame
    ``DataFrame.take`` costs 3-4x its columns' own takes, and ``sizeof`` of a group 0.5 ms).

    The work per input is a few numpy calls and one ``take`` per group sent, whatever the
    number of output partitions its rows go to.
    """
    if not len(data):
        return {}
    if routing is None:
        routing = Routing(destination)
    targets = routing.targets
    parts = np.asarray(parts)
    width = len(routing.rank)  # more than any wanted partition
    if (routing.every_rank is not None and parts.dtype.kind in "iu"
            and parts.min() >= 0 and parts.max() < width):
        # every row goes to a wanted partition (the common case): no masks, a fifth the time
        key = routing.every_rank[parts]
        order = np.argsort(key, kind="stable")
        key = key[order]
    else:
        parts = parts.astype(np.int64, copy=False)
        row_rank = np.full(len(parts), -1, dtype=np.int64)
        known = (parts < width) & (parts >= 0)
        row_rank[known] = routing.rank[parts[known]]
        wanted = np.flatnonzero(row_rank >= 0)
        if not len(wanted):
            return {}
        key = row_rank[wanted].astype(routing.rank_dtype)
        by_key = np.argsort(key, kind="stable")
        order, key = wanted[by_key], key[by_key]
    starts = np.concatenate(([0], np.flatnonzero(key[1:] != key[:-1]) + 1))
    ranks = key[starts].astype(np.int64)
    part_ids = routing.part_of_rank[ranks].tolist()
    part_codes = routing.code_of_rank[ranks]
    code_starts = np.concatenate(([0], np.flatnonzero(part_codes[1:] != part_codes[:-1]) + 1,
                                  [len(starts)])).tolist()
    row_starts = starts.tolist() + [len(key)]
    # columns of Python objects: their cells measured one by one (dask samples them, and
    # a large cell among small ones was missed or counted for every row), the rest of
    # the frame in proportion to the rows
    cells = object_cell_bytes(data)
    cell_bytes_before: np.ndarray | None = None
    if cells is not None:
        row_bytes, nbytes_but_cells = cells
        cell_bytes_before = np.concatenate(([0], np.cumsum(row_bytes[order])))
    per_row = ((nbytes if cells is None else nbytes_but_cells) / len(data)
               + (8 if isinstance(data.index, pd.RangeIndex) else 0))
    out: dict[ServiceId, Batch] = {}
    pending: tuple[ServiceId, int] | None = None  # (sid, first partition slot) not sent yet

    rows_of: dict[ServiceId, list[int]] = {}  # each instance's rows: a run of ``order``
    for c in range(len(code_starts) - 1):
        sid = targets[int(part_codes[code_starts[c]])][0]
        run = rows_of.setdefault(sid, [row_starts[code_starts[c]], 0])
        run[1] = row_starts[code_starts[c + 1]]
    taken: dict[ServiceId | None, Any] = {}
    # the rows for other instances are taken once per instance, or once in all for a small
    # input (a ``take`` costs ~0.2 ms whatever the rows, a slice a fifth of it), and sliced
    # per group; the caller's own groups are takes of their own, so that they hold only
    # their rows while they wait to be assembled
    small = nbytes < MIN_GROUP_BYTES

    def take_of(rows: np.ndarray) -> pd.DataFrame | FrameRows:
        if arrays is None:
            return data.take(rows)
        columns, index, name = arrays
        return rows_of_arrays([c.take(rows) for c in columns], index.take(rows), name)

    def take(sid: ServiceId, i0: int, i1: int
             ) -> tuple[pd.DataFrame | FrameRows, list[int], list[int], int]:
        a, b = row_starts[i0], row_starts[i1]
        if sid == own:
            frame = take_of(order[a:b])
        else:  # pickled when sent: a slice writes only its rows
            whose = None if small else sid
            first, last = (0, len(order)) if small else rows_of[sid]
            if whose not in taken:
                taken[whose] = take_of(order[first:last])
            frame = sliced(taken[whose], a - first, b - first)
        if cell_bytes_before is not None:
            size = int((b - a) * per_row + cell_bytes_before[b] - cell_bytes_before[a])
        elif b - a <= EXACT_SIZE_ROWS:
            size = int((b - a) * per_row)
        else:
            size = rows_nbytes(frame) if isinstance(frame, FrameRows) else frame_sizeof(frame)
        return frame, part_ids[i0:i1], bounds_of(i0, i1), size

    def bounds_of(i0: int, i1: int) -> list[int]:
        return [r - row_starts[i0] for r in row_starts[i0:i1 + 1]]

    for c in range(len(code_starts) - 1):
        i0, i1 = code_starts[c], code_starts[c + 1]
        sid = targets[int(part_codes[i0])][0]
        if pending is not None and pending[0] != sid:
            out.setdefault(pending[0], []).append(take(pending[0], pending[1], i0))
            pending = None
        start = pending[1] if pending is not None else i0
        # small groups travel together: a group is only worth its own copy (so that its
        # memory can be freed on its own) when it is large
        if (row_starts[i1] - row_starts[start]) * per_row < MIN_GROUP_BYTES:
            pending = (sid, start)
            continue
        out.setdefault(sid, []).append(take(sid, start, i1))
        pending = None
    if pending is not None:
        out.setdefault(pending[0], []).append(take(pending[0], pending[1], len(starts)))
    return out


def check_input_columns(index: int, data: Any, meta: Any, partitions_column: Any) -> Any:
    """``data``, input partition ``index``, with the meta's columns in the meta's order (but
    for the column of output partitions ``partitions_column`` dask's partitioning step
    added, if any, kept last); raise if it has other columns than the meta.  ``tasks``
    hands back the meta's order, and would hand back partitions whose columns disagree
    with the collection's."""
    if getattr(data, "ndim", 0) != 2 or getattr(meta, "ndim", 0) != 2:
        return data
    columns = data.columns
    if partitions_column is not None and partitions_column in columns:
        columns = columns[columns != partitions_column]
    if columns.equals(meta.columns):
        return data
    got, expected = Counter(columns), Counter(meta.columns)
    if got == expected and not meta.columns.has_duplicates:
        extra_column = [] if len(columns) == len(data.columns) else [partitions_column]
        return data[list(meta.columns) + extra_column]
    if got == expected:
        how = "the same columns in another order, which the meta's duplicate names leave "
        how += "ambiguous"
    else:
        how = (f"more than in the meta: {list((got - expected).elements())[:10]}; fewer: "
               f"{list((expected - got).elements())[:10]}")
    raise ValueError(
        f"shuffle: input partition {index} has columns {list(columns)[:20]} where the "
        f"collection's meta has {list(meta.columns)[:20]} ({how}); the function that made "
        "the partition and the meta it was given disagree: fix the one or pass meta= "
        "matching the partitions")


def split_input(
    df: pd.DataFrame | pd.Series, assign: Assign | None, column: Any,
    destination: dict[int, tuple[ServiceId, int]], nbytes: int,
    routing: Routing | None = None, own: ServiceId | None = None,
    column_way: ColumnWay | None = None,
) -> tuple[dict[ServiceId, Batch], Any]:
    """:func:`split_by_destination` of one input partition, and the frequency its index
    keeps through the split (:func:`freq_kept`).  Its rows' output partitions
    are in ``column``, or, with ``assign`` (the shuffle took dask's partitioning step in),
    computed here as dask computes them, so rows go where ``tasks`` sends them.
    ``column_way`` (of the outputs' meta): an input that takes the column way is split as
    arrays."""
    frame = df.to_frame() if df.ndim == 1 else df
    arrays = None
    if column_way is not None:
        arrays = column_way.values_of(frame, column, dropping=assign is None)
    if assign is None:
        parts = df[column].to_numpy()
        if arrays is None:
            frame = df.drop(columns=[column])
    else:
        parts = target_partitions(df, assign)
    return (split_by_destination(frame, parts, destination, nbytes, routing, own, arrays),
            freq_kept(frame.index, parts))


def freq_kept(index: pd.Index, parts: np.ndarray) -> Any:
    """The frequency of a datetime or timedelta ``index`` where ``tasks`` keeps it through
    its split of the partition, else None: ``tasks`` takes the rows in output-partition
    order and slices that per output, and pandas keeps a frequency through a take only
    where the rows are already in that order (the take is a slice)."""
    freq = getattr(index, "freq", None)
    if freq is None or not isinstance(index, (pd.DatetimeIndex, pd.TimedeltaIndex)):
        return None
    parts = np.asarray(parts)
    if len(parts) > 1 and bool((parts[1:] < parts[:-1]).any()):
        return None
    return freq


def size_batches(items: list[Any], size: Callable[[Any], int], limit: int) -> list[list[Any]]:
    """``items`` cut, in order, into runs whose sizes add up to at most ``limit`` (an item
    larger than ``limit`` is a run of its own)."""
    batches: list[list[Any]] = []
    total = 0
    for item in items:
        n = size(item)
        if not batches or total + n > limit:
            batches.append([])
            total = 0
        batches[-1].append(item)
        total += n
    return batches


# A received frame as buffered: (input index, frame, partitions, bounds); partition
# ``partitions[j]`` is ``frame.iloc[bounds[j]:bounds[j + 1]]`` (rows before ``bounds[0]`` or
# from ``bounds[-1]`` on belong to other windows, :func:`cut_at`)
Received = tuple[int, pd.DataFrame, list[int], list[int]]
# below this many rows per (received frame, output partition) on average, one concatenation
# and one sort for all the partitions assembled together beat one concatenation of pieces
# per output partition
SMALL_PIECE_ROWS = 256


def assemble_group(received: list[Received], window: list[int], meta: pd.DataFrame,
                   ignore_index: bool, uniform: bool | None = None,
                   freqs: dict[int, Any] | None = None,
                   empty: pd.DataFrame | None = None) -> list[pd.DataFrame]:
    """The output partitions ``window`` (in order) from every frame received for them.

    Rows keep the order ``tasks`` gives them: by input partition, then as they were in it.
    Large pieces are concatenated per output partition (:func:`assemble`).  Small ones are
    concatenated once for the whole window, sorted by (output partition, input partition)
    and cut: a pandas call per piece (a slice, a frame in a concatenation) costs tens of
    microseconds whatever its size, and with thousands of partitions of a few hundred rows
    every output partition is made of hundreds of one-row pieces.  Frames whose dtypes
    differ from the meta's, or with categoricals (a partition's categories are the union
    over its own pieces), always take the first way.  ``uniform``: whether that is known
    not to be the case (found with :func:`frame_is_uniform` otherwise).  ``freqs``: the
    frequency each input's index kept through its split, where it kept one
    (:func:`with_index_freq`); ``empty`` as for :func:`assemble`.
    """
    if not received:
        return [assemble([], meta, ignore_index, empty=empty) for _ in window]
    pairs = sum(len(parts) for _, _, parts, _ in received)
    rows = sum(bounds[-1] - bounds[0] for _, _, _, bounds in received)
    if uniform is None:
        uniform = all(isinstance(frame, FrameRows) or frame_is_uniform(frame, meta)
                      for _, frame, _, _ in received)
    if rows >= SMALL_PIECE_ROWS * pairs or not uniform:
        by_partition = pieces_by_partition(received)
        return [assemble(by_partition.get(p, []), meta, ignore_index, freqs, empty)
                for p in window]
    received = sorted(received, key=lambda item: item[0])
    part = np.concatenate([
        np.repeat(np.asarray(parts, dtype=np.int64), np.diff(bounds))
        for _, _, parts, bounds in received
    ])
    order = np.argsort(part, kind="stable")  # frames are in input order: rows keep it
    part = part[order]
    if any(bounds[0] or bounds[-1] != len(f) for _, f, _, bounds in received):
        # frames cut at a window's edge (:func:`cut_at`): only their rows in bounds
        starts = np.cumsum([0] + [len(f) for _, f, _, _ in received[:-1]]).tolist()
        rows_in = np.concatenate([
            np.arange(start + bounds[0], start + bounds[-1])
            for start, (_, _, _, bounds) in zip(starts, received, strict=True)])
        order = rows_in[order]
    frames = [f for _, f, _, _ in received]
    if all(isinstance(f, FrameRows) for f in frames):  # small inputs' groups, as arrays
        frame = take_rows(frames, order, meta, ignore_index)
    else:
        frame = concat_frames([f.frame(meta) if isinstance(f, FrameRows) else f
                               for f in frames], concat=pd.concat).take(order)
    cuts = np.searchsorted(part, np.asarray(window, dtype=np.int64), side="left").tolist()
    cuts.append(len(part))
    # the inputs each output has rows from, where their frequencies matter
    inputs_of: dict[int, list[int]] = {}
    if freqs and not ignore_index:
        inputs_of = {p: [] for p in window}
        for index, _, parts, bounds in received:
            for j, p in enumerate(parts):
                if bounds[j + 1] > bounds[j] and p in inputs_of:
                    inputs_of[p].append(index)
    out = []
    for j in range(len(window)):
        a, b = cuts[j], cuts[j + 1]
        if b == a:
            out.append(assemble([], meta, ignore_index, empty=empty))
        else:
            out.append(frame.iloc[a:b].reset_index(drop=True) if ignore_index
                       else with_index_freq(frame.iloc[a:b], [
                           freqs.get(i) for i in inputs_of.get(window[j], [])]))
    return out


def with_index_freq(frame: pd.DataFrame, freqs: list[Any]) -> pd.DataFrame:
    """``frame`` (an output partition with rows) with the index frequency ``tasks`` gives
    it, ``freqs`` being the frequency each of its pieces' inputs kept through its split
    (:func:`freq_kept`), in input order: pandas keeps a frequency through the
    concatenation of pieces that all have it and follow each other by it.  The pieces here
    are rebuilt from arrays, which have none (``groupby(...).shift(freq=...)`` and
    ``index.shift`` read it)."""
    index = frame.index
    if not isinstance(index, (pd.DatetimeIndex, pd.TimedeltaIndex)) or not len(index):
        return frame
    freq = freqs[0] if freqs and all(f is not None and f == freqs[0] for f in freqs) else None
    if index.freq == freq:
        return frame
    try:
        frame.index = type(index)(index, freq=freq)  # checks the spacing
    except (ValueError, TypeError):  # not evenly spaced by it: none, as with tasks
        frame.index = type(index)(index, freq=None)
    return frame


def frame_is_uniform(frame: pd.DataFrame, meta: pd.DataFrame) -> bool:
    """Whether ``frame`` has the meta's dtypes and nothing of it is categorical (its rows
    can then be assembled with any other such frame's, :func:`assemble_group`)."""
    if meta.ndim != 2 or isinstance(meta.index.dtype, pd.CategoricalDtype):
        return False
    expected = meta.dtypes.tolist()
    if any(isinstance(d, pd.CategoricalDtype) for d in expected):
        return False
    return frame.dtypes.tolist() == expected and frame.index.dtype == meta.index.dtype


def assemble_many(pieces: list[list[tuple[int, pd.DataFrame | FrameRows]]], meta: pd.DataFrame,
                  ignore_index: bool, freqs: dict[int, Any] | None = None,
                  empty: pd.DataFrame | None = None) -> list[pd.DataFrame]:
    """:func:`assemble` for several output partitions in one call."""
    return [assemble(p, meta, ignore_index, freqs, empty) for p in pieces]


def rows_unlike_meta(frame: pd.DataFrame | FrameRows, meta: pd.DataFrame
                     ) -> pd.DataFrame | None:
    """No rows of ``frame``, if its dtypes (columns' or index's) are not the meta's: an
    output partition without rows is then made like the data, as ``tasks`` makes it (the
    empty slices of the inputs, concatenated), not like the meta (a ``map_partitions``
    whose ``meta=`` says ``int64`` for ``float64`` data, categoricals of unknown
    categories, whose meta holds a placeholder category); else None."""
    if isinstance(frame, FrameRows):
        # rows taking the column way have the meta's dtypes (``ColumnWay``); making their
        # frame would copy its arrays on the event loop, and keep the copy in its source
        return None
    if getattr(frame, "ndim", 0) != 2 or getattr(meta, "ndim", 0) != 2:
        return None
    n = len(meta.columns)
    if not frame.columns[:n].equals(meta.columns):
        return None
    frame = frame.iloc[:0, :n]  # (an input has the column of output partitions last)
    if (frame.dtypes.tolist() == meta.dtypes.tolist()
            and frame.index.dtype == meta.index.dtype):
        return None
    return frame


def assemble(pieces: list[tuple[int, pd.DataFrame | FrameRows]], meta: pd.DataFrame,
             ignore_index: bool, freqs: dict[int, Any] | None = None,
             empty: pd.DataFrame | None = None) -> pd.DataFrame:
    """One output partition from its pieces, in input-partition order (as ``tasks`` does):
    column by column where the pieces allow it (``_rows.py``), else by pandas; ``freqs``
    as for :func:`assemble_group`.  ``empty``: what a partition without pieces is made
    from where the data's dtypes are not the meta's (:func:`rows_unlike_meta`)."""
    if not pieces:
        # a frame of its own (a consumer may change it in place) and without rows: dask's
        # meta may have some (a categorical ``value_counts`` step's: a zero count per
        # category), which an output partition that received nothing does not
        empty = (meta if empty is None else empty).iloc[:0].copy()
        return empty.reset_index(drop=True) if ignore_index else empty
    pieces.sort(key=lambda item: item[0])
    rows = [piece if isinstance(piece, FrameRows) else FrameRows(RowSource(piece), 0, len(piece))
            for _, piece in pieces]
    if all(r.source.takes_column_way(meta) for r in rows):
        result = concat_rows(rows, meta, ignore_index)
    else:
        result = concat_frames([r.frame(meta) for r in rows], ignore_index=ignore_index)
        if ignore_index:
            result = result.reset_index(drop=True)
    if ignore_index:
        return result
    return with_index_freq(result, [freqs.get(i) for i, piece in pieces if len(piece)]
                           if freqs else [])


class DataFrameShuffle(PeerExchange):
    """Peer-to-peer hash shuffle of DataFrame partitions; see module docstring."""

    config_section = "shuffle"

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader, *,
                    meta: pd.DataFrame, column: Any, parts_out: list[int],
                    input_index: dict, ignore_index: bool = False,
                    assign: Assign | None = None, **kwargs: Any) -> None:
        self.meta = meta
        self.column = column
        self.assign = assign
        self.ignore_index = ignore_index
        self.input_index = input_index
        self.partition_of = dict(zip(output_keys, parts_out, strict=True))
        self.destination = group_partitions(
            {self.partition_of[k]: concierge.owner(k) for k in concierge.wanted_outputs},
            int(setting("shuffle.groups")),
        )
        self.routing = Routing(self.destination)
        self.column_way = ColumnWay(meta)
        self.mixed_groups: set[int] = set()  # groups with frames of other dtypes than meta's
        # no rows of the first frame received, if its dtypes are not the meta's: what
        # output partitions without rows are made from (``rows_unlike_meta``); looked at
        # once (a frame's dtypes cost ~0.1 ms, thousands of batches arrive)
        self.empty_like: pd.DataFrame | None = None
        self.looked_at_dtypes = False
        # the index frequency each input kept through its split, where it kept one
        self.index_freqs: dict[int, Any] = {}
        # an input's columns as expected (the meta's, and dask's column of output
        # partitions last unless the shuffle computes them): anything else is looked at
        self.input_columns = (meta.columns if assign is not None or meta.ndim != 2
                              else meta.columns.append(pd.Index([column])))
        self.open_exchange(concierge)

    async def add_key(self, key, data: pd.DataFrame) -> None:
        assert self.stream is not None
        index = self.input_index[key]
        nbytes = self.concierge.input_nbytes(key)
        if nbytes is None:
            nbytes = frame_sizeof(data)
        columns = getattr(data, "columns", None)
        if columns is not None and not columns.equals(self.input_columns):
            data = check_input_columns(index, data, self.meta,
                                       self.column if self.assign is None else None)
        self._look_at_dtypes(data)
        args = (data, self.assign, self.column, self.destination, nbytes, self.routing,
                self.id, self.column_way)
        if nbytes < INLINE_SPLIT_BYTES:
            batches, freq = split_input(*args)  # less than handing it to a thread costs
        else:
            batches, freq = await self.concierge.run_in_executor(split_input, *args)
        del args
        del data
        for sid, batch in batches.items():
            if sid == self.id:
                await self.receive(index, batch, freq)
                continue
            nbytes = sum(group[3] for group in batch)
            self.sent_bytes += nbytes
            await self.stream.send_batched(sid, nbytes, "receive_many", (index, batch, freq))

    @rpc
    async def receive_many(self, items: list[tuple[int, Batch, Any]]) -> None:
        """Peer RPC: :meth:`receive` for the batches of several input partitions."""
        for index, batch, freq in items:
            await self.receive(index, batch, freq)

    @rpc
    async def receive(self, index: int, batch: Batch, freq: Any = None) -> None:
        """Peer RPC: keep the rows of input ``index`` that belong to this instance
        (``freq``: the frequency its index kept through the split, :func:`freq_kept`).

        A frame of large pieces (``SMALL_PIECE_ROWS`` rows or more per partition on
        average) is buffered as one share per partition (its row range, ``_rows.py``: the
        frame is sliced only at assembly, in a worker thread), under its partition, so that
        outputs are read back and assembled a few at a time.  A frame of small pieces is
        kept whole, under the group of its first partition (small groups travel together,
        so it may hold the rows of several): cutting it into a slice per partition or per
        group cost a pandas call per piece, thousands per input when partitions are many
        and small.  :meth:`all_inputs_done` assembles such frames a window of groups at a
        time.
        """
        assert self.buffer is not None
        if freq is not None:
            self.index_freqs[index] = freq
        items: list[tuple[Any, Any, int]] = []
        group_of = self.destination
        # the frames of a batch are cut from one input partition (``split_by_destination``),
        # so they share its columns and dtypes: whether they take the column way, or have
        # the meta's dtypes, is found once per batch (~0.35 ms a frame, on the event loop)
        column_way: bool | None = None
        uniform: bool | None = None
        if batch:
            self._look_at_dtypes(batch[0][0])
        for frame, partitions, bounds, nbytes in batch:
            self.received_bytes += nbytes
            if len(frame) >= SMALL_PIECE_ROWS * len(partitions):
                rows = max(len(frame), 1)
                if isinstance(frame, FrameRows):  # all its source's rows, column way
                    source = frame.source
                else:
                    # found now, not at assembly: a spilled share needs it
                    source = RowSource(frame, column_way=column_way)
                    column_way = source.takes_column_way(self.meta)
                items += [(p, (index, FrameRows(source, bounds[j], bounds[j + 1])),
                           nbytes * (bounds[j + 1] - bounds[j]) // rows)
                          for j, p in enumerate(partitions)]
                continue
            first, last = group_of[partitions[0]][1], group_of[partitions[-1]][1]
            if uniform is None:
                uniform = (isinstance(frame, FrameRows)
                           or frame_is_uniform(frame, self.meta))
            if not uniform:
                self.mixed_groups.update(range(first, last + 1))
            items.append((("group", first), (index, frame, partitions, bounds), nbytes))
        await self.buffer.add_batch(items)

    async def all_inputs_done(self) -> None:
        assert self.buffer is not None and self.stream is not None
        await self.stream.finish()
        # the owned partitions of each group, in partition order
        groups: dict[int, list[int]] = {}
        for p, (sid, g) in sorted(self.destination.items()):
            if sid == self.id:
                groups.setdefault(g, []).append(p)
        key_of = {self.partition_of[k]: k for k in self.concierge.wanted_outputs}
        trim = TrimAfter()
        order = sorted(groups)
        carry: list[Received] = []  # rows of frames that reach past the last window
        i = 0
        while i < len(order):
            # a window: the next group, and the groups after it that the small frames
            # received with it reach into, up to WINDOW_BYTES; groups one window after the
            # other, so that what was received for a window is freed before the next
            held = self.buffer.memory_bytes
            window = [order[i]]
            size = self.buffer.nbytes(("group", order[i]))
            small = carry + await self.buffer.take(("group", order[i]))
            i += 1
            while (i < len(order) and size < WINDOW_BYTES and small
                   and self._last_group(small) >= order[i]):
                window.append(order[i])
                size += self.buffer.nbytes(("group", order[i]))
                small += await self.buffer.take(("group", order[i]))
                i += 1
            small, carry = cut_at(small, window[-1], self.destination)
            partitions = [p for g in window for p in groups[g]]
            await self._assemble_window(window, partitions, small, key_of, trim, held)
        assert not carry, "rows left after the last group"

    def _last_group(self, received: list[Received]) -> int:
        return max(self.destination[parts[-1]][1] for _, _, parts, _ in received)

    async def _assemble_window(self, window: list[int], partitions: list[int],
                               small: list[Received], key_of: dict[int, Key],
                               trim: TrimAfter, held: int) -> None:
        """Produce the outputs ``partitions`` of the groups ``window``."""
        assert self.buffer is not None
        # by presence, not size: a spill under way counts its pieces, but a piece
        # estimated at 0 bytes must not be left behind either
        if not any(self.buffer.holds(p) for p in partitions):
            uniform = not self.mixed_groups.intersection(window)
            frames = await self.concierge.run_in_executor(
                measured, assemble_group, small, partitions, self.meta, self.ignore_index,
                uniform, self.index_freqs, self.empty_like)
            del small
            await self._trim(trim, held)
            for p, (frame, nbytes) in zip(partitions, frames, strict=True):
                await self.concierge.produce_key(key_of[p], frame, nbytes=nbytes)
            return
        # large pieces: a few outputs at a time, each from its own pieces (and the small
        # frames' rows for it, if any)
        rest = pieces_by_partition(small)
        del small
        for batch in size_batches(partitions, self.buffer.nbytes, ASSEMBLY_BATCH_BYTES):
            held = self.buffer.memory_bytes
            pieces = [await self.buffer.take(p) + rest.pop(p, []) for p in batch]
            frames = await self.concierge.run_in_executor(
                measured, assemble_many, pieces, self.meta, self.ignore_index,
                self.index_freqs, self.empty_like)
            del pieces
            await self._trim(trim, held)
            for p, (frame, nbytes) in zip(batch, frames, strict=True):
                await self.concierge.produce_key(key_of[p], frame, nbytes=nbytes)
            del frames

    def _look_at_dtypes(self, frame: Any) -> None:
        """The first frame this instance sees (an input, or rows received) decides what
        its output partitions without rows are made from (``rows_unlike_meta``)."""
        if not self.looked_at_dtypes:
            self.looked_at_dtypes = True
            self.empty_like = rows_unlike_meta(frame, self.meta)

    async def _trim(self, trim: TrimAfter, held: int) -> None:
        """Give memory back to the OS once enough was freed since ``held`` was read."""
        assert self.buffer is not None
        if trim.freed_bytes(held - self.buffer.memory_bytes):
            await self.concierge.run_in_executor(release_freed_memory)


def measured(assemble: Callable[..., list[pd.DataFrame]], *args: Any
             ) -> list[tuple[pd.DataFrame, int]]:
    """The frames ``assemble(*args)`` makes, each with its size (dask's ``sizeof``, from
    the dtypes where it can be: ``_frame_size.py``), measured in the service thread that
    made them: the worker then takes the size from ``produce_key`` instead of measuring
    each output twice on its event loop."""
    return [(frame, frame_sizeof(frame)) for frame in assemble(*args)]


def cut_at(received: list[Received], last_group: int,
           destination: dict[int, tuple[ServiceId, int]],
           ) -> tuple[list[Received], list[Received]]:
    """``received`` split into the rows of partitions in groups up to ``last_group`` and
    the rest.  A frame that reaches past ``last_group`` is not sliced: both sides keep the
    whole frame, each with its own partitions and bounds (its rows are taken out when a
    window is assembled, :func:`assemble_group`), since a pandas slice costs tens of
    microseconds and a window may be reached by every frame received."""
    now: list[Received] = []
    later: list[Received] = []
    for index, frame, parts, bounds in received:
        # partitions are in order, and so are their groups
        j = bisect.bisect_right(parts, last_group, key=lambda p: destination[p][1])
        if j == len(parts):
            now.append((index, frame, parts, bounds))
        elif j == 0:
            later.append((index, frame, parts, bounds))
        else:
            now.append((index, frame, parts[:j], bounds[:j + 1]))
            later.append((index, frame, parts[j:], bounds[j:]))
    return now, later


def pieces_by_partition(received: list[Received]) -> dict[int, list[tuple[int, FrameRows]]]:
    """``(input index, rows)`` pieces of each partition of received frames."""
    out: dict[int, list[tuple[int, FrameRows]]] = {}
    for index, frame, parts, bounds in received:
        # a FrameRows here holds all its source's rows (``Batch``)
        source = frame.source if isinstance(frame, FrameRows) else RowSource(frame)
        for j, p in enumerate(parts):
            out.setdefault(p, []).append((index, FrameRows(source, bounds[j], bounds[j + 1])))
    return out


def group_partitions(owner: dict[int, ServiceId], groups: int
                     ) -> dict[int, tuple[ServiceId, int]]:
    """Each partition's ``(owner, group)``: every owner's partitions, in order, cut into
    at most ``groups`` contiguous groups."""
    by_owner: dict[ServiceId, list[int]] = {}
    for p in sorted(owner):
        by_owner.setdefault(owner[p], []).append(p)
    out = {}
    for sid, partitions in by_owner.items():
        size = -(-len(partitions) // max(groups, 1))
        for i, p in enumerate(partitions):
            out[p] = (sid, i // size)
    return out
