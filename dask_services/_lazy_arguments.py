"""Futures, ``Delayed`` objects and dask collections among arguments that travel as
they are: a service task's parameters, a replicated service's setup and call arguments.

A service task's parameters reach every instance's ``start`` as they were given, and a
call's arguments reach a replica's endpoint the same way: nothing computes a lazy value
on the way, so one given there is refused when the graph is built or the call is made.
A replicated service's setup arguments are computed on the client before it is deployed
(``replicated/_deploy.py``).
"""

from __future__ import annotations

from typing import Any

from dask.base import is_dask_collection

# containers looked into for lazy values (their items, and a dict's values)
_CONTAINERS = (list, tuple, set, frozenset, dict)


def is_lazy(obj: Any) -> bool:
    """A value that stands for one computed elsewhere: a ``distributed.Future``, a
    ``Delayed`` object or another dask collection."""
    from distributed import Future

    return isinstance(obj, Future) or is_dask_collection(obj)


def lazy_kind(obj: Any) -> str:
    """``Future``, ``Delayed`` or ``dask <collection type>``."""
    from dask.delayed import Delayed
    from distributed import Future

    if isinstance(obj, Future):
        return "Future"
    return "Delayed" if isinstance(obj, Delayed) else f"dask {type(obj).__name__}"


def lazy_arguments(args: tuple | list, kwargs: dict, *, deep: bool = True) -> list[str]:
    """Where lazy values are among ``args`` and ``kwargs``, e.g. ``["argument 0 (a
    Future)", "weights[1] (a Delayed)"]``; ``deep`` looks into lists, tuples, sets and
    dicts too (at any depth)."""
    found: list[str] = []

    def visit(obj: Any, where: str, depth: int) -> None:
        if is_lazy(obj):
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


def computed_arguments(client: Any, args: tuple, kwargs: dict) -> Any:
    """``(args, kwargs)`` with every lazy value (at any depth of lists, tuples, sets and
    dicts) replaced by its value, computed on the cluster: the result, or with an
    asynchronous client an awaitable of it."""
    import dask

    task = dask.delayed(_as_given, pure=False)(list(args), dict(kwargs))
    future = client.compute(task)
    return future if client.asynchronous else future.result()
