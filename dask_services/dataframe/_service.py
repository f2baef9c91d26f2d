"""The DataFrame shuffle as a service.

Every instance splits the partitions handed to it by each row's output partition (computed
as dask's ``tasks`` method computes it, ``_partitioning.py``, so rows land in the same output
partitions) and sends one message per destination instance per input partition, holding
the rows of that instance's partitions in a few groups (``shuffle.groups``).  Sends run in
the background within ``shuffle.bytes-in-flight``, so a hand-off returns as soon as its
data is on its way.  Receivers buffer what arrives (spilling to disk past their budget).
Once all inputs are handed off, every instance delivers what it still has in flight and
tells each peer so; when it has heard that from every peer it assembles each output
partition it owns, in a worker thread and in partition order (so received groups are freed
one after the other): pieces in input-partition order, so rows keep their relative order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import dask
import numpy as np
import pandas as pd
from dask.sizeof import sizeof

from dask_services._exchange import PeerExchange
from dask_services._memory import TrimAfter, release_freed_memory
from dask_services.dataframe._partitioning import Assign, target_partitions
from dask_services.service import ServiceId, rpc

Key = Hashable


Batch = list[tuple[pd.DataFrame, list[int], list[int], int]]
MIN_GROUP_BYTES = 2**19  # smaller groups of one input partition are sent together
ASSEMBLY_BATCH_BYTES = 4 * 2**20  # small outputs are assembled several per worker-thread call


def split_by_destination(
    data: pd.DataFrame, parts: np.ndarray, destination: dict[int, tuple[ServiceId, int]],
    nbytes: int,
) -> dict[ServiceId, Batch]:
    """Rows of ``data`` grouped per destination instance, then per group of partitions.

    ``parts`` holds every row's output partition; ``destination`` maps a wanted output
    partition to ``(instance, group)``.  Returns
    ``{sid: [(frame, partitions, bounds, frame_bytes), ...]}``, one entry per group: ``frame``
    holds that group's rows sorted by target partition (stable, so rows keep their order
    within a partition); partition ``partitions[j]`` is
    ``frame.iloc[bounds[j]:bounds[j + 1]]``; ``frame_bytes`` is the size of ``frame``
    (``sizeof``: a taken frame's index takes memory that a ``RangeIndex`` did not, so
    ``data``'s size in proportion to the rows, which ``nbytes`` gives, would be low).
    Every group is its own copy, so that the receiver frees a group's memory once it has
    assembled that group's partitions; consecutive groups smaller than ``MIN_GROUP_BYTES``
    (as estimated from ``nbytes``) are merged.  Rows for unwanted partitions are dropped.
    """
    if not len(data):
        return {}
    order = np.argsort(parts, kind="stable")
    sorted_parts = parts[order]
    uniq, starts = np.unique(sorted_parts, return_index=True)
    ends = np.append(starts[1:], len(sorted_parts))
    by_group: dict[tuple[ServiceId, int], list[tuple[int, int, int]]] = {}
    for p, a, b in zip(uniq.tolist(), starts.tolist(), ends.tolist(), strict=True):
        target = destination.get(p)
        if target is not None:
            by_group.setdefault(target, []).append((p, a, b))
    bytes_per_row = nbytes / len(data)
    out: dict[ServiceId, Batch] = {}
    pending: dict[ServiceId, list[tuple[int, int, int]]] = {}
    for (sid, _), ranges in sorted(by_group.items(), key=lambda item: item[0][1]):
        # small groups travel together: a group is only worth its own copy (so that its
        # memory can be freed on its own) when it is large
        ranges = pending.pop(sid, []) + ranges
        if sum(b - a for _, a, b in ranges) * bytes_per_row < MIN_GROUP_BYTES:
            pending[sid] = ranges
            continue
        out.setdefault(sid, []).append(_take(data, order, ranges))
    for sid, ranges in pending.items():
        out.setdefault(sid, []).append(_take(data, order, ranges))
    return out


def split_input(
    df: pd.DataFrame | pd.Series, assign: Assign | None, column: Any,
    destination: dict[int, tuple[ServiceId, int]], nbytes: int,
) -> dict[ServiceId, Batch]:
    """:func:`split_by_destination` of one input partition.  Its rows' output partitions
    are in ``column``, or, with ``assign`` (the shuffle took dask's partitioning step in),
    computed here as dask computes them, so rows go where ``tasks`` sends them."""
    if assign is None:
        return split_by_destination(df.drop(columns=[column]), df[column].to_numpy(),
                                    destination, nbytes)
    parts = target_partitions(df, assign)
    return split_by_destination(df.to_frame() if df.ndim == 1 else df, parts, destination,
                                nbytes)


def _take(data: pd.DataFrame, order: np.ndarray, ranges: list[tuple[int, int, int]]
          ) -> tuple[pd.DataFrame, list[int], list[int], int]:
    rows = np.concatenate([order[a:b] for _, a, b in ranges])
    bounds = [0]
    for _, a, b in ranges:
        bounds.append(bounds[-1] + b - a)
    frame = data.take(rows)
    return (frame, [p for p, _, _ in ranges], bounds, sizeof(frame))


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


def assemble_many(pieces: list[list[tuple[int, pd.DataFrame]]], meta: pd.DataFrame,
                  ignore_index: bool) -> list[pd.DataFrame]:
    """:func:`assemble` for several output partitions in one call."""
    return [assemble(p, meta, ignore_index) for p in pieces]


def assemble(pieces: list[tuple[int, pd.DataFrame]], meta: pd.DataFrame,
             ignore_index: bool) -> pd.DataFrame:
    """One output partition from its pieces, in input-partition order (as ``tasks`` does)."""
    from dask.dataframe.core import _concat

    if not pieces:
        return meta.reset_index(drop=True) if ignore_index else meta
    pieces.sort(key=lambda item: item[0])
    frames = [frame for _, frame in pieces]
    result = _concat(frames, ignore_index=ignore_index)
    if ignore_index:
        result = result.reset_index(drop=True)
    return result


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
            int(dask.config.get("dask_services.shuffle.groups")),
        )
        self.open_exchange(concierge)

    async def add_key(self, key, data: pd.DataFrame) -> None:
        assert self.stream is not None
        index = self.input_index[key]
        batches = await self.concierge.run_in_executor(
            split_input, data, self.assign, self.column, self.destination, sizeof(data)
        )
        del data
        for sid, batch in batches.items():
            if sid == self.id:
                await self.receive(index, batch)
                continue
            nbytes = sum(group[3] for group in batch)
            self.sent_bytes += nbytes
            await self.stream.send(sid, nbytes, "receive", index, batch)

    @rpc
    async def receive(self, index: int, batch: Batch) -> None:
        """Peer RPC: keep the pieces of input ``index`` that belong to this instance."""
        assert self.buffer is not None
        pieces = []
        for frame, partitions, bounds, nbytes in batch:
            self.received_bytes += nbytes
            n = max(len(frame), 1)
            pieces += [
                (p, (index, frame.iloc[bounds[j]:bounds[j + 1]]),
                 nbytes * (bounds[j + 1] - bounds[j]) // n)
                for j, p in enumerate(partitions)
            ]
        await self.buffer.add_batch(pieces)

    async def all_inputs_done(self) -> None:
        assert self.buffer is not None and self.stream is not None
        await self.stream.finish()
        owned = [out for out in self.concierge.wanted_outputs
                 if self.concierge.owner(out) == self.id]
        # in partition order, so that received groups are freed one after the other; small
        # outputs several per worker-thread call (a call costs more than assembling them)
        owned.sort(key=self.partition_of.__getitem__)
        buffered = self.buffer.nbytes
        trim = TrimAfter()
        for batch in size_batches(owned, lambda out: buffered(self.partition_of[out]),
                                  ASSEMBLY_BATCH_BYTES):
            held = self.buffer.memory_bytes
            pieces = [await self.buffer.take(self.partition_of[out]) for out in batch]
            frames = await self.concierge.run_in_executor(
                assemble_many, pieces, self.meta, self.ignore_index
            )
            del pieces
            if trim.freed_bytes(held - self.buffer.memory_bytes):
                await self.concierge.run_in_executor(release_freed_memory)
            for out, frame in zip(batch, frames, strict=True):
                await self.concierge.produce_key(out, frame)
            del frames


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
