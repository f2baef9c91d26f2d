"""Sample sort: sort scalar inputs into ordered output partitions.

Each input is a scalar or a 1-d sequence of scalars.  Instances send a sample of their
values to the leader, which picks splitters and sends them to every instance; each instance
then sends every wanted output its bucket of values (one batched message per peer), and the
owner of an output produces the sorted bucket once every peer has sent its share.
Concatenating the outputs in order gives ``sorted(all values)``.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
from typing import Any

import numpy as np

from dask_services.service import Service, ServiceId, rpc


class SampleSort(Service):
    """Sort numbers across workers; ``samples_per_instance`` tunes splitter quality."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.samples: dict[ServiceId, list[Any]] = {}
        self.incoming: dict[ServiceId, dict[Any, list[Any]]] = {}

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    samples_per_instance: int = 64, **kwargs: Any) -> None:
        self.samples_per_instance = samples_per_instance

    async def add_key(self, key, data) -> None:
        if np.ndim(data) == 0:
            self.values.append(data.item() if hasattr(data, "item") else data)
        else:
            self.values.extend(np.asarray(data).tolist())

    async def all_inputs_done(self) -> None:
        self.values.sort()
        n = len(self.values)
        k = min(n, self.samples_per_instance)
        sample = [self.values[(i * n) // k] for i in range(k)] if k else []
        await self.peers[self.leader].receive_samples(self.id, sample)

    @rpc
    async def receive_samples(self, source: ServiceId, sample: list[Any]) -> None:
        """Peer RPC (leader): ``source``'s sample; with all of them, pick splitters."""
        self.samples[source] = sample
        if len(self.samples) < len(self.peers):
            return
        pooled = sorted(v for s in self.samples.values() for v in s)
        n_out = len(self.output_keys)
        splitters = [pooled[(i * len(pooled)) // n_out] for i in range(1, n_out)] if pooled else []
        await asyncio.gather(*(p.receive_splitters(splitters) for p in self.peers.values()))

    @rpc
    async def receive_splitters(self, splitters: list[Any]) -> None:
        """Peer RPC: the leader's splitters; send each peer its bucket of values."""
        wanted = set(self.concierge.wanted_outputs)
        buckets: dict[ServiceId, dict[Any, list[Any]]] = {sid: {} for sid in self.peers}
        for out in self.concierge.wanted_outputs:
            buckets[self.concierge.owner(out)][out] = []
        for v in self.values:  # sorted, so every bucket stays sorted
            out = self.output_keys[bisect.bisect_right(splitters, v)]
            if out in wanted:
                buckets[self.concierge.owner(out)][out].append(v)
        await asyncio.gather(
            *(self.peers[sid].receive_bucket(self.id, b) for sid, b in buckets.items())
        )

    @rpc
    async def receive_bucket(self, source: ServiceId, buckets: dict[Any, list[Any]]) -> None:
        """Peer RPC: ``source``'s values for this instance's outputs."""
        self.incoming[source] = buckets
        if len(self.incoming) < len(self.peers):
            return
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) != self.id:
                continue
            parts = [b.get(out, []) for _, b in sorted(self.incoming.items())]
            await self.concierge.produce_key(out, list(heapq.merge(*parts)))

    async def stop(self) -> None:
        self.values.clear()
        self.samples.clear()
        self.incoming.clear()
