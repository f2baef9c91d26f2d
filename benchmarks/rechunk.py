"""Array rechunk: the "service" method against dask.distributed's "p2p" and "tasks".

    dask-services bench rechunk [--sizes 0.5GB,2GB] [--local-size 0.5GB] [--chunks 40000]
                                [--pieces 1000] [--time-series 1GB] [--masked]
                                [--consumer none,sum] [--repeat 3] [--reuse-workers]
                                [--memory-limit 0.5GB]

Cases, every method on the same LocalCluster and the same persisted input, methods
alternating:

* all-to-all: a square float64 array, row chunks to column chunks (every output needs a
  piece of every input);
* local: float64 chunks of 100 rows to chunks of 150 rows (each output needs one or two
  inputs; the work falls apart into independent regions, where streaming matters);
* many chunks (``--chunks N``): a square float32 array in N chunks of 100 x 100, to 125 x 80
  chunks (each output needs at most 4 inputs) and to 2,000 x 5 chunks (each output needs 20
  inputs, each input feeds 20 outputs);
* many pieces (``--pieces N``): an all-to-all of a square float32 array from N chunks of 10
  rows to N chunks of 10 columns, N x N pieces of 400 bytes (N = 1,000: a million pieces,
  400 MB), where the cost is per piece, not per byte;
* time series (``--time-series SIZE``): a float32 array of 1,000 time steps on a square
  grid, one chunk per time step, to whole time series in 20 x 20 tiles of the grid (what
  a reduction over time needs; 1 GB: 1,000 chunks of 500 x 500 to 400 chunks of
  1,000 x 25 x 25, 400,000 pieces of 2.5 kB).

With ``--masked`` every case's array is a masked array (``numpy.ma``), a tenth of its
elements masked (a mask of one byte per element besides the values).

Every case runs with each consumer of ``--consumer``: ``none`` persists the rechunked
array, ``sum`` computes ``rechunked.sum()`` (a pipeline: the consumer of each output runs
while the rechunk goes on).  By default every measured run starts on restarted workers
holding only the input (``fresh_input``); ``--reuse-workers`` keeps them, as users run.

Reported: median wall time, ratio to ``p2p``, peak worker memory (summed process memory,
including the persisted input), time until the first output (``none``) is in memory, the
tasks the rechunk adds to the graph, the scheduler's share (``update-graph`` duration,
of which ordering; ``first_task_s``: until the first task of the run starts) and the cost
per input chunk of each kind of task (``per_chunk``: summed task durations by kind over the
number of input chunks, from the task stream).
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from typing import Any

from benchmarks.common import (
    RUN_TIMEOUT,
    Measurement,
    cancelled_if_failed,
    fresh_input,
    held,
    parse_size,
    peak_memory,
    persist_input,
    progress,
    raise_first_error,
    rotated,
    settle,
    task_kind,
    update_graph_durations,
    worker_troubles,
)

CHUNKS_PER_SIDE = 64  # all-to-all: row chunks (and column chunks) per array
LOCAL_COLUMNS = 1000
MANY_CHUNK = 100  # many chunks: input chunks of 100 x 100


def all_to_all(nbytes: int) -> tuple[tuple[int, int], tuple, tuple]:
    n = int(math.sqrt(nbytes / 8))
    side = max(1, n // CHUNKS_PER_SIDE)
    return (n, n), (side, n), (n, side)


def local(nbytes: int) -> tuple[tuple[int, int], tuple, tuple]:
    rows = max(150, nbytes // 8 // LOCAL_COLUMNS)
    return (rows, LOCAL_COLUMNS), (100, LOCAL_COLUMNS), (150, LOCAL_COLUMNS)


def many(chunks: int) -> list[tuple[str, tuple[int, int], tuple, tuple]]:
    """The two many-chunk cases: ``(label, shape, old chunks, new chunks)``."""
    per_side = max(20, round(math.sqrt(chunks)))
    n = per_side * MANY_CHUNK
    old = (MANY_CHUNK, MANY_CHUNK)
    return [
        (f"{per_side ** 2} chunks 100x100->125x80", (n, n), old, (125, 80)),
        (f"{per_side ** 2} chunks 100x100->2000x5", (n, n), old, (20 * MANY_CHUNK, 5)),
    ]


PIECE_SIDE = 10  # many pieces: chunks of 10 rows to chunks of 10 columns


def many_pieces(per_side: int) -> tuple[str, tuple[int, int], tuple, tuple]:
    """The many-pieces case: ``(label, shape, old chunks, new chunks)``."""
    n = per_side * PIECE_SIDE
    return (f"{per_side ** 2:,} pieces of 400 B", (n, n), (PIECE_SIDE, n), (n, PIECE_SIDE))


TIME_STEPS = 1000  # time series: steps, one chunk each
TILES_PER_SIDE = 20  # time series: the grid cut into 20 x 20 tiles


def time_series(nbytes: int) -> tuple[tuple[int, int, int], tuple, tuple]:
    """The time-series case: ``(shape, old chunks, new chunks)`` of a float32 array of
    about ``nbytes``."""
    tile = max(1, round(math.sqrt(nbytes / 4 / TIME_STEPS) / TILES_PER_SIDE))
    side = tile * TILES_PER_SIDE
    return (TIME_STEPS, side, side), (1, side, side), (TIME_STEPS, tile, tile)


def graph_size(array: Any) -> int:
    """Tasks in the materialized graph."""
    return len(dict(array.__dask_graph__()))


def _task_costs(stream: list[dict], start: float, chunks: int) -> dict[str, float]:
    """First task start after ``start``, and summed compute seconds per input chunk of
    each kind of task; nothing where the scheduler's task stream, which keeps only its
    latest records, dropped some of the run's (a graph of more tasks than it holds)."""
    import dask

    kept = dask.config.get("distributed.scheduler.dashboard.tasks.task-stream-length")
    if len(stream) >= kept:
        return {"first_task_s": math.nan}
    per_kind: dict[str, float] = defaultdict(float)
    first = math.inf
    for record in stream:
        for part in record.get("startstops", ()):
            if part.get("action") == "compute":
                per_kind[task_kind(record["key"])] += part["stop"] - part["start"]
                first = min(first, part["start"])
    out = {"first_task_s": first - start if first < math.inf else math.nan}
    for kind, seconds in per_kind.items():
        out[f"per_chunk_ms:{kind}"] = 1e3 * seconds / chunks
    return out


def run_case(client: Any, label: str, shape: tuple, old: tuple, new: tuple,
             methods: list[str], repeat: int, show_progress: bool, fresh: bool = True,
             consumers: tuple[str, ...] = ("none",), dtype: str = "float64",
             masked: bool = False) -> list[Measurement]:
    import dask.array as da
    from distributed import get_task_stream, wait

    base = held(client)
    label = f"{label} masked" if masked else label

    def make() -> Any:
        values = da.random.default_rng(0).random(shape, chunks=old, dtype=dtype)
        return da.ma.masked_less(values, 0.1) if masked else values

    x, keep = persist_input(client, make)
    chunks = math.prod(x.numblocks)
    results = {(c, m): Measurement(label if c == "none" else f"{label} +{c}", m,
                                   nbytes=x.nbytes)
               for c in consumers for m in methods}
    total, done = repeat * len(methods) * len(consumers), 0
    for r in range(repeat):
        for consumer in consumers:
            for method in rotated(methods, r):  # interleaved: drift hits every method alike
                if fresh:
                    x, keep = fresh_input(client, make, previous=x)
                y = x.rechunk(new, method=method)
                tasks = graph_size(y) - graph_size(x)
                z = y.sum() if consumer == "sum" else y
                first: list[float] = []
                failed = False
                with peak_memory(client, interval=0.05) as peak, \
                        get_task_stream(client) as stream:
                    wall = time.time()
                    start = time.perf_counter()
                    try:
                        with cancelled_if_failed(client) as running:
                            if consumer == "none":
                                persisted = client.persist(z)
                                running += client.futures_of(persisted)
                                wait(running, timeout=RUN_TIMEOUT,
                                     return_when="FIRST_COMPLETED")
                                first.append(time.perf_counter() - start)
                                wait(running, timeout=RUN_TIMEOUT)
                                raise_first_error(running)
                                del persisted
                            else:
                                running.append(client.compute(z))
                                running[0].result(timeout=RUN_TIMEOUT)
                    except Exception as exc:  # noqa: BLE001 - reported as a failed run
                        failed = True
                        print(f"rechunk {label} with {method} failed: {exc!r}",
                              file=sys.stderr)
                    seconds = time.perf_counter() - start
                troubles = worker_troubles(client, wall, time.time())
                del y, z  # its graph holds x's futures, which new_workers must not see
                if failed:  # a failed run may leave its tasks behind: start over
                    x, keep = fresh_input(client, make, previous=x)
                settle(client, keep=keep)
                m = results[consumer, method]
                m.extra.setdefault("tasks", []).append(tasks)
                for name, value in (("failed", float(failed)), *troubles.items()):
                    m.extra.setdefault(name, []).append(value)
                if not failed:  # what a failed run took is no figure of the method's
                    m.seconds.append(seconds)
                    m.peak_memory.extend(peak)
                    m.extra.setdefault("first_output_s", []).extend(first)
                    sched = update_graph_durations(client, wall)
                    costs = _task_costs(stream.data, wall, chunks)
                    for name, value in (*sched.items(), *costs.items()):
                        m.extra.setdefault(name, []).append(value)
                done += 1
                progress(done, total, f"rechunk {label}", show_progress)
    del x
    settle(client, keep=base)
    return list(results.values())


def run(client: Any, sizes: list[str], local_size: str | None, repeat: int,
        methods: tuple[str, ...] = ("service", "p2p", "tasks"),
        show_progress: bool = True, fresh: bool = True, chunks: int = 0,
        consumers: tuple[str, ...] = ("none", "sum"), pieces: int = 0,
        masked: bool = False, series_size: str | None = None) -> list[Measurement]:
    import dask_services

    dask_services.install(client)
    out: list[Measurement] = []
    common = {"show_progress": show_progress, "fresh": fresh, "consumers": consumers,
              "masked": masked}
    for size in sizes:
        shape, old, new = all_to_all(parse_size(size))
        out += run_case(client, f"all-to-all {size}", shape, old, new, list(methods), repeat,
                        **common)
    if local_size:
        shape, old, new = local(parse_size(local_size))
        out += run_case(client, f"local 100->150 rows {local_size}", shape, old, new,
                        list(methods), repeat, **common)
    if chunks:
        for label, shape, old, new in many(chunks):
            out += run_case(client, label, shape, old, new, list(methods), repeat,
                            dtype="float32", **common)
    if pieces:
        label, shape, old, new = many_pieces(pieces)
        out += run_case(client, label, shape, old, new, list(methods), repeat,
                        dtype="float32", **common)
    if series_size:
        shape, old, new = time_series(parse_size(series_size))
        out += run_case(client, f"time series {series_size}", shape, old, new,
                        list(methods), repeat, dtype="float32", **common)
    return out


def per_chunk_columns(results: list[Measurement]) -> tuple[str, ...]:
    """The ``per_chunk_ms:<kind>`` columns that any result has, in a stable order."""
    names = {n for r in results for n in r.extra if n.startswith("per_chunk_ms:")}
    return tuple(sorted(names))
