"""Giving freed memory back to the operating system.

Received shuffle groups and rechunk pieces are many medium-sized buffers; once they are
freed, glibc keeps most of that memory in its heap, where process memory (what the worker's
memory monitor, and the user, see) still counts it.  ``malloc_trim`` returns it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc); nothing elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]


TRIM_EVERY = 16 * 2**20  # measured: the peak of a 2 GB rechunk falls by ~1 GB, at no cost


class TrimAfter:
    """Says when to call :func:`release_freed_memory`: once ``every`` bytes were freed."""

    def __init__(self, every: int = TRIM_EVERY) -> None:
        self.every = every
        self.freed = 0

    def freed_bytes(self, nbytes: int) -> bool:
        """Count ``nbytes`` freed; True when it is time to trim (and the count restarts)."""
        self.freed += nbytes
        if self.freed < self.every:
            return False
        self.freed = 0
        return True
