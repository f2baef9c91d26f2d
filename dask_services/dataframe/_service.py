"""The DataFrame shuffle as a service.

Every instance splits the partitions handed to it by the precomputed target-partition
column (the same column dask's ``tasks`` method uses, so rows land in the same output
partitions), sends one frame per destination worker per input partition (the rows of all
that worker's partitions, grouped), buffers what it receives (spilling to disk past its
budget) and, once all inputs are in, assembles each output partition it owns in a worker
thread: pieces in input-partition order, so rows keep their relative order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import dask
import numpy as np
import pandas as pd
from dask.sizeof import sizeof

from dask_services._spill import SpillBuffer
from dask_services.service import Service, ServiceId, rpc

Key = Hashable


def split_by_destination(
    df: pd.DataFrame, column: Any, destination: dict[int, ServiceId]
) -> dict[ServiceId, tuple[pd.DataFrame, list[int], list[int]]]:
    """Rows of ``df`` grouped per destination: ``{sid: (frame, partitions, bounds)}``.

    ``frame`` holds the destination's rows sorted by target partition (stable, so rows keep
    their order within a partition) without ``column``; partition ``partitions[j]`` is
    ``frame.iloc[bounds[j]:bounds[j + 1]]``.  Rows for unwanted partitions are dropped.
    """
    if not len(df):
        return {}
    parts = df[column].to_numpy()
    data = df.drop(columns=[column])
    order = np.argsort(parts, kind="stable")
    sorted_parts = parts[order]
    uniq, starts = np.unique(sorted_parts, return_index=True)
    ends = np.append(starts[1:], len(sorted_parts))
    by_dest: dict[ServiceId, list[tuple[int, int, int]]] = {}
    for p, a, b in zip(uniq.tolist(), starts.tolist(), ends.tolist(), strict=True):
        sid = destination.get(p)
        if sid is not None:
            by_dest.setdefault(sid, []).append((p, a, b))
    out = {}
    for sid, ranges in by_dest.items():
        rows = np.concatenate([order[a:b] for _, a, b in ranges])
        frame = data.take(rows)
        bounds = [0]
        for _, a, b in ranges:
            bounds.append(bounds[-1] + b - a)
        out[sid] = (frame, [p for p, _, _ in ranges], bounds)
    return out


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


class DataFrameShuffle(Service):
    """Peer-to-peer hash shuffle of DataFrame partitions; see module docstring."""

    def __init__(self) -> None:
        self.buffer: SpillBuffer | None = None
        self.sent_bytes = 0
        self.received_bytes = 0

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader, *,
                    meta: pd.DataFrame, column: Any, parts_out: list[int],
                    input_index: dict, ignore_index: bool = False, **kwargs: Any) -> None:
        self.meta = meta
        self.column = column
        self.ignore_index = ignore_index
        self.input_index = input_index
        self.partition_of = dict(zip(output_keys, parts_out, strict=True))
        self.destination = {
            self.partition_of[k]: concierge.owner(k) for k in concierge.wanted_outputs
        }
        limit = concierge.memory_limit
        fraction = float(dask.config.get("dask_services.shuffle.buffer-fraction"))
        budget = int(limit * fraction) if limit else 2**62
        self.buffer = SpillBuffer(concierge.local_directory, budget)

    async def add_key(self, key, data: pd.DataFrame) -> None:
        index = self.input_index[key]
        batches = await self.concierge.run_in_executor(
            split_by_destination, data, self.column, self.destination
        )
        del data
        sends = []
        for sid, (frame, partitions, bounds) in batches.items():
            if sid != self.id:
                self.sent_bytes += sizeof(frame)
            sends.append(self.peers[sid].receive(index, frame, partitions, bounds))
        await asyncio.gather(*sends)

    @rpc
    async def receive(self, index: int, frame: pd.DataFrame, partitions: list[int],
                      bounds: list[int]) -> None:
        assert self.buffer is not None
        total = sizeof(frame)
        self.received_bytes += total
        n = max(len(frame), 1)
        pieces = [
            (p, (index, frame.iloc[bounds[j]:bounds[j + 1]]),
             total * (bounds[j + 1] - bounds[j]) // n)
            for j, p in enumerate(partitions)
        ]
        await self.buffer.add_batch(pieces)

    async def all_inputs_done(self) -> None:
        assert self.buffer is not None
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) != self.id:
                continue
            pieces = await self.buffer.take(self.partition_of[out])
            frame = await self.concierge.run_in_executor(
                assemble, pieces, self.meta, self.ignore_index
            )
            del pieces
            await self.concierge.produce_key(out, frame)

    async def stop(self) -> None:
        if self.buffer is not None:
            self.buffer.clear()
            self.buffer = None

    def __sizeof__(self) -> int:
        return self.buffer.memory_bytes if self.buffer is not None else 0

    def spilled_bytes(self) -> int:
        return self.buffer.disk_bytes if self.buffer is not None else 0

    async def please_evict(self, nbytes: int) -> None:
        if self.buffer is not None:
            await self.buffer.spill()
