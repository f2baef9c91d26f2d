"""Timing, peak memory and reporting shared by the benchmarks."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measurement:
    case: str
    method: str
    seconds: list[float] = field(default_factory=list)
    peak_memory: list[float] = field(default_factory=list)  # bytes, all workers together
    extra: dict[str, list[float]] = field(default_factory=dict)
    nbytes: int = 0

    @property
    def median(self) -> float:
        """Median over the runs that finished (``nan`` when none did)."""
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def peak(self) -> float:
        """Median over runs of each run's peak (like the time: robust to one odd run)."""
        return statistics.median(self.peak_memory) if self.peak_memory else float("nan")


def parse_size(text: str) -> int:
    text = text.strip().upper().replace(" ", "")
    for suffix, factor in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


@contextlib.contextmanager
def peak_memory(client: Any, interval: float = 0.1) -> Iterator[list[float]]:
    """Samples the summed process memory of all workers; yields a list filled on exit."""
    from distributed.diagnostics import MemorySampler

    sampler = MemorySampler()
    out: list[float] = []
    with sampler.sample("run", client=client, measure="process", interval=interval):
        yield out
    series = sampler.to_pandas()
    out.append(float(series["run"].max()) if len(series) else float("nan"))


def _release_memory() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _keys_held(dask_worker: Any) -> int:
    return len(dask_worker.state.tasks)


def held(client: Any) -> int:
    """Tasks the scheduler and the workers know of, together."""
    on_scheduler = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
    return on_scheduler + sum(client.run(_keys_held).values())


def settle(client: Any, keep: int = 0, timeout: float = 30) -> None:
    """Wait until the cluster holds no more than ``keep`` tasks (see :func:`held`: released
    results are really gone from the workers), then collect garbage and give freed heap
    back to the OS on every worker.

    Between runs, so that one method's peak memory is not inflated by what the run before
    it left behind or freed but the allocator kept (peaks are process memory).
    """
    deadline = time.monotonic() + timeout
    while held(client) > keep and time.monotonic() < deadline:
        time.sleep(0.05)
    client.run(_release_memory)


def _worker_count(dask_scheduler: Any) -> int:
    return len(dask_scheduler.workers)


def new_workers(client: Any, timeout: float = 120) -> None:
    """Replace every worker process of the client's cluster by a new one.

    On a ``LocalCluster`` (or any cluster object with ``scale``) the workers are scaled
    down to none and back up, which starts new nannies; ``Client.restart`` is the fallback
    (on distributed 2026.8.0 it now and then waits forever for workers whose nanny lost a
    race between its own restart and the exit of the old process).
    """
    cluster = getattr(client, "cluster", None)
    if cluster is None or not hasattr(cluster, "scale"):
        client.restart()
        return
    # the cluster's own count of the workers it runs (after a method that killed workers,
    # the scheduler may count none while their nannies restart them); else asked of the
    # scheduler each time: the client's scheduler_info() may be a cached copy from before
    # the last scaling
    n = len(getattr(cluster, "worker_spec", ())) or client.run_on_scheduler(_worker_count)
    cluster.scale(0)
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(_worker_count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers still running {timeout}s after scaling to 0")
        time.sleep(0.05)
    cluster.scale(n)
    client.wait_for_workers(n, timeout=timeout)


def fresh_input(client: Any, make: Callable[[], Any], previous: Any = None
                ) -> tuple[Any, int]:
    """Cancel ``previous`` (the input of the run before), replace every worker process,
    then persist ``make()``; returns the persisted collection and the number of tasks held
    with it (for :func:`settle`).

    Before each measured run, so that every method starts from the same state: worker
    processes holding only the input.  A run's peak is process memory, and a process keeps
    heap it has once grown to (fragmented, or held by the allocator); without fresh
    processes a method's peak depends on which method ran before it.
    """

    if previous is not None:
        # Cancelled, not just dropped: graphs built from it (and caches of dask's
        # expressions) may still hold its futures, and the workers' removal would then
        # recompute it.
        client.cancel(client.futures_of(previous))
    new_workers(client)
    return persist_input(client, make)


def persist_input(client: Any, make: Callable[[], Any]) -> tuple[Any, int]:
    """Persist ``make()`` and wait for it; returns it and the number of tasks held with it
    (for :func:`settle`)."""
    from distributed import wait

    data = client.persist(make())
    wait(data)
    keep = held(client)
    settle(client, keep=keep)
    return data, keep


def rotated(methods: list[str], repeat: int) -> list[str]:
    """The methods in a different order every repeat, so that no method always runs after
    the same one (a run can leave memory behind that the next one's peak would count)."""
    shift = repeat % len(methods)
    return methods[shift:] + methods[:shift]


def progress(i: int, total: int, label: str, enabled: bool = True) -> None:
    if not enabled:
        return
    filled = int(30 * i / total)
    end = "\n" if i == total else ""
    print(f"\r{label:<40} [{'#' * filled}{'.' * (30 - filled)}] {i}/{total}", end=end,
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def cancelled_if_failed(client: Any) -> Iterator[list]:
    """A list for the futures of a measured run; if the run raises, they are cancelled
    before the error goes on.  Without it the client's erred future still wants its key,
    and the cluster keeps the failed graph (``settle`` then waited out its timeout, 30 s
    a failed run)."""
    futures: list = []
    try:
        yield futures
    except BaseException:
        client.cancel(futures)
        raise
    finally:
        futures.clear()


# a measured run not done after this many seconds counts as failed (a method whose workers
# died, and whose nannies lost distributed 2026.8.0's restart race, waited for ever)
RUN_TIMEOUT = 600.0


def raise_first_error(futures: list) -> None:
    """``wait(futures)`` returns whatever state they end in: raise the first one's error."""
    for future in futures:
        if future.status == "error":
            future.result()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


COUNTED_OVER_RUNS = ("failed", "restarts")  # report: summed over the runs, not a median


def report(results: list[Measurement], baseline: str, as_json: bool,
           extra_columns: tuple[str, ...] = ()) -> str:
    rows = []
    for r in results:
        base = next((b for b in results if b.case == r.case and b.method == baseline), None)
        row = {
            "case": r.case, "method": r.method, "median_s": r.median,
            "ratio_to_" + baseline: r.median / base.median if base else None,
            "peak_worker_memory_MB": r.peak / 1e6,
            "MB_per_s": r.nbytes / 1e6 / r.median if r.nbytes else None,
            "runs": r.seconds,
        }
        for name in extra_columns:
            vals = r.extra.get(name)
            # counts over all runs; every other figure is a median like the time
            summed = name in COUNTED_OVER_RUNS
            row[name] = (sum(vals) if summed else statistics.median(vals)) if vals else None
        rows.append(row)
    if as_json:
        return json.dumps(rows, indent=2)
    header = ["case", "method", "median s", f"x {baseline}", "peak MB", "MB/s",
              *extra_columns]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for row in rows:
        ratio = row["ratio_to_" + baseline]
        cells = [row["case"], row["method"], f"{row['median_s']:.3f}",
                 f"{ratio:.2f}" if ratio is not None else "-",
                 f"{row['peak_worker_memory_MB']:.0f}",
                 f"{row['MB_per_s']:.0f}" if row["MB_per_s"] else "-"]
        cells += [_cell(row[n]) for n in extra_columns]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{int(value)}" if float(value).is_integer() else f"{value:.3f}"



def _cpu_seconds() -> float:
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def cpu_seconds(client: Any) -> dict[str, float]:
    """CPU seconds used so far by the scheduler's process and by every worker process.

    On a loaded machine wall time says little; the CPU a run takes, summed over the
    processes, is what it costs whatever else runs."""
    out = {"scheduler": client.run_on_scheduler(_cpu_seconds)}
    out.update(client.run(_cpu_seconds))
    return out


def task_kind(key: Any) -> str:
    """The kind of a task, as the dashboard groups them (``key_split``)."""
    from dask.utils import key_split

    return key_split(key)


def _graph_durations(dask_scheduler: Any, since: float) -> dict[str, float]:
    found: dict[str, float] = {}
    for stamp, msg in dask_scheduler.get_events("scheduler"):
        if (stamp >= since and isinstance(msg, dict)
                and msg.get("action") == "update-graph" and "metrics" in msg):
            m = msg["metrics"]
            found["update_graph_s"] = found.get("update_graph_s", 0.0) + float(
                m.get("duration_seconds", 0.0))
            # distributed 2026.8.0 logs it with the sign reversed
            found["order_s"] = found.get("order_s", 0.0) + abs(float(
                m.get("ordering_duration_seconds", 0.0)))
    return found


def update_graph_durations(client: Any, since: float) -> dict[str, float]:
    """Summed ``update-graph`` and ordering seconds of the graphs the scheduler received
    since ``since`` (its clock: ``time.time()``)."""
    return client.run_on_scheduler(_graph_durations, since=since)


def _worker_troubles(dask_scheduler: Any, since: float, until: float) -> dict[str, float]:
    restarts = sum(
        1 for stamp, msg in dask_scheduler.get_events("all")
        if since <= stamp <= until and isinstance(msg, dict)
        and msg.get("action") == "remove-worker"
    )
    paused = 0.0
    # a worker's own topic is its address; the scheduler drops it when the worker leaves, so
    # the pauses of a worker that was then restarted are not counted (its restart is)
    for topic, events in dask_scheduler.get_events().items():
        if "://" not in str(topic):
            continue
        paused_at: float | None = None
        for stamp, msg in events:
            if not isinstance(msg, dict) or stamp > until:
                continue
            action = msg.get("action")
            if action == "worker-status-change" and msg.get("status") == "paused":
                paused_at = stamp
            elif paused_at is not None and (
                    action == "remove-worker" or (action == "worker-status-change"
                                                  and msg.get("prev-status") == "paused")):
                paused += max(0.0, stamp - max(paused_at, since))
                paused_at = None
        if paused_at is not None:
            paused += max(0.0, until - max(paused_at, since))
    return {"restarts": float(restarts), "paused_s": paused}


def worker_troubles(client: Any, since: float, until: float) -> dict[str, float]:
    """Between ``since`` and ``until`` (the scheduler's clock, ``time.time()``): how many
    workers left the cluster (``restarts``: killed by their nanny for memory, or lost) and
    the seconds workers spent paused (``paused_s``, summed over workers: a worker pauses
    when its process memory passes the pause threshold), from the scheduler's events."""
    return client.run_on_scheduler(_worker_troubles, since=since, until=until)
