"""Serialization attempts whose failure the framework reports itself, kept out of the log.

distributed's ``pickle.dumps`` logs every object it cannot serialize, with three chained
tracebacks (pickle, its own pickler, cloudpickle), before raising.  Where the framework
catches that error and raises or answers its own, naming the call or the value's role
(peer-call arguments, results, stream items, an exception to send), that log is noise
repeated for every call.  :func:`quietly` runs a serialization with those records dropped;
the filter does nothing outside it.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("dask_services_quiet",
                                                              default=False)


class _DropWhileQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _QUIET.get()


_FILTER = _DropWhileQuiet()
logging.getLogger("distributed.protocol.pickle").addFilter(_FILTER)


def quietly(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with distributed's "Failed to serialize" records dropped
    (in this thread or task only)."""
    token = _QUIET.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _QUIET.reset(token)
