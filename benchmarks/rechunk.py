"""Array rechunk: the "service" method against dask.distributed's "p2p" and "tasks".

    dask-services bench rechunk [--sizes 0.5GB,2GB] [--local-size 0.5GB] [--repeat 3]

Cases, float64, every method on the same LocalCluster and the same persisted input:

* all-to-all: a square array, row chunks to column chunks (every output needs a piece of
  every input);
* local: chunks of 100 rows to chunks of 150 rows (each output needs one or two inputs; the
  work falls apart into independent regions, where streaming matters).

Every measured run starts on restarted workers holding only the input (``fresh_input``).
Reported: median wall time, ratio to ``p2p``, peak worker memory (summed process memory,
including the persisted input), time until the first output chunk is in memory, and the
number of tasks the rechunk adds to the graph.
"""

from __future__ import annotations

import math
import time
from typing import Any

from benchmarks.common import (
    Measurement,
    fresh_input,
    held,
    parse_size,
    peak_memory,
    persist_input,
    progress,
    rotated,
    settle,
)

CHUNKS_PER_SIDE = 64  # all-to-all: row chunks (and column chunks) per array
LOCAL_COLUMNS = 1000


def all_to_all(nbytes: int) -> tuple[tuple[int, int], tuple, tuple]:
    n = int(math.sqrt(nbytes / 8))
    side = max(1, n // CHUNKS_PER_SIDE)
    return (n, n), (side, n), (n, side)


def local(nbytes: int) -> tuple[tuple[int, int], tuple, tuple]:
    rows = max(150, nbytes // 8 // LOCAL_COLUMNS)
    return (rows, LOCAL_COLUMNS), (100, LOCAL_COLUMNS), (150, LOCAL_COLUMNS)


def graph_size(array: Any) -> int:
    """Tasks in the materialized graph."""
    return len(dict(array.__dask_graph__()))


def run_case(client: Any, label: str, shape: tuple, old: tuple, new: tuple,
             methods: list[str], repeat: int, show_progress: bool, fresh: bool = True
             ) -> list[Measurement]:
    import dask.array as da
    from distributed import as_completed, wait

    base = held(client)

    def make() -> Any:
        return da.random.random(shape, chunks=old)

    x, keep = persist_input(client, make)
    results = {m: Measurement(label, m, nbytes=x.nbytes) for m in methods}
    total, done = repeat * len(methods), 0
    for r in range(repeat):
        for method in rotated(methods, r):  # interleaved, so drift hits every method alike
            if fresh:
                x, keep = fresh_input(client, make, previous=x)
            y = x.rechunk(new, method=method)
            first: list[float] = []

            with peak_memory(client) as peak:
                start = time.perf_counter()
                persisted = client.persist(y)
                futures = client.futures_of(persisted)
                completed = as_completed(futures)
                next(completed)
                first.append(time.perf_counter() - start)
                wait(futures)
                seconds = time.perf_counter() - start
                completed.clear()  # it holds the futures, and so their results, otherwise
                del persisted, futures, completed
            settle(client, keep=keep)
            m = results[method]
            m.seconds.append(seconds)
            m.peak_memory.extend(peak)
            m.extra.setdefault("first_output_s", []).extend(first)
            m.extra.setdefault("tasks", []).append(graph_size(y) - graph_size(x))
            del y  # its graph holds x's futures, which new_workers must not see
            done += 1
            progress(done, total, f"rechunk {label}", show_progress)
    del x
    settle(client, keep=base)
    return list(results.values())


def run(client: Any, sizes: list[str], local_size: str | None, repeat: int,
        methods: tuple[str, ...] = ("service", "p2p", "tasks"),
        show_progress: bool = True, fresh: bool = True) -> list[Measurement]:
    import dask_services

    dask_services.install(client)
    out: list[Measurement] = []
    for size in sizes:
        shape, old, new = all_to_all(parse_size(size))
        out += run_case(client, f"all-to-all {size}", shape, old, new, list(methods), repeat,
                        show_progress, fresh)
    if local_size:
        shape, old, new = local(parse_size(local_size))
        out += run_case(client, f"local 100->150 rows {local_size}", shape, old, new,
                        list(methods), repeat, show_progress, fresh)
    return out
