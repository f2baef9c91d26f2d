"""Per-replica call counters and latency quantiles (kept on the replica's worker)."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of already sorted values; NaN when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class ReplicaMetrics:
    """Calls, endpoint errors and the latencies of the last ``window`` calls of a replica.

    A call's latency runs from its arrival at the replica to its answer, so it includes
    the time it waited in the queue.
    """

    window: int = 2048
    calls: int = 0
    errors: int = 0
    overloaded: int = 0
    latencies: collections.deque = field(default_factory=collections.deque)

    def record(self, seconds: float, error: bool) -> None:
        """Count one finished call."""
        self.calls += 1
        if error:
            self.errors += 1
        self.latencies.append(seconds)
        if len(self.latencies) > self.window:
            self.latencies.popleft()

    def summary(self) -> dict[str, float | int]:
        """``calls``, ``errors``, ``overloaded``, ``p50_ms`` and ``p99_ms``."""
        values = sorted(self.latencies)
        return {"calls": self.calls, "errors": self.errors, "overloaded": self.overloaded,
                "p50_ms": quantile(values, 0.5) * 1e3, "p99_ms": quantile(values, 0.99) * 1e3}
