"""Background peer sends with a bound on bytes in flight: shared by the shuffle and rechunk.

A hand-off should give its thread back as soon as its data is on its way, not once every
peer has acknowledged it; but unbounded background sends would hold any amount of memory.
:class:`SendWindow` starts sends in the background while fewer than ``limit`` bytes are in
flight and makes the caller wait otherwise.  A failed send is raised from the next ``send``
or from ``flush``, so no error is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class SendWindow:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._room = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None

    async def send(self, nbytes: int, start: Callable[[], Awaitable[Any]]) -> None:
        """Start ``start()`` in the background once ``nbytes`` more fit in the window.

        A send larger than the whole window goes alone.
        """
        while True:
            self._raise_error()
            if self.in_flight == 0 or self.in_flight + nbytes <= self.limit:
                break
            self._room.clear()
            await self._room.wait()
        self.in_flight += nbytes
        task = asyncio.create_task(self._run(start))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finished(t, nbytes))

    @staticmethod
    async def _run(start: Callable[[], Awaitable[Any]]) -> None:
        await start()

    def _finished(self, task: asyncio.Task, nbytes: int) -> None:
        self._tasks.discard(task)
        self.in_flight -= nbytes
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
        self._room.set()

    async def flush(self) -> None:
        """Wait until every send started so far has been delivered; raise the first error."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
        self._raise_error()

    def cancel(self) -> None:
        """Abandon every send; later calls raise ``CancelledError``."""
        if self._error is None:
            self._error = asyncio.CancelledError("the send window was cancelled")
        for task in self._tasks:
            task.cancel()
        self._room.set()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
