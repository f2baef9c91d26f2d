"""A partitioned receive buffer that spills to disk: shared by the shuffle and the rechunk.

Pieces arrive in *batches* (one message from one peer); each piece belongs to one
partition (an output partition or chunk).  Batches stay in memory until the buffer holds
more than ``limit`` bytes; then every piece in memory is appended to one file per
partition under ``directory`` and the batches are dropped, so that memory really is freed
(pieces are often views into their batch).  ``take(partition)`` returns every piece of a
partition, from memory and disk, and forgets them.

Pieces being written still take memory until their write ends: ``held_bytes`` counts them,
and ``add_batch`` does not return while what is held is over the limit and a write is under
way, so a receiver stops taking more (and its senders wait) until the disk has caught up.
A partition being written is still held: ``nbytes`` counts its pieces, and ``holds`` says
by presence whether ``take`` would return any (a spill can start at any moment, asked for
by the worker's memory check).  A write is counted when it ends, also where the
spill that started it was cancelled meanwhile (the write goes on in the I/O thread).

All bookkeeping happens on the event loop; file I/O runs in the buffer's own I/O thread
(never in a task slot, which may be held by a hand-off waiting on this very buffer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import itertools
import os
import pickle
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import cloudpickle

from dask_services._memory import release_freed_memory

Partition = Hashable


def _dump(piece: Any, f: Any) -> None:
    """Append ``piece`` to ``f``: pickled, or where pickle refuses it (objects of classes
    defined in a client's ``__main__``, lambdas: distributed sent them with cloudpickle)
    with cloudpickle, over what pickle had written of it."""
    start = f.tell()
    try:
        pickle.dump(piece, f, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError):
        f.seek(start)
        f.truncate()
        cloudpickle.dump(piece, f, protocol=5)


def _as_pickled_faithfully(piece: Any) -> Any:
    """``piece``, or a contiguous copy of a numpy array that pickle would not give back as
    it is: numpy pickles a non-contiguous array of non-native byte order (``>f8`` on this
    machine) as native ones."""
    if type(piece) is tuple:  # (offset, array) of a rechunk's piece
        return tuple(_as_pickled_faithfully(p) for p in piece)
    dtype = getattr(piece, "dtype", None)
    flags = getattr(piece, "flags", None)
    if (dtype is not None and not getattr(dtype, "isnative", True)
            and not (getattr(flags, "c_contiguous", True)
                     or getattr(flags, "f_contiguous", True))):
        return piece.copy(order="C")
    return piece


class OutOfDiskError(OSError):
    """The disk under the worker's local directory is full."""

    @classmethod
    def writing(cls, what: str, directory: str) -> OutOfDiskError:
        """The error for a full disk met while writing ``what`` to ``directory``."""
        return cls(errno.ENOSPC,
                   f"out of disk space {what} {directory}; free disk space there or point "
                   "the worker's local directory (--local-directory, config "
                   "'temporary-directory') to a larger disk")


class SpillBuffer:
    def __init__(self, directory: str, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spill")
        self._memory: defaultdict[Partition, list[Any]] = defaultdict(list)
        self._memory_bytes: defaultdict[Partition, int] = defaultdict(int)
        self._files: dict[Partition, str] = {}
        self._file_sizes: dict[Partition, int] = {}
        self._counter = itertools.count()
        self.memory_bytes = 0
        self.writing_bytes = 0  # of pieces handed to the I/O thread, not yet written
        # the same, by file: a partition being written is still held (``nbytes``)
        self._writing: dict[str, int] = {}
        self._closed = False
        self._written = asyncio.Event()  # set whenever no write is under way
        self._written.set()
        self.spilled_total = 0  # bytes ever written to disk

    def __len__(self) -> int:
        return len(self._memory) + len(self._files)

    async def add_batch(self, pieces: Iterable[tuple[Partition, Any, int]]) -> None:
        """Keep ``(partition, piece, nbytes)`` triples received together."""
        for partition, piece, nbytes in pieces:
            self._memory[partition].append(piece)
            self._memory_bytes[partition] += nbytes
            self.memory_bytes += nbytes
        if self.memory_bytes > self.limit:
            await self.spill()
        while self.held_bytes > self.limit and self.writing_bytes:
            await self._written.wait()

    @property
    def held_bytes(self) -> int:
        """Bytes in memory: buffered, and being written to disk."""
        return self.memory_bytes + self.writing_bytes

    async def spill(self) -> int:
        """Write every piece held in memory to disk; returns the bytes freed."""
        if not self._memory or self._closed:
            return 0
        memory, self._memory = self._memory, defaultdict(list)
        freed, self.memory_bytes = self.memory_bytes, 0
        writing, self._memory_bytes = self._memory_bytes, defaultdict(int)
        for partition in memory:
            if partition not in self._files:
                name = f"part-{next(self._counter)}"
                self._files[partition] = os.path.join(self.directory, name)
        paths = {p: self._files[p] for p in memory}
        self.writing_bytes += freed
        for partition, nbytes in writing.items():
            path = paths[partition]
            self._writing[path] = self._writing.get(path, 0) + nbytes
        self._written.clear()
        write = asyncio.get_running_loop().run_in_executor(self._io, self._write, memory, paths)
        del memory  # the write holds the pieces until they are on disk
        # counted as written when the write ends, not when this call does: a spill whose
        # caller is cancelled goes on writing in the I/O thread
        write.add_done_callback(functools.partial(self._write_ended, freed, writing, paths))
        await asyncio.shield(write)
        # the pieces are gone, but the allocator would keep their memory: give it back,
        # so that the worker's process memory (which pauses and spills) sees it
        if not self._closed:
            await self._run(release_freed_memory)
        return freed

    def _write_ended(self, freed: int, writing: dict[Partition, int],
                     paths: dict[Partition, str], write: asyncio.Future) -> None:
        """A spill's write ended (written, failed or its caller cancelled): its bytes are
        no longer being written, and those written are counted on disk."""
        if not write.cancelled() and write.exception() is None:
            for partition, (size, appended) in write.result().items():
                self.spilled_total += appended
                if self._files.get(partition) == paths[partition]:  # not taken meanwhile
                    self._file_sizes[partition] = size
        self.writing_bytes -= freed
        for partition, nbytes in writing.items():
            path = paths[partition]
            left = self._writing.get(path, 0) - nbytes
            if left > 0:
                self._writing[path] = left
            else:
                self._writing.pop(path, None)
        if not self.writing_bytes:
            self._written.set()

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    @property
    def disk_bytes(self) -> int:
        return sum(self._file_sizes.values())

    @staticmethod
    def _write(memory: dict[Partition, list[Any]], paths: dict[Partition, str]) -> dict:
        """Append each partition's pieces to its file: partition -> (the file's size, the
        bytes appended)."""
        sizes = {}
        directory = os.path.dirname(next(iter(paths.values())))
        for partition, pieces in memory.items():
            path = paths[partition]
            try:
                with open(path, "ab") as f:
                    start = f.tell()
                    for piece in pieces:
                        _dump(_as_pickled_faithfully(piece), f)
                    sizes[partition] = (f.tell(), f.tell() - start)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise OutOfDiskError.writing("while spilling to", directory) from e
                raise
        return sizes

    def nbytes(self, partition: Partition) -> int:
        """Bytes buffered for ``partition``: in memory (as estimated when added), being
        written, and on disk."""
        path = self._files.get(partition)
        writing = self._writing.get(path, 0) if path is not None else 0
        return (self._memory_bytes.get(partition, 0) + writing
                + self._file_sizes.get(partition, 0))

    def holds(self, partition: Partition) -> bool:
        """Whether ``take(partition)`` would return pieces: in memory, being written (the
        file is named when the write starts) or on disk, whatever their sizes."""
        return partition in self._memory or partition in self._files

    async def take(self, partition: Partition) -> list[Any]:
        """Every piece of ``partition`` (from memory and disk); the buffer forgets them."""
        pieces = self._memory.pop(partition, [])
        self.memory_bytes -= self._memory_bytes.pop(partition, 0)
        path = self._files.pop(partition, None)
        self._file_sizes.pop(partition, None)
        if path is None:
            return pieces
        return await self._run(self._read, path) + pieces

    @staticmethod
    def _read(path: str) -> list[Any]:
        pieces = []
        try:
            with open(path, "rb") as f:
                while True:
                    try:
                        pieces.append(pickle.load(f))
                    except EOFError:
                        break
        finally:
            os.remove(path)
        return pieces

    def clear(self) -> None:
        """Forget everything and remove the files, once the writes under way have ended
        (a write queued after the removal would make its file again)."""
        self._closed = True
        self._io.shutdown(wait=True)
        self._memory.clear()
        self._memory_bytes.clear()
        for path in self._files.values():
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        self._files.clear()
        self._file_sizes.clear()
        self._writing.clear()
        self.memory_bytes = 0
