"""The services' threads on a worker, whose capacity a stopped instance's job cannot take.

A run stops (restarted, cancelled, failed) while a job it gave to ``concierge.run_in_executor``
is still running: a Python thread cannot be stopped from outside, so the job keeps its
thread until it returns.  With the threads shared by every run on the worker (one, by
default, on a one-thread worker), a job blocked on something that never comes would make
every later run on the worker, the shuffle and the rechunk included, wait behind it.  When
an instance stops, its jobs not started yet are cancelled, and for each job still running
the pool may start one thread more until that job returns, so the runs that follow keep
``dask_services.threads`` threads of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

# ThreadPoolExecutor's own capacity and thread start, on which the growth relies
# (tests/test_hooks.py checks that they are still there)
CAPACITY_ATTRIBUTE = "_max_workers"
THREAD_START_METHOD = "_adjust_thread_count"


def kept_until_done(job: concurrent.futures.Future[T],
                    jobs: set[concurrent.futures.Future[Any]] | None
                    ) -> asyncio.Future[T]:
    """``job`` awaitable on the running loop, and kept in ``jobs`` (an instance's) until
    it returns."""
    if jobs is not None:
        jobs.add(job)
        job.add_done_callback(jobs.discard)
    return asyncio.wrap_future(job)


def cancel_unstarted(jobs: Iterable[concurrent.futures.Future[Any]]
                     ) -> list[concurrent.futures.Future[Any]]:
    """Cancel the ``jobs`` not started yet; returns those still running."""
    return [f for f in list(jobs) if not f.cancel() and not f.done()]


class ServiceThreads:
    """A ``ThreadPoolExecutor`` of ``threads`` threads, plus one for each job of a stopped
    instance still running."""

    def __init__(self, threads: int, thread_name_prefix: str = "dask-services") -> None:
        self.threads = threads
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self.held = 0  # threads held by jobs of stopped instances

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self.executor.submit(fn, *args)

    def let_go(self, jobs: Iterable[concurrent.futures.Future[Any]]) -> int:
        """The instance that submitted ``jobs`` stopped: cancel those not started, and give
        the pool a thread more for each one still running, until it returns.  Returns how
        many are still running."""
        running = cancel_unstarted(jobs)
        if running:
            self._resize(len(running))
            for f in running:
                f.add_done_callback(self._returned)
        return len(running)

    def _returned(self, _: concurrent.futures.Future[Any]) -> None:
        self._resize(-1)

    def _resize(self, change: int) -> None:
        with self._lock:
            self.held += change
            setattr(self.executor, CAPACITY_ATTRIBUTE, self.threads + self.held)
            if change > 0:  # jobs queued already get the new thread, not only later ones
                getattr(self.executor, THREAD_START_METHOD)()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class LateJobWatch:
    """Jobs of stopped instances still running, each watched for ``grace`` seconds.

    A job of a cancelled run usually returns within moments (the shuffle's split of a
    partition, the rechunk's assembly of a chunk), so warning as the run stops told users
    who cancelled a built-in shuffle about work that ended a few milliseconds later.  A job
    still running ``grace`` after its instance stopped is warned about then (``warn``
    called with how many still run); a watch whose jobs all returned before is dropped
    without a word.  Runs on the event loop; jobs may return in any thread."""

    def __init__(self) -> None:
        self.watches: dict[asyncio.TimerHandle, set[concurrent.futures.Future[Any]]] = {}

    def watch(self, jobs: Iterable[concurrent.futures.Future[Any]], grace: float,
              warn: Callable[[int], None]) -> None:
        # a copy first: jobs returning in their threads leave an instance's set meanwhile
        running = {job for job in list(jobs) if not job.done()}
        if not running:
            return
        loop = asyncio.get_running_loop()

        def expired() -> None:
            still = self.watches.pop(handle, set())
            still = {job for job in still if not job.done()}
            if still:
                warn(len(still))

        def returned_on_loop(job: concurrent.futures.Future[Any]) -> None:
            left = self.watches.get(handle)
            if left is None:
                return
            left.discard(job)
            if not left:
                handle.cancel()
                del self.watches[handle]

        def returned(job: concurrent.futures.Future[Any]) -> None:  # in the job's thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(returned_on_loop, job)

        handle = loop.call_later(grace, expired)
        self.watches[handle] = running
        for job in list(running):
            job.add_done_callback(returned)

    def close(self) -> None:
        """Drop every watch (the place closes)."""
        for handle in self.watches:
            handle.cancel()
        self.watches.clear()
