"""Futures, ``Delayed`` objects and dask collections among arguments that travel as
they are: a service task's parameters, a replicated service's setup and call arguments.

A service task's parameters reach every instance's ``start`` as they were given, and a
call's arguments reach a replica's endpoint the same way: nothing computes a lazy value
on the way, so one given there is refused when the graph is built or the call is made.
A replicated service's setup arguments are computed on the client's cluster before it
is deployed (``replicated/_deploy.py``), as ``dask.delayed`` finds them: in lists,
tuples, sets and dicts (exactly those types).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dask.base import is_dask_collection
from dask.delayed import Delayed
from distributed import Future

# containers looked into for lazy values (their items, and a dict's values)
_CONTAINERS = (list, tuple, set, frozenset, dict)
# what is never lazy, found before the (slower) look for a dask collection
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def is_lazy(obj: Any) -> bool:
    """A value that stands for one computed elsewhere: a ``distributed.Future``, a
    ``Delayed`` object or another dask collection."""
    if isinstance(obj, _PLAIN):
        return False
    # (on the class: a DataFrame's ``__getattr__`` makes the instance's look slow)
    return isinstance(obj, Future) or (hasattr(type(obj), "__dask_graph__")
                                       and is_dask_collection(obj))


def lazy_kind(obj: Any) -> str:
    """``Future``, ``Delayed`` or ``dask <collection type>``."""
    if isinstance(obj, Future):
        return "Future"
    return "Delayed" if isinstance(obj, Delayed) else f"dask {type(obj).__name__}"


def lazy_arguments(args: tuple | list, kwargs: dict, *, deep: bool = True,
                   futures: bool = True) -> list[str]:
    """Where lazy values are among ``args`` and ``kwargs``, e.g. ``["argument 0 (a
    Future)", "weights[1] (a Delayed)"]``; ``deep`` looks into lists, tuples, sets and
    dicts too (at any depth); ``futures=False`` leaves futures out."""
    found: list[str] = []

    def visit(obj: Any, where: str, depth: int) -> None:
        if isinstance(obj, _PLAIN):
            return
        if is_lazy(obj):
            if futures or not isinstance(obj, Future):
                found.append(f"{where} (a {lazy_kind(obj)})")
        elif deep and isinstance(obj, _CONTAINERS) and depth < 100:
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for i, item in items:
                visit(item, f"{where}[{i!r}]", depth + 1)

    for i, arg in enumerate(args):
        visit(arg, f"argument {i}", 0)
    for name, value in kwargs.items():
        visit(value, name, 0)
    return found


def _as_given(args: list, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(args), kwargs


def computed_arguments(client: Any, args: tuple, kwargs: dict, what: str) -> Any:
    """``(args, kwargs)`` with every lazy value in them replaced by its value, computed on
    the cluster (the result, or with an asynchronous client an awaitable of it).  What
    is computed is released afterwards, also when it fails (the error then says it was
    computing ``what``); a lazy value ``dask.delayed`` does not find (in a subclass of
    dict or in a frozenset) is a ``TypeError``."""
    import dask

    future = client.compute(dask.delayed(_as_given, pure=False)(list(args), dict(kwargs)))
    if client.asynchronous:
        return _awaited(future, what)
    with _computing(future, what):
        return _checked(future.result(), what)


async def _awaited(future: Any, what: str) -> tuple[tuple, dict]:
    with _computing(future, what):
        return _checked(await future, what)


@contextlib.contextmanager
def _computing(future: Any, what: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        e.add_note(f"(computing {what})")
        raise
    finally:
        future.release()


def _checked(computed: tuple[tuple, dict], what: str) -> tuple[tuple, dict]:
    left = lazy_arguments(*computed)
    if left:
        raise TypeError(
            f"{', '.join(left)} of {what} cannot be computed where it is (only lists, "
            "tuples, sets and dicts are looked into, not their subclasses or frozensets): "
            "pass it in one of those, or compute it first")
    return computed
