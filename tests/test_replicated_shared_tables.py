"""Handles of one service in one process (one per task that calls it) share the replica
table they fetch: the pure cache, then tasks calling a service on a cluster."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from replicated_services import Adder, call_from_task
from test_replicated import assert_nothing_left, cluster

from dask_services.replicated import _shared_tables as shared_tables

pytestmark = pytest.mark.timeout(60)


class Scheduler:
    """Answers ``replicated_table`` once ``release`` is set (with ``hold``: once the
    request's own event in ``gates`` is), counting the requests."""

    def __init__(self, hold: bool = False) -> None:
        self.asked = 0
        self.release = asyncio.Event()
        self.hold = hold
        self.gates: list[asyncio.Event] = []

    async def replicated_table(self, name: str, uid: str | None) -> dict | None:
        self.asked += 1
        asked = self.asked
        gate = self.release
        if self.hold:
            gate = asyncio.Event()
            self.gates.append(gate)
        await gate.wait()
        return None if name == "gone" else {"replicas": [], "asked": asked}


async def turns(n: int = 3) -> None:
    """Let the loop run ``n`` turns (a fetch starts, then its request is sent)."""
    for _ in range(n):
        await asyncio.sleep(0)


class Owner:
    """Stands for a Worker or a Client."""


def test_a_fetch_under_way_is_joined_and_a_recent_table_is_taken():
    asyncio.run(_joined_and_recent())


async def _joined_and_recent() -> None:
    owner, scheduler = Owner(), Scheduler()
    fetches = [asyncio.ensure_future(shared_tables.fetch(owner, scheduler, "svc", "u"))
               for _ in range(5)]
    await turns(1)
    scheduler.release.set()
    answers = await asyncio.gather(*fetches)
    assert scheduler.asked == 1 and len({a[1] for a in answers}) == 1
    info, fetched = shared_tables.recent(owner, "svc", "u", max_age=60)
    assert info == {"replicas": [], "asked": 1} and fetched <= time.monotonic()
    # too old, another deployment, another owner: none
    assert shared_tables.recent(owner, "svc", "u", max_age=0) is None
    assert shared_tables.recent(owner, "svc", "other", max_age=60) is None
    assert shared_tables.recent(Owner(), "svc", "u", max_age=60) is None
    # a fetch once the last is over asks again
    await shared_tables.fetch(owner, scheduler, "svc", "u")
    assert scheduler.asked == 2
    # a service that is gone is never taken from the cache
    await shared_tables.fetch(owner, scheduler, "gone", None)
    assert shared_tables.recent(owner, "gone", None, max_age=60) is None


def test_the_tables_kept_per_owner_are_bounded(monkeypatch):
    monkeypatch.setattr(shared_tables, "KEPT", 3)
    owner = Owner()

    async def fetch_five(owner: Owner) -> None:
        scheduler = Scheduler()
        scheduler.release.set()
        for i in range(5):
            await shared_tables.fetch(owner, scheduler, f"svc-{i}", None)

    asyncio.run(fetch_five(owner))
    assert [name for name, _ in shared_tables._BY_OWNER[owner]] == [
        "svc-2", "svc-3", "svc-4"]
    del owner  # the owner gone (a closed client, a closed worker): its tables too
    gc.collect()
    assert not any(isinstance(o, Owner) for o in shared_tables._BY_OWNER)


@cluster(config={"dask_services.replicated.refresh-interval": "30s"})
async def test_tasks_calling_a_service_share_their_handles_table(c, s, *workers):
    """Every task unpickles a handle of its own; the handles on a worker fetch the
    table once between them (one request per task before)."""
    svc = await Adder.options(name="shared-table").as_service(1, client=c)
    asked = []
    table = s.handlers["replicated_table"]

    def counted(comm, **kwargs):
        asked.append(kwargs["name"])
        return table(comm, **kwargs)

    s.handlers["replicated_table"] = counted
    results = await c.gather(c.map(call_from_task, [svc] * 40, range(40)))
    assert results == [i + 1 for i in range(40)]
    # one per worker, and the replica's own handle (for its `self.peers`)
    assert 1 <= len(asked) <= len(workers) + 1, asked
    s.validate_state()
    await svc.shutdown()
    # a handle unpickled after the shutdown (which may take the table cached before it)
    # is told so by the replica's worker or the scheduler
    with pytest.raises(Exception, match="shut down"):
        await c.submit(call_from_task, svc, 1)
    await assert_nothing_left(s, workers)


def test_a_handle_needing_the_table_now_does_not_join_an_older_fetch():
    asyncio.run(_fresh())


async def _fresh() -> None:
    owner, scheduler = Owner(), Scheduler(hold=True)
    older = asyncio.ensure_future(shared_tables.fetch(owner, scheduler, "svc", None))
    await turns()
    # a call failed after that fetch was sent: the table it needs is one asked for now
    newer = asyncio.ensure_future(shared_tables.fetch(owner, scheduler, "svc", None,
                                                      sent_after=time.monotonic()))
    await turns()
    assert scheduler.asked == 2
    scheduler.gates[1].set()  # the newer answer arrives first, the older one last
    _, newer_sent = await newer
    scheduler.gates[0].set()
    _, older_sent = await older
    assert older_sent < newer_sent
    # the cache keeps the newer answer, whichever arrived last
    assert shared_tables.recent(owner, "svc", None, max_age=60)[1] == newer_sent


class Transport:
    """What a handle talks through, on a worker or a client (``_handle.Transport``)."""

    def __init__(self, owner: Owner, scheduler: Scheduler) -> None:
        self.owner, self.scheduler = owner, scheduler

    def closed(self) -> bool:
        return False


def test_handles_starting_together_share_one_fetch_and_a_refresh_asks_anew():
    asyncio.run(_handles_together())


async def _handles_together() -> None:
    from dask_services.replicated._handle import ReplicatedService

    transport = Transport(Owner(), Scheduler())
    handles = [ReplicatedService("svc", Adder, {}, transport=transport, uid="u")
               for _ in range(4)]
    # handles unpickled by tasks starting one after the other: the fetch the first
    # sent is the others' too
    loads = []
    for h in handles[:3]:
        loads.append(asyncio.ensure_future(h._ready_table()))
        await turns()
    assert transport.scheduler.asked == 1
    # a handle that needs the table as it is now does not take that one
    refresh = asyncio.ensure_future(handles[3]._refresh())
    await turns()
    assert transport.scheduler.asked == 2
    transport.scheduler.release.set()
    await asyncio.gather(*loads, refresh)
    assert all(h._table_time > 0 for h in handles)
