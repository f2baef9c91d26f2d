"""A small user-defined service, used by ``dask-services demo`` and the README."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dask_services import Service, ServiceId, rpc


class Histogram(Service):
    """Count values of array inputs into ``bins`` equal bins of ``[0, high)``.

    Output *j* is a dict ``{bin: count}`` for the bins assigned to it (bins are split
    evenly over the outputs), so the histogram ends up partitioned across workers.
    """

    def __init__(self) -> None:
        self.counts: np.ndarray | None = None
        self.received: dict[ServiceId, dict[Any, dict[int, int]]] = {}

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    bins: int = 10, high: float = 1.0, **kwargs: Any) -> None:
        self.bins, self.high = bins, high
        self.counts = np.zeros(bins, dtype=np.int64)

    async def add_key(self, key, data) -> None:
        counts, _ = np.histogram(np.asarray(data), bins=self.bins, range=(0, self.high))
        self.counts += counts

    def _bins_of(self, output: Any) -> range:
        j, n = self.output_keys.index(output), len(self.output_keys)
        return range(j * self.bins // n, (j + 1) * self.bins // n)

    async def all_inputs_done(self) -> None:
        # one message per owner with the counts of the bins its outputs cover
        by_owner: dict[ServiceId, dict[Any, dict[int, int]]] = {sid: {} for sid in self.peers}
        for out in self.concierge.wanted_outputs:
            by_owner[self.concierge.owner(out)][out] = {
                b: int(self.counts[b]) for b in self._bins_of(out)
            }
        await asyncio.gather(*(self.peers[sid].receive(self.id, part)
                               for sid, part in by_owner.items()))

    @rpc
    async def receive(self, source: ServiceId, part: dict[Any, dict[int, int]]) -> None:
        self.received[source] = part
        if len(self.received) < len(self.peers):
            return
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                total: dict[int, int] = {}
                for p in self.received.values():
                    for b, c in p.get(out, {}).items():
                        total[b] = total.get(b, 0) + c
                await self.concierge.produce_key(out, dict(sorted(total.items())))

    async def stop(self) -> None:
        self.counts = None
        self.received.clear()
