"""Spreading queued calls over replicas that were added after the calls were queued.

Calls are queued on the replica their caller chose; a burst sent while there was one
replica waits there even once more replicas are up (the ones the burst made the autoscaler
add).  So when a replica turns healthy, the scheduler reads every healthy replica's running
and queued calls and asks those above their share to give back the excess: the last queued
calls that nothing holds to the replica (no session, no pin) go back to their callers, who
send them on to replicas with less to do (``CallGate.shed``).  This module is the pure
arithmetic of it.
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
