"""The scheduler's passes that spread one deployment's queued calls over its replicas.

When a replica turns healthy, the calls queued on the others beyond their share
(``_rebalance.shed_plan``) go back to their callers, which send them on to a replica with
less to do.  Callers that waited for a service at zero are let go together and send their
calls to the first replica healthy; once those calls have landed a pass spreads them too.
One pass runs at a time per deployment; a replica turning healthy meanwhile asks for
another.  The plugin (``_scheduler.Deployments``) gives it the deployment's healthy
replicas and the means to ask workers for figures and to shed calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from dask_services.replicated._rebalance import shed_plan

logger = logging.getLogger("dask_services")

# how long a pass waits for the calls it (or a wake) let go to land somewhere: callers
# that left never send theirs
LANDING_WAIT_S = 2.0
POLL_S = 0.05


class Rebalancer:
    """The passes of one deployment: when to run one, and what the last one moved."""

    def __init__(
        self,
        name: str,
        healthy: Callable[[], dict[str, str]],
        stats: Callable[[Mapping[str, str]], Awaitable[dict[str, dict]]],
        shed: Callable[[str, str, int, list], Awaitable[int]],
        spawn: Callable[[Coroutine], asyncio.Task],
        log_event: Callable[[dict], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.name = name
        self._healthy = healthy  # id -> worker of the healthy replicas
        self._stats = stats  # figures now of replicas (id -> worker)
        self._shed = shed  # (worker, id, keep, table) -> calls given back
        self._spawn = spawn  # a background task of the deployment
        self._log_event = log_event
        self._stopping = stopping
        self.task: asyncio.Task | None = None  # the pass under way
        self.again = False  # a replica turned healthy while it ran
        # the replicas' ``moved_in`` summed once every call the last pass moved has arrived
        self.moved_landed_by = 0
        # callers of each handle let go since the last spreading pass
        self.woken_by: dict[object, int] = {}
        # callers a wake let go whose calls may still be on their way
        self.woken_released = 0
        self.woken_spread: asyncio.Task | None = None

    def soon(self) -> None:
        """A replica turned healthy: run a pass (or another once the one under way ends)."""
        if self.task is not None and not self.task.done():
            self.again = True
            return
        self.task = self._spawn(self._run())

    def forget_moved(self) -> None:
        """Replicas were removed: the calls moved to them are counted nowhere, so no pass
        waits for them."""
        self.moved_landed_by = 0

    def woken(self, key: object, callers: int) -> None:
        """A wake of handle ``key`` let ``callers`` go in all (an earlier ask of the same
        handle may have let some go already: each is counted once).  The callers let go
        together send their calls to the first replica healthy; the others a burst asked
        for may turn healthy before those calls land there, when their passes found
        nothing to spread.  So once the calls have landed (the healthy replicas' running
        and queued calls add up to the callers let go, or after 2 s), a pass spreads
        them."""
        released = self.woken_by.get(key, 0)
        if callers <= released:
            return
        self.woken_by[key] = callers
        self.woken_released += callers - released
        if self.woken_spread is None or self.woken_spread.done():
            self.woken_spread = self._spawn(self._spread_woken_once_landed())

    async def _spread_woken_once_landed(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LANDING_WAIT_S
        try:
            while not self._stopping() and loop.time() < deadline:
                await asyncio.sleep(POLL_S)  # the callers let go send their calls
                _, loads, _ = await self._loads()
                if sum(a + b for a, b in loads.values()) >= self.woken_released:
                    break
        finally:
            self.woken_released = 0
            self.woken_by.clear()
        if not self._stopping():
            self.soon()

    async def _run(self) -> None:
        try:
            await self._passes()
        except Exception:  # noqa: BLE001 - calls stay where they are, as before
            logger.exception("spreading the queued calls of %s over its replicas failed",
                             self.name)

    async def _passes(self) -> None:
        again = True
        while again and not self._stopping():
            self.again = False
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LANDING_WAIT_S
            while True:
                healthy, loads, arrived = await self._loads()
                # The calls the last pass moved are counted on no replica until their
                # callers have sent them on: a pass before that would take them for
                # gone and shed too much.
                if arrived >= self.moved_landed_by or loop.time() > deadline \
                        or self._stopping():
                    break
                await asyncio.sleep(POLL_S)
            if len(healthy) < 2:
                return
            self.moved_landed_by = arrived
            plan = shed_plan(loads)
            if plan:
                # the healthy replicas and their loads once the plan is carried out, for
                # the callers that send the calls on (each knows only its own calls)
                table = [[rid, worker, plan.get(rid, sum(loads.get(rid, (0, 0))))]
                         for rid, worker in healthy.items()]
                moved = sum(await asyncio.gather(*(self._shed(healthy[rid], rid, keep, table)
                                                   for rid, keep in plan.items())))
                self.moved_landed_by = arrived + moved
                if moved:
                    self._log_event({"action": "calls-rebalanced", "service": self.name,
                                     "moved": moved, "healthy": len(loads)})
                    logger.info("replicated service %s: %d queued calls given back to be "
                                "sent to replicas with less to do", self.name, moved)
            again = self.again

    async def _loads(self) -> tuple[dict[str, str], dict[str, tuple[int, int]], int]:
        """The healthy replicas (id -> worker), their running and queued calls now, and
        the moved calls they have taken in, summed."""
        healthy = self._healthy()
        found: dict[str, Any] = await self._stats(healthy)
        loads = {rid: (int(f["in_flight"]), int(f["queued"])) for rid, f in found.items()}
        arrived = sum(int(f.get("moved_in", 0)) for f in found.values())
        return healthy, loads, arrived
