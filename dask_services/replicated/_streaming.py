"""Streaming endpoints: a generator on the replica, an iterator at the caller.

Transport: one connection per stream, taken from the caller's connection pool (the
``Client``'s or ``Worker``'s ``rpc``, so the cluster's security and TLS apply), holding
the ``replicated_stream`` request for as long as the stream runs.  The replica writes
messages ``item`` (one per value the generator yields), then one of ``done``, ``error``
(the pickled exception), or, before any item, ``overloaded``, ``shutdown``, ``gone``.  The
caller writes ``credit`` (one per item it hands to its code), then ``end`` once it has read
the last message, or ``cancel`` when it stops early, which the replica acknowledges with
``cancelled`` once the generator is closed.  The replica starts with ``stream-window``
credits and spends one per item: its generator is not advanced while the caller has that
many items it has not taken yet (backpressure).  A connection that breaks (the caller was
garbage-collected, its task cancelled while reading) cancels the stream too.  After
``end`` or ``cancelled`` the connection is clean and goes back to the pool.

On the replica a stream is one running call of its gate (``max_concurrency``) from its
first step to its end, and is in ``rep.running`` so that shutdown cancels it.  Cancelling
closes the generator (its ``finally`` runs): an async generator's step in progress is
cancelled; a sync generator's step runs in the replica's threads and cannot be
interrupted, so the replica waits for it and then closes the generator there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import time
from typing import TYPE_CHECKING, Any

from distributed.comm.core import CommClosedError
from distributed.core import Status

from dask_services._messages import dumps_exception, loads_exception, raise_future_safe
from dask_services._worker_context import in_current_context
from dask_services.config import setting
from dask_services.replicated._errors import (
    CallMoved,
    ReplicaGone,
    ScaledDown,
    ServiceOverloaded,
    ServiceShutdown,
    ServiceUnavailable,
)
from dask_services.replicated._options import config_seconds
from dask_services.replicated._queue import not_admitted
from dask_services.replicated._watch import ReplacementWatch
from dask_services.replicated._wire import pack, unpack

if TYPE_CHECKING:
    from dask_services.replicated._endpoints import Session
    from dask_services.replicated._handle import ReplicatedService, _Replica
    from dask_services.replicated._worker import HostedReplica

_END = object()


def stream_window() -> int:
    """Items a replica may send ahead of what the caller has taken."""
    return max(1, int(setting("replicated.stream-window")))


# ------------------------------------------------------------------ the replica's side


def _step(gen: Any, what: str) -> Any:
    """One ``next(gen)`` in a replica thread; ``_END`` when it is exhausted (StopIteration
    cannot cross a future); a ``KeyboardInterrupt`` or ``SystemExit`` it raises as a
    ``RuntimeError`` (``_messages.contained``), the stream's error."""
    try:
        return next(gen)
    except StopIteration:
        return _END
    except BaseException as e:  # ("generator raised StopIteration" named: future_safe)
        raise_future_safe(e, what, fails="the stream")


async def _anext(gen: Any, what: str) -> Any:
    """One ``await anext(gen)``: as :func:`_step`, for an async generator.  A
    ``KeyboardInterrupt`` or ``SystemExit`` let out of the task running it would be
    raised by asyncio from the worker's event loop (the worker gone, and the caller's
    re-sent stream stopping the next one)."""
    try:
        return await gen.__anext__()
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # ("async generator raised StopIteration" named)
        raise_future_safe(e, what, fails="the stream")


async def _credits(comm: Any, credit: list[int], more: asyncio.Event) -> str:
    """Read the caller's messages: add credits; return ``end``, ``cancel`` or ``closed``."""
    while True:
        try:
            msg = await comm.read()
        except (CommClosedError, OSError):
            return "closed"
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "credit":
            credit[0] += int(msg.get("n", 1))
            more.set()
        elif op in ("end", "cancel"):
            return op


async def serve(rep: HostedReplica, comm: Any, method: str, args: tuple, kwargs: dict,
                window: int, caller: str | None = None) -> Status:
    """Run generator endpoint ``method`` of ``rep`` and send its items over ``comm``;
    while it waits for a slot, it is given back should ``caller`` leave the cluster."""
    arrived = time.perf_counter()
    try:
        await rep.gate.acquire(caller=caller)
    except (ServiceOverloaded, ReplicaGone, ServiceShutdown, CallMoved) as e:
        await comm.write(not_admitted(rep.metrics, e))
        return Status.dont_reply
    task = asyncio.current_task()
    if task is not None:
        rep.running.add(task)
    loop = asyncio.get_running_loop()
    credit = [window]
    more = asyncio.Event()
    reader = asyncio.ensure_future(_credits(comm, credit, more))
    fn = getattr(rep.service, method)
    is_async = inspect.isasyncgenfunction(fn)
    gen: Any = None
    step: asyncio.Future | None = None
    error = True  # for the ``finally``: a stream that ended no other way failed
    recorded = False

    def record(failed: bool) -> None:
        """Count the call in the replica's metrics, once: before its last message goes out,
        so that the caller, having read it, finds the call counted."""
        nonlocal recorded
        if not recorded:
            recorded = True
            rep.metrics.record(time.perf_counter() - arrived, failed)

    try:
        gen = fn(*args, **kwargs)
        while True:
            while credit[0] <= 0 and not reader.done():
                more.clear()
                waiter = asyncio.ensure_future(more.wait())
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            if reader.done():  # the caller stopped, or went away
                break
            what = f"streaming endpoint {rep.name}.{method}"
            step = (asyncio.ensure_future(_anext(gen, what)) if is_async else
                    loop.run_in_executor(rep.executor, in_current_context(
                        functools.partial(_step, gen, what))))
            await asyncio.wait({step, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                break  # cancelled while the generator works on its next item
            try:
                item = step.result()
            except StopAsyncIteration:
                item = _END
            except Exception as e:
                record(True)
                await comm.write({"status": "error", "exception": dumps_exception(e)})
                break
            finally:
                step = None
            if item is _END:
                record(False)
                await comm.write({"status": "done"})
                break
            credit[0] -= 1
            try:
                packed = pack(item, "item")
            except TypeError as e:  # the generator's fault: the stream ends with it
                record(True)
                await comm.write({"status": "error", "exception": dumps_exception(TypeError(
                    f"an item of {rep.name}.{method} ({type(item).__name__}) cannot be "
                    f"sent to the caller: {e}"))})
                break
            await comm.write({"status": "item", **packed})
        outcome = await reader
        if outcome == "cancel":
            error = False
            await _close(gen, step, is_async, rep, loop)
            gen = None
            record(False)
            await comm.write({"status": "cancelled"})
    except asyncio.CancelledError:  # the replica stops (shutdown timeout)
        if not rep.cancelled:
            comm.abort()
            raise
        # the caller learns why its stream ends, as a call's caller does
        # (a stream cut by a scale-down has started: its caller is not to run it again)
        status = ("cut" if isinstance(rep.closed_with, ScaledDown) else
                  "gone" if isinstance(rep.closed_with, ReplicaGone) else "shutdown")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(comm.write({"status": status, "message": (
                f"the stream was cancelled: replica {rep.id} of {rep.name} stopped before "
                "it ended" + (f" ({rep.closed_with})" if status != "shutdown" else
                              " (svc.shutdown timeout)"))}), 1)
        comm.abort()
    except (CommClosedError, OSError):
        comm.abort()
    finally:
        reader.cancel()
        await _close(gen, step, is_async, rep, loop)
        record(error)
        if task is not None:
            rep.running.discard(task)
        rep.gate.release()
    return Status.dont_reply


async def _close(gen: Any, step: asyncio.Future | None, is_async: bool,
                 rep: HostedReplica, loop: asyncio.AbstractEventLoop) -> None:
    """Close ``gen`` (its ``finally`` runs), after its step in progress if any."""
    if gen is None:
        return
    if is_async:
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        with contextlib.suppress(Exception):
            await gen.aclose()
        return
    if step is not None:  # a thread is inside next(gen): let it finish first
        with contextlib.suppress(BaseException):
            await asyncio.shield(step)
    try:
        await loop.run_in_executor(rep.executor, gen.close)
    except RuntimeError:  # the executor is shut down (replica stopped): close here
        with contextlib.suppress(Exception):
            gen.close()
    except Exception:
        pass


# ------------------------------------------------------------------ the caller's side


class Stream:
    """``svc.<endpoint>.stream(...)``: ``async for x in stream`` in async code, ``for x in
    stream`` otherwise.  ``close()`` / ``await aclose()`` (or leaving ``with`` / ``async
    with``, breaking out of a loop over it, dropping it) cancels it on the replica."""

    def __init__(self, handle: ReplicatedService, method: str, args: tuple, kwargs: dict,
                 session: Session | None) -> None:
        self._handle = handle
        self._transport = handle._transport
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._session = session
        self._comm: Any = None
        self._target: _Replica | None = None
        self._first: Any = None
        self._finished = False
        self._lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        state = "finished" if self._finished else "open" if self._comm else "not started"
        return f"<Stream {self._handle.name}.{self._method} {state}>"

    # ----------------------------------------------------- async

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        if not self._transport.in_loop():
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self._next(), self._transport.loop))
        return await self._next()

    async def aclose(self) -> None:
        """Stop the stream: the replica closes the generator."""
        if not self._transport.in_loop():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self._cancel(), self._transport.loop))
        else:
            await self._cancel()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ----------------------------------------------------- sync

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        if self._transport.in_loop():
            raise RuntimeError(f"{self._handle.name}.{self._method}: in async code, use "
                               "`async for` over the stream")
        cf = asyncio.run_coroutine_threadsafe(self._next(), self._transport.loop)
        try:
            return cf.result()
        except StopAsyncIteration:
            raise StopIteration from None
        except BaseException:
            cf.cancel()
            raise

    def close(self) -> None:
        """Stop the stream: the replica closes the generator (waits for its answer)."""
        if self._transport.in_loop():
            raise RuntimeError("in async code, use `await stream.aclose()`")
        if not self._finished:
            asyncio.run_coroutine_threadsafe(self._cancel(), self._transport.loop).result()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if self._finished or self._comm is None:
            return
        self._finished = True
        comm, abort = self._comm, functools.partial(self._abort_now, self._comm)
        self._comm = None
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the comm
            self._transport.loop.call_soon_threadsafe(abort)
        del comm

    # ----------------------------------------------------- the protocol

    def _abort_now(self, comm: Any) -> None:
        """Break the connection: the replica cancels the stream (no await needed)."""
        comm.abort()
        self._release(comm)

    def _release(self, comm: Any) -> None:
        target = self._target
        if target is None:
            return
        self._transport.pool.reuse(target.worker, comm)
        h = self._handle
        h._outstanding[target.id] -= 1
        if h._outstanding[target.id] <= 0:
            del h._outstanding[target.id]
        self._target = None

    async def _next(self) -> Any:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._finished:
                raise StopAsyncIteration
            comm = self._comm
            watch: ReplacementWatch | None = None
            try:
                if comm is None:
                    msg = await self._open()
                    comm = self._comm
                else:
                    watch = (ReplacementWatch(self._handle, self._target, comm)
                             if self._target is not None else None)
                    try:
                        msg = await comm.read()
                    finally:
                        if watch is not None:
                            watch.cancel()
            except asyncio.CancelledError:
                if self._comm is not None:  # our read was interrupted: the comm is spoilt
                    self._finished = True
                    self._abort_now(self._comm)
                    self._comm = None
                raise
            except (CommClosedError, OSError) as e:
                self._finished = True
                if self._comm is not None:
                    self._abort_now(self._comm)
                    self._comm = None
                if await self._shut_down():
                    # the replica's last word ("shutdown") was lost with the connection
                    # (a credit written after it closed its end closes ours)
                    raise ServiceShutdown(
                        f"{self._handle.name}.{self._method}: the stream was cut: service "
                        f"{self._handle.name} was shut down") from e
                if watch is not None and watch.replaced:
                    raise ServiceUnavailable(
                        f"{self._handle.name}.{self._method}: {watch.replaced}; the items "
                        "already taken are not replayed") from e
                raise ServiceUnavailable(
                    f"{self._handle.name}.{self._method}: the stream's connection broke "
                    f"mid-stream ({type(e).__name__}: {e})") from e
            status = msg.get("status") if isinstance(msg, dict) else None
            if status == "item":
                # a replica gone meanwhile: the item is here, the next read says it broke
                with contextlib.suppress(CommClosedError, OSError):
                    await comm.write({"op": "credit", "n": 1})
                return unpack(msg, "item")
            # the last message: tell the replica we are done, give the comm back
            self._finished = True
            with contextlib.suppress(CommClosedError, OSError):
                await comm.write({"op": "end"})
            self._comm = None
            self._release(comm)
            if status == "done":
                raise StopAsyncIteration
            if status == "error":
                raise loads_exception(msg["exception"])
            if status == "shutdown":
                raise ServiceShutdown(msg["message"])
            if status in ("gone", "cut"):  # items were taken already: not re-sent
                raise ServiceUnavailable(f"{self._handle.name}.{self._method}: "
                                         f"{msg['message']}")
            raise ServiceUnavailable(f"{self._handle.name}.{self._method}: unexpected "
                                     f"message {msg!r}")

    async def _shut_down(self) -> bool:
        """Whether the service is shut down, or being shut down (asked of the scheduler)."""
        try:
            info = await asyncio.wait_for(
                self._handle._transport.scheduler.replicated_table(
                    name=self._handle.name, uid=self._handle._uid), 10)
        except (CommClosedError, OSError, TimeoutError):
            return False
        return info is None or bool(info.get("stopping"))

    async def _open(self) -> Any:
        """Route the stream to a replica, re-sending on infrastructure failures until the
        first message arrives; returns that message."""
        h = self._handle
        retries = int(setting("replicated.call-retries"))
        delay = config_seconds("retry-backoff")
        max_delay = config_seconds("retry-backoff-max")
        connect_timeout = config_seconds("connect-timeout")
        await h._ready_table()
        try:
            payload = pack((self._args, self._kwargs), "payload")
        except TypeError as e:  # the caller's mistake: nothing to re-send
            raise TypeError(f"the arguments of {h.name}.{self._method} cannot be sent to a "
                            f"replica: {e}") from None
        failures: list[str] = []
        woken = False  # waited for a replica of a service scaled to zero (``_wake``)
        in_flight_losses = 0  # connections that broke once the stream was asked for
        while True:
            target = h._choose(self._session)
            if target is not None:
                h._outstanding[target.id] += 1
                self._target = target
                comm = None
                watch: ReplacementWatch | None = None
                lost_in_flight = False
                try:
                    comm = await h._connect(target, connect_timeout)
                    watch = ReplacementWatch(h, target, comm)
                    try:
                        await comm.write({
                            "op": "replicated_stream", "id": str(target.id),
                            "method": self._method, "window": stream_window(),
                            "caller": self._transport.caller, **payload})
                        msg = await comm.read()
                    finally:
                        watch.cancel()
                except (CommClosedError, OSError) as e:
                    failure = (watch.replaced if watch is not None and watch.replaced else
                               f"{target.id} on {target.worker}: {type(e).__name__}: {e}")
                    # connected: the replica may have been running the generator (its
                    # worker died, perhaps of it, before the first item)
                    lost_in_flight = comm is not None
                except BaseException:
                    if comm is not None:
                        self._abort_now(comm)
                    else:
                        self._release_target()
                    raise
                else:
                    status = msg.get("status") if isinstance(msg, dict) else None
                    if status in ("item", "done", "error"):
                        self._comm = comm
                        return msg
                    self._transport.pool.reuse(target.worker, comm)  # handler ended
                    comm = None
                    self._release_target()
                    if status == "moved":  # given back while queued: not a failure
                        continue
                    if status == "overloaded":
                        raise ServiceOverloaded(msg["message"])
                    if status == "shutdown":
                        raise ServiceShutdown(msg["message"])
                    if status == "cut":  # started, then its replica was scaled down
                        raise ServiceUnavailable(f"{h.name}.{self._method}: "
                                                 f"{msg['message']}")
                    failure = f"{target.id}: {msg.get('message', msg)}"
                if comm is not None:
                    self._abort_now(comm)
                self._release_target()
                h._drop(target.id)
                if lost_in_flight:
                    in_flight_losses += 1
                    h._give_up_if_killing(f"{self._method} (stream)", target,
                                          in_flight_losses, failure)
            else:
                if not woken and await h._wake():
                    woken = True  # not a failure: the service was at zero replicas
                    continue
                failure = h._no_healthy_replica()
            failures.append(failure)
            if len(failures) > retries:
                states = collections.Counter(r.state for r in h._table)
                raise ServiceUnavailable(
                    f"{h.name}.{self._method} (stream) failed after {len(failures)} attempts "
                    f"(dask_services.replicated.call-retries={retries}); replica states: "
                    f"{dict(states) or 'none'}; last failure: {failures[-1]}")
            if len(failures) > 1 or target is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)
            await h._refresh()

    def _release_target(self) -> None:
        target, self._target = self._target, None
        if target is not None:
            h = self._handle
            h._outstanding[target.id] -= 1
            if h._outstanding[target.id] <= 0:
                del h._outstanding[target.id]

    async def _cancel(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._finished:
                return
            self._finished = True
            comm, self._comm = self._comm, None
            if comm is None:
                return  # never started: nothing on any replica
            try:
                await comm.write({"op": "cancel"})
                while True:  # skip the items in flight, up to the acknowledgement
                    msg = await asyncio.wait_for(comm.read(), config_seconds("drain-timeout"))
                    if isinstance(msg, dict) and msg.get("status") == "cancelled":
                        break
            except (CommClosedError, OSError, TimeoutError):
                self._abort_now(comm)  # the replica sees the broken connection
                return
            except BaseException:
                self._abort_now(comm)
                raise
            self._release(comm)
