"""The scheduler's calls to the replicated worker plugin (``_worker.py``): start, stop,
probe a replica's rank, ask replicas for their figures or to give back queued calls.

Each takes ``rpc``, the scheduler's connection pool (``scheduler.rpc``), and turns what
can go wrong on the way (a lost connection, a worker that does not answer) into an
answer of its own, so that the plugin's state machine only ever sees answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from distributed.comm import CommClosedError

from dask_services.replicated._gang import rank_id
from dask_services.replicated._options import config_seconds

if TYPE_CHECKING:
    from dask_services.replicated._deployment import Deployment

logger = logging.getLogger("dask_services")
STATS_TIMEOUT = 5  # seconds a worker has to give its replicas' figures or shed calls
START_ATTEMPTS = 50  # asks of a joining worker that has no replicated_start handler yet


async def start_rank(rpc: Callable[[str], Any], dep: Deployment, rank: int,
                     ranks: list[tuple[str, str]], known: Callable[[str], bool]) -> dict:
    """Start rank ``rank`` of a replica whose ranks are ``ranks`` ((id, worker) each):
    the worker's answer, or ``{"status": "lost", ...}``.  ``known(worker)``: whether the
    worker is still in the cluster (a joining one is asked again until it has the
    handler)."""
    gang = {"rank": rank, "ranks": ranks} if len(ranks) > 1 else {}
    worker = ranks[rank][1]
    for attempt in range(START_ATTEMPTS):
        try:
            resp = await rpc(worker).replicated_start(
                id=ranks[rank][0], name=dep.name, blob=dep.blob,
                max_concurrency=dep.max_concurrency, max_queued=dep.max_queued,
                setup_timeout=config_seconds("setup-timeout"), peers_of=dep.name,
                uid=dep.uid, **gang,
            )
        except CommClosedError as e:  # sent: the worker died or closed while starting it
            return {"status": "lost", "error": f"{worker} was lost while it started the "
                                              f"replica: {type(e).__name__}: {e}",
                    "in_flight": True}
        except Exception as e:  # no connection made, worker closing
            return {"status": "lost", "error": f"{type(e).__name__}: {e}"}
        if isinstance(resp, dict):
            return resp
        # No answer: the worker has no such handler yet.  A joining worker is announced
        # (add_worker) before it has set up the worker plugins the scheduler sent it.
        if not known(worker):
            break
        await asyncio.sleep(0.05 * min(attempt + 1, 4))
    return {"status": "lost", "error": f"{worker} has no replicated_start handler "
                                      "(is the dask_services_replicated plugin there?)"}


async def stop_rank(rpc: Callable[[str], Any], worker: str, sid: Any, timeout: float,
                    reason: str) -> None:
    """Ask ``worker`` to stop incarnation ``sid`` (its rank there), draining its calls for
    ``timeout`` s; a worker that does not answer is logged, not raised."""
    try:
        await asyncio.wait_for(rpc(worker).replicated_stop(
            id=str(sid), timeout=timeout, reason=reason), timeout + 40)
    except Exception as e:
        # the worker may be frozen: once it reports the replica again, it is stopped
        # as an orphan (``Deployments._stop_orphans``)
        logger.info("stopping replica %s on %s: %r", sid, worker, e)


class ProbeAnswer(NamedTuple):
    """A rank's answer to a health probe: ``error`` None if healthy, else why not;
    ``in_flight``: its connection broke once the probe was sent (the worker died while
    ``check_health`` ran, perhaps of it)."""

    error: str | None
    in_flight: bool = False


async def probe_rank(rpc: Callable[[str], Any], sid: Any, rank: int, worker: str,
                     timeout: float) -> ProbeAnswer:
    """Probe rank ``rank`` of incarnation ``sid`` on ``worker``."""
    rid = str(rank_id(str(sid), rank))
    try:
        resp = await asyncio.wait_for(
            rpc(worker).replicated_health(id=rid, timeout=timeout), timeout + 1)
        return ProbeAnswer(None if resp["status"] == "ok" else resp["error"])
    except TimeoutError:
        return ProbeAnswer(f"no answer from {rid} within {timeout} s")
    except CommClosedError as e:
        return ProbeAnswer(f"{worker} was lost while its probe of {rid} ran: "
                           f"{type(e).__name__}: {e}", in_flight=True)
    except Exception as e:
        return ProbeAnswer(f"{type(e).__name__}: {e}")


async def replica_stats(rpc: Callable[[str], Any], placed: Mapping[str, str]
                        ) -> dict[str, dict]:
    """The figures now of the replicas ``placed`` (id -> worker), one message per worker
    (none for a worker that does not answer within ``STATS_TIMEOUT`` s)."""
    by_worker: dict[str, list[str]] = {}
    for rid, worker in placed.items():
        by_worker.setdefault(worker, []).append(rid)

    async def ask(worker: str, ids: list[str]) -> dict:
        try:
            return await asyncio.wait_for(rpc(worker).replicated_stats(ids=ids),
                                          STATS_TIMEOUT)
        except (OSError, TimeoutError):
            return {}

    found: dict[str, dict] = {}
    for part in await asyncio.gather(*(ask(w, ids) for w, ids in by_worker.items())):
        found.update(part)
    return found


async def callers_left(rpc: Callable[[str], Any], worker: str, callers: list[str]) -> int:
    """Tell ``worker`` that ``callers`` left the cluster, so that its replicas give back
    their queued calls: how many it gave back; none if it does not answer within
    ``STATS_TIMEOUT`` s (the calls then run, as before)."""
    try:
        return await asyncio.wait_for(rpc(worker).replicated_callers_left(callers=callers),
                                      STATS_TIMEOUT)
    except Exception as e:  # a worker gone, a pool closed with the scheduler: nothing to do
        logger.debug("telling %s that %s left: %r", worker, callers, e)
        return 0


async def shed_calls(rpc: Callable[[str], Any], worker: str, rid: str, keep: int,
                     table: list) -> int:
    """Replica ``rid`` gives back its queued calls beyond ``keep`` (with ``table``, the
    healthy replicas, for their callers): how many it gave back; none if it does not
    answer within ``STATS_TIMEOUT`` s."""
    try:
        return await asyncio.wait_for(rpc(worker).replicated_shed(
            id=rid, keep=keep, replicas=table), STATS_TIMEOUT)
    except (OSError, TimeoutError):
        return 0
