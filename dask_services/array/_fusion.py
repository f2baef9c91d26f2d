"""A rechunk's copies fused with their consumers keep the consumers' keys.

dask.array's low-level optimization (``fuse_linear_task_spec``) fuses a chain of tasks, such
as the copy that makes an output chunk of a local rechunk and the ``.sum()`` of that chunk,
into one task under a new name (``rechunk-service-sum-<token>``), and leaves the chain's last
key (``sum-<token>``) as an :class:`~dask._task_spec.Alias` of it.  In distributed an alias
is a task of its own: a scheduler round trip and the workers' state machines, ~2 ms on a
two-core machine, where the copy itself is a fraction of that.  The local rechunk of 1 GB
then ``.sum()`` ran 834 such aliases among its 3,335 tasks.

Where a fused chain contains one of the service rechunk's copies (or an output chunk of a
culled service task, an alias of its renamed output: ``_culling``), the fused task here
takes the chain's last key itself and the alias is dropped: every task that named the last key
still does, and it is the fused task.  Chains without a copy of ours are left as dask made
them.  ``install()`` wraps the function where ``dask.array.optimization.optimize`` looks it
up; ``tests/test_array_hooks.py`` fails loudly if an upgrade moves it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import Any

from dask._task_spec import Alias, Task

_optimization = importlib.import_module("dask.array.optimization")


def _copies() -> frozenset[Callable]:
    from dask_services.array._pieces import copy_part, copy_pieces

    return frozenset((copy_pieces, copy_part))


def is_culled_output(node: Any) -> bool:
    """Whether ``node`` is an output chunk's key kept as an alias of the output of a culled
    service task (``_culling.with_inputs``: the same key with a suffix on its name)."""
    if not isinstance(node, Alias):
        return False
    key, target = node.key, node.target
    return (isinstance(key, tuple) and isinstance(target, tuple) and len(key) > 1
            and isinstance(key[0], str) and isinstance(target[0], str)
            and target[0].startswith(f"{key[0]}-") and target[1:] == key[1:])


def fuses_a_copy(node: Any, copies: frozenset[Callable]) -> bool:
    """Whether ``node`` is a fused task (``Task.fuse``) of which a copy, or an output of a
    culled service task, is a part."""
    if not (isinstance(node, Task) and node.has_subgraph()):
        return False
    inner = node.args[0] if node.args else None
    return isinstance(inner, dict) and any(
        (isinstance(t, Task) and t.func in copies) or is_culled_output(t)
        for t in inner.values()
    )


def without_copy_aliases(dsk: dict) -> dict:
    """``dsk`` (a fused graph) where every alias of a fused task containing a copy is
    replaced by that task, under the alias's key."""
    copies = _copies()
    renamed = {
        key: node.target for key, node in dsk.items()
        if isinstance(node, Alias) and fuses_a_copy(dsk.get(node.target), copies)
    }
    if not renamed:
        return dsk
    targets = set(renamed.values())
    out = {key: node for key, node in dsk.items() if key not in targets}
    for key, target in renamed.items():
        out[key] = dsk[target].substitute({}, key=key)
    return out


def _fuse_keeping_consumer_keys(fuse: Callable) -> Callable:
    @functools.wraps(fuse)
    def fuse_linear_task_spec(dsk: Any, keys: Iterable) -> dict:
        from dask_services._claim_fusion import fuse_consumers

        return fuse_consumers(without_copy_aliases(fuse(dsk, keys)), keys)

    fuse_linear_task_spec.keeps_consumer_keys = True  # type: ignore[attr-defined]
    return fuse_linear_task_spec


def optimize_without_consumer_fusion(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """dask.array's ``optimize`` with ``dask_services.fuse-consumers`` off: what an array
    computed where that setting is off optimizes with, wherever it is optimized."""
    import dask.config

    with dask.config.set({"dask_services.fuse-consumers": False}):
        return _optimization.optimize(dsk, keys, **kwargs)


class _CarryingConsumerFusion:
    """``Array.__dask_optimize__``: dask's own (a ``GlobalMethod``), and where
    ``dask_services.fuse-consumers`` is off in the process computing the array,
    :func:`optimize_without_consumer_fusion` in its place.  distributed optimizes an
    array's graph where it builds it, on the scheduler, whose config the setting made
    around ``compute()`` does not reach (with the scheduler in the client's process, the
    block may have ended by then); the optimizer is taken when ``compute()`` is called,
    and carries the choice made there."""

    carries_consumer_fusion = True

    def __init__(self, dasks: Any) -> None:
        self.dasks = dasks

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        from dask_services.config import setting

        chosen = self.dasks.__get__(instance, owner)
        if chosen is _optimization.optimize and not setting("fuse-consumers"):
            return optimize_without_consumer_fusion
        return chosen


def install() -> None:
    """Make dask.array's optimization fuse the rechunk's copies under their consumers'
    keys, and carry ``fuse-consumers`` to where an array is optimized (idempotent)."""
    from dask.array.core import Array

    current = _optimization.fuse_linear_task_spec
    if not getattr(current, "keeps_consumer_keys", False):
        _optimization.fuse_linear_task_spec = _fuse_keeping_consumer_keys(current)
    dasks = Array.__dict__["__dask_optimize__"]
    if not getattr(dasks, "carries_consumer_fusion", False):
        Array.__dask_optimize__ = _CarryingConsumerFusion(dasks)  # type: ignore[assignment]
