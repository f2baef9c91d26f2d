"""Giving freed memory back to the operating system, and taking memory without huge pages.

Received shuffle groups and rechunk pieces are many medium-sized buffers; once they are
freed, glibc keeps most of that memory in its heap, where process memory (what the worker's
memory monitor, and the user, see) still counts it.  ``malloc_trim`` returns it.

numpy advises transparent huge pages for every allocation of 4 MiB or more.  Where THP is
``madvise`` (a common default), each first write into such an array makes the kernel find
and zero a whole 2 MiB page, compacting memory when none is free (~70 ms of kernel time for
a 31 MB rechunk output chunk), and the allocation is served by fresh pages where the heap
holds freed memory that would need no page fault at all.  :func:`without_huge_page_advice`
turns that advice off while the rechunk allocates its output chunks (the shuffle's takes
and concatenations, measured the same way, were no faster without it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Iterator

try:  # numpy's process-wide switch for that advice (numpy 1.x and 2.x)
    from numpy._core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage
except ImportError:  # pragma: no cover - a numpy without it: the advice stays
    _get_madvise_hugepage = _set_madvise_hugepage = None

HUGE_PAGE_ADVICE_FROM = 4 * 2**20  # numpy advises huge pages from this size on (Linux)
_switch = threading.Lock()
_sections = 0  # threads inside ``without_huge_page_advice`` now
_advised = False  # the setting to restore when the last of them leaves


@contextlib.contextmanager
def without_huge_page_advice() -> Iterator[None]:
    """numpy allocates without huge-page advice inside this block.

    The switch is process-wide: it is turned off when the first thread enters and restored
    (to whatever it was then) when the last one leaves, so concurrent blocks neither wait
    for each other nor leave it changed.  An allocation elsewhere meanwhile at worst goes
    without the advice.
    """
    global _sections, _advised
    if _set_madvise_hugepage is None:
        yield
        return
    with _switch:
        if _sections == 0:
            _advised = _set_madvise_hugepage(False)
        _sections += 1
    try:
        yield
    finally:
        with _switch:
            _sections -= 1
            if _sections == 0:
                _set_madvise_hugepage(_advised)


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
