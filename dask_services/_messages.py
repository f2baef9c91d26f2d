"""Helpers for the messages both sides of the framework exchange: the service-task core
(``worker.py``, ``scheduler.py``) and the extensions (``replicated/``) alike.

Exceptions travel pickled with their traceback text attached; payloads wrapped by
distributed's serialization (``Serialize``, ``ToPickle``) are unwrapped on arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import pickle
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

from distributed.protocol import pickle as dask_pickle
from distributed.protocol.serialize import Serialize, ToPickle

from dask_services._quiet import quietly

T = TypeVar("T")


def unwrap(obj: Any) -> Any:
    """The object inside distributed's serialization wrappers (however deeply nested)."""
    while isinstance(obj, (Serialize, ToPickle)):
        obj = obj.data
    return obj


# the blob of an exception that could not be loaded, on the RuntimeError standing for it
_UNLOADED = "_dask_services_unloaded_exception"


def dumps_exception(exc: BaseException) -> bytes:
    """Pickle an exception with its traceback text attached as a note.

    distributed's pickle falls back to cloudpickle, so exception classes defined in
    ``__main__`` (a notebook, a script) travel by value and keep their type.
    """
    original = getattr(exc, _UNLOADED, None)
    if original is not None:  # one this process could not load: passed on as it came
        return original
    return pickle.dumps((_plain_pickle(exc), _traceback_text(exc), describe_exception(exc)))


def dumps_as_raised(exc: BaseException) -> bytes:
    """``exc`` pickled as distributed's clients load an erred task's exception, as a
    worker would raise it after :func:`loads_exception` (its traceback as a note): for
    a task the scheduler errs itself."""
    return _plain_pickle(loads_exception(dumps_exception(exc)))


def _plain_pickle(exc: BaseException) -> bytes:
    """``exc`` pickled so that it loads: as it is, else by its parts, else as a
    ``RuntimeError`` that says what it was."""
    payload = _loadable_pickle(exc)
    if payload is None and _printable(exc) and _pickled_as_exceptions_are(type(exc)):
        # (one whose str() raises, or whose class pickles itself its own way, stays a
        # RuntimeError that says what it was)
        payload = _loadable_pickle(_ByParts(exc))
    if payload is None:
        payload = dask_pickle.dumps(RuntimeError(describe_exception(exc)))
    return payload


def _loadable_pickle(obj: Any) -> bytes | None:
    try:
        payload = quietly(dask_pickle.dumps, obj)
        quietly(dask_pickle.loads, payload)
    except Exception:
        return None
    return payload


def _pickled_as_exceptions_are(cls: type) -> bool:
    """Whether ``cls`` pickles as Python's exceptions do (no ``__reduce__`` or
    ``__reduce_ex__`` of its own): a class that defines its own way, or refuses, is not
    rebuilt behind its back."""
    for name in ("__reduce__", "__reduce_ex__"):
        owner = next((k for k in cls.__mro__ if name in vars(k)), object)
        if owner.__module__ != "builtins":
            return False
    return True


def _printable(exc: BaseException) -> bool:
    try:
        str(exc)
    except Exception:
        return False
    return True


class _ByParts:
    """Pickles an exception as its class, ``args`` and attributes, rebuilt without
    calling its ``__init__``: pickle calls ``cls(*args)``, which fails for a class whose
    ``__init__`` takes other arguments than it gives ``Exception`` (a keyword-only one,
    a message made of two), and such an exception lost its type on its way."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple:
        exc = self.exc
        made_with = exc.args
        if isinstance(exc, OSError) and exc.filename is not None:
            # OSError.__new__ sets errno, strerror and the file names from its arguments
            made_with = (exc.errno, exc.strerror, exc.filename, None, exc.filename2)
        # an attribute that does not pickle (a lock, an open file) stays behind
        attributes = {name: value for name, value in getattr(exc, "__dict__", {}).items()
                      if _loadable_pickle(value) is not None}
        return _rebuilt, (type(exc), made_with, exc.args, attributes)


def _rebuilt(cls: type[BaseException], made_with: tuple, args: tuple,
             attributes: dict) -> BaseException:
    exc = cls.__new__(cls, *made_with)
    if isinstance(exc, OSError):  # whose __new__ leaves them to an __init__ of its own
        OSError.__init__(exc, *made_with)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


_NOTE = "Raised by a service instance:\n"


def _traceback_text(exc: BaseException) -> str:
    """``exc``'s traceback as text, without the notes :func:`loads_exception` added on
    the hops it came by: each hop's note carried every earlier one's, a chain of peer
    calls 2**(depth + 1) copies of its tracebacks (270 MB at depth 16)."""
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list) or not any(
            isinstance(n, str) and n.startswith(_NOTE) for n in notes):
        return "".join(traceback.format_exception(exc))
    try:
        exc.__notes__ = [n for n in notes if not (isinstance(n, str) and n.startswith(_NOTE))]
        return "".join(traceback.format_exception(exc))
    finally:
        exc.__notes__ = notes


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, whatever its ``__str__`` does (a module-qualified type
    where it is not a builtin)."""
    cls = type(exc)
    name = (cls.__qualname__ if cls.__module__ == "builtins"
            else f"{cls.__module__}.{cls.__qualname__}")
    try:
        message = str(exc)
    except Exception as e:
        message = f"<its message could not be made: str() raised {type(e).__name__}>"
    return f"{name}: {message}" if message else name


def loads_exception(blob: bytes) -> BaseException:
    """The exception pickled by :func:`dumps_exception`, with the sender's traceback as a
    note.  One whose class cannot be loaded here (a library installed on the workers
    only) is a ``RuntimeError`` with its type, message and traceback, which
    :func:`dumps_exception` passes on as it came: where it can be loaded (the worker of
    the service task, the client) it is the exception itself again."""
    payload, text, summary = pickle.loads(blob)
    try:
        exc = dask_pickle.loads(payload)
    except Exception as e:
        exc = RuntimeError(f"{summary} (this exception's class cannot be loaded here, "
                           f"{type(e).__name__}: {e}; install the library it comes from "
                           "where the error is read to get the exception itself)")
        setattr(exc, _UNLOADED, blob)
    with contextlib.suppress(Exception):
        exc.add_note(_NOTE + text)
    return exc


def contained(exc: BaseException, what: str, fails: str = "the run",
              how: str = "raised") -> Exception:
    """What ``what`` (a hook, a peer method, an endpoint) raising ``exc`` fails with:
    ``exc`` if it is an ``Exception``; otherwise (``SystemExit``, ``KeyboardInterrupt``,
    ``GeneratorExit``, a ``BaseException`` of the service's own) a ``RuntimeError``
    caused by it.  Service code runs on the worker's event loop, which such an exception
    would stop (the worker gone, the run restarted on a new one to fail the same way) or
    leave a caller without an answer.  ``how``: "raised", or "returned" for an exception
    given as a result (a batched endpoint's)."""
    if isinstance(exc, Exception):
        return exc
    error = RuntimeError(
        f"{what} {how} {exc!r}, which is not an Exception: it would stop the worker's "
        f"event loop, where services run; raise an Exception to fail {fails}")
    error.__cause__ = exc
    return error


# what Python makes of a StopIteration that leaves a coroutine or a generator (PEP 479)
_STOP_ITERATION_TURNED = frozenset({
    "coroutine raised StopIteration", "async generator raised StopIteration",
    "generator raised StopIteration"})


def future_safe(exc: BaseException, what: str, fails: str = "the call",
                how: str = "raised") -> Exception:
    """``exc`` as a future can carry it to whoever awaits ``what``: :func:`contained`,
    and a ``StopIteration`` as a ``RuntimeError`` caused by it, as Python turns one that
    leaves a coroutine.  asyncio refuses to set a ``StopIteration`` on a future: the
    refusal (a ``TypeError``) is raised where the outcome is copied, in a callback of the
    loop, and the future is never done, so its caller would wait for ever (and a
    replica's slot would never be given back).  The ``RuntimeError`` Python itself makes
    of one that left a coroutine ("coroutine raised StopIteration", which names neither
    the function nor the likely cause) is replaced by the same message, naming ``what``."""
    cause = exc.__cause__
    if (type(exc) is RuntimeError and isinstance(cause, StopIteration)
            and str(exc) in _STOP_ITERATION_TURNED):
        exc = cause
    if isinstance(exc, StopIteration):
        error = RuntimeError(
            f"{what} {how} StopIteration (a next() on an exhausted iterator? give next() "
            f"a default), which can neither end a coroutine nor be the outcome of a call; "
            f"raise another exception to fail {fails}")
        error.__cause__ = exc
        return error
    return contained(exc, what, fails, how)


def raise_future_safe(exc: BaseException, what: str, fails: str = "the call") -> NoReturn:
    """Raise ``exc`` as :func:`future_safe` makes it (``exc`` itself where it is safe as
    it is), from within the ``except`` clause that caught it."""
    safe = future_safe(exc, what, fails)
    if safe is exc:
        raise exc
    raise safe from safe.__cause__


async def guarded(awaitable: Awaitable[T], what: str, fails: str) -> T:
    """``await awaitable``, with what it raises that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) or that no future can carry
    (``StopIteration``) made what :func:`future_safe` makes of it: a task letting out the
    first stops the worker's event loop."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        raise_future_safe(e, what, fails)


def guarded_in_thread(fn: Callable[[], T], what: str, fails: str) -> Callable[[], T]:
    """``fn``, for a thread whose outcome a future carries to the event loop, with the same
    exceptions made safe as :func:`guarded` makes them, in the thread: set on that future,
    a ``KeyboardInterrupt`` would stop the loop where it is awaited, and a
    ``StopIteration`` could not be set (its awaiter waiting for ever)."""

    @functools.wraps(fn)
    def call() -> T:
        try:
            return fn()
        except Exception as e:
            if isinstance(e, StopIteration):
                raise_future_safe(e, what, fails)
            raise
        except BaseException as e:
            raise_future_safe(e, what, fails)

    return call


def without_stop_iteration(fn: Callable[..., T], what: str | None = None
                           ) -> Callable[..., T]:
    """``fn``, for a thread pool whose result a future carries: a ``StopIteration`` it
    raises comes out as :func:`future_safe` makes it (``what`` names ``fn`` in the
    message; by default its own name)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except StopIteration as e:
            raise future_safe(e, what or callable_name(fn)) from e

    return call


def callable_name(fn: Any) -> str:
    """``fn``'s qualified name (through ``functools.partial``), else its repr."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or repr(fn)
