"""DataFrame shuffle: the "service" method against dask.distributed's "p2p" and "tasks".

    dask-services bench shuffle [--sizes 0.5GB,2GB] [--repeat 3] [--workers 2] [--json]

Every method runs on the same LocalCluster, on the same generated frame (int key, float and
string columns, 128 partitions by default), persisted before the timings; each shuffle's
output is persisted and released.  Peak memory is the summed process memory of the workers,
so it includes the persisted input.  Every measured run of a sized case starts on restarted
workers holding only the input (``fresh_input``).  The tiny case (10 partitions of 1,000
rows) shows per-call overhead, on warm workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

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
    timed,
)

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


def run_case(client: Any, label: str, nbytes: int, npartitions: int, methods: list[str],
             repeat: int, show_progress: bool, fresh: bool = True) -> list[Measurement]:
    from distributed import wait

    # The input is persisted first, so that the timings are of the shuffles alone (making
    # the frame costs every method the same, and would only dilute the ratios).
    base = held(client)

    def make() -> Any:
        return frame(nbytes, npartitions)

    df, keep = persist_input(client, make)
    true_bytes = int(client.compute(df.memory_usage(deep=True).sum()).result())
    results = {m: Measurement(label, m, nbytes=true_bytes) for m in methods}
    total, done = repeat * len(methods), 0
    for r in range(repeat):
        for method in rotated(methods, r):  # interleaved, so drift hits every method alike
            if fresh:
                df, keep = fresh_input(client, make, previous=df)
            # optimized as df.persist() and df.compute() do (client.persist does not fuse)
            shuffled = df.shuffle("key", shuffle_method=method).optimize()

            def once(shuffled: Any = shuffled) -> None:
                persisted = client.persist(shuffled)
                wait(persisted)
                del persisted

            with peak_memory(client) as peak:
                seconds = timed(once)
            del shuffled, once  # they hold df's futures, which new_workers must not see
            settle(client, keep=keep)
            results[method].seconds.append(seconds)
            results[method].peak_memory.extend(peak)
            done += 1
            progress(done, total, f"shuffle {label}", show_progress)
    del df
    settle(client, keep=base)
    return list(results.values())


def run(client: Any, sizes: list[str], repeat: int, npartitions: int = 128,
        methods: tuple[str, ...] = ("service", "p2p", "tasks"), tiny: bool = True,
        show_progress: bool = True, fresh: bool = True) -> list[Measurement]:
    import dask_services

    dask_services.install(client)
    out: list[Measurement] = []
    if tiny:
        out += run_case(client, "tiny (10 x 1,000 rows)", 10 * 1000 * BYTES_PER_ROW, 10,
                        list(methods), max(repeat, 5), show_progress, fresh=False)
    for size in sizes:
        out += run_case(client, size, parse_size(size), npartitions, list(methods), repeat,
                        show_progress, fresh)
    return out
