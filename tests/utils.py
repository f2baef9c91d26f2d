"""Helpers for cluster tests."""

from __future__ import annotations

import os

from distributed.utils_test import async_poll_for, gen_cluster

import dask_services

TWO_WORKERS = [("127.0.0.1", 1), ("127.0.0.1", 1)]


def service_cluster(**kwargs):
    """``gen_cluster`` (validation on) with dask_services installed, then leak checks."""
    kwargs.setdefault("client", True)
    kwargs.setdefault("nthreads", TWO_WORKERS)
    kwargs.setdefault("timeout", 60)

    def decorator(fn):
        async def body(c, s, *workers):
            await dask_services.install_async(c)
            await fn(c, s, *workers)
            s.validate_state()
            for w in workers:
                w.validate_state()

        body.__name__ = fn.__name__
        body.__qualname__ = fn.__qualname__
        body.__module__ = fn.__module__
        return gen_cluster(**kwargs)(body)

    return decorator


async def assert_nothing_left(s, workers, timeout: float = 10) -> None:
    """No instance, produced value, waiting outcome, directory or scheduler state remains."""

    def clean() -> bool:
        for w in workers:
            ext = w.extensions["dask_services"]
            if ext.host.instances or ext.produced or ext.outcomes:
                return False
            base = ext.host.env.local_directory
            if os.path.isdir(base) and os.listdir(base):
                return False
        plugin = s.extensions["dask_services"]
        return not (plugin.machines or plugin.cut or plugin.produced_at or plugin.handoff_of)

    try:
        await async_poll_for(clean, timeout=timeout)
    except BaseException:
        plugin = s.extensions["dask_services"]
        for w in workers:
            ext = w.extensions["dask_services"]
            print(w.address, ext.host.instances, ext.produced, ext.outcomes,
                  os.listdir(ext.host.env.local_directory))
        print("machines", plugin.machines, "cut", plugin.cut, "handoffs", plugin.handoff_of)
        print({k: ts.state for k, ts in s.tasks.items()})
        raise


def events_of(kind: str) -> list[tuple]:
    from services import Recorder

    return [e for e in Recorder.events if e[0] == kind]
