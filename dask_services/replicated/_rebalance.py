"""Spreading queued calls over replicas added after the calls were queued, and replicas
over workers that joined after the replicas were placed.

Calls are queued on the replica their caller chose; a burst sent while there was one
replica waits there even once more replicas are up (the ones the burst made the autoscaler
add).  So when a replica turns healthy, the scheduler reads every healthy replica's running
and queued calls and asks those above their share to give back the excess: the last queued
calls that nothing holds to the replica (no session, no pin) go back to their callers, who
send them on to replicas with less to do (``CallGate.shed``).

Replicas are placed on the eligible workers holding the fewest of the service's, but a
cluster whose workers come back one by one (``client.restart()``, a cluster scaled up
after a loss) has them all placed on the first to return.  So when a worker joins, or a
replica turns healthy, a replica on the most crowded worker is moved to one holding at
least two fewer: a new replica is started there first, and the old one is stopped (its
calls drained) once the new one is healthy, so the service never has fewer replicas.

This module is the pure arithmetic of both.
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


def spread_move(ranks: Mapping[str, int], eligible: set[str],
                movable: Mapping[str, list[int]]) -> tuple[int, str] | None:
    """One replica to move so that replicas spread over the workers, or None.

    ``ranks``: worker -> ranks of the service it holds (replicas staying, and new ones
    being started); ``eligible``: the workers a new replica may go to; ``movable``: worker
    -> healthy replica slots with a rank there that may move (not already moving).
    Returns (slot, worker it leaves) for a replica on the most crowded worker when an
    eligible worker holds at least two ranks fewer (moving one then evens them out by
    one each; a difference of one cannot be made smaller)."""
    crowded = sorted((w for w in movable if movable[w]), key=lambda w: (-ranks.get(w, 0), w))
    if not crowded or not eligible:
        return None
    source = crowded[0]
    target = min(eligible, key=lambda w: (ranks.get(w, 0), w))
    if ranks.get(target, 0) + 2 > ranks.get(source, 0):
        return None
    return movable[source][0], source
