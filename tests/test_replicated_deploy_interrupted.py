"""An interrupted ``as_service()`` leaves nothing deployed: no one holds a handle to it,
so nothing else could ever shut it down."""

from __future__ import annotations

import asyncio

import pytest
from distributed import Client
from distributed.comm import CommClosedError
from distributed.utils_test import async_poll_for
from replicated_services import GATES, Adder
from test_replicated import assert_nothing_left, cluster, hosted

from dask_services.replicated import DeploymentError, _scheduler

pytestmark = pytest.mark.timeout(60)
EXT = "dask_services_replicated"


@cluster()
async def test_an_as_service_timed_out_by_its_caller_is_shut_down(c, s, *workers):
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(Adder.options(name="impatient", replicas=2).as_service(
            setup_gate="never-opened", client=c), 1.0)
    assert GATES.get("never-opened-reached") is not None  # it was in its setup
    await assert_nothing_left(s, workers)
    # the name is free again
    svc = await Adder.options(name="impatient").as_service(3, client=c)
    assert await svc.add.route(1) == 4
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_an_as_service_whose_client_closes_is_shut_down(c, s, *workers):
    other = await Client(s.address, asynchronous=True)
    deploying = asyncio.ensure_future(Adder.options(name="orphan", replicas=2).as_service(
        setup_gate="closed-meanwhile", client=other))
    await async_poll_for(lambda: "closed-meanwhile-reached" in GATES, timeout=20)
    await other.close()
    # (a CommClosedError naming the connection, before)
    with pytest.raises(DeploymentError, match="as_service.. of orphan was cut short: its "
                                              "client closed while it waited") as info:
        await deploying
    assert isinstance(info.value.__cause__, CommClosedError)
    # the client could not send the shutdown: the scheduler saw it leave
    await assert_nothing_left(s, workers)
    events = [e for _, e in await c.get_events("dask_services")
              if e["action"] == "deploy-abandoned"]
    assert [e["service"] for e in events] == ["orphan"]
    # a client leaving later does not touch what it deployed and waited for
    third = await Client(s.address, asynchronous=True)
    await Adder.options(name="kept").as_service(client=third)
    await third.close()
    await async_poll_for(lambda: third.id not in s.clients, timeout=10)  # removed
    assert "kept" in s.extensions[EXT].deployments
    assert sum(len(ids) for ids in hosted(workers).values()) == 1
    await s.extensions[EXT].shutdown(None, "kept", 0)
    await assert_nothing_left(s, workers)


@cluster()
async def test_slot_counts_are_kept_for_a_bounded_number_of_names(c, s, *workers):
    kept = _scheduler.NAMES_KEPT
    _scheduler.NAMES_KEPT = 2
    try:
        ids: dict[str, list[str]] = {}
        for name in ["a", "b", "c", "a"]:
            svc = await Adder.options(name=name, replicas=2).as_service(client=c)
            ids.setdefault(name, []).extend(r["id"] for r in await svc.replicas())
            await svc.shutdown()
        assert list(s.extensions[EXT]._slots_made) == ["c", "a"]
        # "a" was dropped and deployed again: its replicas got ids of their own
        assert len(set(ids["a"])) == 4, ids
    finally:
        _scheduler.NAMES_KEPT = kept
    await assert_nothing_left(s, workers)


@cluster()
async def test_an_as_service_cancelled_once_its_replicas_are_healthy_is_shut_down(
        c, s, *workers):
    from dask_services.replicated._handle import ReplicatedService

    original = ReplicatedService._refresh
    reached = asyncio.Event()

    async def held(self):  # the handle's first table fetch, after the wait ended well
        reached.set()
        await asyncio.Event().wait()

    ReplicatedService._refresh = held
    try:
        deploying = asyncio.ensure_future(
            Adder.options(name="late-cancel").as_service(client=c))
        await reached.wait()
        assert s.extensions[EXT].deployments["late-cancel"].deploying_client is None
        deploying.cancel()
        with pytest.raises(asyncio.CancelledError):
            await deploying
    finally:
        ReplicatedService._refresh = original
    await assert_nothing_left(s, workers)
