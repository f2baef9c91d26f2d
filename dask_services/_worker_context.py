"""Making ``distributed.get_worker()`` work in service code that is not a task.

distributed sets the current worker in a context variable while it runs a task.  Instance
hooks, peer calls and replica methods run in tasks of the worker's event loop (or threads)
that distributed did not start, so the framework sets the same variable around them.  The
variable is private to distributed: ``tests/test_hooks.py`` fails loudly if it moves.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from distributed.worker import _worker_cvar

from dask_services._messages import without_stop_iteration

if TYPE_CHECKING:
    from distributed import Worker

T = TypeVar("T")


@contextlib.contextmanager
def as_worker(worker: Worker) -> Iterator[None]:
    """``get_worker()`` returns ``worker`` inside the block (and in tasks created there)."""
    token = _worker_cvar.set(worker)
    try:
        yield
    finally:
        _worker_cvar.reset(token)


def in_current_context(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` bound to a copy of the current context, for a thread pool
    (``loop.run_in_executor`` does not carry context variables over); a
    ``StopIteration`` it raises comes out as a ``RuntimeError``, which the future of its
    result can carry (``_messages.without_stop_iteration``)."""
    return functools.partial(contextvars.copy_context().run, without_stop_iteration(fn))


def worker_handler(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a coroutine method of an object with a ``worker`` attribute so that it runs
    with ``get_worker()`` set to that worker."""

    @functools.wraps(fn)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with as_worker(self.worker):
            return await fn(self, *args, **kwargs)

    return run
