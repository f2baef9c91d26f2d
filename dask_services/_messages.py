"""Helpers for the messages both sides of the framework exchange: the service-task core
(``worker.py``, ``scheduler.py``) and the extensions (``replicated/``) alike.

Exceptions travel pickled with their traceback text attached; payloads wrapped by
distributed's serialization (``Serialize``, ``ToPickle``) are unwrapped on arrival.
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
from typing import Any

from distributed.protocol import pickle as dask_pickle
from distributed.protocol.serialize import Serialize, ToPickle

from dask_services._quiet import quietly


def unwrap(obj: Any) -> Any:
    """The object inside distributed's serialization wrappers (however deeply nested)."""
    while isinstance(obj, (Serialize, ToPickle)):
        obj = obj.data
    return obj


def dumps_exception(exc: BaseException) -> bytes:
    """Pickle an exception with its traceback text attached as a note.

    distributed's pickle falls back to cloudpickle, so exception classes defined in
    ``__main__`` (a notebook, a script) travel by value and keep their type.
    """
    text = "".join(traceback.format_exception(exc))
    try:
        payload = quietly(dask_pickle.dumps, exc)
        dask_pickle.loads(payload)
    except Exception:
        payload = dask_pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return pickle.dumps((payload, text))


def loads_exception(blob: bytes) -> BaseException:
    """The exception pickled by :func:`dumps_exception`, with the sender's traceback as a
    note."""
    payload, text = pickle.loads(blob)
    exc = dask_pickle.loads(payload)
    with contextlib.suppress(Exception):
        exc.add_note("Raised by a service instance:\n" + text)
    return exc


def contained(exc: BaseException, what: str, fails: str = "the run") -> Exception:
    """What ``what`` (a hook, a peer method, an endpoint) raising ``exc`` fails with:
    ``exc`` if it is an ``Exception``; otherwise (``SystemExit``, ``KeyboardInterrupt``,
    a ``BaseException`` of the service's own) a ``RuntimeError`` caused by it.  Service
    code runs on the worker's event loop, which such an exception would stop (the worker
    gone, the run restarted on a new one to fail the same way) or leave a caller without
    an answer."""
    if isinstance(exc, Exception):
        return exc
    error = RuntimeError(
        f"{what} raised {exc!r}, which is not an Exception: it would stop the worker's "
        f"event loop, where services run; raise an Exception to fail {fails}")
    error.__cause__ = exc
    return error
