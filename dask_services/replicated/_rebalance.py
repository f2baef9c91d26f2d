"""Spreading queued calls over replicas added after the calls were queued, and replicas
over workers that joined after the replicas were placed: the pure arithmetic of both
(``design/replicated-services.md``, Queues and Recovery).
"""

from __future__ import annotations

from collections.abc import Mapping


def shed_plan(loads: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """For replica id -> (running, queued) calls, the replicas that should give calls
    back, each with the number of running and queued calls it keeps: the even share,
    ``ceil(all calls / replicas)``.  A replica at or below the share, or with nothing
    queued, is not asked; nor is anyone when there is one replica."""
    if len(loads) < 2:
        return {}
    total = sum(running + queued for running, queued in loads.values())
    share = -(-total // len(loads))
    return {rid: share for rid, (running, queued) in loads.items()
            if queued > 0 and running + queued > share}


def spread_move(held: Mapping[str, int], eligible: set[str],
                movable: Mapping[str, list[int]]) -> tuple[int, str] | None:
    """One replica to move so that replicas spread over the workers, or None.

    ``held``: worker -> replicas of the service it holds (staying, or new ones starting);
    ``eligible``: the workers a new replica may go to; ``movable``: worker -> healthy
    replica slots there that may move (not already moving).  Returns (slot, worker it
    leaves) for a replica on the most crowded worker when an eligible worker holds at
    least two fewer (a difference of one cannot be made smaller)."""
    crowded = sorted((w for w in movable if movable[w]), key=lambda w: (-held.get(w, 0), w))
    if not crowded or not eligible:
        return None
    source = crowded[0]
    target = min(eligible, key=lambda w: (held.get(w, 0), w))
    if held.get(target, 0) + 2 > held.get(source, 0):
        return None
    return movable[source][0], source
