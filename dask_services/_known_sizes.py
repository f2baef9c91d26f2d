"""Sizes of produced values, known before the worker measures them.

A worker measures every task result with dask's ``sizeof`` on its event loop, twice: for
the task-finished message to the scheduler and for its memory manager.  For a pandas frame
that is ~0.2 ms a call (a Series is built per column), a fifth of a worker's event loop
when a shuffle produces thousands of small partitions.  A service that knows the size of a
value it produces (it measured it in a service thread, where the value was built) passes
it to ``produce_key(key, value, nbytes=...)``; the size is remembered here for that very
object, and dask's ``sizeof`` of the object returns it without measuring.

How: dask's ``sizeof`` dispatch for the value's type is wrapped, once per type, by a
function that returns the remembered size of the object if there is one and otherwise
calls the function dask had for the type.  Every other object measures as before.  A size
is forgotten when its object is freed (a weak reference); values that cannot be weakly
referenced (``int``, ``list``, ``dict``, ``tuple``) are not remembered and are measured.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections.abc import Callable
from typing import Any

from dask.sizeof import sizeof

# id(value) -> (weak reference to value, nbytes)
_sizes: dict[int, tuple[weakref.ref, int]] = {}
# type -> the function dask's sizeof dispatched that type to before it was wrapped
_wrapped: dict[type, Callable[[Any], int]] = {}
_lock = threading.Lock()


# The largest size a worker can report: its messages carry sizes as signed 64-bit ints (a
# larger one failed the worker's stream to the scheduler, which then dropped the worker).
LARGEST_NBYTES = 2**63 - 1


def checked_nbytes(nbytes: Any) -> int:
    """``nbytes`` as an int, or a clear error: a size must be a non-negative integer that
    a worker's messages can carry."""
    if (isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0
            or nbytes > LARGEST_NBYTES):
        raise ValueError(
            f"nbytes={nbytes!r} is not a size in bytes; pass a non-negative integer below "
            "2**63 (the value's size as dask's sizeof measures it), or leave it out to "
            "have the worker measure the value"
        )
    return int(nbytes)


def remember(value: Any, nbytes: int) -> bool:
    """Make dask's ``sizeof(value)`` return ``nbytes`` while ``value`` lives.  Returns
    False, remembering nothing, for a value that cannot be weakly referenced."""
    key = id(value)
    try:
        ref = weakref.ref(value, lambda _, key=key: _sizes.pop(key, None))
    except TypeError:
        return False
    _wrap(type(value))
    _sizes[key] = (ref, nbytes)
    return True


def remembered(value: Any) -> int | None:
    """The size remembered for ``value``, if any."""
    entry = _sizes.get(id(value))
    if entry is None or entry[0]() is not value:
        return None
    return entry[1]


def remembered_count() -> int:
    """How many values have a remembered size (they are alive)."""
    return len(_sizes)


def _wrap(cls: type) -> None:
    if cls in _wrapped:
        return
    with _lock:
        if cls in _wrapped:
            return
        # dispatch first: it runs dask's lazy registrations for the type's library
        measure = sizeof.dispatch(cls)

        def sizeof_remembered(value: Any) -> int:
            size = remembered(value)
            return measure(value) if size is None else size

        _wrapped[cls] = measure
        sizeof.register(cls)(sizeof_remembered)
