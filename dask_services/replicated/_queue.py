"""Per-replica admission: at most ``max_concurrency`` calls run, ``max_queued`` wait.

Waiting callers each hold a future that the releasing call completes (first come, first
served); nobody polls.  Beyond the queue a call fails at once with ``ServiceOverloaded``.
Calls waiting to join a batch (``_batching.py``) are *held*: they count as queued, and
the batch they join takes one slot (``acquire(internal=True)``, which is not a queued call).
A call admitted as *movable* (no session holds it here, nor was it addressed to this
replica) may be given back while it waits (:meth:`CallGate.shed`), the last queued
first, when replicas are added.  A queued call also names its *caller* (a client's id, or
the address of the worker whose task or replica made it): the calls of a caller that left
the cluster are given back at once (:meth:`CallGate.give_back_calls_of`) instead of run
for nobody.

A sync call queues as a :class:`ThreadCall` (``admit_to_thread``): the thread that ends
one call takes the next queued thread call itself, slot and all, so a busy replica of a
sync endpoint goes from call to call without a trip through the event loop (which only
hands back the results).  The queue is shared with those threads, under a lock.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from dask_services._messages import future_safe
from dask_services.replicated._errors import (
    CallMoved,
    ReplicaGone,
    ServiceOverloaded,
    ServiceShutdown,
)


@dataclass(eq=False)
class ThreadCall:
    """A sync call admitted by a :class:`CallGate`: ``fn`` runs on ``executor`` once it
    has a slot, and its result or exception goes to ``future`` (on ``loop``)."""

    fn: Callable[[], Any]
    executor: Executor
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    state: str = "queued"  # -> "running" (has the slot) or "dropped" (left the queue)
    what: str = "the call"  # named in its error if its thread is interrupted
    movable: bool = False  # may be given back while queued (:meth:`CallGate.shed`)
    caller: str | None = None  # who made it (:meth:`CallGate.give_back_calls_of`)


class CallGate:
    """An asyncio admission gate with a bounded FIFO queue."""

    def __init__(self, max_concurrency: int, max_queued: int, name: str = "replica") -> None:
        self.max_concurrency = max_concurrency
        self.max_queued = max_queued
        self.name = name
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future | ThreadCall] = collections.deque()
        self._lock = threading.Lock()  # the queue, which threads ending a call also take from
        self._internal: set[asyncio.Future] = set()  # waiters that are batches, not calls
        self._movable: set[asyncio.Future] = set()  # waiting calls that may be given back
        self._callers: dict[asyncio.Future, str] = {}  # who made each waiting call
        self.held = 0  # calls waiting to join a batch (counted as queued)
        # the calls of running batches beyond the one slot each batch takes: a batch of
        # 16 requests is 16 calls running (what the autoscaler and the routers count)
        self.batched = 0
        self._closed: BaseException | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def running(self) -> int:
        """Calls running: one per slot taken, every request of a running batch."""
        return self.in_flight + self.batched

    @property
    def load(self) -> int:
        """Calls running or queued (what a router and the autoscaler weigh)."""
        return self.running + self.queued

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

    async def acquire(self, internal: bool = False, movable: bool = False,
                      caller: str | None = None) -> None:
        """Wait for a slot; ``ServiceOverloaded`` at once when the queue is full.

        ``internal``: a batch of held calls asks, never refused for a full queue.
        ``movable``: while it waits, :meth:`shed` may give the call back (``CallMoved``).
        ``caller``: who made the call (:meth:`give_back_calls_of`)."""
        if self._closed is not None:
            raise self._closed
        if self.in_flight < self.max_concurrency and not self._waiters:
            self._take()
            return
        if not internal:
            self._check_room()
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiters.append(fut)
        if internal:
            self._internal.add(fut)
        elif movable:
            self._movable.add(fut)
        if caller is not None and not internal:
            self._callers[fut] = caller
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
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                if isinstance(waiter, ThreadCall):
                    self._take()
                    waiter.state = "running"
                    self._start(waiter)
                    return
                self._forget(waiter)
                if not waiter.done():
                    self._take()
                    waiter.set_result(None)
                    return
        if self.in_flight == 0:
            self._idle.set()

    def close(self, exc: BaseException | None = None) -> None:
        """Refuse new calls and fail every queued one with ``exc``."""
        self._closed = exc or ServiceShutdown(f"{self.name} is shutting down")
        with self._lock:
            waiters = list(self._waiters)
            self._waiters.clear()
        for waiter in waiters:
            if isinstance(waiter, ThreadCall):
                waiter.state = "dropped"
                waiter = waiter.future
            self._forget(waiter)
            if not waiter.done():
                waiter.set_exception(self._closed)

    def shed(self, keep: int, why: str, replicas: list | None = None) -> int:
        """Give back movable queued calls, the last queued first, until this replica's
        running and queued calls are at most ``keep`` (or none movable is left): each
        fails with ``CallMoved`` and its caller sends it again, to a replica with less to
        do (``replicas``, the healthy ones, goes with them).  Returns how many were given
        back.  Calls that hold their place (a session's,
        a pinned one, a batch's) stay, and so does the order of those left."""
        moved: list[asyncio.Future | ThreadCall] = []
        with self._lock:
            excess = self.load - keep
            for waiter in reversed(self._waiters):
                if len(moved) >= excess:
                    break
                # (a thread call whose caller was just cancelled has its future done
                # before ``outcome`` marks it dropped)
                if (waiter.movable and waiter.state == "queued" and not waiter.future.done()
                        if isinstance(waiter, ThreadCall)
                        else waiter in self._movable and not waiter.done()):
                    moved.append(waiter)
            for waiter in moved:
                self._waiters.remove(waiter)
                if isinstance(waiter, ThreadCall):
                    waiter.state = "dropped"
        return self._give_back(moved, why, replicas)

    def give_back_calls_of(self, callers: set[str], why: str) -> int:
        """Give back every queued call made by one of ``callers`` (clients or workers that
        left the cluster): a caller gone reads no answer, and one still there (a client
        whose connection to the scheduler broke and came back) sends the call again, as
        for :meth:`shed`.  Returns how many were given back."""
        leaving: list[asyncio.Future | ThreadCall] = []
        with self._lock:
            for waiter in self._waiters:
                if isinstance(waiter, ThreadCall):
                    if waiter.caller in callers and waiter.state == "queued" \
                            and not waiter.future.done():
                        leaving.append(waiter)
                elif self._callers.get(waiter) in callers and not waiter.done():
                    leaving.append(waiter)
            for waiter in leaving:
                self._waiters.remove(waiter)
                if isinstance(waiter, ThreadCall):
                    waiter.state = "dropped"
        return self._give_back(leaving, why, None, caller_left=True)

    def _give_back(self, waiters: list[asyncio.Future | ThreadCall], why: str,
                   replicas: list | None, caller_left: bool = False) -> int:
        """Fail ``waiters``, taken out of the queue, with ``CallMoved``."""
        for waiter in waiters:
            future = waiter.future if isinstance(waiter, ThreadCall) else waiter
            self._forget(future)
            if not future.done():
                future.set_exception(CallMoved(f"{self.name} {why}", replicas,
                                               caller_left=caller_left))
        return len(waiters)

    # ------------------------------------------------------------ sync calls

    def admit_to_thread(self, executor: Executor, fn: Callable[[], Any],
                        what: str = "the call", movable: bool = False,
                        caller: str | None = None) -> ThreadCall:
        """Admit sync call ``fn`` (run on ``executor``): started at once if a slot is
        free, else queued; ``ServiceOverloaded`` (or the closing error) at once when the
        queue is full.  Await its outcome with :meth:`outcome`; its slot is given back
        by the thread that runs it, or passed on to the next queued thread call."""
        if self._closed is not None:
            raise self._closed
        loop = asyncio.get_running_loop()
        call = ThreadCall(fn, executor, loop, loop.create_future(), what=what,
                          movable=movable, caller=caller)
        with self._lock:
            if self.in_flight < self.max_concurrency and not self._waiters:
                self._take()
                call.state = "running"
                self._start(call)
            else:
                self._check_room()
                self._waiters.append(call)
        return call

    async def outcome(self, call: ThreadCall) -> Any:
        """The result of ``call`` (or its exception).  A caller cancelled while the call
        is queued takes it out of the queue; one that is running finishes in its thread."""
        try:
            return await call.future
        except asyncio.CancelledError:
            with self._lock:
                if call.state == "queued":
                    call.state = "dropped"
                    try:
                        self._waiters.remove(call)
                    except ValueError:
                        pass
            raise

    def _start(self, call: ThreadCall) -> None:
        try:
            call.executor.submit(self._run_calls, call)
        except RuntimeError as e:  # the executor is shut down: the replica is stopping
            call.loop.call_soon(self._settle, call.future, None, e, True)

    def _run_calls(self, call: ThreadCall) -> None:
        """In a thread: run ``call``, then every thread call queued right behind it."""
        while True:
            try:
                result, error = call.fn(), None
            except Exception as e:
                result, error = None, future_safe(e, call.what)
            except BaseException as e:  # SystemExit, KeyboardInterrupt: give the slot back
                error = RuntimeError(f"{call.what} raised {_described(e)} in its thread")
                error.__cause__ = e
                self._post(call, None, error, True)
                raise
            with self._lock:
                queued = self._waiters[0] if self._waiters else None
                if isinstance(queued, ThreadCall):
                    self._waiters.popleft()
                    queued.state = "running"
                else:
                    queued = None
            if not self._post(call, result, error, queued is None) or queued is None:
                return
            call = queued

    def _post(self, call: ThreadCall, result: Any, error: BaseException | None,
              release: bool) -> bool:
        """From a thread: settle ``call`` on its loop (and give its slot back with
        ``release``); False if the loop is closed (the worker is gone)."""
        try:
            call.loop.call_soon_threadsafe(self._settle, call.future, result, error, release)
        except RuntimeError:
            return False
        return True

    def _settle(self, future: asyncio.Future, result: Any, error: BaseException | None,
                release: bool) -> None:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        if release:
            self.release()

    async def wait_idle(self) -> None:
        """Return once no call is running."""
        await self._idle.wait()

    def _take(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _forget(self, fut: asyncio.Future) -> None:
        """What was kept of a waiter that left the queue."""
        self._internal.discard(fut)
        self._movable.discard(fut)
        self._callers.pop(fut, None)

    def _discard(self, fut: asyncio.Future) -> None:
        self._forget(fut)
        with self._lock:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass


def not_admitted(metrics: Any, exc: BaseException, gate: CallGate | None = None) -> dict:
    """The answer to a call that a replica's gate (or batcher) did not take in, as the
    caller reads it: ``overloaded`` (fail at once; counted in ``metrics``), ``gone`` (send
    it elsewhere), ``moved`` (given back while queued: send it elsewhere, no failure) or
    ``shutdown`` (stop); a moved call's answer has the load ``gate`` is left with."""
    if isinstance(exc, CallMoved):
        load = gate.load if gate is not None else 0
        answer = {"status": "moved", "message": str(exc), "load": load,
                  "replicas": exc.replicas}
        if exc.caller_left:
            answer["caller_left"] = True
        return answer
    if isinstance(exc, ServiceOverloaded):
        metrics.overloaded += 1
        return {"status": "overloaded", "message": str(exc)}
    if isinstance(exc, ReplicaGone):
        return {"status": "gone", "message": str(exc)}
    return {"status": "shutdown", "message": str(exc)}


def _described(exc: BaseException) -> str:
    """``KeyboardInterrupt`` or ``SystemExit('leaving')``: the exception's name, and its
    message where it has one (an exception whose ``__str__`` fails is named alone)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - the call must be answered all the same
        message = ""
    return f"{type(exc).__name__}({message!r})" if message else type(exc).__name__
