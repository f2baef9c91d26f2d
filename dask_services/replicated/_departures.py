"""Workers whose connection broke once the scheduler had sent them something (a replica's
start, a health probe): most have died, perhaps of what they were asked to run, and the
scheduler removes them moments later.  Until it has, the worker still looks running, so
a replica relaunched at once was placed on it again and its start counted as a second
worker lost for one death.  :class:`Departures` lets the scheduler part wait for such a
worker's removal (``remove_worker`` calls :meth:`left`), for a bounded time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable


class Departures:
    """Futures of callers waiting for workers to leave, by address."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}

    def left(self, worker: str) -> None:
        """``worker`` left the cluster: wake whoever waits for it."""
        for waiter in self._waiting.pop(worker, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def any_gone_within(self, workers: Iterable[str], present: Callable[[str], bool],
                              timeout: float) -> bool:
        """Whether one of ``workers`` has left, or leaves within ``timeout`` s
        (``present(worker)``: whether it is still in the cluster)."""
        workers = list(workers)
        if not workers:
            return False
        if not all(present(w) for w in workers):
            return True
        loop = asyncio.get_running_loop()
        waiters = {w: loop.create_future() for w in workers}
        for w, waiter in waiters.items():
            self._waiting.setdefault(w, []).append(waiter)
        try:
            await asyncio.wait(waiters.values(), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w, waiter in waiters.items():
                waiter.cancel()
                left = self._waiting.get(w)
                if left is not None:
                    if waiter in left:
                        left.remove(waiter)
                    if not left:
                        del self._waiting[w]
        return not all(present(w) for w in workers)
