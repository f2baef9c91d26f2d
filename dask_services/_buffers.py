"""Arrays for a peer call that the receiver reads where it wants them: ``Buffers`` out,
``IncomingBuffers`` in.

A peer call that passes a :class:`Buffers` argument hands its arrays to the receiving
method as an :class:`IncomingBuffers`, whose ``read_into(destinations)`` writes them where
the method says: into its output arrays, at their offsets, with no array of their own in
between.  Between workers with ``tcp://`` addresses the arrays travel on the bulk lane
(``_bulk.py``) and are read from the socket straight into the destinations; on other
comms (``tls://``, ``inproc://``), with ``dask_services.bulk-lane: false``, and to an
instance of the same worker, they travel as ordinary arguments and arrive as
:class:`ArraysInMemory`, which ``read_into`` copies: the receiving method is written once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# arrays already in memory are copied into their destinations on the event loop up to this
# many bytes, else in a thread, this many bytes at a time (a read stopped when its method
# returns ends within one such step)
COPY_ON_LOOP_MAX = 1 << 20
COPY_STEP_BYTES = 4 << 20


class Buffers:
    """numpy arrays for a peer call, to be read by the receiver where it wants them.

    Pass one as an argument of a peer call (``await self.peers[sid].take(meta,
    Buffers(arrays))``); the receiving ``@rpc`` method gets an :class:`IncomingBuffers` in
    its place.  The arrays may be views (strided parts are copied as they are sent); they
    must not change until the call returns.
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        if isinstance(arrays, np.ndarray):
            raise TypeError(
                "Buffers takes a list of numpy arrays, got one array: write "
                "Buffers([array])")
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
        self._reading: asyncio.Task | None = None  # the read under way, if any

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
        # a task of its own: a read the method gave up on (a timeout) or left running when
        # it returned (a task of its own) is stopped then, and what it left unread skipped
        self._reading = asyncio.ensure_future(self._read_into(destinations))
        try:
            await self._reading
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._over and current is not None and not current.cancelling():
                raise RuntimeError(
                    "these buffers can no longer be read: the method they were sent to "
                    "returned before the read was over (read them within the method)"
                ) from None
            raise

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
        (on the lane the connection goes on to the next call), and a read still under
        way is stopped."""
        self._over = True
        if self._reading is not None and not self._reading.done():
            self._reading.cancel()

    async def _read_stopped(self) -> None:
        """Once a read stopped by :meth:`method_returned` has ended."""
        if self._reading is not None:
            await asyncio.wait({self._reading})

    async def stopped(self) -> None:
        """Once nothing reads the arrays sent or writes the destinations any more (called
        after :meth:`method_returned`, before the call is answered: the sender may then
        change its arrays, the receiver its destinations)."""
        await self._read_stopped()

    async def discard(self) -> None:
        """Skip what was not read (called once the method returned)."""

    async def call_started(self) -> None:
        """The call these arrays came with took its turn on the receiver (the bulk lane
        tells its sender, ``_bulk.py``)."""


class ArraysInMemory(IncomingBuffers):
    """Arrays already in this process (sent to the same worker, or through the comms)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        super().__init__([a.shape for a in arrays], [a.dtype for a in arrays])
        self._arrays = arrays
        self._stop = threading.Event()
        self._copying: asyncio.Future | None = None  # the copy's thread, if any

    def method_returned(self) -> None:
        self._stop.set()  # a copy in a thread ends at its next step
        super().method_returned()
        self._arrays = []

    async def stopped(self) -> None:
        await super().stopped()
        if self._copying is not None:  # (a thread cannot be cancelled: it is told to stop)
            await asyncio.wait({self._copying})

    async def _read_into(self, destinations: list[np.ndarray]) -> None:
        arrays, self._arrays = self._arrays, []
        stop = self._stop

        def copy() -> None:
            for d, a in zip(destinations, arrays, strict=True):
                for into, part in _steps(d, a):
                    if stop.is_set():
                        return
                    np.copyto(into, part)

        if self.nbytes > COPY_ON_LOOP_MAX:  # in a thread: the event loop goes on meanwhile
            self._copying = asyncio.get_running_loop().run_in_executor(None, copy)
            try:  # (shielded: a read given up on leaves the thread's future to stopped())
                await asyncio.shield(self._copying)
            except asyncio.CancelledError:
                stop.set()  # given up on (a timeout): it stops writing at its next step
                raise
        else:
            copy()


def _steps(destination: np.ndarray, source: np.ndarray
           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``destination`` and ``source`` in matching slices along their first axis, about
    ``COPY_STEP_BYTES`` each (a 0-d array, or one row larger than that, in one)."""
    if destination.ndim == 0 or destination.nbytes <= COPY_STEP_BYTES:
        yield destination, source
        return
    rows = len(destination)
    per_row = max(1, destination.nbytes // max(rows, 1))
    step = max(1, COPY_STEP_BYTES // per_row)
    for start in range(0, rows, step):
        yield destination[start:start + step], source[start:start + step]


def as_incoming(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every :class:`Buffers` given as :class:`ArraysInMemory`
    (a call delivered in this process, or through distributed's comms)."""
    if not any(isinstance(a, Buffers) for a in (*args, *kwargs.values())):
        return args, kwargs
    def swap(a: Any) -> Any:
        return ArraysInMemory(a.arrays) if isinstance(a, Buffers) else a

    return tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()}


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
