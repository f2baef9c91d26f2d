"""Calls that find a service scaled to zero wait for a replica: the calls waiting through
one handle ask the scheduler together, one long poll saying how many wait, instead of one
per call (a burst of thousands of calls at zero opened a connection to the scheduler
each)."""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dask_services.replicated._background import consume, idle
from dask_services.replicated._errors import ServiceUnavailable
from dask_services.replicated._options import config_seconds

if TYPE_CHECKING:
    from dask_services.replicated._handle import ReplicatedService

# the calls waiting for a service scaled to zero ask the scheduler again this often, so
# that callers that went away stop counting in the autoscaler's load within that time
WAKE_ASK_S = 2.0
# ... and at once when more calls join, but not more often than this (calls made one by
# one, from tasks starting in turn, are counted together)
WAKE_JOIN_S = 0.05


@dataclass
class Waiters:
    """The calls waiting through a handle for a replica of a service at zero, on one
    event loop, and the task asking the scheduler for them."""

    callers: int = 0
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # set as callers join
    task: asyncio.Future | None = None


class Waking:
    """One handle's waits for a replica of its service at zero (``ReplicatedService._wake``)."""

    def __init__(self) -> None:
        self.waiters: Waiters | None = None
        self.last_ask: asyncio.Future | None = None  # at the calls' deadline
        self.asks_sent = 0  # each ask's number (newer ones replacing older)
        self.asker = uuid.uuid4().hex  # the handle, to the scheduler's count of waiters

    async def wait(self, handle: ReplicatedService) -> bool:
        """For a call that found no healthy replica: if the service scales to zero,
        wait until it has one (scaled up from zero at once, the caller counted in its
        load) and refresh the table; False if it does not scale to zero.  Raises what
        the replicas' setup raised, or ``ServiceUnavailable`` after
        ``dask_services.replicated.deploy-timeout``."""
        if not handle._scales_to_zero:
            return False
        timeout = config_seconds("deploy-timeout")
        waiters = self.waiters
        if waiters is None or idle(waiters.task):
            waiters = self.waiters = Waiters()  # on this loop
            waiters.task = asyncio.ensure_future(self._ask(handle, waiters))
            waiters.task.add_done_callback(consume)
        else:
            waiters.joined.set()
        asking = waiters.task
        waiters.callers += 1
        try:
            # not cancelled with this caller: the others still wait on it
            await asyncio.wait({asking}, timeout=timeout)
        finally:
            waiters.callers -= 1
        if asking.done():
            return asking.result()
        # this caller's deadline: one last ask, answered at once, for the state now
        # (healthy just in time, or what each replica waits for), shared by the calls
        # whose deadlines come together (a burst's all do)
        if idle(self.last_ask):
            self.last_ask = asyncio.ensure_future(
                handle._management("replicated_wake", timeout=0))
            self.last_ask.add_done_callback(consume)
        result = await asyncio.shield(self.last_ask)
        if result.get("status") == "pending":
            raise ServiceUnavailable(
                f"no replica of {handle.name} healthy {timeout:g} s after a call found it "
                "scaled to zero (dask_services.replicated.deploy-timeout): "
                f"{result.get('why')}")
        await handle._refresh()
        return result.get("status") == "ok"

    async def _ask(self, handle: ReplicatedService, waiters: Waiters) -> bool:
        """Ask the scheduler, for the calls waiting in ``wait``, until a replica is
        healthy (True; the table refreshed) or the service does not scale to zero
        (False); raise what the scheduler answers with an error.  Each ask is a long poll
        of ``WAKE_ASK_S`` counting the callers waiting when it was sent; when more join,
        a new ask with the new count takes the place of the last (the scheduler counts
        the newest of each handle).  Stops once no caller waits."""
        loop = asyncio.get_running_loop()
        asks: set[asyncio.Future] = set()
        newest: asyncio.Future | None = None
        sent, sent_at = 0, -math.inf
        try:
            while waiters.callers > 0:
                joined = waiters.callers > sent
                if newest is None or (joined and loop.time() >= sent_at + WAKE_JOIN_S):
                    sent, sent_at = waiters.callers, loop.time()
                    self.asks_sent += 1
                    newest = asyncio.ensure_future(handle._management(
                        "replicated_wake", timeout=WAKE_ASK_S, callers=sent,
                        asker=self.asker, seq=self.asks_sent))
                    asks.add(newest)
                    joined = False
                waiters.joined.clear()
                if joined:  # more callers than the newest ask counts: ask again soon
                    pause = asyncio.ensure_future(
                        asyncio.sleep(sent_at + WAKE_JOIN_S - loop.time()))
                else:  # ... once more join (callers that leave stop counting at the
                    # next ask, within WAKE_ASK_S)
                    pause = asyncio.ensure_future(waiters.joined.wait())
                try:
                    done, _ = await asyncio.wait(asks | {pause},
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    pause.cancel()
                for ask in done - {pause}:
                    asks.discard(ask)
                    if ask is not newest and ask.exception() is not None:
                        continue  # a replaced ask's failure: the newest answers for all
                    result = ask.result()
                    if result.get("status") != "pending":
                        await handle._refresh()
                        return result.get("status") == "ok"
                    if ask is newest:
                        newest = None  # timed out: asked again while callers wait
            return False
        finally:
            for ask in asks:
                ask.cancel()
                ask.add_done_callback(consume)
