"""Replicated services used by the tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import dask_services

# Events that endpoints wait for, by name: shared with the test only on in-process workers.
GATES: dict[str, asyncio.Event] = {}
STARTS: dict[str, int] = {}  # calls of ``count_and_wait`` started, by tag


class Adder(dask_services.Service):
    """Adds an offset; endpoints covering every case the tests need."""

    service_options = {"max_concurrency": 4}

    async def setup(self, offset: int = 0, fail_if_exists: str | None = None,
                    delays: dict | None = None, setup_gate: str | None = None,
                    setup_gates: str | None = None) -> None:
        if fail_if_exists is not None and os.path.exists(fail_if_exists):
            raise FileExistsError(f"setup refused: {fail_if_exists} exists")
        if setup_gates is not None:  # the n-th setup to start waits for its own gate
            n = STARTS[setup_gates] = STARTS.get(setup_gates, 0) + 1
            await GATES.setdefault(f"{setup_gates}-{n}", asyncio.Event()).wait()
        if setup_gate is not None:  # reached: GATES[setup_gate + "-reached"] is set
            GATES.setdefault(setup_gate + "-reached", asyncio.Event()).set()
            await GATES.setdefault(setup_gate, asyncio.Event()).wait()
        self.offset = offset
        self.delays = delays or {}
        self.sick = False
        self.stopped = False

    @dask_services.endpoint
    async def add(self, x: int) -> int:
        return x + self.offset

    @dask_services.endpoint
    async def whoami(self) -> str:
        return str(self.id)

    @dask_services.endpoint
    async def slow_add(self, x: int, delay: float = 0.3) -> tuple[str, int]:
        await asyncio.sleep(self.delays.get(str(self.id), delay))
        return str(self.id), x + self.offset

    @dask_services.endpoint
    async def set_delays(self, delays: dict) -> None:
        self.delays = delays

    @dask_services.endpoint
    def thread_name(self) -> str:
        return threading.current_thread().name

    @dask_services.endpoint
    def sync_sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return str(self.id)

    @dask_services.endpoint
    async def wait_for(self, gate: str, value: int) -> int:
        await GATES.setdefault(gate, asyncio.Event()).wait()
        return value

    @dask_services.endpoint
    async def wait_then_whoami(self, gate: str) -> str:
        await GATES.setdefault(gate, asyncio.Event()).wait()
        return str(self.id)

    @dask_services.endpoint
    async def count_and_wait(self, gate: str, tag: str) -> str:
        """Counts its starts in ``STARTS[tag]``, then waits for ``GATES[gate]``."""
        STARTS[tag] = STARTS.get(tag, 0) + 1
        await GATES.setdefault(gate, asyncio.Event()).wait()
        return tag

    @dask_services.endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @dask_services.endpoint
    async def make_sick(self) -> None:
        self.sick = True

    @dask_services.endpoint
    async def ask_peer(self, x: int) -> list[int]:
        """Calls ``add`` on every peer (replicas reach each other through ``self.peers``)."""
        await self.service.refresh()
        return sorted([await self.peers[sid].add(x) for sid in self.peers])

    @dask_services.endpoint
    async def pid(self) -> int:
        return os.getpid()

    @dask_services.endpoint
    def die(self) -> None:
        """Kills its worker's process, as a call that runs it out of memory would."""
        os.kill(os.getpid(), signal.SIGKILL)

    async def check_health(self) -> bool:
        return not self.sick

    def helper(self) -> str:
        return "not an endpoint"

    async def stop(self) -> None:
        self.stopped = True


class BadSetup(dask_services.Service):
    """``setup`` always raises."""

    async def setup(self) -> None:
        raise KeyError("model weights not found")

    @dask_services.endpoint
    async def ping(self) -> str:
        return "pong"


def call_from_task(svc, x: int) -> int:
    """A task (in a worker thread) calling the service through a pickled handle."""
    return svc.add.route(x).result(timeout=30)


async def call_from_async_task(svc, x: int) -> int:
    """An async task calling the service through a pickled handle."""
    return await svc.add.route(x)


def whoami_from_task(svc, i: int) -> str:
    """A task asking which replica answered, through its own unpickled handle."""
    return svc.whoami.route().result(timeout=30)


def inc(x: int) -> int:
    return x + 1


class Tally(dask_services.Service):
    """Counts the calls of its slow endpoints that ran (one at a time)."""

    service_options = {"max_concurrency": 1, "max_queued": 1000}

    def setup(self) -> None:
        self.ran = 0

    @dask_services.endpoint
    def sync_work(self, seconds: float) -> int:
        time.sleep(seconds)
        self.ran += 1
        return self.ran

    @dask_services.endpoint
    async def async_work(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        self.ran += 1
        return self.ran

    @dask_services.endpoint(batch_size=2, batch_wait="1ms")
    def batch_work(self, requests: list[float]) -> list[int]:
        time.sleep(max(requests))
        self.ran += len(requests)
        return [self.ran] * len(requests)

    @dask_services.endpoint
    def stream_work(self, seconds: float):
        self.ran += 1
        time.sleep(seconds)  # a first item that takes time (a model's first tokens)
        yield self.ran

    @dask_services.endpoint
    async def ran_so_far(self) -> int:
        return self.ran
