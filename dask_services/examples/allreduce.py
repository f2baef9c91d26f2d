"""All-reduce: every output receives the reduction of every input.

Each instance reduces the inputs handed to it, sends its partial result to every peer over
RPC (itself included, through the loopback), and once it holds every partial it produces the
total as each output it owns.  Works for anything ``op`` can combine: numbers, numpy arrays,
pandas objects.

>>> outs = dask_services.submit(AllReduce, futures, outputs=4, op="sum")
"""

from __future__ import annotations

import asyncio
import functools
import operator
from collections.abc import Callable
from typing import Any

from dask_services.service import Service, ServiceId, rpc

OPS: dict[str, Callable[[Any, Any], Any]] = {
    "sum": operator.add,
    "prod": operator.mul,
    "max": max,
    "min": min,
}


class AllReduce(Service):
    """Reduce all inputs with ``op`` (a name in ``OPS`` or a binary function)."""

    def __init__(self) -> None:
        self.partial: list[Any] = []  # [] or [value]
        self.received: dict[ServiceId, list[Any]] = {}

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    op: str | Callable[[Any, Any], Any] = "sum", **kwargs: Any) -> None:
        if isinstance(op, str):
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; use one of {sorted(OPS)} or a function")
            op = OPS[op]
        self.op = op

    async def add_key(self, key, data) -> None:
        self.partial = [self.op(self.partial[0], data) if self.partial else data]

    async def all_inputs_done(self) -> None:
        await asyncio.gather(
            *(peer.receive_partial(self.id, self.partial) for peer in self.peers.values())
        )

    @rpc
    async def receive_partial(self, source: ServiceId, partial: list[Any]) -> None:
        """Peer RPC: ``source``'s partial result; the last one completes the total."""
        self.received[source] = partial
        if len(self.received) < len(self.peers):
            return
        values = [v for sid in sorted(self.received) for v in self.received[sid]]
        if not values:
            raise ValueError("AllReduce needs at least one input")
        total = functools.reduce(self.op, values)
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, total)

    async def stop(self) -> None:
        self.partial = []
        self.received.clear()
