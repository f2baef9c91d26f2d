"""The bulk lane: peer calls carrying ``Buffers`` between workers, without transient
buffers.

Through distributed's comms, every byte that crosses between workers lands in a buffer the
comm allocates for the message, and from there is copied where it belongs; a piece that is
not contiguous where it comes from is first copied into a buffer of its own on the sender.
Each of those buffers is fresh memory (the nanny's allocator settings unmap every
allocation of 128 KiB or more when it is freed), and on the measured machine writing fresh
memory costs a page fault per 4 KiB, 0.4-0.9 s per GB: for the bytes that cross, more than
the copies themselves (``design/array-rechunk.md``).

So between workers with ``tcp://`` addresses a call with a ``Buffers`` argument
(``_buffers.py``) takes a lane of its own (:class:`BulkLane`): a plain TCP connection per
call in flight (at most ``CONNECTIONS_PER_PEER`` calls to a worker, ``CONNECTIONS_TOTAL``
in all, not yet taken by their receivers; a call taken, whose method runs, keeps its
connection but frees its place), pooled (at most ``IDLE_KEPT`` idle), on which the sender
writes a small header and then every array's bytes, contiguous runs straight from the
array and strided parts through a reused scratch buffer, and the receiver reads them
straight into the destinations (strided ones through a reused scratch buffer of its own).
A connection starts with a random 16-byte token that the receiving worker hands out over
its ordinary (authenticated, where the cluster is) comm, before anything is unpickled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import dask.config
import numpy as np
from dask.utils import parse_timedelta
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.protocol import pickle

from dask_services._buffers import IncomingBuffers

logger = logging.getLogger("dask_services")

# token, header bytes, payload bytes
_REQUEST = struct.Struct("<16sQQ")
# the receiver's answers: a call that takes its turn is told STARTED (a value no reply's
# length takes), then every call its reply's length and the reply
_REPLY = struct.Struct("<Q")
STARTED = (1 << 64) - 1
# strided parts are copied through scratch buffers of this many bytes, lent to a call while
# it is written or read (the lane keeps a few for the next call until no run is left)
SCRATCH_BYTES = 256 * 1024
SCRATCH_KEPT = 4
# seconds between attempts to accept a connection after an error (out of file descriptors)
ACCEPT_RETRY_DELAY = 0.1
# calls on their way at once to one peer worker, and to all of them, until their receivers
# take them (calls beyond wait their turn); and idle connections kept open for later
# calls, over all peers (the least recently used closed first), so that a worker with
# hundreds of peers keeps few file descriptors
CONNECTIONS_PER_PEER = 4
CONNECTIONS_TOTAL = 64
IDLE_KEPT = 32
# a contiguous run at least this long is written from (read into) its array directly
DIRECT_FROM = 64 * 1024


def parts(array: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """Views covering ``array`` in C order, each C-contiguous or of at most ``limit``
    bytes (the order its bytes travel in)."""
    if array.size == 0:
        return
    if array.flags.c_contiguous or array.nbytes <= limit:
        yield array
        return
    if array.ndim == 1:
        step = max(1, limit // array.itemsize)
        for i in range(0, array.shape[0], step):
            yield array[i:i + step]
        return
    row = array.nbytes // array.shape[0]
    step = max(1, limit // row)
    for i in range(0, array.shape[0], step):
        part = array[i:i + step]
        if part.flags.c_contiguous or part.nbytes <= limit:
            yield part
        else:  # one row, strided and larger than the limit
            yield from parts(part[0], limit)


def _bytes_of(part: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (of any dtype but object)."""
    return memoryview(part.reshape(-1).view(np.uint8))


async def _send_arrays(sock: socket.socket, arrays: Sequence[np.ndarray],
                       scratch: np.ndarray) -> None:
    loop = asyncio.get_running_loop()
    filled = 0
    for array in arrays:
        for part in parts(array, scratch.nbytes):
            n = part.nbytes
            if part.flags.c_contiguous and (n >= DIRECT_FROM or n > scratch.nbytes):
                if filled:
                    await loop.sock_sendall(sock, memoryview(scratch[:filled]))
                    filled = 0
                await loop.sock_sendall(sock, _bytes_of(part))
                continue
            if filled + n > scratch.nbytes:
                await loop.sock_sendall(sock, memoryview(scratch[:filled]))
                filled = 0
            np.copyto(scratch[filled:filled + n].view(part.dtype).reshape(part.shape), part)
            filled += n
    if filled:
        await loop.sock_sendall(sock, memoryview(scratch[:filled]))


async def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    while view.nbytes:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise ConnectionResetError("the peer closed the connection mid-message")
        view = view[n:]


class Slots:
    """At most ``n`` holders at once, given their turn in the order their tickets were
    taken, whatever the order in which they come to wait."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.line: collections.deque[tuple[asyncio.Future, Callable[[], None] | None]] = \
            collections.deque()

    def ticket(self, on_turn: Callable[[], None] | None = None) -> asyncio.Future:
        """A ticket, done when its holder's turn comes; ``on_turn`` is called at that
        moment (before any other ticket is given out or taken)."""
        ticket = asyncio.get_running_loop().create_future()
        if self.free and not self.line:
            self.free -= 1
            ticket.set_result(None)
            if on_turn is not None:
                on_turn()
        else:
            self.line.append((ticket, on_turn))
        return ticket

    def done_with(self, ticket: asyncio.Future) -> None:
        if not ticket.done():
            ticket.cancel()  # still in line: skipped
        elif not ticket.cancelled():
            self._next()

    def _next(self) -> None:
        while self.line:
            ticket, on_turn = self.line.popleft()
            if not ticket.done():
                ticket.set_result(None)
                if on_turn is not None:
                    on_turn()
                return
        self.free += 1


class Turn:
    """A call's place in the line of calls to its peer worker and then, once its turn
    there has come, in the line of all calls from this worker (a call waiting for its
    peer holds no place among all: a peer with a backlog does not hold up the others).
    Both give turns in the order their tickets were taken, and the second ticket is taken
    the moment the first one's turn comes, so a channel's calls keep their order in both.
    Awaiting it waits for both."""

    def __init__(self, peer_slots: Slots, all_slots: Slots) -> None:
        self._all_slots = all_slots
        self.total: asyncio.Future | None = None
        self.given_back = False
        self.peer = peer_slots.ticket(on_turn=self._peer_turn)

    def _peer_turn(self) -> None:
        self.total = self._all_slots.ticket()

    def __await__(self) -> Any:
        return self._both().__await__()

    async def _both(self) -> None:
        await self.peer
        assert self.total is not None
        await self.total

    def give_back(self, peer_slots: Slots) -> None:
        """Leave both lines (once; again is a no-op)."""
        if self.given_back:
            return
        self.given_back = True
        peer_slots.done_with(self.peer)
        if self.total is not None:
            self._all_slots.done_with(self.total)


class ScratchPool:
    """Scratch buffers lent to the calls being written or read; ``SCRATCH_KEPT`` given
    back are kept for the next ones (fresh memory costs a page fault per 4 KiB written)."""

    def __init__(self, keep: Callable[[], bool] = lambda: True) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep  # whether buffers given back are kept (a run is going on)

    def take(self) -> np.ndarray:
        while self._free:
            scratch = self._free.pop()
            if scratch.nbytes == SCRATCH_BYTES:
                return scratch
        return np.empty(SCRATCH_BYTES, np.uint8)

    def give(self, scratch: np.ndarray) -> None:
        if len(self._free) < SCRATCH_KEPT and self._keep():
            self._free.append(scratch)

    def clear(self) -> None:
        self._free.clear()


class _SocketReader(IncomingBuffers):
    """The payload of one request, read from its connection (at most its length)."""

    def __init__(self, sock: socket.socket, shapes: list, dtypes: list, payload: int,
                 pool: ScratchPool) -> None:
        super().__init__(shapes, dtypes)
        self._sock = sock
        self._left = payload  # bytes of the payload not yet taken from the socket
        self._pool = pool
        self._limit = SCRATCH_BYTES
        self._taken: np.ndarray | None = None  # taken from the pool when first needed
        self._start = self._end = 0  # bytes read ahead into the scratch buffer
        self._told_started = False

    @property
    def _scratch(self) -> np.ndarray:
        if self._taken is None:
            self._taken = self._pool.take()
            self._limit = self._taken.nbytes
        return self._taken

    async def call_started(self) -> None:
        """Tell the sender that its call took its turn here (``STARTED``): the sender
        gives its connection's place in line to the next call to this worker, which may
        be the one this call's method waits for."""
        if not self._told_started:
            self._told_started = True
            await asyncio.get_running_loop().sock_sendall(self._sock, _REPLY.pack(STARTED))

    def release(self) -> None:
        """Give the scratch buffer back (the request is over)."""
        if self._taken is not None:
            self._pool.give(self._taken)
            self._taken = None

    async def _fill(self, need: int) -> None:
        """At least ``need`` bytes read ahead (``need`` <= the scratch's size)."""
        if self._end - self._start >= need:
            return
        if self._start:
            held = self._end - self._start
            self._scratch[:held] = self._scratch[self._start:self._end]
            self._start, self._end = 0, held
        while self._end - self._start < need:
            room = min(self._scratch.nbytes - self._end, self._left)
            self._end += await self._receive(
                memoryview(self._scratch[self._end:self._end + room]))

    async def _read_into(self, destinations: list[np.ndarray]) -> None:
        for dest in destinations:
            for part in parts(dest, self._limit):
                await self._read_part(part)

    async def _read_part(self, part: np.ndarray) -> None:
        n = part.nbytes
        held = self._end - self._start
        if part.flags.c_contiguous and (n - held >= DIRECT_FROM or n > self._limit):
            target = _bytes_of(part)
            if held:
                target[:held] = memoryview(self._scratch[self._start:self._end])
                self._start = self._end = 0
            await self._recv_payload(target[held:])
            return
        await self._fill(n)
        np.copyto(part, self._scratch[self._start:self._start + n].view(part.dtype)
                  .reshape(part.shape))
        self._start += n

    async def _receive(self, view: memoryview) -> int:
        """Bytes of the payload received into ``view`` (at least one), counted off
        ``_left`` in the same step as they leave the socket: a read cancelled at any
        point leaves the count right for :meth:`discard` (``loop.sock_recv_into`` may
        take bytes and still raise ``CancelledError``, its result lost)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                n = self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                readable = loop.create_future()
                fd = self._sock.fileno()
                loop.add_reader(fd, _set_if_pending, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(fd)
                continue
            if n == 0:
                raise ConnectionResetError("the peer closed the connection mid-message")
            self._left -= n
            return n

    async def _recv_payload(self, view: memoryview) -> None:
        """``view`` filled from the payload (see :meth:`_receive`)."""
        while view.nbytes:
            view = view[await self._receive(view):]

    async def discard(self) -> None:
        await self._read_stopped()  # nothing else reads the connection meanwhile
        self._start = self._end = 0
        while self._left:
            await self._recv_payload(
                memoryview(self._scratch[:min(self._left, self._scratch.nbytes)]))


async def _answer(sock: socket.socket, started: Callable[[], None]) -> bytearray:
    """The receiver's reply to a call, read from its connection; ``started()`` when the
    receiver says the call took its turn there."""
    head = bytearray(_REPLY.size)
    while True:
        await _recv_exactly(sock, memoryview(head))
        (length,) = _REPLY.unpack(head)
        if length != STARTED:
            break
        started()
    body = bytearray(length)
    await _recv_exactly(sock, memoryview(body))
    return body


def _retrieved(task: asyncio.Task) -> None:
    """(An answer's failure is the call's, raised where the call awaits it or its send
    failed first: not "never retrieved".)"""
    if not task.cancelled():
        task.exception()


def _set_if_pending(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


# the receiving side: given a request's header and its payload, the reply (picklable)
Handler = Callable[[dict, IncomingBuffers], Awaitable[Any]]


def lane_host(address: str) -> str | None:
    """The host a worker at ``address`` can open the lane on: its ``tcp://`` host, else
    None (other comms carry what the lane would not: encryption, in-process transfer)."""
    scheme, location = parse_address(address)
    if scheme != "tcp":
        return None
    return parse_host_port(location)[0]


def _tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, and a peer that stops answering detected within
    ``distributed.comm.timeouts.tcp`` as distributed's comms do (keepalive probes, and
    unacknowledged data given up on)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    timeout = int(parse_timedelta(dask.config.get("distributed.comm.timeouts.tcp")) or 0)
    probes = 10
    if timeout < probes + 1:
        return
    idle = max(2, timeout // 4)
    with contextlib.suppress(AttributeError, OSError):  # Linux only
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL,
                        max(1, (timeout - idle) // probes))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout * 1000)


class BulkLane:
    """One worker's lane: its listening socket (opened on first use) and its pooled
    connections to other workers' lanes."""

    def __init__(self, host: str, handler: Handler,
                 endpoint_of: Callable[[str], Awaitable[dict | None]],
                 connect_timeout: float = 10.0,
                 keep_idle: Callable[[], bool] = lambda: True) -> None:
        self.host = host
        self.connect_timeout = connect_timeout
        self.keep_idle = keep_idle  # whether a connection no call uses stays open
        self.handler = handler
        self.endpoint_of = endpoint_of  # a worker address -> its lane (host, port, token)
        self.token = secrets.token_bytes(16)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._serving: set[asyncio.Task] = set()
        self._endpoints: dict[str, dict | None] = {}
        self._idle: dict[str, list[tuple[socket.socket, bytes]]] = {}  # with their tokens
        # every idle connection and its peer, the least recently used first
        self._idle_order: collections.OrderedDict[socket.socket, str] = \
            collections.OrderedDict()
        self._slots: dict[str, Slots] = {}
        self._all_slots = Slots(CONNECTIONS_TOTAL)
        self._asking: dict[str, asyncio.Future] = {}
        self._busy: set[socket.socket] = set()
        self._closed = False
        self.scratch = ScratchPool(lambda: not self._closed and self.keep_idle())

    # ------------------------------------------------------------- receiving side

    def endpoint(self) -> dict | None:
        """This worker's lane, listening from now on; None if it cannot listen (closed, or
        the worker's contact host is not an address of this machine)."""
        if self._closed:
            return None
        if self._listener is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self.host, 0))
                listener.listen(128)
                listener.setblocking(False)
            except OSError as exc:
                listener.close()
                logger.warning("dask_services: no bulk lane on %s (%s); peers send to this "
                               "worker through distributed's comms", self.host, exc)
                self._closed = True
                return None
            self._listener = listener
            self._accepting = asyncio.ensure_future(self._accept())
        return {"host": self.host, "port": self._listener.getsockname()[1],
                "token": self.token}

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while not self._closed:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if self._closed or self._listener.fileno() < 0:
                    return
                # out of file descriptors or buffers, or a connection aborted before it
                # was taken: the peers' connections wait in the backlog meanwhile
                logger.warning("dask_services: the bulk lane could not accept a connection "
                               "(%s); trying again", exc)
                await asyncio.sleep(ACCEPT_RETRY_DELAY)
                continue
            _tune(sock)
            task = asyncio.ensure_future(self._serve(sock))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, sock: socket.socket) -> None:
        head = bytearray(_REQUEST.size)
        loop = asyncio.get_running_loop()
        try:
            while True:
                n = await loop.sock_recv_into(sock, head)
                if n == 0:
                    return  # the sender closed an idle connection
                if n < len(head):
                    await _recv_exactly(sock, memoryview(head)[n:])
                token, header_bytes, payload = _REQUEST.unpack(head)
                if not secrets.compare_digest(token, self.token):
                    logger.warning("dask_services: a connection to the bulk lane without "
                                   "its token was closed")
                    return
                header = bytearray(header_bytes)
                await _recv_exactly(sock, memoryview(header))
                request = pickle.loads(header)
                incoming = _SocketReader(sock, request["shapes"], request["dtypes"], payload,
                                         self.scratch)
                try:
                    reply = await self.handler(request, incoming)
                    await incoming.discard()
                finally:
                    incoming.release()
                try:
                    body = pickle.dumps(reply)
                except Exception as exc:  # the handler answers picklable replies only
                    body = pickle.dumps(("lane-error", f"{type(exc).__name__}: {exc}"))
                await loop.sock_sendall(sock, _REPLY.pack(len(body)) + body)
        except (OSError, EOFError):
            return  # the sender went away; its run is restarted or over
        except Exception:
            logger.exception("dask_services: a bulk lane connection failed")
        finally:
            sock.close()

    # ------------------------------------------------------------- sending side

    def ticket(self, address: str) -> Turn:
        """A place in the lines of calls to the worker at ``address`` and of all calls:
        take it before the call's first ``await`` (calls of one channel are made in the
        order of their sequence numbers, which the receiver starts them in), pass it to
        :meth:`call`, give it back with :meth:`done_with`."""
        slots = self._slots.get(address)
        if slots is None:
            slots = self._slots[address] = Slots(CONNECTIONS_PER_PEER)
        return Turn(slots, self._all_slots)

    def done_with(self, address: str, ticket: Turn) -> None:
        """The call holding ``ticket`` is over (or went another way)."""
        ticket.give_back(self._slots[address])

    async def call(self, address: str, request: dict, arrays: Sequence[np.ndarray],
                   ticket: Turn | None = None) -> Any:
        """Send ``request`` and ``arrays`` to the lane of the worker at ``address``; its
        handler's reply.  ``OSError`` if the connection fails.

        At most ``CONNECTIONS_PER_PEER`` calls to one worker, and ``CONNECTIONS_TOTAL``
        to all, are on their way at once; the others wait their turn in the order of
        their tickets (:meth:`ticket`; one is taken here if none is given).  Every
        concurrent run and peer call opening its own connection ran a worker out of file
        descriptors; and the turns must follow the tickets, not the order in which calls
        come to wait: a call that found the peer's lane already known overtook earlier
        ones still waiting for it, and with every connection held by calls the receiver
        kept waiting for an earlier one (whose turn never came), a rechunk hung.  (A call
        that holds a place among all calls came after its channel's earlier calls in both
        lines, so they hold places too or are answered: the earliest of them goes on.)"""
        own = ticket is None
        if ticket is None:
            ticket = self.ticket(address)
        try:
            await ticket
            # the places in line are given back once the receiver took the call (its
            # method may wait for a later call, whose turn must come), not when it returns
            return await self._call(address, request, arrays,
                                    functools.partial(self.done_with, address, ticket))
        finally:
            if own:
                self.done_with(address, ticket)

    async def _call(self, address: str, request: dict, arrays: Sequence[np.ndarray],
                    started: Callable[[], None] = lambda: None) -> Any:
        sock, token = await self._connection(address)
        answer: asyncio.Task | None = None
        try:
            header = pickle.dumps({**request, "shapes": [a.shape for a in arrays],
                                   "dtypes": [a.dtype for a in arrays]})
            payload = sum(int(a.nbytes) for a in arrays)
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, _REQUEST.pack(token, len(header), payload) + header)
            # read while the payload is written: the receiver may say STARTED before
            # reading it (a method waiting for a later call first)
            answer = asyncio.ensure_future(_answer(sock, started))
            answer.add_done_callback(_retrieved)
            scratch = self.scratch.take()
            try:
                await _send_arrays(sock, arrays, scratch)
            finally:
                self.scratch.give(scratch)
            body = await answer
        except BaseException:
            if answer is not None:
                answer.cancel()
            self._drop(sock)
            self._endpoints.pop(address, None)  # asked again: the worker may be new
            raise
        self._busy.discard(sock)
        if self._closed or not self.keep_idle() or (
                address in self._endpoints and self._endpoints[address] is None):
            self._drop(sock)  # (refused meanwhile: nothing more goes there on the lane)
        else:
            self._keep(address, sock, token)
        reply = pickle.loads(body)
        if isinstance(reply, tuple) and reply and reply[0] == "lane-error":
            raise RuntimeError(f"the reply of a bulk call could not be sent: {reply[1]}")
        return reply

    def _keep(self, address: str, sock: socket.socket, token: bytes) -> None:
        """``sock`` idle, kept for the next call to ``address``; past ``IDLE_KEPT`` idle
        connections, the least recently used one is closed."""
        self._idle.setdefault(address, []).append((sock, token))
        self._idle_order[sock] = address
        while len(self._idle_order) > IDLE_KEPT:
            oldest, peer = self._idle_order.popitem(last=False)
            self._idle[peer] = [(s, t) for s, t in self._idle[peer] if s is not oldest]
            self._drop(oldest)

    def _unkeep(self, address: str) -> list[tuple[socket.socket, bytes]]:
        """The idle connections to ``address``, no longer kept."""
        socks = self._idle.pop(address, [])
        for sock, _ in socks:
            self._idle_order.pop(sock, None)
        return socks

    async def available(self, address: str) -> bool:
        """Whether the worker at ``address`` takes bulk calls on its lane (asked once;
        calls asking together wait for the same answer, in the order they asked)."""
        if address not in self._endpoints:
            asking = self._asking.get(address)
            if asking is None:
                asking = self._asking[address] = asyncio.ensure_future(
                    self.endpoint_of(address))
                asking.add_done_callback(functools.partial(self._asked, address))
            await asyncio.shield(asking)
        return self._endpoints.get(address) is not None

    def _asked(self, address: str, asking: asyncio.Future) -> None:
        if self._asking.get(address) is asking:
            del self._asking[address]
        if not asking.cancelled() and asking.exception() is None:
            self._endpoints[address] = asking.result()

    async def _connection(self, address: str) -> tuple[socket.socket, bytes]:
        idle = self._idle.get(address, [])
        while idle:
            sock, token = idle.pop()
            self._idle_order.pop(sock, None)
            if _still_open(sock):
                self._busy.add(sock)
                return sock, token
            self._drop(sock)
        fresh = address not in self._endpoints
        if not await self.available(address):
            raise ConnectionRefusedError(f"the worker at {address} has no bulk lane")
        endpoint = self._endpoints.get(address)
        if endpoint is None:  # forgotten meanwhile: a call to it failed
            raise ConnectionResetError(f"the bulk lane of {address} failed")
        family = socket.AF_INET6 if ":" in endpoint["host"] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        self._busy.add(sock)
        try:
            _tune(sock)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(
                sock, (endpoint["host"], endpoint["port"])), self.connect_timeout)
        except (TimeoutError, OSError) as exc:
            self._drop(sock)
            self._endpoints.pop(address, None)  # asked again next time
            raise LaneUnreachable(f"the bulk lane of {address} at {endpoint['host']}:"
                                  f"{endpoint['port']}: {type(exc).__name__}: {exc}",
                                  fresh) from exc
        except BaseException:
            self._drop(sock)
            raise
        return sock, endpoint["token"]

    def refuse(self, address: str) -> None:
        """Send nothing more to ``address`` on the lane (it could not be reached)."""
        self._endpoints[address] = None
        for sock, _ in self._unkeep(address):
            self._drop(sock)

    def close_idle(self) -> None:
        """Close the pooled connections that no call uses, and let the kept scratch
        buffers go (no run is going on)."""
        for address in list(self._idle):
            for sock, _ in self._unkeep(address):
                self._drop(sock)
        self.scratch.clear()

    def _drop(self, sock: socket.socket) -> None:
        self._busy.discard(sock)
        sock.close()

    async def close(self) -> None:
        """Stop listening, cut every connection."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        for task in [self._accepting, *self._serving]:
            if task is not None:
                task.cancel()
        for task in [self._accepting, *self._serving]:
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task
        self._serving.clear()
        for address in list(self._idle):
            for sock, _ in self._unkeep(address):
                self._drop(sock)
        for sock in list(self._busy):
            self._drop(sock)
        self.scratch.clear()

    @property
    def connections(self) -> int:
        """Open connections of both sides (for tests: none after ``close``)."""
        return (sum(map(len, self._idle.values())) + len(self._busy)
                + len(self._serving))


class LaneUnreachable(ConnectionError):
    """A worker's lane could not be connected to (its ordinary comm may still work).
    ``fresh``: its endpoint had just been asked for (the worker answered), so the lane,
    not the worker, is what cannot be reached."""

    def __init__(self, message: str, fresh: bool) -> None:
        super().__init__(message)
        self.fresh = fresh


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection is still open (its peer did not close it)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True  # nothing to read: open
    except OSError:
        return False
