"""Per-replica admission: at most ``max_concurrency`` calls run, ``max_queued`` wait.

Waiting callers each hold a future that the releasing call completes (first come, first
served); nobody polls.  Beyond the queue a call fails at once with ``ServiceOverloaded``.
Calls waiting to join a batch (``_batching.py``) are *held*: they count as queued, and
the batch they join takes one slot (``acquire(internal=True)``, which is not a queued call).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from dask_services.replicated._errors import ReplicaGone, ServiceOverloaded, ServiceShutdown


class CallGate:
    """An asyncio admission gate with a bounded FIFO queue."""

    def __init__(self, max_concurrency: int, max_queued: int, name: str = "replica") -> None:
        self.max_concurrency = max_concurrency
        self.max_queued = max_queued
        self.name = name
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._internal: set[asyncio.Future] = set()  # waiters that are batches, not calls
        self.held = 0  # calls waiting to join a batch (counted as queued)
        self._closed: BaseException | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        """Calls waiting for a slot or to join a batch."""
        return len(self._waiters) - len(self._internal) + self.held

    def _check_room(self) -> None:
        if self._closed is not None:
            raise self._closed
        if self.queued >= self.max_queued:
            raise ServiceOverloaded(
                f"{self.name} is overloaded: {self.in_flight} calls running "
                f"(max_concurrency={self.max_concurrency}) and {self.queued} queued "
                f"(max_queued={self.max_queued}); retry later, add replicas with "
                "svc.scale(n), or raise max_queued in options()"
            )

    def hold(self) -> None:
        """Count one more call waiting to join a batch; ``ServiceOverloaded`` (or the
        closing error) at once when the queue is full."""
        self._check_room()
        self.held += 1

    def unhold(self, n: int = 1) -> None:
        """``n`` held calls joined a running batch or left."""
        self.held -= n

    async def acquire(self, internal: bool = False) -> None:
        """Wait for a slot; ``ServiceOverloaded`` at once when the queue is full.

        ``internal``: a batch of held calls asks, never refused for a full queue."""
        if self._closed is not None:
            raise self._closed
        if self.in_flight < self.max_concurrency and not self._waiters:
            self._take()
            return
        if not internal:
            self._check_room()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        if internal:
            self._internal.add(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # the slot was handed over just as we were cancelled
            else:
                self._discard(fut)
            raise

    def release(self) -> None:
        """Give a slot back: to the next waiter if any."""
        self.in_flight -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            self._internal.discard(fut)
            if not fut.done():
                self._take()
                fut.set_result(None)
                return
        if self.in_flight == 0:
            self._idle.set()

    def close(self, exc: BaseException | None = None) -> None:
        """Refuse new calls and fail every queued one with ``exc``."""
        self._closed = exc or ServiceShutdown(f"{self.name} is shutting down")
        while self._waiters:
            fut = self._waiters.popleft()
            self._internal.discard(fut)
            if not fut.done():
                fut.set_exception(self._closed)

    async def wait_idle(self) -> None:
        """Return once no call is running."""
        await self._idle.wait()

    def _take(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _discard(self, fut: asyncio.Future) -> None:
        self._internal.discard(fut)
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass


def not_admitted(metrics: Any, exc: BaseException) -> dict:
    """The answer to a call that a replica's gate (or batcher) did not take in, as the
    caller reads it: ``overloaded`` (fail at once; counted in ``metrics``), ``gone`` (send
    it elsewhere) or ``shutdown`` (stop)."""
    if isinstance(exc, ServiceOverloaded):
        metrics.overloaded += 1
        return {"status": "overloaded", "message": str(exc)}
    if isinstance(exc, ReplicaGone):
        return {"status": "gone", "message": str(exc)}
    return {"status": "shutdown", "message": str(exc)}
