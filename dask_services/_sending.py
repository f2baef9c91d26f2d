"""Background peer sends with a bound on bytes in flight: shared by the shuffle and rechunk.

A hand-off should return as soon as its data is on its way, not once every peer has
acknowledged it; but unbounded background sends would hold any amount of memory.
:class:`SendWindow` starts sends in the background while fewer than ``limit`` bytes are in
flight and makes the caller wait otherwise.  A failed send is raised from the next ``send``
or from ``flush``, so no error is lost.

:class:`PeerStream` adds what a service needs once hand-offs may return before their data
has arrived: a barrier.  ``finish()`` flushes the window, tells every peer (through the
service's ``done_sending`` RPC) and returns once every peer has said the same; by then
everything every peer sent to this instance has been received.

``send_batched`` coalesces small messages to one peer, as Nagle's algorithm does for
bytes: a message goes at once when nothing sent this way to that peer is in flight;
otherwise it waits, and everything that waited goes as one call when that send has been
delivered (or once it adds up to ``coalesce_bytes``).  A peer call costs about a
millisecond of CPU on each side whatever it carries, so with thousands of small pieces
the calls, not the bytes, were the cost.  A message that finds nothing in flight lingers
``linger`` seconds first (as ``linger.ms`` does in Kafka's producers), so that the next few
go with it: a worker hands off a small partition every few milliseconds, and a round trip
to a peer is shorter than that, so without it nearly every message went alone.  No
message waits longer than the linger plus one delivery, and ``finish()`` sends at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dask_services._memory import TrimAfter, release_freed_memory
from dask_services._payload import arguments_of_size

if TYPE_CHECKING:
    from dask_services.service import Service, ServiceId


class SendWindow:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # bytes of the sends started and not yet delivered
        self.held = 0  # bytes of the holds not yet let go
        self._room = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self.on_sent: Callable[[int], None] | None = None  # called with the bytes delivered

    async def send(self, nbytes: int, start: Callable[[], Awaitable[Any]]) -> None:
        """Start ``start()`` in the background once ``nbytes`` more fit in the window.

        A send larger than the whole window goes alone.  Sends wait for each other only,
        never for holds (:meth:`hold`): a hold is let go by deliveries, which must not
        wait for it.
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

    async def hold(self, nbytes: int, parts: int) -> Hold:
        """Count ``nbytes`` in the window once they fit beside the sends and the other
        holds, until ``parts`` deliveries have each called :meth:`Hold.part_done`: memory
        that several sends keep alive together (views of one array) counted once, for as
        long as the last of them is on its way.  The sends and the holds each stay within
        the limit, but for one larger than it, which goes alone; bytes still queued per
        peer (``PeerStream.send_batched``) are in neither."""
        while True:
            self._raise_error()
            if self.fits_hold(nbytes):
                break
            self._room.clear()
            await self._room.wait()
        self.held += nbytes
        return Hold(self, nbytes, parts)

    def fits_hold(self, nbytes: int) -> bool:
        taken = self.in_flight + self.held
        return taken == 0 or taken + nbytes <= self.limit

    def _let_go(self, nbytes: int) -> None:
        self.held -= nbytes
        if self.on_sent is not None and self._error is None:
            self.on_sent(nbytes)
        self._room.set()

    @staticmethod
    async def _run(start: Callable[[], Awaitable[Any]]) -> None:
        await start()

    def _finished(self, task: asyncio.Task, nbytes: int) -> None:
        self._tasks.discard(task)
        self.in_flight -= nbytes
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
        elif self.on_sent is not None and not task.cancelled():
            self.on_sent(nbytes)
        self._room.set()

    async def flush(self) -> None:
        """Wait until every send started so far has been delivered; raise the first error."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
        self._raise_error()

    def fail(self, error: BaseException) -> None:
        """A send failed before it started: later calls raise ``error`` (the first one)."""
        if self._error is None:
            self._error = error
        self._room.set()

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


def window_size(configured: int, memory_limit: int | None) -> int:
    """A configured per-worker byte budget (the bytes in flight, the hand-off buffer), but
    at most 1/32 of the worker's memory limit."""
    return min(configured, memory_limit // 32) if memory_limit else configured


class Hold:
    """Bytes counted in a :class:`SendWindow` until ``parts`` deliveries are done."""

    def __init__(self, window: SendWindow, nbytes: int, parts: int) -> None:
        self.window = window
        self.nbytes = nbytes
        self.parts = parts
        if parts <= 0:
            self._let_go()

    def part_done(self) -> None:
        self.parts -= 1
        if self.parts == 0:
            self._let_go()

    def _let_go(self) -> None:
        self.window._let_go(self.nbytes)
        self.nbytes = 0


class PeerStream:
    """A service's sends to its peers, and the barrier that ends them.

    The service must expose ``@rpc async def done_sending(self, sender)`` calling
    :meth:`sender_done`.
    """

    def __init__(self, service: Service, limit: int, trim: bool = True,
                 coalesce_bytes: int = 2**20, linger: float = 0.05) -> None:
        self.service = service
        self.trim = trim
        self.coalesce_bytes = coalesce_bytes
        self.linger = linger
        self._lingering: dict[ServiceId, asyncio.TimerHandle] = {}
        self.window = SendWindow(limit)
        # send_batched: per peer, the items waiting and their bytes, the method that takes
        # them, and how many of its batches are in flight
        self._queued: dict[ServiceId, list[Any]] = {}
        self._queued_bytes: dict[ServiceId, int] = {}
        self._queued_held: dict[ServiceId, int] = {}
        self._queued_holds: dict[ServiceId, list[Hold]] = {}
        self._waiting_held = 0  # of batches taken from the queue, waiting for room
        self._batch_method: dict[ServiceId, str] = {}
        self._busy: dict[ServiceId, int] = {}
        self._drains: set[asyncio.Task] = set()
        self.done_from: set[ServiceId] = set()
        self.all_received = asyncio.Event()
        self._trim = TrimAfter()
        self._trimming: asyncio.Future | None = None
        self.window.on_sent = self._sent
        # the arguments of a batch's call, made of its items (default: the list itself)
        self.encode: Callable[[list[Any]], tuple] | None = None

    async def hold(self, nbytes: int, parts: int) -> Hold:
        """:meth:`SendWindow.hold`; a hold that must wait for room first sends what
        lingers (it would otherwise linger behind the hold, one chunk at a time)."""
        if not self.window.fits_hold(nbytes):
            for sid in list(self._lingering):
                self._lingering.pop(sid).cancel()
                if not self._busy.get(sid):
                    self._drain(sid)
        return await self.window.hold(nbytes, parts)

    @property
    def in_flight(self) -> int:
        """Bytes held by sends in flight and by holds, and waiting to be sent
        (``send_batched``)."""
        return (self.window.in_flight + self.window.held
                + sum(self._queued_held.values()) + self._waiting_held)

    def _others(self) -> list[ServiceId]:
        return [sid for sid in self.service.peers if sid != self.service.id]

    async def send_batched(self, sid: ServiceId, nbytes: int, method: str, item: Any,
                           held: int | None = None, hold: Hold | None = None) -> None:
        """Deliver ``item`` (``nbytes`` of data) to peer ``sid``'s ``method``, which takes
        a list of items: at once if no batch to ``sid`` is in flight, else with the next
        batch (see the module docstring).  ``held``: the bytes that ``item`` keeps in
        memory of its own until it is delivered, counted in the window (default
        ``nbytes``); ``hold``: a :meth:`SendWindow.hold` counting memory it shares with
        other items, of which its delivery is one part."""
        self._queued.setdefault(sid, []).append(item)
        self._queued_bytes[sid] = self._queued_bytes.get(sid, 0) + nbytes
        self._queued_held[sid] = self._queued_held.get(sid, 0) + (
            nbytes if held is None else held)
        if hold is not None:
            self._queued_holds.setdefault(sid, []).append(hold)
        self._batch_method[sid] = method
        if self._queued_bytes[sid] >= self.coalesce_bytes:
            await self._send_queued(sid)
        elif not self._busy.get(sid) and sid not in self._lingering:
            if self.linger <= 0:
                await self._send_queued(sid)
            else:
                self._lingering[sid] = asyncio.get_running_loop().call_later(
                    self.linger, self._linger_over, sid)

    def _linger_over(self, sid: ServiceId) -> None:
        del self._lingering[sid]
        if not self._busy.get(sid):  # else the end of that delivery sends the queue
            self._drain(sid)

    def _drain(self, sid: ServiceId) -> None:
        drain = asyncio.create_task(self._send_queued(sid))
        self._drains.add(drain)
        drain.add_done_callback(self._drained)

    async def _send_queued(self, sid: ServiceId) -> None:
        timer = self._lingering.pop(sid, None)
        if timer is not None:
            timer.cancel()
        items = self._queued.pop(sid, None)
        nbytes = self._queued_bytes.pop(sid, 0)
        held = self._queued_held.pop(sid, 0)
        holds = self._queued_holds.pop(sid, [])
        if not items:
            return
        self._busy[sid] = self._busy.get(sid, 0) + 1
        try:
            call = getattr(self.service.peers[sid], self._batch_method[sid])
            args = self.encode(items) if self.encode is not None else (items,)
        except BaseException as exc:
            # the batch is lost: the run fails with this error (raised from the next send,
            # hold or flush), and what it held is let go so that nothing waits for it
            self._busy[sid] -= 1
            for hold in holds:
                hold.part_done()
            self.window.fail(exc)
            raise
        del items

        async def deliver() -> None:
            try:
                with arguments_of_size(nbytes):
                    await call(*args)
            finally:
                self._busy[sid] -= 1
                for hold in holds:
                    hold.part_done()
                if not self._busy[sid] and sid in self._queued:
                    self._drain(sid)  # what waited for this delivery goes now

        self._waiting_held += held  # (neither queued nor in the window while it waits)
        try:
            await self.window.send(held, deliver)
        except BaseException:
            self._busy[sid] -= 1
            raise
        finally:
            self._waiting_held -= held

    def _drained(self, drain: asyncio.Task) -> None:
        self._drains.discard(drain)
        # its error, if any, is the window's (set by the window for a failed delivery,
        # by _send_queued for a batch that could not be made), which flush() and the next
        # send raise; retrieved here so that asyncio does not report it as lost
        if not drain.cancelled():
            drain.exception()

    async def _flush_batched(self) -> None:
        """Send every waiting item and wait until all have been delivered."""
        while True:
            for sid in list(self._queued):
                await self._send_queued(sid)
            if self._drains:
                await asyncio.gather(*list(self._drains))
            await self.window.flush()
            if not self._queued and not self._drains:
                return

    def _sent(self, nbytes: int) -> None:
        """What was sent is freed now: give it back to the OS every so often (in a thread:
        trimming a large heap takes milliseconds)."""
        if self.trim and self._trim.freed_bytes(nbytes) and self._trimming is None:
            loop = asyncio.get_running_loop()
            self._trimming = loop.run_in_executor(None, release_freed_memory)
            self._trimming.add_done_callback(self._trimmed)

    def _trimmed(self, _: Any) -> None:
        self._trimming = None

    def sender_done(self, sender: ServiceId) -> None:
        self.done_from.add(sender)
        if self.done_from >= set(self._others()):
            self.all_received.set()

    async def finish(self) -> None:
        """Deliver everything still in flight, tell every peer, wait until all have."""
        await self._flush_batched()
        others = self._others()
        await asyncio.gather(*(self.service.peers[sid].done_sending(self.service.id)
                               for sid in others))
        if not others:
            self.all_received.set()
        await self.all_received.wait()

    def cancel(self) -> None:
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        self._queued.clear()
        self._queued_bytes.clear()
        self._queued_held.clear()
        self._queued_holds.clear()
        for drain in self._drains:
            drain.cancel()
        self.window.cancel()
