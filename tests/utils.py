"""Helpers for cluster tests."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import re
import signal

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
            base = ext.host.env.local_directory
            if os.path.isdir(base) and os.listdir(base):
                left.append(f"{w.address} files: {os.listdir(base)}")
        plugin = s.extensions["dask_services"]
        for name in ("machines", "cut", "produced_at", "restrictions", "handoff_of",
                     "output_of"):
            if getattr(plugin, name):
                left.append(f"scheduler {name}: {list(getattr(plugin, name))[:3]}")
        return left

    try:
        await async_poll_for(lambda: not leftovers(), timeout=timeout)
    except BaseException:
        print("LEFT BEHIND:", leftovers())
        print({k: (ts.state, ts.who_wants) for k, ts in s.tasks.items()})
        raise


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


def pid_of(client, address: str) -> int:
    """Process id of the worker at ``address`` (a LocalCluster worker process)."""
    return client.run(os.getpid, workers=[address])[address]


def kill(client, address: str) -> None:
    """SIGKILL the worker process at ``address``."""
    os.kill(pid_of(client, address), signal.SIGKILL)


def live_run(cluster, condition=lambda run: True):
    """The first live run (of any service task) that satisfies ``condition``, or None."""
    plugin = cluster.scheduler.extensions["dask_services"]
    for machine in plugin.machines.values():
        run = machine.live_run
        if run is not None and condition(run):
            return run
    return None


def assert_lean_run(client, samples, limit: float, directory) -> None:
    """Per-worker peak of ``samples`` (summed process memory of two workers) under
    ``limit``, no worker killed on the way, and no file left under ``directory``."""
    from distributed.utils_test import poll_for

    per_worker_peak = samples.max() / 2
    assert per_worker_peak < limit, per_worker_peak
    restarts = [e for _, e in client.get_events("dask_services") if e["action"] == "restarted"]
    assert not restarts, restarts  # no worker was killed for memory on the way
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
