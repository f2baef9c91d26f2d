"""The memory a worker's buffers are sized from when the worker has no memory limit.

The shuffle's and the rechunk's buffer budgets, the bytes in flight and the hand-off
buffer are shares of the worker's memory limit.  A worker started with ``memory_limit=0``
(or ``None``, ``--memory-limit 0``) has none; taking "none" as "unbounded" held every
received byte in memory (a 3 GB shuffle on two such workers peaked at 4.3 GB where p2p's
peaked at 0.9 GB), so a shuffle larger than the host's memory met the kernel's OOM killer
where p2p spills.  Such a worker's budgets are taken from the memory distributed's
``memory_limit="auto"`` would have given it: the host's memory (or its cgroup limit), times
the worker's share of the host's cores.  The worker's own memory manager still does what
its configuration says (nothing, without a limit).
"""

from __future__ import annotations

import dask.system
from distributed import system


def memory_to_plan_on(memory_limit: int | None, nthreads: int) -> int:
    """``memory_limit`` where the worker has one, else the share ``"auto"`` would give."""
    if memory_limit:
        return memory_limit
    return int(system.MEMORY_LIMIT * min(1.0, nthreads / dask.system.CPU_COUNT))
