"""Choosing a replica for a call: the routers.

A router is any object with one method, ``choose(replicas) -> ReplicaView``, given the
healthy replicas (never an empty list).  Each handle owns its own router instance, so state
such as a round-robin position is per caller.  Loads are the caller's own view: the
larger of the calls it has in flight on a replica and the calls running or queued there
(from every caller) that the replica reported with its last answer to it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from dask_services.service import ServiceId


@dataclass(frozen=True)
class ReplicaView:
    """What a router knows about one healthy replica."""

    id: ServiceId
    worker: str
    load: int = 0  # max(calls of this caller in flight there, the replica's last report)
    sessions: int = 0  # sessions of this caller bound to it


@runtime_checkable
class Router(Protocol):
    """The one method a router has."""

    def choose(self, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """Pick the replica for the next call among ``replicas`` (never empty)."""
        ...


def _first_turn() -> int:
    """A random first turn, so that callers that know nothing yet spread their calls."""
    return random.randrange(1 << 30)


class RoundRobin:
    """Each replica in turn."""

    def __init__(self) -> None:
        # a plain number, not an ``itertools.count``: a router travels pickled with its
        # handle, and itertools objects stop pickling in Python 3.14 (3.12 warns).  It
        # starts at a random turn: every task calling the service makes a fresh handle
        # (and router), and fresh routers starting alike would all pick the first replica
        self._turns = _first_turn()

    def choose(self, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """The next replica in id order."""
        ordered = sorted(replicas, key=lambda r: r.id)
        self._turns += 1
        return ordered[(self._turns - 1) % len(ordered)]


class LeastLoaded:
    """The replica with the fewest calls in flight (ties: fewest sessions, then in turn)."""

    def __init__(self) -> None:
        self._turns = _first_turn()  # see RoundRobin: a fresh handle knows no load yet

    def choose(self, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """The least-loaded replica."""
        best = min((r.load, r.sessions) for r in replicas)
        tied = sorted((r for r in replicas if (r.load, r.sessions) == best),
                      key=lambda r: r.id)
        self._turns += 1
        return tied[(self._turns - 1) % len(tied)]


class PowerOfTwo:
    """Two replicas at random, the less loaded of the two (cheap on many replicas)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """The less loaded of two random replicas."""
        if len(replicas) == 1:
            return replicas[0]
        a, b = self._rng.sample(list(replicas), 2)
        return a if (a.load, a.sessions) <= (b.load, b.sessions) else b


class SessionAffinity(LeastLoaded):
    """Every call of one handle goes to one replica, chosen least-loaded, until it is gone.

    The same stickiness as ``with svc.session():`` but for all calls of the handle.  The
    handle keeps the binding; as a router this picks the least-loaded replica.
    """

    sticky = True


ROUTERS: dict[str, type] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "session_affinity": SessionAffinity,
}


def check_router(spec: Any) -> None:
    """Raise early (a clear message) if ``spec`` cannot become a router."""
    make_router(spec)


def make_router(spec: Any) -> Any:
    """A fresh router from a name, a router class, or a router instance (used as is)."""
    if isinstance(spec, str):
        try:
            return ROUTERS[spec]()
        except KeyError:
            raise ValueError(
                f"unknown router {spec!r}; use one of {sorted(ROUTERS)} or an object with a "
                "`choose(replicas)` method"
            ) from None
    if isinstance(spec, type):
        if not callable(getattr(spec, "choose", None)):
            raise TypeError(f"router class {spec.__name__} has no `choose(replicas)` method")
        return spec()
    if callable(getattr(spec, "choose", None)):
        return spec
    raise TypeError(
        f"router must be a name ({sorted(ROUTERS)}), a class or an object with a "
        f"`choose(replicas)` method, got {spec!r}"
    )
