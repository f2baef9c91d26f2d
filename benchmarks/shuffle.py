"""DataFrame shuffle: the "service" method against dask.distributed's "p2p" and "tasks".

    dask-services bench shuffle [--sizes 0.5GB,2GB] [--repeat 3] [--workers 2] [--json]
                                [--partitions 100,1000,10000] [--consumer none,len]

Many partitions (``--partitions``): N partitions of 200 rows shuffled into N, on warm
workers, with the scheduler's share (``update-graph`` and ordering seconds), the CPU
seconds of all processes together, and the task seconds per partition of each kind of
task.  ``--consumer`` runs every case with what follows the shuffle: ``none`` (outputs
persisted), ``len`` (``len`` of every partition, summed), ``groupby`` (a groupby-sum per
partition), ``merge`` (instead of one shuffle, the frame joined with itself on ``key``,
both sides shuffled into as many partitions, then ``len`` of every partition).  The
method ``noop`` (many-partition cases only) is no shuffle: one task per
partition that returns its input, distributed's own cost of a task per partition on the
same cluster, the floor of any method that runs a task per partition.

Every method runs on the same LocalCluster, on the same generated frame (int key, float and
string columns, 128 partitions by default), persisted before the timings; each shuffle's
output is persisted and released.  Peak memory is the summed process memory of the workers,
so it includes the persisted input.  Every measured run of a sized case starts on restarted
workers holding only the input (``fresh_input``).  The tiny case (10 partitions of 1,000
rows) shows per-call overhead, on warm workers.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from benchmarks.common import (
    RUN_TIMEOUT,
    Measurement,
    cancelled_if_failed,
    cpu_seconds,
    fresh_input,
    held,
    new_workers,
    parse_size,
    peak_memory,
    persist_input,
    progress,
    raise_first_error,
    rotated,
    settle,
    task_kind,
    timed,
    update_graph_durations,
    worker_troubles,
)

SMALL_ROWS = 200  # rows per partition of the many-partition cases

BYTES_PER_ROW = 29  # int64 key, float64, a short arrow string: measured by memory_usage(deep=True)


def make_partition(i: int, rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    keys = rng.integers(0, 2**40, rows)
    # arrow formats the numbers: through numpy (``astype(str)``, 84-byte '<U21' cells, then
    # Python strings) making a 19 MB partition took 136 MB more, now it takes 47 MB
    text = pc.cast(pa.array(keys % 99991), pa.string())
    return pd.DataFrame({
        "key": keys,
        "value": rng.random(rows),
        "text": pd.array(text, dtype="str"),
    })


def frame(nbytes: int, npartitions: int) -> Any:
    import dask.dataframe as dd

    rows = max(1, nbytes // BYTES_PER_ROW // npartitions)
    return dd.from_map(make_partition, range(npartitions), rows=rows,
                       meta=make_partition(0, 1).iloc[:0], enforce_metadata=False)


def consumed(shuffled: Any, consumer: str) -> Any:
    """``shuffled`` followed by ``consumer`` (see the module docstring), as users run it:
    outputs persisted are optimized as ``df.persist()`` does (blockwise steps fused;
    ``client.persist`` of a list does not fuse), a consumer is left to ``compute()``, which
    does not fuse (dask/distributed#8833) except where dask_services fuses a computation
    containing a service shuffle (``dataframe/_compute_fusion.py``)."""
    if consumer in ("len", "sum"):  # "sum": the rechunk's default consumer names
        return shuffled.map_partitions(len).sum()
    if consumer == "groupby":
        sums = shuffled.map_partitions(lambda df: df.groupby("key")["value"].sum(),
                                       meta=("value", "f8"))
        return sums.map_partitions(len).sum()
    return shuffled.optimize()


def task_seconds(stream: list[dict]) -> dict[str, float]:
    """Summed compute seconds of each kind of task in a task stream."""
    out: dict[str, float] = {}
    for record in stream:
        for part in record.get("startstops", ()):
            if part.get("action") == "compute":
                kind = task_kind(record["key"])
                out[kind] = out.get(kind, 0.0) + part["stop"] - part["start"]
    return out


def operated(frame: Any, method: str, consumer: str) -> Any:
    """What is measured on ``frame`` with ``method``: a shuffle on ``key`` followed by
    ``consumer``, or for ``merge`` a hash join of the frame with itself on ``key`` (both
    sides shuffled into ``frame``'s number of partitions; keys are random over 2**40, so
    nearly every row meets only itself), then ``len`` of every partition."""
    if consumer == "merge":
        other = frame.rename(columns={"value": "value_right", "text": "text_right"})
        joined = frame.merge(other, on="key", npartitions=frame.npartitions,
                             shuffle_method=method)
        return joined.map_partitions(len).sum()
    return consumed(frame.shuffle("key", shuffle_method=method), consumer)


NOOP = "noop"  # not a shuffle: one trivial task per partition (many-partition cases only)


def same(partition: Any) -> Any:
    return partition


def run_many(client: Any, npartitions: int, methods: list[str], repeat: int,
             consumer: str, show_progress: bool) -> list[Measurement]:
    """N partitions of ``SMALL_ROWS`` rows into N, on warm workers: the cost per partition."""
    import time

    from distributed import futures_of, get_task_stream, wait

    label = f"{npartitions:,} x {SMALL_ROWS} rows" + (f" + {consumer}" if consumer != "none"
                                                      else "")
    base = held(client)

    def make() -> Any:
        import dask.dataframe as dd

        return dd.from_map(make_partition, range(npartitions), rows=SMALL_ROWS,
                           meta=make_partition(0, 1).iloc[:0], enforce_metadata=False)

    df, keep = persist_input(client, make)
    results = {m: Measurement(label, m) for m in methods}
    total, done = repeat * len(methods), 0
    for r in range(repeat):
        for method in rotated(methods, r):
            if method == NOOP:  # distributed's own cost of one task per partition
                work = futures_of(df)
            else:
                work = operated(df, method, consumer)
            before = cpu_seconds(client)
            since = time.time()
            with get_task_stream(client) as stream, peak_memory(client) as peak:
                if method == NOOP:
                    seconds = timed(lambda s=work: wait(client.map(same, s, pure=False)))
                elif consumer == "none":
                    seconds = timed(lambda s=work: wait(client.persist(s)))
                else:
                    seconds = timed(lambda s=work: client.compute(s).result())
            after = cpu_seconds(client)
            del work
            settle(client, keep=keep)
            m = results[method]
            m.peak_memory += peak
            m.seconds.append(seconds)
            extra = {
                "cpu_s": sum(after[k] - before.get(k, 0.0) for k in after),
                "scheduler_cpu_s": after["scheduler"] - before["scheduler"],
                **update_graph_durations(client, since),
                "per_part_ms": seconds / npartitions * 1e3,
            }
            for kind, secs in task_seconds(stream.data).items():
                extra[f"task_ms:{kind}"] = secs / npartitions * 1e3
            for name, value in extra.items():
                m.extra.setdefault(name, []).append(value)
            done += 1
            progress(done, total, f"shuffle {label}", show_progress)
    del df
    settle(client, keep=base)
    return list(results.values())


def run_case(client: Any, label: str, nbytes: int, npartitions: int, methods: list[str],
             repeat: int, show_progress: bool, fresh: bool = True, consumer: str = "none",
             made: bool = False) -> list[Measurement]:
    """One sized case.  Its input is persisted first, so that the timings are of the
    shuffles alone (making the frame costs every method the same, and would only dilute
    the ratios); with ``made`` it is made inside every measured graph instead and freed as
    the shuffle consumes it, as in a pipeline over data larger than the workers' memory.
    A run that fails (a worker killed over and over, ``KilledWorker``) counts as failed
    and is not timed."""
    import time

    from distributed import wait

    base = held(client)

    def make() -> Any:
        return frame(nbytes, npartitions)

    if made:
        df, keep = None, base
        true_bytes = nbytes
    else:
        df, keep = persist_input(client, make)
        true_bytes = int(client.compute(df.memory_usage(deep=True).sum()).result())
    results = {m: Measurement(label, m, nbytes=true_bytes) for m in methods}
    total, done = repeat * len(methods), 0
    for r in range(repeat):
        for method in rotated(methods, r):  # interleaved, so drift hits every method alike
            if made:
                if fresh:
                    new_workers(client)
                source = make()
            else:
                if fresh:
                    df, keep = fresh_input(client, make, previous=df)
                source = df
            shuffled = operated(source, method, consumer)

            def once(shuffled: Any = shuffled) -> None:
                with cancelled_if_failed(client) as running:
                    if consumer == "none":
                        persisted = client.persist(shuffled)
                        running += client.futures_of(persisted)
                        wait(persisted, timeout=RUN_TIMEOUT)
                        raise_first_error(running)
                        del persisted
                    else:
                        running.append(client.compute(shuffled))
                        running[0].result(timeout=RUN_TIMEOUT)

            failed = False
            since = time.time()
            with peak_memory(client) as peak:
                try:
                    seconds = timed(once)
                except Exception as exc:  # noqa: BLE001 - reported as a failed run
                    failed = True
                    print(f"shuffle {label} with {method} failed: {exc!r}", file=sys.stderr)
            troubles = worker_troubles(client, since, time.time())
            del shuffled, once, source  # they hold df's futures, which new_workers must not see
            if failed:  # a failed run may leave its tasks behind: start over
                if made:
                    new_workers(client)
                else:
                    df, keep = fresh_input(client, make, previous=df)
            settle(client, keep=keep)
            m = results[method]
            if not failed:
                m.seconds.append(seconds)
                m.peak_memory.extend(peak)
            for name, value in (("failed", float(failed)), *troubles.items()):
                m.extra.setdefault(name, []).append(value)
            done += 1
            progress(done, total, f"shuffle {label}", show_progress)
    del df
    settle(client, keep=base)
    return list(results.values())


def run(client: Any, sizes: list[str], repeat: int, npartitions: int = 128,
        methods: tuple[str, ...] = ("service", "p2p", "tasks"), tiny: bool = True,
        show_progress: bool = True, fresh: bool = True, many: tuple[int, ...] = (),
        consumers: tuple[str, ...] = ("none",), made: bool = False) -> list[Measurement]:
    import dask_services

    dask_services.install(client)
    out: list[Measurement] = []
    shuffles = [m for m in methods if m != NOOP]
    if tiny:
        out += run_case(client, "tiny (10 x 1,000 rows)", 10 * 1000 * BYTES_PER_ROW, 10,
                        shuffles, max(repeat, 5), show_progress, fresh=False)
    for n in many:
        for consumer in consumers:
            out += run_many(client, n, [m for m in methods if m != NOOP or consumer == "none"],
                            repeat, consumer, show_progress)
    for size in sizes:
        for consumer in consumers:
            label = size + (f" + {consumer}" if consumer != "none" else "")
            out += run_case(client, label, parse_size(size), npartitions, shuffles,
                            repeat, show_progress, fresh, consumer, made)
    return out


def columns(results: list[Measurement]) -> tuple[str, ...]:
    """The extra columns any result has: the scheduler's share, then task ms per kind."""
    names = {n for r in results for n in r.extra}
    first = [n for n in ("failed", "restarts", "paused_s", "per_part_ms", "cpu_s",
                         "scheduler_cpu_s", "update_graph_s", "order_s") if n in names]
    return (*first, *sorted(n for n in names if n.startswith("task_ms:")))
