"""A computation containing a service shuffle is fused the way ``persist()`` fuses it.

dask.dataframe fuses chains of blockwise steps (a read, a conversion, a
``map_partitions``) into one task per partition in ``persist()`` and ``optimize()``, but
``compute()`` (``dask.compute`` and ``Client.compute``) optimizes the expression it wraps
in ``FinalizeCompute`` without that step (dask/distributed#8833): every step is then a
task of its own.  For a service shuffle that costs a task per input partition making it,
one handing it off, and one per step consuming each output: 500 partitions of 200 rows,
shuffled then grouped and counted, took 16.8 s through ``compute()`` against 11.1 s
through ``optimize().compute()`` on the same cluster (medians of three).

``install()`` gives ``FinalizeCompute`` an ``optimize`` that, after dask's own, applies
dask's blockwise fusion (``optimize_blockwise_fusion``, what ``optimize(fuse=True)``
runs) to an expression that contains a service shuffle and was not fused yet.  Other
computations are optimized exactly as dask does; ``dask_services.shuffle.fuse-compute:
false`` turns it off.  ``tests/test_dataframe_hooks.py`` fails loudly if an upgrade moves
what this relies on.
"""

from __future__ import annotations

from typing import Any

from dask._expr import Expr, FinalizeCompute
from dask.dataframe.dask_expr._expr import Fused, optimize_blockwise_fusion

from dask_services.config import setting

_dask_optimize = Expr.optimize


def unfused_service_shuffle(expr: Expr) -> bool:
    """Whether ``expr`` contains a service shuffle and no fused step."""
    from dask_services.dataframe._expr import ServiceShuffle

    found = False
    for node in expr.walk():
        if isinstance(node, Fused):
            return False
        found = found or isinstance(node, ServiceShuffle)
    return found


# dask's fusion walks the expression as a tree, a shared step once per path to it: a chain
# of shuffles each followed by a step reading the shuffled frame twice (``d.shuffle(...)
# .assign(y=d.y + 1)``) doubles the paths with each shuffle (32,762 paths of 62 steps at
# 12 shuffles: 3.8 s before anything runs, about 0.1 ms a path, minutes at 20).  Past this
# many paths the computation runs unfused, as dask's ``compute()`` runs it.
MAX_FUSED_PATHS = 5_000


def paths_beyond(expr: Expr, limit: int) -> bool:
    """Whether ``expr`` has more than ``limit`` paths from its root (its size as a
    tree); counted over its distinct steps, stopping once past ``limit``."""
    paths: dict[str, int] = {}
    stack: list[tuple[Expr, bool]] = [(expr, False)]
    while stack:  # the steps in post-order, each once (no recursion: chains may be long)
        node, children_done = stack.pop()
        if node._name in paths:
            continue
        if children_done:
            count = 1 + sum(paths[d._name] for d in node.dependencies())
            if count > limit:
                return True
            paths[node._name] = count
            continue
        stack.append((node, True))
        stack.extend((d, False) for d in node.dependencies() if d._name not in paths)
    return False


def fused_if_shuffled(expr: Expr) -> Expr:
    """``expr`` with its blockwise steps fused, where it contains an unfused service
    shuffle (and ``dask_services.shuffle.fuse-compute`` is on) and dask's fusion of it
    costs little (:data:`MAX_FUSED_PATHS`)."""
    if not setting("shuffle.fuse-compute"):
        return expr
    if not unfused_service_shuffle(expr) or paths_beyond(expr, MAX_FUSED_PATHS):
        return expr
    return optimize_blockwise_fusion(expr)


def _optimize(self: FinalizeCompute, **kwargs: Any) -> Expr:
    if type(self) is not FinalizeCompute:  # a subclass (FinalizeComputeDF): as dask does
        return super(FinalizeCompute, self).optimize(**kwargs)
    expr = _dask_optimize(self, **kwargs)
    return expr if kwargs.get("fuse") else fused_if_shuffled(expr)


_optimize.__wrapped__ = _dask_optimize  # type: ignore[attr-defined]


def install() -> None:
    """Fuse the computations that contain a service shuffle (idempotent)."""
    if FinalizeCompute.__dict__.get("optimize") is not _optimize:
        FinalizeCompute.optimize = _optimize  # type: ignore[method-assign]
