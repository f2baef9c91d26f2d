"""Services used by the tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from typing import Any

from dask_services import Service, rpc
from dask_services.examples import AllReduce


class Recorder(AllReduce):
    """An all-reduce that records every hook call and can fail or restart on demand.

    Records live in the class (so only in-process workers share them with the test).
    Parameters: ``fail_in`` (hook name) raises ``ValueError`` there; ``restart_runs``
    restarts from ``all_inputs_done`` that many times; ``gate`` waits for
    ``Recorder.gates[gate]`` before exchanging partials.
    """

    events: list[tuple] = []
    gates: dict[str, asyncio.Event] = {}
    restarts_done: defaultdict[str, int] = defaultdict(int)

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    fail_in: str | None = None, restart_runs: int = 0,
                    gate: str | None = None, **kwargs: Any) -> None:
        self.fail_in = fail_in
        self.restart_runs = restart_runs
        self.gate = gate
        self.events.append(("start", id, key, concierge.address, dict(
            peers=sorted(peers), input_keys=list(input_keys), output_keys=list(output_keys),
            leader=leader, run_id=concierge.run_id, wanted=list(concierge.wanted_outputs),
            kwargs=dict(kwargs, fail_in=fail_in), directory=concierge.local_directory,
        )))
        self._maybe_fail("start")
        await super().start(id, key, peers, input_keys, output_keys, concierge, leader,
                            **kwargs)

    def _maybe_fail(self, hook: str) -> None:
        if self.fail_in == hook:
            raise ValueError(f"boom in {hook}")

    async def all_started(self) -> None:
        self.events.append(("all_started", self.id))
        self._maybe_fail("all_started")

    async def add_key(self, key, data) -> None:
        self.events.append(("add_key", self.id, key, self.concierge.address))
        self._maybe_fail("add_key")
        if self.fail_in == "concierge.error":
            self.concierge.error(KeyError("refused by the service"))
        await super().add_key(key, data)

    async def all_inputs_done(self) -> None:
        self.events.append(("all_inputs_done", self.id))
        self._maybe_fail("all_inputs_done")
        key = str(self.key)
        if self.restarts_done[key] < self.restart_runs and self.id == self.leader:
            self.restarts_done[key] += 1
            self.concierge.restart("asked by the test")
            return
        if self.gate is not None:
            await self.gates.setdefault(self.gate, asyncio.Event()).wait()
        await super().all_inputs_done()

    async def stop(self) -> None:
        self.events.append(("stop", self.id))
        await super().stop()

    @classmethod
    def reset(cls) -> None:
        cls.events.clear()
        cls.gates.clear()
        cls.restarts_done.clear()


class Streamer(Service):
    """Produces output i as soon as input ``xi`` arrives, before all inputs are in."""

    async def add_key(self, key, data) -> None:
        i = int(key[1:])
        out = self.output_keys[i]
        if out in self.concierge.wanted_outputs:
            await self.peers[self.concierge.owner(out)].produce(out, data * 10)

    @rpc
    async def produce(self, key, value) -> None:
        await self.concierge.produce_key(key, value)


class Chatty(Service):
    """Peer RPC behaviour: ordering, loopback identity, refused names."""

    received: list[tuple] = []

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    **kwargs: Any) -> None:
        self.log: list[Any] = []
        self._me = peers[id]._source

    async def all_started(self) -> None:
        results: dict[str, Any] = {}
        others = [sid for sid in self.peers if sid != self.id]
        target = self.peers[others[0]] if others else self.peers[self.id]
        # 1. ordering: 50 calls started without awaiting one another
        await asyncio.gather(*(target.record(self.id, i) for i in range(50)))
        # 2. loopback skips serialization: the very same object arrives
        marker = object()
        results["loopback_identity"] = (await self.peers[self.id].echo(marker)) is marker
        if others:
            remote = await self.peers[others[0]].echo(marker)
            results["remote_identity"] = remote is marker
        # 3. refused names
        refused = {}
        for name in ("_private", "__class__", "__init__", "not_marked", "stop", "start",
                     "nope"):
            try:
                if name.startswith("__"):
                    # Dunder lookups on the handle are the handle's own; send the raw
                    # request the way a misbehaving peer would.
                    await target._host.call_peer(self._me, target.id, _next_seq(self, target),
                                                 name, (), {})
                else:
                    await getattr(target, name)()
            except Exception as e:
                refused[name] = (type(e).__name__, str(e))
            else:
                refused[name] = None
        results["refused"] = refused
        self.results = results

    async def all_inputs_done(self) -> None:
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, (self.results, self.log))

    @rpc
    async def record(self, source, i) -> None:
        self.log.append((str(source), i))  # calls start in the order they were sent
        if i % 7 == 0:
            await asyncio.sleep(0)  # even when handlers yield

    @rpc
    async def echo(self, obj) -> Any:
        return obj

    async def not_marked(self) -> None:
        pass


def _next_seq(chatty: Chatty, target: Any) -> int:
    seq = chatty._me.next_seq_out.get(target.id, 0)
    chatty._me.next_seq_out[target.id] = seq + 1
    return seq


class SlowSum(AllReduce):
    """An all-reduce that lingers before exchanging partials (for kill tests)."""

    async def all_inputs_done(self) -> None:
        await asyncio.sleep(float(self.params.get("delay", 1.0)))
        await super().all_inputs_done()


class PidReporter(Service):
    """Produces, as every output it owns, the pid of its worker process."""

    async def all_inputs_done(self) -> None:
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, os.getpid())


class SlowPidReporter(PidReporter):
    """A ``PidReporter`` that lingers first (kill tests of a service without inputs)."""

    async def all_inputs_done(self) -> None:
        await asyncio.sleep(float(self.params.get("delay", 1.0)))
        await super().all_inputs_done()


class Hog(Service):
    """Claims to hold a lot of memory; records please_evict calls."""

    evicted: list[int] = []

    async def start(self, *args: Any, **kwargs: Any) -> None:
        self.held = 50_000_000
        self.freed = asyncio.Event()

    def __sizeof__(self) -> int:
        return self.held

    def spilled_bytes(self) -> int:
        return 1234

    async def please_evict(self, nbytes: int) -> None:
        self.evicted.append(nbytes)
        self.held = max(0, self.held - nbytes)
        if not self.held:
            self.freed.set()

    async def all_inputs_done(self) -> None:
        await self.freed.wait()
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, "evicted")


class GatedTaker(AllReduce):
    """An all-reduce whose ``add_key`` waits for ``GatedTaker.gate`` (in-process workers
    only) before taking its input; ``entered`` counts the ``add_key`` calls that began."""

    gate: asyncio.Event | None = None
    entered: int = 0

    async def add_key(self, key, data) -> None:
        type(self).entered += 1
        if type(self).gate is None:
            type(self).gate = asyncio.Event()
        await type(self).gate.wait()
        await super().add_key(key, data)

    @classmethod
    def reset(cls) -> None:
        cls.gate = None
        cls.entered = 0


class RestartsOnceAtTheBarrier(AllReduce):
    """An all-reduce whose first run, once every input was handed off, waits for
    ``RestartsOnceAtTheBarrier.gate`` (in-process workers only), then asks for a restart;
    the next run finishes."""

    gate: asyncio.Event | None = None
    restarted = False

    async def all_inputs_done(self) -> None:
        cls = type(self)
        if not cls.restarted:
            cls.restarted = True
            if cls.gate is None:
                cls.gate = asyncio.Event()
            await cls.gate.wait()
            self.concierge.restart("asked once, at the barrier")
            return
        await super().all_inputs_done()

    @classmethod
    def reset(cls) -> None:
        cls.gate = None
        cls.restarted = False


class SizeRecorder(AllReduce):
    """An all-reduce recording ``concierge.input_nbytes`` of every input while its
    ``add_key`` runs (in-process workers only)."""

    seen: dict = {}

    async def add_key(self, key, data) -> None:
        type(self).seen[key] = self.concierge.input_nbytes(key)
        await super().add_key(key, data)


class ByPosition(Service):
    """Output *i* is input *i*, found by its position in ``input_keys``."""

    async def add_key(self, key, data):
        await self.concierge.produce_key(self.output_keys[self.input_keys.index(key)], data)


def ident(x):
    return x



class ChangesItsInput(AllReduce):
    """Takes its input's buffer for its own: changes it in place."""

    async def add_key(self, key, data) -> None:
        data *= 2
        await super().add_key(key, data)


class ChangesACopy(AllReduce):
    """Changes a copy of its input, as the README says to."""

    async def add_key(self, key, data) -> None:
        data = data.copy()
        data *= 2
        await super().add_key(key, data)
