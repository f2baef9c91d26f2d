"""Arrays between peers without transient buffers: ``Buffers`` out, ``IncomingBuffers`` in.

A peer call that passes a :class:`Buffers` argument hands its arrays to the receiving
method as an :class:`IncomingBuffers`, whose ``read_into(destinations)`` writes them where
the method says: into its output arrays, at their offsets, with no array of their own in
between.

Through distributed's comms, every byte that crosses between workers lands in a buffer the
comm allocates for the message, and from there is copied where it belongs; a piece that is
not contiguous where it comes from is first copied into a buffer of its own on the sender.
Each of those buffers is fresh memory (the nanny's allocator settings unmap every
allocation of 128 KiB or more when it is freed), and on the measured machine writing fresh
memory costs a page fault per 4 KiB, 0.4-0.9 s per GB: for the bytes that cross, more than
the copies themselves (``design/array-rechunk.md``).

So between workers with ``tcp://`` addresses such calls take a lane of their own
(:class:`BulkLane`): a plain TCP connection per call in flight, pooled, on which the
sender writes a small header and then every array's bytes, contiguous runs straight from
the array and strided parts through a reused scratch buffer, and the receiver reads them
straight into the destinations (strided ones through a reused scratch buffer of its own).
A connection starts with a random 16-byte token that the receiving worker hands out over
its ordinary (authenticated, where the cluster is) comm, before anything is unpickled.
On other comms (``tls://``, ``inproc://``), with ``dask_services.bulk-lane: false``,
and to an instance of the same worker, the arrays travel as ordinary arguments and
``read_into`` copies them: the receiving method is written once.
"""

from __future__ import annotations

import asyncio
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

logger = logging.getLogger("dask_services")

# token, header bytes, payload bytes
_REQUEST = struct.Struct("<16sQQ")
_REPLY = struct.Struct("<Q")
# strided parts are copied through scratch buffers of this many bytes, lent to a call while
# it is written or read (the lane keeps a few for the next call until no run is left)
SCRATCH_BYTES = 256 * 1024
SCRATCH_KEPT = 4
# seconds between attempts to accept a connection after an error (out of file descriptors)
ACCEPT_RETRY_DELAY = 0.1
# connections open at once to one peer worker (calls beyond wait their turn)
CONNECTIONS_PER_PEER = 4
# a contiguous run at least this long is written from (read into) its array directly
DIRECT_FROM = 64 * 1024
# arrays already in memory are copied into their destinations on the event loop up to this
# many bytes, else in a thread
COPY_ON_LOOP_MAX = 1 << 20


class Buffers:
    """numpy arrays for a peer call, to be read by the receiver where it wants them.

    Pass one as an argument of a peer call (``await self.peers[sid].take(meta,
    Buffers(arrays))``); the receiving ``@rpc`` method gets an :class:`IncomingBuffers` in
    its place.  The arrays may be views (strided parts are copied as they are sent); they
    must not change until the call returns.
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        arrays = list(arrays)
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise TypeError(
                    f"Buffers takes numpy arrays; item {i} is a {type(a).__name__}: "
                    "convert it with numpy.asarray, or pass it as an ordinary argument")
            if a.dtype.hasobject:
                raise TypeError(
                    f"Buffers cannot carry item {i}, an array of dtype object (its bytes "
                    "are pointers): pass it as an ordinary argument")
        self.arrays = arrays

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __reduce__(self) -> tuple:
        # through distributed's comms (no lane): a strided array is copied here (pickle
        # would copy it into the message's bytes, and out of them again on the receiver);
        # a contiguous one travels as a frame of its own
        return (Buffers, ([a if a.flags.c_contiguous else np.ascontiguousarray(a)
                           for a in self.arrays],))

    def __repr__(self) -> str:
        return f"<Buffers: {len(self.arrays)} arrays, {self.nbytes} bytes>"


class IncomingBuffers:
    """The arrays of a :class:`Buffers` argument, as the receiving method sees them.

    ``shapes`` and ``dtypes`` describe them; ``await read_into(destinations)`` writes them,
    in order, into writeable arrays of the same shapes and dtypes (views into larger arrays
    are fine), ``await arrays()`` into new ones.  Read them once, within the method: what
    a method leaves unread is discarded when it returns.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype]
                 ) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = [np.dtype(d) for d in dtypes]
        self._read = False
        self._over = False  # the method returned

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * d.itemsize
                   for s, d in zip(self.shapes, self.dtypes, strict=True))

    def __len__(self) -> int:
        return len(self.shapes)

    async def read_into(self, destinations: Sequence[np.ndarray]) -> None:
        """Write the arrays sent, in order, into ``destinations``: writeable arrays of the
        same shapes and dtypes (views into larger arrays are fine).  ``ValueError`` naming
        the first that does not match; ``RuntimeError`` if the arrays were read already."""
        destinations = list(destinations)
        self._check(destinations)
        self._read = True
        await self._read_into(destinations)

    async def arrays(self) -> list[np.ndarray]:
        """The arrays sent, each in a new array of its own."""
        out = [np.empty(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]
        await self.read_into(out)
        return out

    def _check(self, destinations: list[np.ndarray]) -> None:
        if self._over:
            raise RuntimeError("these buffers can no longer be read: the method they were "
                               "sent to has returned (read them within the method)")
        if self._read:
            raise RuntimeError("these buffers were read already: read them once")
        if len(destinations) != len(self.shapes):
            raise ValueError(f"read_into needs {len(self.shapes)} destinations, one per "
                             f"array sent; got {len(destinations)}")
        for i, (d, shape, dtype) in enumerate(zip(destinations, self.shapes, self.dtypes,
                                                  strict=True)):
            if not isinstance(d, np.ndarray) or d.shape != shape or d.dtype != dtype:
                got = (f"shape {d.shape}, dtype {d.dtype}" if isinstance(d, np.ndarray)
                       else type(d).__name__)
                raise ValueError(f"destination {i} must be an array of shape {shape} and "
                                 f"dtype {dtype} (the array sent); got {got}")
            if not d.flags.writeable:
                raise ValueError(f"destination {i} is read-only")

    async def _read_into(self, destinations: list[np.ndarray]) -> None:
        raise NotImplementedError

    def method_returned(self) -> None:
        """The method the buffers were sent to has returned: they can no longer be read
        (on the lane the connection goes on to the next call)."""
        self._over = True

    async def discard(self) -> None:
        """Skip what was not read (called once the method returned)."""


class ArraysInMemory(IncomingBuffers):
    """Arrays already in this process (sent to the same worker, or through the comms)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        super().__init__([a.shape for a in arrays], [a.dtype for a in arrays])
        self._arrays = arrays

    def method_returned(self) -> None:
        super().method_returned()
        self._arrays = []

    async def _read_into(self, destinations: list[np.ndarray]) -> None:
        arrays, self._arrays = self._arrays, []

        def copy() -> None:
            for d, a in zip(destinations, arrays, strict=True):
                np.copyto(d, a)

        if self.nbytes > COPY_ON_LOOP_MAX:  # in a thread: the event loop goes on meanwhile
            await asyncio.get_running_loop().run_in_executor(None, copy)
        else:
            copy()


def as_incoming(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every :class:`Buffers` given as :class:`ArraysInMemory`
    (a call delivered in this process, or through distributed's comms)."""
    if not any(isinstance(a, Buffers) for a in (*args, *kwargs.values())):
        return args, kwargs
    swap = _swapper(lambda b: ArraysInMemory(b.arrays))
    return tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()}


def _swapper(make: Callable[[Buffers], Any]) -> Callable[[Any], Any]:
    return lambda a: make(a) if isinstance(a, Buffers) else a


def buffers_of(args: tuple, kwargs: dict) -> Buffers | None:
    """The one :class:`Buffers` argument of a call, or None; two are refused."""
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, Buffers)]
    if len(found) > 1:
        raise TypeError("a peer call takes at most one Buffers argument; put every array "
                        "into one")
    return found[0] if found else None


class _Slot:
    """Where the :class:`Buffers` argument was, in a call sent on the lane."""

    def __reduce__(self) -> tuple:
        return (_Slot, ())


def put_slot(args: tuple, kwargs: dict, incoming: IncomingBuffers | None = None
             ) -> tuple[tuple, dict]:
    """Sending (``incoming`` None): every :class:`Buffers` argument replaced by a slot.
    Receiving: every slot by ``incoming``."""
    if incoming is None:
        def swap(a: Any) -> Any:
            return _Slot() if isinstance(a, Buffers) else a
    else:
        def swap(a: Any) -> Any:
            return incoming if isinstance(a, _Slot) else a
    return tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()}


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

    @property
    def _scratch(self) -> np.ndarray:
        if self._taken is None:
            self._taken = self._pool.take()
            self._limit = self._taken.nbytes
        return self._taken

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
        loop = asyncio.get_running_loop()
        while self._end - self._start < need:
            room = min(self._scratch.nbytes - self._end, self._left)
            n = await loop.sock_recv_into(self._sock, memoryview(self._scratch[self._end:
                                                                             self._end + room]))
            if n == 0:
                raise ConnectionResetError("the peer closed the connection mid-message")
            self._end += n
            self._left -= n

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
            await _recv_exactly(self._sock, target[held:])
            self._left -= n - held
            return
        await self._fill(n)
        np.copyto(part, self._scratch[self._start:self._start + n].view(part.dtype)
                  .reshape(part.shape))
        self._start += n

    async def discard(self) -> None:
        self._start = self._end = 0
        while self._left:
            view = memoryview(self._scratch[:min(self._left, self._scratch.nbytes)])
            await _recv_exactly(self._sock, view)
            self._left -= view.nbytes


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
        self._slots: dict[str, asyncio.Semaphore] = {}
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

    async def call(self, address: str, request: dict, arrays: Sequence[np.ndarray]) -> Any:
        """Send ``request`` and ``arrays`` to the lane of the worker at ``address``; its
        handler's reply.  ``OSError`` if the connection fails.

        At most ``CONNECTIONS_PER_PEER`` calls to one worker are on their way at once, the
        others wait their turn in the order they came (calls of one channel come in the
        order of their sequence numbers, which the receiver starts them in): every
        concurrent run and peer call opening its own connection ran a worker out of file
        descriptors."""
        slots = self._slots.get(address)
        if slots is None:
            slots = self._slots[address] = asyncio.Semaphore(CONNECTIONS_PER_PEER)
        async with slots:
            return await self._call(address, request, arrays)

    async def _call(self, address: str, request: dict, arrays: Sequence[np.ndarray]) -> Any:
        sock, token = await self._connection(address)
        try:
            header = pickle.dumps({**request, "shapes": [a.shape for a in arrays],
                                   "dtypes": [a.dtype for a in arrays]})
            payload = sum(int(a.nbytes) for a in arrays)
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, _REQUEST.pack(token, len(header), payload) + header)
            scratch = self.scratch.take()
            try:
                await _send_arrays(sock, arrays, scratch)
            finally:
                self.scratch.give(scratch)
            head = bytearray(_REPLY.size)
            await _recv_exactly(sock, memoryview(head))
            body = bytearray(_REPLY.unpack(head)[0])
            await _recv_exactly(sock, memoryview(body))
        except BaseException:
            self._drop(sock)
            self._endpoints.pop(address, None)  # asked again: the worker may be new
            raise
        self._busy.discard(sock)
        idle = self._idle.setdefault(address, [])
        if self._closed or not self.keep_idle():
            self._drop(sock)
        else:
            idle.append((sock, token))
        reply = pickle.loads(body)
        if isinstance(reply, tuple) and reply and reply[0] == "lane-error":
            raise RuntimeError(f"the reply of a bulk call could not be sent: {reply[1]}")
        return reply

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
        for sock, _ in self._idle.pop(address, []):
            self._drop(sock)

    def close_idle(self) -> None:
        """Close the pooled connections that no call uses, and let the kept scratch
        buffers go (no run is going on)."""
        for socks in self._idle.values():
            for sock, _ in socks:
                self._drop(sock)
        self._idle.clear()
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
        for socks in self._idle.values():
            for sock, _ in socks:
                self._drop(sock)
        self._idle.clear()
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
