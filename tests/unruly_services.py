"""A replicated service whose endpoints let out what an ``Exception`` handler does not
catch (importable by worker processes): ``KeyboardInterrupt``, ``SystemExit``,
``GeneratorExit`` and ``StopIteration``, raised or given as a batch's result; and one
raising an exception that pickle cannot remake."""

from __future__ import annotations

import asyncio
import os

import dask_services

# what a batch's request asks its slot to hold
SLOT = {"kb": KeyboardInterrupt("in a slot"), "exit": SystemExit("in a slot"),
        "stop": StopIteration(), "genexit": GeneratorExit()}


class Coded(Exception):
    """Its ``__init__`` takes a keyword-only argument it does not give ``Exception``."""

    def __init__(self, code, *, reason):
        super().__init__(f"{code}: {reason}")
        self.code = code


class Unruly(dask_services.Service):
    service_options = {"max_concurrency": 1}

    @dask_services.endpoint
    async def echo(self, x):
        return x

    @dask_services.endpoint
    async def sleeps(self, seconds):
        await asyncio.sleep(seconds)
        return seconds

    @dask_services.endpoint
    async def coded(self, code):
        raise Coded(code, reason="from a replica")

    @dask_services.endpoint
    async def interrupted(self):
        raise KeyboardInterrupt("async stop")

    @dask_services.endpoint
    async def generator_exit(self):
        raise GeneratorExit

    @dask_services.endpoint
    def next_of_empty(self):
        return next(iter([]))

    @dask_services.endpoint(batch_size=2, batch_wait="20ms")
    def batch_next_of_empty(self, requests):
        return [next(iter([])) for _ in requests]

    @dask_services.endpoint
    async def async_next_of_empty(self):
        return next(iter([]))

    @dask_services.endpoint(batch_size=2, batch_wait="20ms")
    async def async_batch_next_of_empty(self, requests):
        return [next(iter([])) for _ in requests]

    @dask_services.endpoint(batch_size=4, batch_wait="200ms")
    async def slots(self, requests):
        return [SLOT[r] if r in SLOT else 2 * r for r in requests]

    @dask_services.endpoint
    async def interrupted_stream(self):
        yield 0
        raise KeyboardInterrupt("async generator stop")

    @dask_services.endpoint
    def interrupted_stream_sync(self):
        yield 0
        raise KeyboardInterrupt("generator stop")

    @dask_services.endpoint
    async def stopped_stream(self):
        yield 0
        next(iter([]))

    @dask_services.endpoint
    def stopped_stream_sync(self):
        yield 0
        next(iter([]))


def let_out(what: str, where: str = "in a hook") -> None:
    """Raise what an ``Exception`` handler does not catch (``what``: "kb", "exit",
    "genexit") or a ``StopIteration`` ("stop"), or end the process at once ("die"); a
    ``KeyboardInterrupt`` says ``where``."""
    if what == "die":
        os._exit(1)
    if what == "kb":
        raise KeyboardInterrupt(where)
    if what == "exit":
        raise SystemExit(3)
    if what == "genexit":
        raise GeneratorExit()
    if what == "stop":
        next(iter([]))


class UnrulyHooks(dask_services.Service):
    """``hook`` ("setup", "check_health" once ``flag`` exists, or "stop") lets out
    ``what`` (see :func:`let_out`)."""

    async def setup(self, hook: str, what: str, flag: str | None = None) -> None:
        self.hook, self.what, self.flag = hook, what, flag
        if hook == "setup":
            let_out(what)

    async def check_health(self) -> bool:
        if self.hook == "check_health" and os.path.exists(self.flag):
            let_out(self.what)
        return True

    async def stop(self) -> None:
        if self.hook == "stop":
            let_out(self.what)

    @dask_services.endpoint
    async def ok(self) -> int:
        return 1


class UnrulySyncHooks(dask_services.Service):
    """:class:`UnrulyHooks` with plain-``def`` hooks (run in threads)."""

    def setup(self, hook: str, what: str, flag: str | None = None) -> None:
        self.hook, self.what, self.flag = hook, what, flag
        if hook == "setup":
            let_out(what)

    def check_health(self) -> bool:
        if self.hook == "check_health" and os.path.exists(self.flag):
            let_out(self.what)
        return True

    def stop(self) -> None:
        if self.hook == "stop":
            let_out(self.what)

    @dask_services.endpoint
    async def ok(self) -> int:
        return 1
