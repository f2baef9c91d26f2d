"""Workers with nothing to do in a run: a small service task on a cluster whose inputs
sit on two workers, with an instance on every worker (``participants="all"``) against
only the workers involved (``"involved"``), and a small ``"service"`` shuffle of a frame
held by two workers, with every worker taking part (the scheduler plugin told that no
input is located, as before ``"involved"``) against the workers involved.

Runs alternate between the two variants on one cluster (warm workers): medians of
``repeat`` runs each.  Meaningful with more than two workers (``--workers 8``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from dask_services import Service


class LocalTotal(Service):
    """Sums the inputs each instance takes, and produces that sum for the outputs it
    owns: no peer calls, so what a participant costs is the framework's alone."""

    async def add_key(self, key: Any, data: Any) -> None:
        self.total = getattr(self, "total", 0.0) + float(np.sum(data))

    async def all_inputs_done(self) -> None:
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, getattr(self, "total", 0.0))


@contextlib.contextmanager
def every_worker_taking_part(client: Any, on: bool) -> Iterator[None]:
    """The scheduler plugin believes no input located while ``on``: every worker takes
    part in a ``participants="involved"`` run (the behaviour of ``"all"``)."""

    def set_everyone(dask_scheduler: Any, on: bool) -> None:
        plugin = dask_scheduler.plugins["dask_services"]
        if on:
            def everyone(service_key: Any) -> tuple[list[str], None]:
                participants, _ = type(plugin)._participants(plugin, service_key)
                return sorted(participants), None

            plugin._participants = everyone
        else:
            plugin.__dict__.pop("_participants", None)

    client.run_on_scheduler(set_everyone, on=on)
    try:
        yield
    finally:
        client.run_on_scheduler(set_everyone, on=False)


def run(client: Any, repeat: int) -> dict[str, float]:
    """Median seconds of each case and variant, over ``repeat`` alternating runs."""
    import dask
    import dask.dataframe as dd
    import pandas as pd
    from distributed import wait

    import dask_services

    holders = sorted(client.scheduler_info()["workers"])[:2]
    arrays = [client.submit(np.full, 1000, i, workers=[holders[i % 2]], pure=False)
              for i in range(8)]
    frame = pd.DataFrame({"k": np.arange(2000) % 13, "v": np.arange(2000.0)})
    df = client.persist(dd.from_pandas(frame, npartitions=4), workers=holders)
    wait([*arrays, df])
    inputs = [dask.delayed(a) for a in arrays]
    times: dict[str, list[float]] = {}

    def service_task(mode: str, r: int) -> float:
        outs = dask_services.service_task(LocalTotal, inputs, outputs=2, participants=mode,
                                          name=f"participants-{mode}-{r}")
        start = time.perf_counter()
        dask.compute(*outs)
        return time.perf_counter() - start

    def shuffle(everyone: bool, r: int) -> float:
        lengths = df.shuffle("k", npartitions=2, shuffle_method="service").map_partitions(len)
        with every_worker_taking_part(client, everyone):
            start = time.perf_counter()
            total = int(lengths.compute().sum())
            seconds = time.perf_counter() - start
        assert total == len(frame), total
        return seconds

    variants = {
        "service task, every worker": lambda r: service_task("all", r),
        "service task, workers involved": lambda r: service_task("involved", r),
        "shuffle, every worker": lambda r: shuffle(True, r),
        "shuffle, workers involved": lambda r: shuffle(False, r),
    }
    for r in range(repeat + 1):  # the first round warms up
        names = list(variants) if r % 2 else list(reversed(variants))
        for name in names:
            seconds = variants[name](r)
            if r:
                times.setdefault(name, []).append(seconds)
    return {name: statistics.median(ts) for name, ts in times.items()}
