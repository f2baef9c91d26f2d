"""Outputs produced on a worker, held until their claims take them into its memory.

A produced value is not in distributed's managed memory until its claim runs, so
distributed cannot spill it.  A worker paused for memory runs no task, so no claim runs:
the values held there would keep the worker paused for good (its own run, whose outputs
they are, then waits too).  While the worker is paused they are written to disk
(:meth:`ProducedOutputs.spill`) and read back by the claim that takes them.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dask.typing import Key
from distributed.protocol import deserialize_bytes, serialize_bytelist

from dask_services._counters import size_of
from dask_services._directory import in_directory, remove_if_empty
from dask_services._spill import OutOfDiskError

logger = logging.getLogger("dask_services")


@dataclass(frozen=True)
class _OnDisk:
    path: str


class ProducedOutputs:
    """``key -> value`` of the outputs produced here and not yet taken by their claims."""

    def __init__(self, directory: str) -> None:
        self.directory = directory  # where values are written while the worker is paused
        self._values: dict[Key, Any] = {}
        # claims take values in task threads, spilling runs in a service thread
        self._lock = threading.Lock()

    def put(self, key: Key, value: Any) -> None:
        self.drop(key)
        with self._lock:
            self._values[key] = value

    def take(self, key: Key, *, keep: bool = False) -> Any:
        """The value of ``key`` (``KeyError`` if not held); let go of it unless ``keep``."""
        with self._lock:
            value = self._values[key] if keep else self._values.pop(key)
        if not isinstance(value, _OnDisk):
            return value
        with open(value.path, "rb") as f:
            loaded = deserialize_bytes(f.read())
        if not keep:
            _remove(value.path)
        return loaded

    def drop(self, key: Key) -> None:
        with self._lock:
            value = self._values.pop(key, None)
        if isinstance(value, _OnDisk):
            _remove(value.path)

    def clear(self) -> None:
        for key in self._keys():
            self.drop(key)

    def spill(self) -> tuple[int, int]:
        """Write every value held in memory to disk; returns how many and their bytes.
        A value that cannot be serialized stays in memory (its claim takes the object).
        A write that fails (``OutOfDiskError`` for a full disk) raises, its file removed,
        with the values written before it as ``spilled``; the others stay in memory."""
        count = written = 0
        with self._lock:
            held = list(self._values.items())
        for key, value in held:
            if isinstance(value, _OnDisk):
                continue
            try:
                frames = serialize_bytelist(value, on_error="raise")
            except Exception:
                logger.debug("produced output %r cannot be serialized: kept in memory", key)
                continue
            path = os.path.join(self.directory, f"produced-{uuid.uuid4().hex}")
            try:
                with in_directory(self.directory, functools.partial(open, path, "wb")) as f:
                    f.writelines(frames)
            except OSError as e:
                _remove(path)  # a file half written (a full disk) is not left behind
                error = e
                if e.errno == errno.ENOSPC:
                    error = OutOfDiskError.writing("writing produced outputs to",
                                                   self.directory)
                error.spilled = (count, written)  # type: ignore[attr-defined]  # before it
                if error is e:
                    raise
                raise error from e
            with self._lock:
                kept = self._values.get(key) is value  # not taken meanwhile
                if kept:
                    self._values[key] = _OnDisk(path)
            if kept:
                count += 1
                written += size_of(value)
            else:
                _remove(path)
        return count, written

    def in_memory(self) -> int:
        """Values held in memory (not written to disk)."""
        with self._lock:
            values = list(self._values.values())
        return sum(not isinstance(v, _OnDisk) for v in values)

    def _keys(self) -> list[Key]:
        with self._lock:
            return list(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[Key]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"<ProducedOutputs {len(self)} held, {self.in_memory()} in memory>"


def _remove(path: str) -> None:
    """Remove a value's file, and its directory with the last one (``_directory``)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    remove_if_empty(os.path.dirname(path))
