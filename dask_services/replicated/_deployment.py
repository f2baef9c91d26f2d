"""A deployed replicated service as the scheduler keeps it (:class:`Deployment`), and a
handle's ask for a replica of a service at zero (:class:`WakeAsk`)."""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from dask_services.replicated import _lifecycle as lc
from dask_services.replicated._autoscale import AutoscalePolicy
from dask_services.replicated._lifecycle import ReplicaState
from dask_services.replicated._rebalancer import Rebalancer


@dataclass
class WakeAsk:
    """A handle's ask for a replica of a service at zero (``Deployments.wake``)."""

    seq: int  # the handle's count of its asks: a newer one replaces an older one
    callers: int  # calls waiting through the handle when it asked
    superseded: asyncio.Event = field(default_factory=asyncio.Event)  # by a newer ask


async def first_set(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Wait until one of ``events`` is set, at most ``timeout`` seconds."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


@dataclass(eq=False)
class Deployment:
    """One deployed service: its options and its replica slots."""

    name: str
    blob: bytes  # pickled (class, setup args, setup kwargs, options): never unpickled here
    max_concurrency: int
    max_queued: int
    workers: tuple[str, ...] | None
    resources: Mapping[str, float] | None
    cls: str = ""  # the service class's name, for the status table
    procs_per_replica: int = 1  # ranks of each replica, each on a worker of its own
    max_replicas_per_worker: int | None = None  # ranks of this service a worker may hold
    autoscaling: AutoscalePolicy | None = None
    floor: int = 0  # the last svc.scale(n): autoscaling never goes below it
    last_decision: str = ""  # the last autoscaling decision, with its reason
    # calls waiting for a replica of a service at zero (``wake``): the newest ask of each
    # handle asking for them
    waiting: dict[object, WakeAsk] = field(default_factory=dict)
    # each replica's call count, the time of the report it came with, and whether it grew
    # over the report before (``_called``: calls made between samples keep a service from
    # scaling to zero, though none is under way when a sample is taken)
    calls_seen: dict[str, tuple[float, float | None, bool]] = field(default_factory=dict)
    deploying_client: str | None = None  # the client whose as_service() still waits
    # stopping replicas whose setup failed on waking (``wake``)
    failed_removal: asyncio.Task | None = None
    # this deployment, apart from any other deployed under the same name before or after:
    # a handle carries it, so that a handle of a shut-down service never reaches another
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    slots: dict[int, lc.ReplicaMachine] = field(default_factory=dict)
    errors: dict[int, bytes] = field(default_factory=dict)  # slot -> last setup exception
    next_slot: int = 0
    stopping: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # its shutdown is over
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task] = field(default_factory=set)
    moves: dict[int, int] = field(default_factory=dict)  # new slot -> slot it replaces
    # incarnations draining their calls in flight (a stop with a drain under way, one
    # count a rank): replaced or not, their calls are not to be re-sent (``table``)
    draining: collections.Counter[str] = field(default_factory=collections.Counter)
    spread_pending: bool = False  # a spreading check is due (``_spread_soon``)
    # spreads queued calls over the replicas (``_rebalancer.py``; set by the plugin)
    rebalancer: Rebalancer = field(init=False)

    @property
    def callers_waiting(self) -> int:
        """Calls waiting for a replica of a service at zero, as the handles asking for
        them counted them."""
        return sum(ask.callers for ask in self.waiting.values())

    def notify(self) -> None:
        """Wake whoever waits for a change of state."""
        self.changed.set()
        self.changed = asyncio.Event()

    def scales_to_zero(self) -> bool:
        """Whether the service scales to zero replicas and back: its autoscaling allows
        none (``min_replicas: 0``, no ``svc.scale(n)`` floor)."""
        return self.autoscaling is not None and self.autoscaling.bounds(self.floor)[0] == 0

    def active(self) -> dict[int, lc.ReplicaMachine]:
        """The replica slots that are not stopped, nor being replaced by a move's new
        replica (which counts in their place)."""
        leaving = set(self.moves.values())
        return {s: m for s, m in self.slots.items()
                if m.state is not ReplicaState.STOPPED and s not in leaving}
