"""How a replicated service's handle reaches the scheduler and the workers: through the
``Client`` it was made with, or through the worker a task or a replica runs on."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any

from distributed.core import send_recv


class Transport(abc.ABC):
    """How a handle reaches the scheduler and the workers from where it lives."""

    loop: asyncio.AbstractEventLoop
    pool: Any  # distributed ConnectionPool
    scheduler: Any  # rpc to the scheduler
    owner: Any  # the Client or Worker (handles through the same one share tables)

    def closed(self) -> bool:
        """Whether what this transport goes through was closed (a closed ``Client``)."""
        return False

    @property
    @abc.abstractmethod
    def caller(self) -> str:
        """Who calls through it, as the scheduler names it when it leaves (a client's id,
        a worker's address): replicas give back the queued calls of a caller gone."""

    def in_loop(self) -> bool:
        """Whether the caller runs on this transport's event loop (async code)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def sync(self, fn: Callable[..., Coroutine], *args: Any, timeout: float | None = None,
             **kwargs: Any) -> Any:
        """Run ``fn`` on the loop: a coroutine in async code, the result otherwise."""
        if self.in_loop():
            return fn(*args, **kwargs)
        cf = asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop)
        try:
            return cf.result(timeout)
        except concurrent.futures.TimeoutError:
            if cf.done():  # the coroutine's own TimeoutError (the same class on 3.11+)
                raise
            cf.cancel()
            raise TimeoutError(
                f"{getattr(fn, '__name__', fn)} took longer than {timeout} s") from None

    async def request(self, comm: Any, address: str, op: str, **kwargs: Any) -> Any:
        """One request to a worker's handler ``op`` on ``comm``, a pooled connection."""
        try:
            return await send_recv(comm=comm, op=op, **kwargs)
        finally:
            self.pool.reuse(address, comm)


def _connect(transport: Transport, owner: Any) -> None:
    """Loop, connection pool and scheduler rpc of a ``Client`` or a ``Worker``."""
    transport.owner = owner
    transport.loop = owner.loop.asyncio_loop
    transport.pool = owner.rpc
    transport.scheduler = owner.scheduler


class ClientTransport(Transport):
    """Through a ``Client`` (sync or async)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        _connect(self, client)

    def closed(self) -> bool:
        return self.client.status in ("closing", "closed")

    @property
    def caller(self) -> str:
        return str(self.client.id)


class WorkerTransport(Transport):
    """Through the worker a task or a replica runs on."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        _connect(self, worker)

    @property
    def caller(self) -> str:
        return str(self.worker.address)


def current_transport() -> Transport:
    """The worker this code runs on, else the default client."""
    from distributed import default_client
    from distributed.worker import get_worker

    try:
        return WorkerTransport(get_worker())
    except ValueError:
        pass
    try:
        return ClientTransport(default_client())
    except ValueError:
        raise ValueError(
            "a replicated service handle needs a Client or a worker to talk through: "
            "create a distributed.Client first"
        ) from None
