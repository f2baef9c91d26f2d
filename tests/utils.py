"""Helpers for cluster tests."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import os
import re
import signal
import threading
import time

import dask
from distributed import Event
from distributed.utils_test import async_poll_for, gen_cluster

import dask_services

TWO_WORKERS = [("127.0.0.1", 1), ("127.0.0.1", 1)]


def service_cluster(**kwargs):
    """``gen_cluster`` (validation on) with dask_services installed, then leak checks."""
    kwargs.setdefault("client", True)
    kwargs.setdefault("nthreads", TWO_WORKERS)
    kwargs.setdefault("timeout", 60)

    def decorator(fn):
        @functools.wraps(fn)  # keeps the signature, so pytest parametrization works
        async def body(c, s, *workers, **params):
            await dask_services.install_async(c)
            await fn(c, s, *workers, **params)
            s.validate_state()
            for w in workers:
                w.validate_state()

        return gen_cluster(**kwargs)(body)

    return decorator


async def assert_nothing_left(s, workers, timeout: float = 10) -> None:
    """No instance, produced value, waiting outcome, directory or scheduler state remains."""
    gc.collect()  # futures kept alive by tracebacks of caught errors (reference cycles)

    def leftovers() -> list[str]:
        left = []
        for w in workers:
            ext = w.extensions["dask_services"]
            for name in ("instances", "current"):
                if getattr(ext.host, name):
                    left.append(f"{w.address} host.{name}: {getattr(ext.host, name)}")
            if ext.produced:
                left.append(f"{w.address} produced: {list(ext.produced)}")
            if ext.outcomes:
                left.append(f"{w.address} outcomes: {list(ext.outcomes)}")
            if ext.lane is not None and ext.lane.connections:
                left.append(f"{w.address} bulk lane connections: {ext.lane.connections}")
            if ext.pending_inputs.bytes or ext.pending_inputs.count:
                left.append(f"{w.address} pending inputs: {ext.pending_inputs.count}")
            base = ext.host.env.local_directory
            if os.path.isdir(base):  # made with the first thing in it, gone with the last
                left.append(f"{w.address} directory {base}: {os.listdir(base)}")
        plugin = s.extensions["dask_services"]
        for name in ("machines", "definitions", "cut", "unplaced", "produced_at",
                     "restrictions", "handoff_of", "input_of_handoff", "pinned", "output_of",
                     "placements", "maybe_unneeded", "timers"):
            if getattr(plugin, name):
                left.append(f"scheduler {name}: {list(getattr(plugin, name))[:3]}")
        return left

    try:
        await async_poll_for(lambda: not leftovers(), timeout=timeout)
    except BaseException:
        print("LEFT BEHIND:", leftovers())
        print({k: (ts.state, ts.who_wants) for k, ts in s.tasks.items()})
        raise


async def until(condition, timeout: float = 5) -> None:
    """Let the event loop run until ``condition()`` holds; fail after ``timeout`` seconds."""
    await async_poll_for(condition, timeout=timeout, period=0.001)


def suspended_in(task: asyncio.Task, qualname: str, owner: object) -> bool:
    """Whether ``task`` is parked inside the coroutine method ``qualname`` (e.g.
    ``"Event.wait"``) called on ``owner``, anywhere down the chain of coroutines it awaits.

    A task found parked on the event, lock or queue it should block on cannot make progress
    until that is released: asserting that it is not done proves it waits, where a check
    after a few turns of the loop would pass too for a task that is merely slow."""
    if task.done():
        return False
    coro = task.get_coro()
    while inspect.iscoroutine(coro):
        if coro.cr_code.co_qualname == qualname and coro.cr_frame.f_locals.get("self") is owner:
            return coro.cr_suspended
        coro = coro.cr_await
    return False


def any_task_suspended_in(qualname: str, owner: object) -> bool:
    """Whether some task of the running loop is parked in ``qualname`` of ``owner``."""
    return any(suspended_in(t, qualname, owner) for t in asyncio.all_tasks())


def events_of(kind: str) -> list[tuple]:
    from services import Recorder

    return [e for e in Recorder.events if e[0] == kind]


async def assert_errs(future, exc_type: type, match: str) -> BaseException:
    """The future erred with ``exc_type`` whose message contains ``match``.

    Uses ``Future.exception()`` rather than ``await future``: a raised exception's
    traceback holds the future itself, which would keep its key alive on the cluster.
    """
    exc = await future.exception()
    assert isinstance(exc, exc_type), repr(exc)
    assert match in str(exc), (match, str(exc))
    return exc


def spill_files(root) -> list[str]:
    """Files under ``root`` in dask-services directories (spill files, instance dirs)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
            if "dask-services" in d]


@contextlib.contextmanager
def held_up_spill_writes():
    """``SpillBuffer`` writes wait for the event yielded to be set (set on the way out,
    so that a failing test leaves no I/O thread waiting)."""
    from unittest import mock

    from dask_services._spill import SpillBuffer

    release = threading.Event()
    write = SpillBuffer._write

    def held_up_write(memory, paths):
        assert release.wait(10)
        return write(memory, paths)

    with mock.patch.object(SpillBuffer, "_write", staticmethod(held_up_write)):
        try:
            yield release
        finally:
            release.set()


def pid_of(client, address: str) -> int:
    """Process id of the worker at ``address`` (a LocalCluster worker process)."""
    return client.run(os.getpid, workers=[address])[address]


def kill(client, address: str) -> None:
    """SIGKILL the worker process at ``address``."""
    os.kill(pid_of(client, address), signal.SIGKILL)


def live_run(client, condition=lambda run: True):
    """A copy of the first live run (of any service task) that satisfies ``condition``, or
    None.  Taken on the scheduler's event loop: the scheduler runs in another thread."""

    def live_runs(dask_scheduler) -> list:
        plugin = dask_scheduler.extensions["dask_services"]
        return [m.live_run for m in plugin.machines.values() if m.live_run is not None]

    return next((run for run in client.run_on_scheduler(live_runs) if condition(run)), None)


def lost_worker(reason: str, worker: str | None = None) -> bool:
    """Whether ``reason`` (of a restart) says that a worker was lost, ``worker`` where the
    reason names one.  Which of two reasons comes first depends on what the scheduler
    handles first: the worker leaving, or the service task losing an input it was waiting
    on (that reason names no worker)."""
    if "lost with its worker" in reason:
        return True
    return "left the cluster" in reason and (worker is None or worker in reason)


def removed_workers(client, since: float = 0.0) -> list[str]:
    """The workers the scheduler removed since ``since`` (its ``remove-worker`` events)."""
    return [e["worker"] for t, e in client.get_events("all")
            if t >= since and e.get("action") == "remove-worker"]


def validate_scheduler(client) -> None:
    """``Scheduler.validate_state()`` on the scheduler's event loop, not from this thread."""
    client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.validate_state())


def service_events(client, action: str | None = None) -> list[dict]:
    """Events of the scheduler's ``dask_services`` topic (those with ``action`` if given)."""
    return [e for _, e in client.get_events("dask_services")
            if action is None or e["action"] == action]


class WorkerWatch:
    """Every worker process of a LocalCluster, watched from this process while the block runs.

    A background thread reads each worker process's own resident memory every ``interval``
    seconds (the nanny, which kills a worker over its terminate threshold, looks every
    100 ms) and keeps each worker's peak.  ``deaths()`` lists every worker that died or left
    the cluster since the block began: processes that ended, workers whose process id
    changed (a nanny restarts a killed worker under a new pid and address), the scheduler's
    ``remove-worker`` events and the nannies' ``worker-restart-memory`` events.
    """

    def __init__(self, client, interval: float = 0.02) -> None:
        self.client = client
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self.samples = 0  # rounds in which every live worker was read
        self.ended: list[str] = []

    def __enter__(self) -> WorkerWatch:
        import psutil

        self.pids = self.client.run(os.getpid)
        self.since = time.time()  # the scheduler of a LocalCluster runs in this process
        processes = {address: psutil.Process(pid) for address, pid in self.pids.items()}
        self.peaks = dict.fromkeys(processes, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(processes,), daemon=True,
                                        name="worker-memory-watch")
        self._thread.start()
        return self

    def _sample(self, processes) -> None:
        import psutil

        while not self._stop.is_set():
            for address, process in list(processes.items()):
                try:
                    rss = process.memory_info().rss
                except psutil.NoSuchProcess:  # zombies too
                    self.ended.append(address)
                    del processes[address]
                    continue
                self.peaks[address] = max(self.peaks[address], rss)
            self.samples += 1
            self._stop.wait(self.interval)

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def deaths(self) -> list[str]:
        """Every worker death or departure seen since the block began."""
        found = [f"{address}: its process ended" for address in self.ended]
        now = self.client.run(os.getpid)
        found += [f"{address}: pid {pid} is now {now.get(address)}"
                  for address, pid in self.pids.items() if now.get(address) != pid]
        found += [f"remove-worker {w}" for w in removed_workers(self.client, self.since)]
        found += [f"worker-restart-memory {e}" for t, e in
                  self.client.get_events("worker-restart-memory") if t >= self.since]
        return found


def assert_lean_run(watch: WorkerWatch, limit: float, directory) -> None:
    """While ``watch`` ran: each worker's own peak memory stayed under the nanny's terminate
    threshold (``distributed.worker.memory.terminate`` of ``limit``, 95% by default), no
    worker died, no service run was restarted; afterwards no file is left under
    ``directory``."""
    from distributed.utils_test import poll_for

    assert watch.samples >= 10, watch.samples  # the block ran long enough to be watched
    fraction = dask.config.get("distributed.worker.memory.terminate")
    threshold = fraction * limit
    peaks_mb = {a: round(p / 1e6) for a, p in watch.peaks.items()}
    print(f"worker peaks (MB): {peaks_mb}, threshold {threshold / 1e6:.0f} MB, "
          f"{watch.samples} samples")
    assert watch.peaks and all(watch.peaks.values()), peaks_mb  # every worker was read
    assert max(watch.peaks.values()) < threshold, (peaks_mb, threshold / 1e6)
    deaths = watch.deaths()
    assert not deaths, deaths
    restarts = service_events(watch.client, "restarted")
    assert not restarts, restarts
    poll_for(lambda: not spill_files(directory), timeout=30)


# ------------------------------------------------------------------ dashboard and metrics

DASHBOARD = {"scheduler_kwargs": {"dashboard": True, "dashboard_address": ":0"}}


def pull_tables(url: str) -> dict[str, dict]:
    """Open the Bokeh page as a browser does (HTTP, then its websocket); its tables' data."""
    from bokeh.client import pull_session
    from bokeh.models import DataTable
    from tornado.ioloop import IOLoop

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        session = pull_session(url=url, io_loop=IOLoop.current())
        try:
            return {t.name: dict(t.source.data) for t in session.document.select(
                {"type": DataTable})}
        finally:
            session.close()
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in Prometheus text format."""
    found = re.findall(rf"^{name}\{{(.*?)\}} (\S+)$", text, flags=re.M)
    return {labels: float(value) for labels, value in found}


def assembled_in_two_windows(received, destination, nparts: int, last: int, meta,
                             ignore_index: bool, small: bool) -> list:
    """``(partition, frame)`` of every partition, assembled by ``assemble_group`` from the
    frames ``received`` cut at the group ``last`` (``cut_at``): the groups up to it in one
    window, the rest in another; each window's small pieces concatenated once (``small``)
    or per partition."""
    from unittest import mock

    from dask_services.dataframe import _service

    now, later = _service.cut_at(received, last, destination)
    windows = [([p for p in range(nparts) if destination[p][1] <= last], now),
               ([p for p in range(nparts) if destination[p][1] > last], later)]
    out = []
    for window, items in windows:
        with mock.patch.object(_service, "SMALL_PIECE_ROWS", 10**9 if small else 0):
            frames = _service.assemble_group(items, window, meta, ignore_index)
        out += list(zip(window, frames, strict=True))
    return out


def no_heartbeats(*workers) -> None:
    """The test sends the heartbeats itself, so it knows when the final figures are in."""
    for w in workers:
        w.periodic_callbacks["heartbeat"].stop()


async def final_rows(c, *workers) -> list[dict]:
    """The runs table once every instance has stopped and its final figures arrived."""
    def idle() -> bool:
        return all(not w.extensions["dask_services"].host.instances for w in workers)
    await async_poll_for(idle, timeout=10)
    for w in workers:
        await w.heartbeat()
    rows = (await c.scheduler.service_status(tables=["runs"]))["runs"]
    return [dict(r) for r in rows]


def after_gate(x, name: str):
    """``x``, once the distributed Event ``name`` is set: an input that is still
    computing for as long as a test wants."""
    Event(name).wait()
    return x
