"""Batched and streaming replicated services used by the tests (importable by worker
processes)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np

import dask_services

# Events endpoints wait for and what generators record, by name: shared with the test only
# on in-process workers.
GATES: dict[str, asyncio.Event] = {}
THREAD_GATES: dict[str, threading.Event] = {}
RECORD: dict[str, list] = {}


class Batched(dask_services.Service):
    """Batched endpoints: async and sync, with failing items, wrong lengths, a gate."""

    service_options = {"max_concurrency": 1}

    async def setup(self) -> None:
        self.sizes: list[int] = []

    @dask_services.endpoint(batch_size=4, batch_wait="10s")
    async def double(self, xs: list[int]) -> list[int]:
        self.sizes.append(len(xs))
        return [2 * x for x in xs]

    @dask_services.endpoint(batch_size=4, batch_wait="10s")
    def double_sync(self, xs: list[int]) -> list[int]:
        assert threading.current_thread().name.startswith("replica-")
        self.sizes.append(len(xs))
        return [2 * x for x in xs]

    @dask_services.endpoint(batch_size=8, batch_wait="20ms")
    async def quick(self, xs: list[int]) -> list[int]:
        self.sizes.append(len(xs))
        return [x + 1 for x in xs]

    @dask_services.endpoint(batch_size=4, batch_wait="10s")
    async def picky(self, xs: list[int]) -> list[int | Exception]:
        """A negative request fails on its own: its slot holds the exception."""
        self.sizes.append(len(xs))
        return [ValueError(f"negative request {x}") if x < 0 else x for x in xs]

    @dask_services.endpoint(batch_size=4, batch_wait="10s")
    async def short(self, xs: list[int]) -> list[int]:
        return xs[:-1]

    @dask_services.endpoint(batch_size=4, batch_wait="10s")
    async def broken(self, xs: list[int]) -> list[int]:
        raise RuntimeError(f"the whole batch of {len(xs)} failed")

    @dask_services.endpoint(batch_size=2, batch_wait="10s")
    async def gated(self, xs: list[str]) -> list[str]:
        self.sizes.append(len(xs))
        await GATES.setdefault("batch", asyncio.Event()).wait()
        return xs

    @dask_services.endpoint(batch_size=64, batch_wait="2ms")
    def vectorized(self, xs: list[float]) -> list[float]:
        self.sizes.append(len(xs))
        return list(np.sqrt(np.asarray(xs, dtype=float)))

    @dask_services.endpoint
    async def batch_sizes(self) -> list[int]:
        return list(self.sizes)


class Streamer(dask_services.Service):
    """Generator endpoints (async and sync) that record how far they got."""

    service_options = {"max_concurrency": 2}

    @dask_services.endpoint
    async def count(self, n: int, tag: str = "count") -> AsyncIterator[int]:
        RECORD.setdefault(tag, [])
        try:
            for i in range(n):
                RECORD[tag].append(i)  # produced (the generator was advanced)
                yield i
        finally:
            RECORD[tag].append("finally")

    @dask_services.endpoint
    async def ends_its_process(self) -> AsyncIterator[int]:
        """Ends its worker's process before its first item (a native crash, say)."""
        os._exit(1)
        yield 0

    @dask_services.endpoint
    def count_sync(self, n: int, tag: str = "count_sync") -> Iterator[int]:
        RECORD.setdefault(tag, [])
        try:
            for i in range(n):
                RECORD[tag].append(i)
                yield i
        finally:
            RECORD[tag].append("finally")

    @dask_services.endpoint
    async def forever(self, tag: str) -> AsyncIterator[int]:
        RECORD.setdefault(tag, [])
        i = 0
        try:
            while True:
                RECORD[tag].append(i)
                yield i
                i += 1
                await asyncio.sleep(0)
        finally:
            RECORD[tag].append("finally")

    @dask_services.endpoint
    async def gated_first(self, gate: str, tag: str) -> AsyncIterator[str]:
        """Records its start in ``RECORD[tag]``, then waits for ``GATES[gate]``."""
        RECORD.setdefault(tag, []).append("started")
        await GATES.setdefault(gate, asyncio.Event()).wait()
        yield tag

    @dask_services.endpoint
    def forever_sync(self, tag: str) -> Iterator[int]:
        RECORD.setdefault(tag, [])
        i = 0
        try:
            while True:
                RECORD[tag].append(i)
                yield i
                i += 1
        finally:
            RECORD[tag].append("finally")

    @dask_services.endpoint
    async def fail_after(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise ValueError(f"generator failed after {n} items")

    @dask_services.endpoint
    def fail_after_sync(self, n: int) -> Iterator[int]:
        yield from range(n)
        raise ValueError(f"sync generator failed after {n} items")

    @dask_services.endpoint
    async def tokens(self, prompt: str, delay: float = 0.0) -> AsyncIterator[str]:
        for word in prompt.split():
            if delay:
                await asyncio.sleep(delay)
            yield word

    @dask_services.endpoint
    def slow_tokens(self, prompt: str, delay: float) -> Iterator[str]:
        for word in prompt.split():
            time.sleep(delay)
            yield word

    @dask_services.endpoint
    async def add(self, x: int) -> int:
        return x + 1


def stream_from_task(svc: dask_services.ReplicatedService, prompt: str) -> list[str]:
    """A task (in a worker thread) iterating over a stream through a pickled handle."""
    return list(svc.tokens.stream(prompt))


async def stream_from_async_task(svc: dask_services.ReplicatedService,
                                 prompt: str) -> list[str]:
    """An async task iterating over a stream through a pickled handle."""
    return [w async for w in svc.tokens.stream(prompt)]
