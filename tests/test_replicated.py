"""Replicated services on a cluster (in-process workers, validation on)."""

from __future__ import annotations

import asyncio
import collections
import gc
import pickle

import numpy as np
import pytest
from distributed import Client
from distributed.core import Status
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster
from replicated_services import (
    GATES,
    STARTS,
    Adder,
    BadSetup,
    call_from_async_task,
    call_from_task,
    inc,
    whoami_from_task,
)
from utils import any_task_suspended_in

from dask_services.replicated import (
    DeploymentError,
    EndpointRefused,
    ReplicatedService,
    ServiceOverloaded,
    ServiceShutdown,
    ServiceUnavailable,
)
from dask_services.replicated import _lifecycle as lc
from dask_services.replicated._watch import ReplacementWatch

pytestmark = pytest.mark.timeout(60)

THREE_WORKERS = [("127.0.0.1", 1)] * 3
FAST_PROBES = {"dask_services.replicated.health-check-period": "50ms",
               # (a loaded machine's event loop may stall for seconds: a healthy
               # replica must not time out)
               "dask_services.replicated.health-check-timeout": "5s"}


def cluster(**kwargs):
    """gen_cluster with validation on; afterwards the scheduler and workers are checked."""
    kwargs.setdefault("client", True)
    kwargs.setdefault("nthreads", THREE_WORKERS)
    kwargs.setdefault("timeout", 45)

    def decorator(fn):
        async def body(c, s, *workers):
            assert s.validate and all(w.state.validate for w in workers)
            try:
                await fn(c, s, *workers)
            finally:
                GATES.clear()
            s.validate_state()
            for w in workers:
                w.validate_state()

        body.__name__ = fn.__name__
        return gen_cluster(**kwargs)(body)

    return decorator


def hosted(workers) -> dict[str, list[str]]:
    """Replica ids held by each worker's extension."""
    return {w.address: sorted(w.extensions["dask_services_replicated"].replicas)
            for w in workers if w.status.name == "running"}


async def assert_nothing_left(s, workers) -> None:
    gc.collect()
    await async_poll_for(lambda: not any(hosted(workers).values()), timeout=10)
    assert not s.extensions["dask_services_replicated"].deployments


async def replica_events(c, action: str) -> list[dict]:
    """Events of the scheduler's ``dask_services`` topic with this action."""
    return [e for _, e in await c.get_events("dask_services") if e["action"] == action]


def healthy_count(s, svc) -> int:
    """Healthy replicas of ``svc`` according to the scheduler."""
    slots = s.extensions["dask_services_replicated"].deployments[svc.name].slots
    return sum(m.state.value == "healthy" for m in slots.values())


def healthy(rows) -> list[dict]:
    return [r for r in rows if r["state"] == "healthy"]


@cluster()
async def test_route_fanout_sync_and_async_endpoints(c, s, *workers):
    svc = await Adder.options(replicas=3).as_service(10, client=c)
    assert await svc.add.route(1) == 11
    assert await svc.add.route(x=5) == 15
    ids = await svc.whoami.fanout()
    assert len(set(ids)) == 3
    rows = await svc.replicas()
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert {r["worker"] for r in rows} == {w.address for w in workers}  # spread out
    assert all(r["state"] == "healthy" and r["in_flight"] == 0 and r["queued"] == 0
               and r["last_error"] is None for r in rows)
    names = await svc.thread_name.fanout()
    assert all(n.startswith("replica-") for n in names)  # sync endpoints: replica threads
    assert sorted(sum(hosted(workers).values(), [])) == sorted(ids)
    metrics = await svc.metrics()
    assert sum(m["calls"] for m in metrics) == 2 + 3 + 3
    assert all(m["p50_ms"] >= 0 and m["p99_ms"] >= m["p50_ms"] for m in metrics)
    await svc.shutdown()
    await assert_nothing_left(s, workers)
    with pytest.raises(ServiceShutdown, match="shut down"):
        await svc.add.route(1)


@cluster()
async def test_endpoint_error_reaches_caller_and_replica_stays_healthy(c, s, *workers):
    svc = await Adder.options(replicas=1).as_service(client=c)
    with pytest.raises(ValueError, match="bad input 7"):
        await svc.fail.route("bad input 7")
    (row,) = await svc.replicas()
    assert row["state"] == "healthy"
    assert await svc.add.route(1) == 1  # same replica, still serving
    (m,) = await svc.metrics()
    assert (m["calls"], m["errors"]) == (2, 1)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_only_endpoints_are_callable(c, s, *workers):
    svc = await Adder.options(replicas=1).as_service(client=c)
    for name in ("helper", "setup", "check_health", "stop", "offset", "_call_me"):
        with pytest.raises(EndpointRefused, match="not an endpoint of Adder"):
            getattr(svc, name).route()
    # The worker refuses too, whatever a caller sends.
    with pytest.raises(EndpointRefused, match="'helper' is not an endpoint"):
        await svc._call("helper", (), {})
    with pytest.raises(TypeError, match=r"svc.add.route"):
        svc.add(1)
    await svc.shutdown()


@cluster()
async def test_setup_error_is_raised_by_as_service_and_nothing_stays(c, s, *workers):
    with pytest.raises(KeyError, match="model weights not found"):
        await BadSetup.options(replicas=2).as_service(client=c)
    await assert_nothing_left(s, workers)
    events = await replica_events(c, "replica-unhealthy")
    assert events and "model weights not found" in events[0]["detail"]


@cluster()
async def test_setup_failing_repeatedly_shows_unhealthy_in_replicas(c, s, *workers):
    import tempfile

    marker = tempfile.mktemp(prefix="dask-services-test-")
    svc = await Adder.options(replicas=1).as_service(5, fail_if_exists=marker, client=c)
    open(marker, "w").close()
    try:
        with pytest.raises(FileExistsError, match="setup refused"):
            await svc.scale(2)
        rows = await svc.replicas()
        bad = [r for r in rows if r["state"] == "unhealthy"]
        assert len(bad) == 1 and "setup refused" in bad[0]["last_error"]
        assert len(healthy(rows)) == 1
        assert await svc.add.route(1) == 6  # the healthy replica still serves
    finally:
        import os

        os.remove(marker)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_overload_fails_fast_and_queue_limits_hold(c, s, w):
    svc = await Adder.options(replicas=1, max_concurrency=1, max_queued=2).as_service(client=c)
    running = svc.wait_for.route("g", 1)
    queued = [svc.wait_for.route("g", i) for i in (2, 3)]

    async def counts():
        (row,) = await svc.replicas()
        return row["in_flight"], row["queued"]

    await until_equal(counts, (1, 2), timeout=10)
    with pytest.raises(ServiceOverloaded, match="max_queued=2"):
        await asyncio.wait_for(svc.wait_for.route("g", 4), 5)  # fails fast, not queued
    GATES["g"].set()
    assert [await running, *[await q for q in queued]] == [1, 2, 3]
    (m,) = await svc.metrics()
    assert m["overloaded"] == 1 and m["calls"] == 3
    await svc.shutdown()
    await assert_nothing_left(s, [w])


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_shutdown_drains_running_calls_and_fails_queued_ones(c, s, w):
    svc = await Adder.options(replicas=1, max_concurrency=1).as_service(client=c)
    running = svc.wait_for.route("g", 42)
    queued = svc.wait_for.route("g", 43)
    ext = w.extensions["dask_services_replicated"]
    await async_poll_for(lambda: any(r.gate.queued for r in ext.replicas.values()), 10)
    (rep,) = ext.replicas.values()
    stopping = asyncio.ensure_future(svc.shutdown(timeout=20))
    await async_poll_for(lambda: rep.closing, 10)
    with pytest.raises(ServiceShutdown, match="queued .* never started"):
        await queued
    # the worker's drain is parked on the gate until the call in flight ends
    await async_poll_for(lambda: any_task_suspended_in("CallGate.wait_idle", rep.gate), 10)
    assert not stopping.done() and rep.gate.in_flight == 1
    GATES["g"].set()
    assert await running == 42
    await stopping
    assert rep.service.stopped  # stop() ran
    await assert_nothing_left(s, [w])


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_shutdown_timeout_cancels_calls_still_running(c, s, w):
    svc = await Adder.options(replicas=1).as_service(client=c)
    running = svc.wait_for.route("never", 1)
    ext = w.extensions["dask_services_replicated"]
    await async_poll_for(lambda: any(r.gate.in_flight for r in ext.replicas.values()), 10)
    await svc.shutdown(timeout=0.2)
    with pytest.raises(ServiceShutdown, match="cancelled"):
        await running
    await assert_nothing_left(s, [w])


@cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_least_loaded_sends_fewer_calls_to_a_slow_replica(c, s, *workers):
    svc = await Adder.options(replicas=2, max_concurrency=8).as_service(client=c)
    slow, fast = sorted(await svc.whoami.fanout())
    # (far apart, so that a loaded machine's own delay per call does not even them out)
    await svc.set_delays.fanout({slow: 1.0, fast: 0.01})
    counts = {slow: 0, fast: 0}

    async def caller():
        for _ in range(10):
            rid, value = await svc.slow_add.route(1)
            assert value == 1
            counts[rid] += 1

    await asyncio.gather(*(caller() for _ in range(4)))
    assert sum(counts.values()) == 40
    print("calls per replica (slow, fast):", counts[slow], counts[fast])
    assert counts[slow] < 10, counts  # round robin would give it 20
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_round_robin_and_custom_router(c, s, *workers):
    svc = await Adder.options(replicas=2, router="round_robin").as_service(client=c)
    got = [await svc.whoami.route() for _ in range(6)]
    assert got[:2] * 3 == got and len(set(got)) == 2
    await svc.shutdown()

    class Last:
        def choose(self, replicas):
            return max(replicas, key=lambda r: r.id)

    svc = await Adder.options(replicas=2, router=Last).as_service(client=c)
    ids = sorted(await svc.whoami.fanout())
    assert {await svc.whoami.route() for _ in range(4)} == {ids[-1]}
    await svc.shutdown()

    class ById:  # an id is taken as its replica
        def choose(self, replicas):
            return min(r.id for r in replicas)

    svc = await Adder.options(replicas=2, router=ById).as_service(client=c)
    ids = sorted(await svc.whoami.fanout())
    assert {await svc.whoami.route() for _ in range(4)} == {ids[0]}
    await svc.shutdown()

    class Wrong:  # None, or a replica it remembers that is no longer there
        def choose(self, replicas):
            return None

    svc = await Adder.options(replicas=2, router=Wrong).as_service(client=c)
    # it raised AttributeError ('NoneType' object has no attribute 'id'), and a replica
    # not in the list "coroutine raised StopIteration"
    with pytest.raises(ValueError, match=r"the router of service .*\(Wrong.choose\) "
                                         r"returned None, which is not one of the healthy"):
        await svc.add.route(2)
    await svc.shutdown()
    svc = await Adder.options(replicas=2, router="power_of_two").as_service(client=c)
    assert await svc.add.route(2) == 2
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_sessions_are_sticky_and_spread_out(c, s, *workers):
    svc = await Adder.options(replicas=3).as_service(client=c)
    async with svc.session() as one:
        first = [await svc.whoami.route() for _ in range(5)]
        async with svc.session() as two:
            second = [await svc.whoami.route() for _ in range(5)]
            r2 = two.replica
        third = await svc.whoami.route()
        r1 = one.replica
    assert set(first) == {r1} and third == r1
    assert set(second) == {r2} and r2 != r1  # a new session takes the least-loaded one
    assert one.replica is None and two.replica is None  # released on exit
    sticky = await Adder.options(replicas=3, router="session_affinity").as_service(client=c)
    assert len({await sticky.whoami.route() for _ in range(6)}) == 1
    await sticky.shutdown()
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_session_moves_when_its_replica_worker_leaves(c, s, *workers):
    svc = await Adder.options(replicas=2).as_service(client=c)
    async with svc.session() as sess:
        before = await svc.whoami.route()
        (row,) = [r for r in await svc.replicas() if r["id"] == before]
        await next(w for w in workers if w.address == row["worker"]).close()
        after = [await svc.whoami.route() for _ in range(4)]
    assert len(set(after)) == 1 and after[0] != before and sess.replica is None
    await async_poll_for(lambda: healthy_count(s, svc) == 2, timeout=20)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


async def until_equal(get, want, timeout: float = 20) -> None:
    """Poll ``await get()`` until it equals ``want``; after ``timeout`` s, fail showing
    the last value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (got := await get()) != want:
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.01)


async def loads(svc) -> dict[str, tuple[int, int]]:
    """Running and queued calls of each healthy replica, now."""
    return {r["id"]: (r["in_flight"], r["queued"]) for r in healthy(await svc.replicas())}


async def one_load(svc, rid: str) -> tuple[int, int] | None:
    return (await loads(svc)).get(rid)


async def totals(svc) -> list[int]:
    """Running and queued calls of the healthy replicas, summed per replica, sorted."""
    return sorted(sum(v) for v in (await loads(svc)).values())


@cluster()
async def test_calls_queued_before_replicas_were_added_move_to_them(c, s, *workers):
    """A burst queued on the one replica there was is spread over the replicas added
    after it (its last queued calls go back to the caller, sent on to the new ones);
    calls of a session stay where their session is."""
    svc = await Adder.options(replicas=1, max_concurrency=1).as_service(client=c)
    burst = [svc.wait_then_whoami.route("burst") for _ in range(12)]
    async with svc.session():
        held = [svc.wait_then_whoami.route("burst") for _ in range(3)]
    (first,) = await loads(svc)
    await until_equal(lambda: one_load(svc, first), (1, 14))

    async def spread(expected: list[int]) -> None:
        await until_equal(lambda: totals(svc), expected)

    await svc.scale(2)
    await spread([7, 8])  # 7 moved: the second replica runs one of them
    await svc.scale(3)
    # 5 a replica: the first keeps its running call, the session's 3 and 1 more; calls
    # moved once move again (3 from the first replica, 2 from the second)
    await spread([5, 5, 5])
    events = await replica_events(c, "calls-rebalanced")
    assert [(e["moved"], e["healthy"]) for e in events] == [(7, 2), (5, 3)]
    GATES["burst"].set()
    served = collections.Counter([await call for call in burst])
    assert len(served) == 3 and sorted(served.values()) == [2, 5, 5], served
    assert {await call for call in held} == {first}
    (m,) = [m for m in await svc.metrics() if m["id"] == first]
    assert m["calls"] == 5 and m["errors"] == 0  # the moved calls are no errors
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_pass_waits_for_the_calls_the_last_pass_moved_to_land(c, s, *workers):
    """Calls given back are counted on no replica until their callers send them on: a
    second pass (a third replica turning healthy) right after the first took them for
    gone and shed too many, and callers that each know only their own call spread them
    at random ([3, 6, 6] where 5 each were wanted)."""
    svc = await Adder.options(replicas=1, max_concurrency=1).as_service(client=c)
    callers = [ReplicatedService(svc.name, Adder, {}) for _ in range(15)]
    third_up = asyncio.Event()

    def slow_to_send_on(handle):  # callers busy with other work until a third replica
        send = handle._send

        async def answer(target, msg):
            got = await send(target, msg)
            if got.get("status") == "moved":
                await third_up.wait()
            return got

        handle._send = answer

    for handle in callers:
        slow_to_send_on(handle)
    burst = [h.wait_then_whoami.route("in-transit") for h in callers]
    (first,) = await loads(svc)
    await until_equal(lambda: one_load(svc, first), (1, 14))
    await svc.scale(2)
    await svc.scale(3)  # while the calls the first pass moved are on their way
    third_up.set()
    await until_equal(lambda: totals(svc), [5, 5, 5])
    GATES["in-transit"].set()
    assert len(await asyncio.gather(*burst)) == 15
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_call_given_back_that_then_finds_no_room_is_sent_again_not_refused(
        c, s, *workers):
    """Callers that moved calls to an added replica at once may fill its queue: a call
    taken in once is re-sent, not refused for load; a call never taken in is refused."""
    svc = await Adder.options(replicas=2).as_service(client=c)
    send = svc._send
    sent: list[bool] = []
    scripted = [{"status": "moved", "message": "gave the call back", "load": 3},
                {"status": "overloaded", "message": "replica x is overloaded"}]

    async def answers(target, msg):
        sent.append(msg.get("movable", False))
        return scripted.pop(0) if scripted else await send(target, msg)

    svc._send = answers
    assert await svc.add.route(1) == 1
    assert sent == [True, True, True]
    scripted[:] = [{"status": "overloaded", "message": "replica x is overloaded"}]
    with pytest.raises(ServiceOverloaded, match="replica x is overloaded"):
        await svc.add.route(2)
    # once only: a second replica full after a move is an overload, said so
    scripted[:] = [{"status": "moved", "message": "gave the call back", "load": 3},
                   {"status": "overloaded", "message": "replica x is overloaded"},
                   {"status": "overloaded", "message": "replica y is overloaded"}]
    with pytest.raises(ServiceOverloaded, match="replica y is overloaded"):
        await svc.add.route(4)
    async with svc.session():  # a session's calls are never given back
        assert await svc.add.route(3) == 3
    assert sent[-1] is False
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_replicas_crowded_on_one_worker_spread_to_workers_that_join(c, s, a):
    """Workers coming back one by one (``client.restart()``) had every replica placed on
    the first to return, for good. Replicas now move to workers that join: a new one is
    started there, and the one it replaces stops once it is healthy, so the service
    never has fewer healthy replicas than it should."""
    from distributed import Worker

    svc = await Adder.options(replicas=3).as_service(client=c)
    dep = s.extensions["dask_services_replicated"].deployments[svc.name]
    assert {r["worker"] for r in await svc.replicas()} == {a.address}
    fewest_healthy = []
    notify = dep.notify

    def healthy_at_every_change():  # every state change of a replica notifies
        fewest_healthy.append(sum(m.state.value == "healthy" for m in dep.slots.values()))
        notify()

    dep.notify = healthy_at_every_change
    async with Worker(s.address, nthreads=1, validate=True) as b, \
            Worker(s.address, nthreads=1, validate=True) as w3:
        everywhere = {a.address, b.address, w3.address}

        async def spread() -> bool:
            rows = await svc.replicas()
            return (len(rows) == 3 and all(r["state"] == "healthy" for r in rows)
                    and {r["worker"] for r in rows} == everywhere)

        await until_equal(spread, True, timeout=30)
        await async_poll_for(lambda: not dep.moves, timeout=10)
        assert sorted(len(v) for v in hosted([a, b, w3]).values()) == [1, 1, 1]
        assert min(fewest_healthy) >= 3  # made before broken
        assert len(await replica_events(c, "replica-spreading")) == 2
        assert sorted(await svc.add.fanout(1)) == [1, 1, 1]
        await svc.shutdown()
        await assert_nothing_left(s, [a, b, w3])


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_a_replica_is_replaced_once_when_workers_join_as_its_move_ends(c, s, a):
    """The replica a move replaces was stopped a step after its successor turned healthy:
    a spreading check in between (a worker turning running then) moved it again, and the
    service kept a replica too many."""
    from distributed import Worker

    svc = await Adder.options(replicas=3).as_service(client=c)
    ext = s.extensions["dask_services_replicated"]
    dep = ext.deployments[svc.name]
    apply = ext._apply

    def check_in_the_same_step(dep_, slot, actions, *args, **kwargs):
        if slot in dep_.moves and any(isinstance(x, lc.StateChanged) and
                                      x.state.value == "healthy" for x in actions):
            ext._spread_soon(dep_)
        return apply(dep_, slot, actions, *args, **kwargs)

    ext._apply = check_in_the_same_step
    async with Worker(s.address, nthreads=1, validate=True) as b:
        await async_poll_for(lambda: len(dep.slots) == 3 and not dep.moves
                             and {m.worker for m in dep.slots.values()} == {a.address,
                                                                             b.address},
                             timeout=20)
        assert len(healthy(await svc.replicas())) == 3
        await svc.shutdown()
        await assert_nothing_left(s, [a, b])


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_scale_during_a_move_counts_the_move_once(c, s, a):
    """``scale(4)`` while a move's new replica starts saw 4 replicas (the new one and the
    one it replaces), added none, and the service ended with 3."""
    from distributed import Worker

    GATES["move-setup"] = asyncio.Event()
    GATES["move-setup"].set()
    svc = await Adder.options(replicas=3).as_service(setup_gate="move-setup", client=c)
    dep = s.extensions["dask_services_replicated"].deployments[svc.name]
    GATES["move-setup"].clear()  # the move's new replica waits in its setup
    async with Worker(s.address, nthreads=1, validate=True) as b:
        await async_poll_for(lambda: dep.moves, timeout=20)
        assert len(dep.active()) == 3
        scaling = asyncio.ensure_future(svc.scale(4))
        await async_poll_for(lambda: len(dep.active()) == 4, timeout=20)
        GATES["move-setup"].set()
        await scaling
        await async_poll_for(lambda: not dep.moves and len(dep.slots) == 4, timeout=20)
        assert len(healthy(await svc.replicas())) == 4
        await svc.shutdown()
        await assert_nothing_left(s, [a, b])


@cluster()
async def test_scale_up_and_down(c, s, *workers):
    svc = await Adder.options(replicas=1).as_service(3, client=c)
    await svc.scale(3)
    rows = await svc.replicas()
    assert len(healthy(rows)) == 3
    assert len(set(await svc.whoami.fanout())) == 3
    await svc.scale(1)
    rows = await svc.replicas()
    assert len(rows) == 1 and rows[0]["state"] == "healthy"
    assert sum(len(v) for v in hosted(workers).values()) == 1
    assert await svc.add.route(1) == 4
    with pytest.raises(ValueError, match="n >= 1"):
        svc.scale(0)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_pickled_handle_in_tasks_and_submit_futures(c, s, *workers):
    svc = await Adder.options(replicas=2).as_service(100, client=c)
    clone = pickle.loads(pickle.dumps(svc))
    assert clone.name == svc.name
    assert await c.submit(call_from_task, svc, 1) == 101
    assert await c.submit(call_from_async_task, svc, 2) == 102
    f = svc.add.submit(3)
    g = c.submit(inc, f)
    h = svc.add.submit(f)  # a call's result as the argument of another call
    assert await f == 103 and await g == 104 and await h == 203
    assert sorted(await svc.ask_peer.route(1)) == [101, 101]  # replicas call their peers
    del f, g, h
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_calls_from_many_tasks_spread_over_the_replicas(c, s, *workers):
    # every task unpickles a fresh handle that knows no load yet: they used to all pick
    # the first replica, so replicas added for the load got none of it
    for router in ["least_loaded", "round_robin"]:
        svc = await Adder.options(replicas=4, router=router).as_service(client=c)
        ids = set(await svc.whoami.fanout())
        got = await c.gather(c.map(whoami_from_task, [svc] * 60, range(60)))
        assert set(got) == ids  # a replica missed by 60 random picks: < 4 * 0.75**60
        got = await c.gather([svc.whoami.submit() for _ in range(60)])
        assert set(got) == ids
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST_PROBES)
async def test_failed_health_probe_relaunches_the_replica(c, s, *workers):
    svc = await Adder.options(replicas=2).as_service(7, client=c)
    ids = sorted(await svc.whoami.fanout())
    plugin = s.extensions["dask_services_replicated"]
    sick = ids[0]
    await svc._call("make_sick", (), {}, pin=sick)

    def recovered():
        states = [(str(m.id), m.state.value) for m in plugin.deployments[svc.name].slots.values()]
        return sick not in dict(states) and all(st == "healthy" for _, st in states)

    await async_poll_for(recovered, timeout=20)
    new_ids = sorted(await svc.whoami.fanout())
    assert sick not in new_ids and ids[1] in new_ids
    events = await replica_events(c, "replica-recovering")
    assert any("health probe failed" in (e["detail"] or "") for e in events)
    assert await svc.add.route(1) == 8
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config={"dask_services.replicated.health-check-period": 0,
                 "dask_services.replicated.refresh-interval": 0})
async def test_a_health_check_period_of_zero_turns_probes_off(c, s, *workers):
    from dask_services.replicated._handle import WATCH_FLOOR_S

    svc = await Adder.options(replicas=1).as_service(7, client=c)
    plugin = s.extensions["dask_services_replicated"]
    assert plugin._probe is None
    # a sick replica is not probed, so stays; calls go on reaching it
    await svc.make_sick.route()
    assert await svc.add.route(1) == 8
    assert [r["state"] for r in await svc.replicas()] == ["healthy"]
    # a call's watch for a replaced replica does not run without pause
    assert svc._watch_period() == WATCH_FLOOR_S
    assert await svc.slow_add.route(1, 0.2) == ((await svc.whoami.route()), 8)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_closing_worker_answers_a_late_start_as_lost_without_a_traceback(
        c, s, *workers):
    """A closing cluster closes its workers one by one; the scheduler relaunches the first
    ones' replicas on workers it does not know are closing too, whose replica plugin may
    have closed already: the start is answered as lost, not logged by distributed as a
    missing handler with a traceback."""
    svc = await Adder.options(replicas=2).as_service(0, client=c)
    w = workers[0]
    plugin = w.extensions["dask_services_replicated"]
    close, answers = plugin.close, []

    async def close_then_asked_to_start():
        await close()
        answers.append(await s.rpc(w.address).replicated_start(
            id="late.0", name=svc.name, blob=b"", max_concurrency=1, max_queued=1,
            setup_timeout=1, peers_of=svc.name))

    plugin.close = close_then_asked_to_start
    with captured_logger("distributed.core") as log:
        await w.close()
    assert answers == [{"status": "lost", "error": f"worker {w.address} is closing"}]
    assert "No handler" not in log.getvalue()
    assert await svc.add.route(1) == 1
    await svc.shutdown()
    await assert_nothing_left(s, workers[1:])


@cluster()
async def test_a_replica_plugin_torn_down_on_running_workers_leaves_no_handler(
        c, s, *workers):
    svc = await Adder.options(replicas=2).as_service(0, client=c)  # plugins installed
    await svc.shutdown()
    for w in workers:  # as distributed tears a worker plugin down
        await w.extensions["dask_services_replicated"].teardown(w)
        assert not [name for name in w.handlers if name.startswith("replicated_")]
        assert "dask_services_replicated" not in w.extensions


@cluster()
async def test_retiring_a_worker_moves_its_replica(c, s, *workers):
    svc = await Adder.options(replicas=2).as_service(1, client=c)
    rows = await svc.replicas()
    leaving = rows[0]["worker"]
    calls = [svc.slow_add.route(i, 0.05) for i in range(20)]
    retired = await asyncio.wait_for(c.retire_workers([leaving]), 30)
    assert leaving in retired
    assert [v for _, v in await asyncio.gather(*calls)] == [i + 1 for i in range(20)]
    await async_poll_for(lambda: healthy_count(s, svc) == 2, timeout=20)
    rows = await svc.replicas()
    assert leaving not in {r["worker"] for r in rows}
    assert await svc.add.route(1) == 2
    await svc.shutdown()
    await assert_nothing_left(s, [w for w in workers if w.address != leaving])


RETIRE_FAST = {"dask_services.replicated.refresh-interval": "100ms",
               "dask_services.replicated.health-check-period": "100ms",
               "dask_services.replicated.health-check-timeout": "5s"}


async def successor_seen_by_watches(handle, old_id: str, aborted: list) -> list:
    """Counts the looks of ``handle``'s replacement watches once its table shows a
    successor of replica ``old_id`` (each look would abort a call on a replaced replica),
    until two were made or one aborted (``aborted``)."""
    base = old_id.rsplit(".", 1)[0]
    looks: list[str | None] = []
    original = ReplacementWatch._look

    async def look(self) -> None:
        await original(self)
        if any(str(r.id) != old_id and str(r.id).rsplit(".", 1)[0] == base
               for r in handle._table):
            looks.append(self.replaced)
            if self.replaced:
                aborted.append(self.replaced)

    ReplacementWatch._look = look
    try:
        await async_poll_for(lambda: len(looks) >= 2 or aborted, timeout=20)
    finally:
        ReplacementWatch._look = original
    return looks


@cluster(config=RETIRE_FAST)
async def test_a_retired_workers_replica_finishes_the_call_it_had_started(c, s, *workers):
    """Retiring a worker replaces its replica elsewhere at once, and the old one drains
    (``drain-timeout``): the call it had started ends there, run once, though the worker
    closes meanwhile and the caller's watch sees the replica replaced."""
    svc = await Adder.options(replicas=1, max_concurrency=4).as_service(0, client=c)
    (row,) = await svc.replicas()
    leaving = next(w for w in workers if w.address == row["worker"])
    plugin = leaving.extensions["dask_services_replicated"]
    call = asyncio.ensure_future(svc.count_and_wait.route("drained-gate", "drained"))
    await async_poll_for(lambda: STARTS.get("drained") == 1, timeout=10)
    # data to move first: the scheduler removes the worker only then, which breaks the
    # connection of the replica's stop while the replica still drains there
    held = await c.scatter([np.full(5_000_000, i) for i in range(4)],
                           workers=[leaving.address])
    assert leaving.address in await asyncio.wait_for(c.retire_workers([leaving.address]),
                                                     30)
    await async_poll_for(lambda: leaving.address not in s.workers, timeout=20)
    await async_poll_for(lambda: healthy_count(s, svc) == 1, timeout=20)
    await async_poll_for(lambda: plugin.closed, timeout=20)  # closing its replicas
    aborted: list[str] = []
    await successor_seen_by_watches(svc, row["id"], aborted)
    assert not aborted and STARTS["drained"] == 1 and not call.done()
    assert leaving.status == Status.closing  # held open by the drain
    GATES.setdefault("drained-gate", asyncio.Event()).set()
    assert await asyncio.wait_for(call, 20) == "drained"
    assert STARTS["drained"] == 1  # not re-sent to the new replica
    assert [int(x[0]) for x in await c.gather(held)] == [0, 1, 2, 3]  # moved
    await async_poll_for(lambda: leaving.status == Status.closed, timeout=20)
    assert await svc.add.route(1) == 1
    await svc.shutdown()
    await assert_nothing_left(s, [w for w in workers if w is not leaving])


@cluster(nthreads=[("127.0.0.1", 1, {"resources": {"slot": 1}})] * 3)
async def test_a_replica_waiting_for_a_resource_takes_the_one_another_service_frees(
        c, s, *workers):
    # only a worker joining used to wake a waiting replica: services sharing resource-
    # limited workers never handed capacity to each other
    a = await Adder.options(replicas=2, resources={"slot": 1}, name="a").as_service(client=c)
    b = await Adder.options(replicas=1, resources={"slot": 1}, name="b").as_service(client=c)
    ext = s.extensions["dask_services_replicated"]

    def b_waits() -> bool:
        return any(m.waiting_for_worker for m in ext.deployments["b"].slots.values())

    async def healthy_b(n):
        await async_poll_for(lambda: sum(m.state.value == "healthy" for m in
                                         ext.deployments["b"].slots.values()) == n, timeout=10)

    growing = asyncio.ensure_future(b.scale(2))
    await async_poll_for(b_waits, timeout=10)
    # a's replicas both busy: the one scaled down holds its slot while it drains
    calls = asyncio.ensure_future(a.wait_for.fanout("a-busy", 1))
    await async_poll_for(lambda: sum(r.gate.in_flight for w in workers for r in
                                     w.extensions["dask_services_replicated"].replicas.values()
                                     ) == 2, timeout=10)
    scaling = asyncio.ensure_future(a.scale(1))
    await async_poll_for(lambda: ext._stops_under_way, timeout=10)
    ext._broadcast(lc.WorkerAdded())  # any placement meanwhile: the slot is not free yet
    assert b_waits()
    GATES.setdefault("a-busy", asyncio.Event()).set()  # the drain ends, the slot is free:
    await healthy_b(2)  # b's second replica takes it
    await scaling
    assert await calls == [1, 1]
    await growing
    growing = asyncio.ensure_future(b.scale(3))
    await async_poll_for(b_waits, timeout=10)
    await a.shutdown()  # frees the last slot
    await healthy_b(3)
    await growing
    assert len(set(await b.whoami.fanout())) == 3
    await b.shutdown()
    await assert_nothing_left(s, workers)


@cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_placement_options(c, s, w):
    with pytest.raises(DeploymentError, match="not healthy after"):
        with dask_services_config({"dask_services.replicated.deploy-timeout": "300ms"}):
            await Adder.options(resources={"GPU": 1}).as_service(client=c)
    await assert_nothing_left(s, [w])
    svc = await Adder.options(workers=[w.address], name="placed").as_service(client=c)
    assert (await svc.replicas())[0]["worker"] == w.address
    with pytest.raises(DeploymentError, match="'placed' is already deployed"):
        await Adder.options(name="placed").as_service(client=c)
    await svc.shutdown()
    await assert_nothing_left(s, [w])


@cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_handle_never_reaches_another_service_deployed_under_its_name(c, s, a, b):
    # the old handle worked again once the name was reused, reached the new service's
    # replicas (whose ids were the old ones), and its shutdown() stopped the new service
    old = await Adder.options(name="model", replicas=2).as_service(offset=1, client=c)
    old_ids = {str(r["id"]) for r in await old.replicas()}
    pickled = pickle.loads(pickle.dumps(old))
    await old.shutdown()
    new = await Adder.options(name="model", replicas=2).as_service(offset=100, client=c)
    assert await new.add.route(1) == 101
    assert not old_ids & {str(r["id"]) for r in await new.replicas()}  # ids not reused
    for handle in (old, pickled):
        with pytest.raises(ServiceShutdown, match="model was shut down"):
            await handle.add.route(1)
        with pytest.raises(ServiceShutdown):
            await handle.replicas()
        await handle.shutdown()  # of a service gone already: nothing happens
    assert await new.add.route(2) == 102
    await new.shutdown()
    await assert_nothing_left(s, [a, b])


def dask_services_config(values):
    import dask

    return dask.config.set(values)


@cluster()
async def test_calls_in_flight_on_a_closing_worker_are_resent(c, s, *workers):
    svc = await Adder.options(replicas=2, max_concurrency=2).as_service(10, client=c)
    leaving = (await svc.replicas())[0]
    calls = [svc.slow_add.route(i, 0.5) for i in range(8)]
    ext = next(w for w in workers if w.address == leaving["worker"]).extensions[
        "dask_services_replicated"]
    await async_poll_for(lambda: any(r.gate.in_flight for r in ext.replicas.values()), 10)
    await next(w for w in workers if w.address == leaving["worker"]).close()
    results = await asyncio.wait_for(asyncio.gather(*calls), 30)
    assert [v for _, v in results] == [i + 10 for i in range(8)]
    assert leaving["id"] not in {rid for rid, _ in results}  # answered elsewhere
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 2,
         config={"dask_services.replicated.call-retries": 3,
                 "dask_services.replicated.retry-backoff": "20ms"})
async def test_calls_fail_clearly_when_no_replica_can_come_back(c, s, a, b):
    svc = await Adder.options(replicas=1, workers=[a.address]).as_service(client=c)
    assert (await svc.replicas())[0]["worker"] == a.address
    await a.close()  # the only eligible worker: the replica cannot be relaunched
    with pytest.raises(ServiceUnavailable, match="after 4 attempts.*'recovering'"):
        await asyncio.wait_for(svc.add.route(1), 20)  # bounded: no hang
    (row,) = await svc.replicas()
    assert row["state"] == "recovering" and a.address in row["last_error"]
    await svc.shutdown()
    await assert_nothing_left(s, [b])


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_replica_waits_for_an_eligible_worker_to_join(c, s, a):
    from distributed import Worker

    deploying = asyncio.ensure_future(
        Adder.options(workers=["late"]).as_service(3, client=c))

    def waiting() -> bool:
        plugin = s.extensions.get("dask_services_replicated")  # installed by as_service
        return plugin is not None and any(m.waiting_for_worker for d in plugin
                                          .deployments.values() for m in d.slots.values())

    await async_poll_for(waiting, timeout=10)
    # the scheduler's answer to as_service is parked, waiting for a healthy replica
    plugin = s.extensions["dask_services_replicated"]
    await async_poll_for(lambda: any_task_suspended_in("Deployments.wait", plugin), 10)
    assert not deploying.done()
    async with Worker(s.address, name="late", nthreads=1) as late:
        svc = await asyncio.wait_for(deploying, 20)
        (row,) = await svc.replicas()
        assert row["worker"] == late.address and row["state"] == "healthy"
        (rep,) = late.extensions["dask_services_replicated"].replicas.values()
        assert rep.gate.max_concurrency == 4  # Adder.service_options, the class default
        assert await svc.add.route(1) == 4
        await svc.shutdown()
        await assert_nothing_left(s, [a, late])


async def reached(gate: str) -> None:
    await GATES.setdefault(gate + "-reached", asyncio.Event()).wait()


@cluster()
async def test_as_service_shut_down_during_setup_raises_service_shutdown(c, s, *workers):
    """Another handle shuts the service down while ``as_service()`` waits for its replicas'
    ``setup()``: ``as_service()`` raises ``ServiceShutdown`` instead of returning a handle
    to a service that is gone."""
    deploy = asyncio.ensure_future(
        Adder.options(replicas=2, name="gated").as_service(setup_gate="setup", client=c))
    await reached("setup")
    await ReplicatedService("gated", Adder, {}).shutdown(timeout=1)
    with pytest.raises(ServiceShutdown, match="gated was shut down while its replicas"):
        await deploy
    await assert_nothing_left(s, workers)


@cluster()
async def test_scale_shut_down_during_setup_raises_service_shutdown(c, s, *workers):
    GATES["setup"] = asyncio.Event()
    GATES["setup"].set()  # the first replica's setup goes through
    svc = await Adder.options(replicas=1, name="gated").as_service(setup_gate="setup",
                                                                   client=c)
    GATES["setup"], GATES["setup-reached"] = asyncio.Event(), asyncio.Event()
    growing = asyncio.ensure_future(svc.scale(3))
    await reached("setup")
    await ReplicatedService("gated", Adder, {}).shutdown(timeout=1)
    with pytest.raises(ServiceShutdown, match="gated was shut down while its replicas"):
        await growing
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_second_shutdown_returns_once_the_first_is_over(c, s, *workers):
    """Two handles shut the service down at once: the second returns only once the first
    is over (its replicas gone, the name free), not at once."""
    svc = await Adder.options(replicas=2, name="twice").as_service(client=c)
    call = asyncio.ensure_future(svc.wait_for.route("running", 7))
    await async_poll_for(lambda: "running" in GATES, timeout=20)  # the call runs
    plugin = s.extensions["dask_services_replicated"]
    dep = plugin.deployments["twice"]
    first = asyncio.ensure_future(svc.shutdown(timeout=10))
    await async_poll_for(lambda: dep.stopping, timeout=20)
    second = asyncio.ensure_future(ReplicatedService("twice", Adder, {}).shutdown(timeout=10))
    await async_poll_for(lambda: len(dep.stopped._waiters) == 1, timeout=20)
    assert not second.done() and not first.done()  # the call in flight is drained
    GATES["running"].set()
    await second
    assert "twice" not in plugin.deployments and not any(hosted(workers).values())
    await first
    assert await call == 7
    again = await Adder.options(replicas=1, name="twice").as_service(client=c)
    await again.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_replica_whose_stop_was_lost_is_stopped_when_its_worker_reports_it(
        c, s, *workers):
    """A stop that never reached its worker (frozen past the stop's wait: a native call
    holding the GIL) left the replica there for ever; the worker's next heartbeat reports a
    replica no deployment places there, and the scheduler stops it."""
    svc = await Adder.options(replicas=1, name="lost-stop").as_service(client=c)
    plugin = s.extensions["dask_services_replicated"]
    real = plugin._stop_on

    async def lost(worker, sid, timeout, reason, under_way):
        await real("tcp://127.0.0.1:1", sid, timeout, reason, under_way)  # not reached

    plugin._stop_on = lost
    try:
        await svc.shutdown(timeout=1)
    finally:
        plugin._stop_on = real
    assert sum(len(ids) for ids in hosted(workers).values()) == 1  # the stop was lost
    assert not plugin.deployments
    await assert_nothing_left(s, workers)  # stopped at the worker's next heartbeat
    assert not plugin._orphan_stops and not plugin._stops_under_way


@cluster()
async def test_a_handle_whose_client_was_closed_uses_the_default_client(c, s, *workers):
    """The Client a handle was deployed with is closed: the handle goes through the
    default client instead of failing with "ConnectionPool is closed"."""
    async with Client(s.address, asynchronous=True, set_as_default=False) as other:
        svc = await Adder.options(replicas=1).as_service(10, client=other)
        assert await svc.add.route(1) == 11
    assert await svc.add.route(2) == 12  # through c, the default client
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_name_taken_says_by_what(c, s, *workers):
    """A second deployment of a name was refused as "already deployed" while the first
    was still setting up or shutting down; it now says which, and what to do."""
    deploy = asyncio.ensure_future(
        Adder.options(replicas=1, name="taken").as_service(setup_gate="setup", client=c))
    await reached("setup")
    with pytest.raises(DeploymentError, match=r"'taken' is being deployed \(this client's "
                                              r"as_service\(\) has not returned yet\)"):
        await Adder.options(name="taken").as_service(client=c)
    GATES["setup"].set()
    svc = await deploy
    with pytest.raises(DeploymentError, match="'taken' is already deployed"):
        await Adder.options(name="taken").as_service(client=c)
    held = asyncio.ensure_future(svc.wait_for.route("held", 1))
    await async_poll_for(lambda: "held" in GATES, timeout=10)  # the call is running
    stopping = asyncio.ensure_future(svc.shutdown(timeout=30))
    plugin = s.plugins["dask_services_replicated"]
    await async_poll_for(lambda: plugin.deployments["taken"].stopping, timeout=10)
    with pytest.raises(DeploymentError, match="'taken' is still shutting down; deploy it "
                                              r"again once its shutdown\(\) returned"):
        await Adder.options(name="taken").as_service(client=c)
    GATES["held"].set()
    assert await held == 1
    await stopping
    await assert_nothing_left(s, workers)
