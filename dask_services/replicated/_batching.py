"""Request batching on a replica: single calls gathered into lists for a batched endpoint.

``@endpoint(batch_size=32, batch_wait="5ms")``: each call passes one request.  On the
replica, one :class:`Batcher` per batched endpoint keeps the calls waiting to join a batch
(*held* in the replica's :class:`~dask_services.replicated._queue.CallGate`, so they count
against ``max_queued``).  Its flusher sends a batch once ``batch_size`` calls wait, or
``batch_wait`` after the first one arrived, whichever comes first; the batch then takes one
slot of the gate (it is one running call against ``max_concurrency``), and calls arriving
while it waits for the slot still join it, up to ``batch_size``.  The method gets the list
of requests and returns a list of results, one per request, in order: an exception
instance in a slot is raised at that caller only; an exception raised by the method, or a
result of the wrong length (or not a list), fails every call of the batch.  Held calls of
a caller that left the cluster are given back (:meth:`Batcher.give_back_calls_of`), as the
gate gives back its queued calls.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

from dask_services._messages import future_safe
from dask_services.replicated._errors import BatchResultError, CallMoved
from dask_services.replicated._queue import CallGate

RunBatch = Callable[[list[Any]], Awaitable[Any]]


class Batcher:
    """Gathers the calls of one batched endpoint of one replica into batches."""

    def __init__(self, gate: CallGate, name: str, size: int, wait: float, run: RunBatch,
                 track: Callable[[asyncio.Task], None]) -> None:
        self.gate = gate
        self.name = name
        self.size = size
        self.wait = wait
        self._run_batch = run
        self._track = track
        self.pending: collections.deque[tuple[Any, asyncio.Future]] = collections.deque()
        self._callers: dict[asyncio.Future, str] = {}  # who made each held call
        self._first_arrival = 0.0
        self._full = asyncio.Event()
        self._flusher: asyncio.Task | None = None
        self._closed: BaseException | None = None

    def enqueue(self, request: Any, caller: str | None = None) -> asyncio.Future:
        """Hold one call for the next batch: its future gets the call's own result or
        exception.  Raises at once (``ServiceOverloaded``, the closing error) if the
        replica cannot take it; cancelling the future takes the call back out.
        ``caller``: who made it (:meth:`give_back_calls_of`)."""
        if self._closed is not None:
            raise self._closed
        self.gate.hold()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.pending:
            self._first_arrival = loop.time()
        self.pending.append((request, fut))
        if caller is not None:
            self._callers[fut] = caller
        fut.add_done_callback(self._left)
        if len(self.pending) >= self.size:
            self._full.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return fut

    def give_back_calls_of(self, callers: set[str], why: str) -> int:
        """Give back the held calls made by one of ``callers`` (that left the cluster):
        each fails with ``CallMoved``, as the gate's queued calls do.  Returns how many."""
        leaving = [item for item in self.pending if self._callers.get(item[1]) in callers
                   and not item[1].done()]
        for item in leaving:
            self.pending.remove(item)
            self._callers.pop(item[1], None)
            self.gate.unhold()
            item[1].set_exception(CallMoved(f"{self.gate.name} {why}", caller_left=True))
        return len(leaving)

    def _left(self, fut: asyncio.Future) -> None:
        """A held call's caller went away before its batch started: forget it."""
        self._callers.pop(fut, None)
        if not fut.cancelled():
            return
        for item in self.pending:
            if item[1] is fut:
                self.pending.remove(item)
                self.gate.unhold()
                return

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.pending and self._closed is None:
                remaining = self._first_arrival + self.wait - loop.time()
                if len(self.pending) < self.size and remaining > 0:
                    self._full.clear()
                    try:
                        await asyncio.wait_for(self._full.wait(), remaining)
                    except TimeoutError:
                        pass
                if not self.pending:
                    continue
                await self.gate.acquire(internal=True)
                items: list[tuple[Any, asyncio.Future]] = []
                while self.pending and len(items) < self.size:
                    items.append(self.pending.popleft())
                self.gate.unhold(len(items))
                if self.pending:
                    self._first_arrival = loop.time()
                if not items:  # every caller went away while the batch waited for a slot
                    self.gate.release()
                    continue
                task = asyncio.ensure_future(self._run(items))
                self._track(task)
        except BaseException as e:  # closed (the gate's error) or cancelled
            self._fail_pending(e if isinstance(e, Exception) else self._closed)
            if isinstance(e, asyncio.CancelledError):
                raise

    async def _run(self, items: list[tuple[Any, asyncio.Future]]) -> None:
        self.gate.batched += len(items) - 1  # the batch's slot counts one of them
        try:
            results = await self._run_batch([request for request, _ in items])
            if not isinstance(results, (list, tuple)) or len(results) != len(items):
                got = (f"{len(results)} results" if isinstance(results, (list, tuple))
                       else f"a {type(results).__name__}")
                raise BatchResultError(
                    f"batched endpoint {self.name} returned {got} for a batch of "
                    f"{len(items)} requests; it must return a list with one result per "
                    "request, in order")
        except asyncio.CancelledError:
            for _, fut in items:
                if not fut.done():
                    fut.cancel()
            raise
        except BaseException as e:
            # SystemExit, KeyboardInterrupt... let out of this task would stop the worker's
            # event loop: the batch's callers get them as their error instead
            e = future_safe(e, f"batched endpoint {self.name}", fails="the calls")
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(e)
        else:
            for i, ((_, fut), result) in enumerate(zip(items, results, strict=True)):
                if fut.done():
                    continue
                if isinstance(result, BaseException):
                    # (a StopIteration or KeyboardInterrupt given as a result would leave
                    # this caller, and those after it, without an answer, or stop the
                    # worker's event loop where the caller's handler re-raises it)
                    fut.set_exception(future_safe(
                        result, f"batched endpoint {self.name} (result {i} of {len(items)})",
                        fails="that request", how="returned"))
                else:
                    fut.set_result(result)
        finally:
            self.gate.batched -= len(items) - 1
            self.gate.release()

    def _fail_pending(self, exc: BaseException | None) -> None:
        while self.pending:
            _, fut = self.pending.popleft()
            self.gate.unhold()
            if not fut.done():
                if exc is None:
                    fut.cancel()
                else:
                    fut.set_exception(exc)

    def close(self, exc: BaseException) -> None:
        """Fail every held call with ``exc`` (the replica is stopping); refuse new ones."""
        self._closed = exc
        self._fail_pending(exc)
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
