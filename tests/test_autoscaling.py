"""Autoscaling of replicated services: the pure policy, then on clusters."""

from __future__ import annotations

import asyncio
import collections
import os
import tempfile

import pytest
from distributed.utils_test import async_poll_for
from gang_services import Sleeper
from replicated_services import GATES, STARTS, Adder
from test_replicated import assert_nothing_left, cluster, until_equal

from dask_services.replicated import ReplicaOptions, ServiceShutdown, ServiceUnavailable
from dask_services.replicated._autoscale import AutoscalePolicy, AutoscalingConfig, Decision

pytestmark = pytest.mark.timeout(60)
EXT = "dask_services_replicated"


def policy(**kwargs) -> AutoscalePolicy:
    values = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 2,
              "upscale_delay": "2s", "downscale_delay": "30s", **kwargs}
    return AutoscalePolicy(AutoscalingConfig.from_options(values))


def test_config_validation():
    config = AutoscalingConfig.from_options({"max_replicas": 4, "upscale_delay": "500ms"})
    assert config.upscale_delay == 0.5 and config.downscale_delay == 600
    assert config.initial(10) == 4 and config.initial(0) == 1
    for bad, match in [({"max_replicas": 0}, "max_replicas"),
                       ({"min_replicas": 3, "max_replicas": 2}, "below"),
                       ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
                       ({"max_replicas": 2, "initial_replicas": 5}, "initial_replicas"),
                       ({"upscale_delay": -1}, "upscale_delay"),
                       ({"downscale_delay": "soon"}, "downscale_delay")]:
        with pytest.raises(ValueError, match=match):
            AutoscalingConfig.from_options(bad)
    with pytest.raises(TypeError, match="unknown autoscaling option"):
        AutoscalingConfig.from_options({"max_replica": 3})
    options = ReplicaOptions.merged({"autoscaling": {"max_replicas": 3}})
    assert options.autoscaling["max_replicas"] == 3


def test_scales_up_only_after_the_upscale_delay():
    p = policy()
    assert p.observe(0.0, 1, 10) is None  # above the target: the delay starts
    assert p.observe(1.9, 1, 10) is None
    decision = p.observe(2.0, 1, 10)
    assert decision == Decision(1, 5, decision.reason) and decision.direction == "up"
    assert "10.00 ongoing calls per replica (target 2) for 2 s" in decision.reason
    assert p.observe(2.1, 5, 10) is None  # at the target now


def test_load_dipping_restarts_the_delay():
    p = policy()
    assert p.observe(0.0, 1, 10) is None
    assert p.observe(1.0, 1, 2) is None  # back at the target: the delay starts over
    assert p.observe(2.5, 1, 10) is None
    assert p.observe(4.5, 1, 10).target == 5


def test_scales_down_after_the_downscale_delay_within_bounds():
    p = policy(min_replicas=2)
    assert p.observe(0, 6, 0) is None
    assert p.observe(29, 6, 0) is None
    decision = p.observe(30, 6, 0)
    assert decision.target == 2 and decision.direction == "down"  # never below min


def test_max_replicas_and_floor():
    p = policy(max_replicas=3, upscale_delay=0)
    assert p.observe(0, 1, 100).target == 3
    p = policy(downscale_delay=0)
    assert p.observe(0, 5, 0, floor=4).target == 4  # scale(4) is a floor
    assert p.observe(1, 4, 0, floor=4) is None
    assert p.observe(2, 2, 0, floor=4) == Decision(2, 4, "2 replicas outside the bounds "
                                                         "[4, 8]")
    assert policy(max_replicas=2).observe(0, 1, 0, floor=5).target == 5  # floor wins


FAST = {"dask_services.replicated.autoscaling-interval": "50ms"}


async def _load(svc, callers: int, stop: asyncio.Event) -> list[tuple[int, int]]:
    """``callers`` concurrent loops of calls until ``stop``; (argument, result) pairs."""
    done: list[tuple[int, int]] = []

    async def loop(k: int) -> None:
        i = 0
        while not stop.is_set():
            x = k * 10_000 + i
            done.append((x, await svc.work.route(x)))
            i += 1

    await asyncio.gather(*(loop(k) for k in range(callers)))
    return done


@cluster(nthreads=[("127.0.0.1", 1)] * 3, config=FAST)
async def test_autoscales_up_and_down_under_load_without_losing_a_call(c, s, *workers):
    if True:
        svc = await Sleeper.options(max_concurrency=1, autoscaling={
            "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 1,
            "upscale_delay": "200ms", "downscale_delay": "500ms"}).as_service(0.05, client=c)
        dep = s.extensions[EXT].deployments[svc.name]
        assert len(dep.active()) == 1
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(svc, 6, stop))
        await async_poll_for(lambda: len(dep.active()) == 4, timeout=20)
        await async_poll_for(lambda: all(m.state.value == "healthy"
                                         for m in dep.active().values()), timeout=20)
        stop.set()
        done = await load
        assert done and all(r == x + 1 for x, r in done)  # every call answered, rightly
        await async_poll_for(lambda: len(dep.active()) == 1, timeout=20)
        events = [e for _, e in await c.get_events("dask_services")
                  if e["action"] == "replicas-autoscaled"]
        assert events[0]["from"] < events[0]["to"] and "ongoing calls per replica" in \
            events[0]["reason"]
        assert events[-1]["to"] == 1 and events[-1]["from"] > 1
        assert "->" in dep.last_decision
        # scale(n) is a floor
        await svc.scale(2)
        assert len(dep.active()) == 2 and dep.floor == 2
        assert dep.last_decision.endswith("sets the floor")
        s.extensions[EXT]._autoscale_all()  # no load: the floor holds
        assert len(dep.active()) == 2
        rows = await c.run_on_scheduler(_rows)
        assert {r["target"] for r in rows if r["service"] == svc.name} == {2}
        assert all(r["decision"].endswith("sets the floor") for r in rows)
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 3, config=FAST)
async def test_a_burst_queued_on_one_replica_is_spread_over_the_replicas_it_caused(
        c, s, *workers):
    svc = await Adder.options(max_concurrency=1, autoscaling={
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 3,
        "upscale_delay": 0, "downscale_delay": "60s"}).as_service(client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    burst = [svc.wait_then_whoami.route("autoscaled-burst") for _ in range(12)]
    await async_poll_for(lambda: len(dep.active()) == 3, timeout=20)
    await async_poll_for(lambda: all(m.state.value == "healthy"
                                     for m in dep.active().values()), timeout=20)

    async def spread() -> list[int]:
        return sorted(r["in_flight"] + r["queued"] for r in await svc.replicas())

    await until_equal(spread, [4, 4, 4])
    GATES["autoscaled-burst"].set()
    served = [await call for call in burst]
    assert sorted(collections.Counter(served).values()) == [4, 4, 4]
    await svc.shutdown()
    await assert_nothing_left(s, workers)


def _record_scale_downs(ext) -> list[list[str]]:
    """The replicas' states at each scale-down ``ext`` decides from now on."""
    scale_downs: list[list[str]] = []
    carry_out = ext.autoscale

    def recording(dep, decision):
        if decision.target < decision.current:
            scale_downs.append(sorted(m.state.value for m in dep.active().values()))
        carry_out(dep, decision)

    ext.autoscale = recording
    return scale_downs


async def _upscaled_into_failing_setups(c, s, to: int, **delays):
    """An autoscaled service of one healthy replica, scaled up to ``to`` while its setup
    fails (the returned flag file exists): the added replicas unhealthy (or, with a short
    downscale delay, already being scaled down: the returned list of the states seen at
    each scale-down says so)."""
    flag = os.path.join(tempfile.mkdtemp(), "store-down")
    svc = await Adder.options(autoscaling={
        "min_replicas": 1, "max_replicas": 3, **delays}).as_service(0, flag, client=c)
    ext = s.extensions[EXT]
    dep = ext.deployments[svc.name]
    open(flag, "w").close()
    scale_downs = _record_scale_downs(ext)
    ext.autoscale(dep, Decision(1, to, "a burst"))
    await async_poll_for(lambda: scale_downs or sum(
        m.state.value == "unhealthy" for m in dep.active().values()) == to - 1, timeout=10)
    return svc, dep, flag, scale_downs


@cluster(nthreads=[("127.0.0.1", 1)] * 2,
         config={**FAST, "dask_services.replicated.setup-attempts": 1})
async def test_replicas_whose_setup_failed_are_scaled_down_when_the_load_falls(
        c, s, a, b):
    # replicas an upscale added failed their setup (a model store down for a while):
    # autoscaling stopped for good, scale-down included, and the service kept them
    svc, dep, flag, scale_downs = await _upscaled_into_failing_setups(
        c, s, 3, upscale_delay="100ms", downscale_delay="300ms")
    os.remove(flag)
    # no load: down to min_replicas, the unhealthy ones stopped first
    await async_poll_for(lambda: len(dep.active()) == 1, timeout=10)
    assert [m.state.value for m in dep.active().values()] == ["healthy"]
    assert dep.last_decision.startswith("3 -> 1")
    assert scale_downs[0] == ["healthy", "unhealthy", "unhealthy"]
    assert await svc.add.route(1) == 1
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


@cluster(nthreads=[("127.0.0.1", 1)] * 2,
         config={**FAST, "dask_services.replicated.setup-attempts": 1})
async def test_no_upscale_while_a_replica_is_unhealthy(c, s, a, b):
    svc, dep, flag, _ = await _upscaled_into_failing_setups(
        c, s, 2, upscale_delay="0s", downscale_delay="600s")
    dep.autoscaling.observe = lambda *args, **kwargs: Decision(2, 3, "more load")  # as under load
    s.extensions[EXT]._autoscale_all()
    assert len(dep.active()) == 2  # more replicas of a failing setup would not help
    os.remove(flag)
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


@cluster(nthreads=[("127.0.0.1", 1)] * 2, config=FAST)
async def test_replicas_still_starting_are_not_scaled_down(c, s, a, b):
    # with a setup slower than downscale_delay, the initial replicas were stopped while
    # they started, and as_service() returned with fewer than it deploys
    GATES.pop("slow-setup", None)
    deploying = asyncio.ensure_future(Adder.options(autoscaling={
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 3,
        "downscale_delay": "0s"}).as_service(0, None, None, "slow-setup", client=c))
    await async_poll_for(lambda: EXT in s.extensions and s.extensions[EXT].deployments,
                         timeout=10)
    ext = s.extensions[EXT]
    (dep,) = ext.deployments.values()
    scale_downs = _record_scale_downs(ext)
    await async_poll_for(lambda: len(dep.active()) == 3, timeout=10)
    ext._autoscale_all()  # no load, no delay: would scale down at once
    assert len(dep.active()) == 3 and scale_downs == []
    GATES.setdefault("slow-setup", asyncio.Event()).set()
    svc = await deploying
    await async_poll_for(lambda: len(dep.active()) == 1, timeout=10)  # then, idle: down
    # (the scale-down may come before as_service()'s answer reaches the client: asking
    # the replicas after it would race it; the decisions say what it stopped)
    assert scale_downs and scale_downs[0] == ["healthy"] * 3
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


@cluster(nthreads=[("127.0.0.1", 1)] * 2, config=FAST)
async def test_a_replica_waiting_for_a_worker_does_not_hold_back_a_scale_down(c, s, a, b):
    svc = await Adder.options(max_replicas_per_worker=1, autoscaling={
        "min_replicas": 1, "max_replicas": 3, "upscale_delay": "0s",
        "downscale_delay": "200ms"}).as_service(client=c)
    ext = s.extensions[EXT]
    dep = ext.deployments[svc.name]
    ext.autoscale(dep, Decision(1, 3, "a burst"))  # the third can never be placed
    await async_poll_for(lambda: any(m.waiting_for_worker for m in dep.active().values()),
                         timeout=10)
    await async_poll_for(lambda: len(dep.active()) == 1, timeout=10)  # idle: back to 1
    assert [m.state.value for m in dep.active().values()] == ["healthy"]
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


def _rows(dask_scheduler) -> list[dict]:
    from dask_services.replicated._table import rows

    return rows(dask_scheduler.extensions[EXT])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_autoscaling_on_worker_processes_under_a_load_step():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import dask
    from distributed import Client, LocalCluster
    from distributed.utils_test import poll_for

    config = {**FAST, "distributed.scheduler.validate": True}
    with dask.config.set(config), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as lc_, Client(lc_) as client:
        svc = Sleeper.options(max_concurrency=1, autoscaling={
            "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 1,
            "upscale_delay": "300ms", "downscale_delay": "1s"}).as_service(0.02,
                                                                          client=client)
        stop = threading.Event()

        def caller(k: int) -> tuple[int, int]:
            calls = wrong = 0
            while not stop.is_set():
                x = k * 100_000 + calls
                wrong += svc.work.route(x).result(timeout=30) != x + 1  # raises if lost
                calls += 1
            return calls, wrong

        with ThreadPoolExecutor(6) as pool:
            running = [pool.submit(caller, k) for k in range(6)]
            poll_for(lambda: [r["state"] for r in svc.replicas()] == ["healthy"] * 4,
                     timeout=40)
            stop.set()
            outcomes = [f.result(timeout=60) for f in running]
        assert sum(c for c, _ in outcomes) > 0 and sum(w for _, w in outcomes) == 0
        poll_for(lambda: len(svc.replicas()) == 1, timeout=30)
        events = [e for _, e in client.get_events("dask_services")
                  if e["action"] == "replicas-autoscaled"]
        assert any(e["to"] > e["from"] for e in events)
        assert events[-1]["to"] == 1
        svc.shutdown()


@cluster(nthreads=[("127.0.0.1", 1)] * 2, config=FAST)
async def test_scale_below_min_replicas_keeps_min_replicas(c, s, a, b):
    # svc.scale(1) under min_replicas=2 stopped a replica, which autoscaling relaunched
    svc = await Sleeper.options(autoscaling={
        "min_replicas": 2, "max_replicas": 4, "upscale_delay": "100ms",
        "downscale_delay": "100ms"}).as_service(client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    before = sorted(str(m.id) for m in dep.active().values())
    assert len(before) == 2
    await svc.scale(1)
    assert dep.floor == 1 and dep.last_decision == (
        "2 -> 2: svc.scale(1) sets the floor; min_replicas is 2")
    s.extensions[EXT]._autoscale_all()
    assert sorted(str(m.id) for m in dep.active().values()) == before  # none stopped
    actions = [e["action"] for _, e in await c.get_events("dask_services")
               if e.get("service") == svc.name]
    assert "replica-stopped" not in actions, actions
    assert await svc.work.route(1) == 2
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


async def _holding_both_replicas(svc, s, workers, gate: str):
    """A call of ``wait_for(gate)`` running on each of the service's two replicas (one per
    worker); then ``svc.scale(1)`` under way, its victim stopped and draining."""
    calls = asyncio.ensure_future(svc.wait_for.fanout(gate, 7))
    await async_poll_for(lambda: [r.gate.in_flight for w in workers
                                  for r in w.extensions[EXT].replicas.values()] == [1, 1],
                         timeout=10)
    scaling = asyncio.ensure_future(svc.scale(1))
    ext = s.extensions[EXT]
    dep = ext.deployments[svc.name]
    await async_poll_for(lambda: any(m.state.value == "stopped" for m in dep.slots.values())
                         and ext._stops_under_way, timeout=10)
    (victim,) = [m for m in dep.slots.values() if m.state.value == "stopped"]
    (worker,) = {w for w, sid in ext._stops_under_way if sid == str(victim.id)}
    return calls, scaling, worker


async def _reported_busy(s, sid) -> None:
    await async_poll_for(lambda: s.extensions[EXT].reports.get(str(sid))["in_flight"] == 1,
                         timeout=10)


@cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_scale_down_stops_an_idle_replica_before_a_busy_one(c, s, a, b):
    # the newest replica was stopped first, busy or not: its calls had to finish within
    # the drain while an idle replica stayed
    from dask_services.replicated._endpoints import PeerEndpoints

    svc = await Adder.options(replicas=2, max_replicas_per_worker=1).as_service(client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    newest = dep.slots[max(dep.slots)].id
    call = asyncio.ensure_future(PeerEndpoints(svc, newest).wait_for("idle-first", 5))
    await _reported_busy(s, newest)
    await svc.scale(1)
    assert [m.id for m in dep.active().values()] == [newest]
    GATES.setdefault("idle-first", asyncio.Event()).set()
    assert await call == 5
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


@cluster(nthreads=[("127.0.0.1", 1)] * 2,
         config={"dask_services.replicated.drain-timeout": "300ms"})
async def test_a_call_cut_by_a_scale_down_fails_and_is_not_run_again(c, s, a, b):
    # a call still running when a scale-down's drain ended was sent to another replica
    # and ran twice: a normal scaling decision must not repeat a call's effects
    STARTS.clear()
    svc = await Adder.options(replicas=2, max_replicas_per_worker=1).as_service(client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    first = asyncio.ensure_future(svc.count_and_wait.route("cut", "first"))
    await async_poll_for(lambda: STARTS.get("first") == 1, timeout=10)
    second = asyncio.ensure_future(svc.count_and_wait.route("cut", "second"))
    await async_poll_for(lambda: STARTS.get("second") == 1, timeout=10)
    for m in dep.active().values():  # one call on each replica
        await _reported_busy(s, m.id)
    await svc.scale(1)
    done, running = await asyncio.wait([first, second], timeout=30,
                                       return_when=asyncio.FIRST_COMPLETED)
    (cut,) = done
    with pytest.raises(ServiceUnavailable, match="scaled down.*drain-timeout.*not sent again"):
        await cut
    GATES.setdefault("cut", asyncio.Event()).set()
    (kept,) = running
    assert await kept in ("first", "second")
    assert STARTS == {"first": 1, "second": 1}
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


@cluster(nthreads=[("127.0.0.1", 1)] * 2,
         config={"dask_services.replicated.drain-timeout": "60s"})
async def test_shutdown_cuts_a_scale_downs_drain_to_its_own_timeout(c, s, a, b):
    # the shutdown ignored a drain under way: it returned after 10 s with the draining
    # replica still on its worker, which stayed until drain-timeout
    svc = await Adder.options(replicas=2, max_replicas_per_worker=1).as_service(client=c)
    calls, scaling, _ = await _holding_both_replicas(svc, s, [a, b], "never")
    await svc.shutdown(timeout=0.2)
    assert not any(w.extensions[EXT].replicas for w in (a, b))  # gone when it returns
    assert not s.extensions[EXT]._stops_under_way
    with pytest.raises(ServiceShutdown):
        await calls
    try:
        await scaling
    except ServiceShutdown:
        pass  # its refresh found the service shut down
    await assert_nothing_left(s, [a, b])


# ------------------------------------------------------------------ adaptive clusters


@cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_replicas_count_in_the_adaptive_target(c, s, a, b):
    from distributed import Worker

    assert s.adaptive_target() == 0 and sorted(s.workers_to_close()) == sorted(s.workers)
    svc = await Sleeper.options(replicas=2, max_replicas_per_worker=1).as_service(
        client=c)
    # both workers hold a replica: the target keeps them, none is to close
    assert s.adaptive_target() == 2 and s.workers_to_close() == []
    assert s.handlers["adaptive_target"]() == 2  # what Adaptive calls, over RPC
    assert s.handlers["workers_to_close"](attribute="name") == []
    dep = s.extensions[EXT].deployments[svc.name]
    scaling = asyncio.ensure_future(svc.scale(3))
    await async_poll_for(lambda: any(m.waiting_for_worker for m in dep.slots.values()),
                         timeout=10)
    assert s.adaptive_target() == 3  # the waiting replica asks for a worker
    (waiting,) = [m for m in dep.slots.values() if m.waiting_for_worker]
    assert "max_replicas_per_worker" in waiting.last_error
    async with Worker(s.address, nthreads=1) as extra:
        await scaling
        assert extra.address in waiting.workers
        await svc.scale(1)
        (kept,) = [m.worker for m in dep.active().values()]
        assert s.adaptive_target() == 1
        assert sorted(s.workers_to_close()) == sorted(set(s.workers) - {kept})
        await svc.shutdown()
        await assert_nothing_left(s, [a, b, extra])
    assert s.adaptive_target() == 0


@cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_draining_replica_keeps_its_worker_from_closing(c, s, a, b):
    # a replica stopped by a scale-down while its calls drain still holds its worker: an
    # adaptive cluster retired it mid-call (the call ran twice, stop() never ran)
    svc = await Adder.options(replicas=2, max_replicas_per_worker=1).as_service(client=c)
    calls, scaling, worker = await _holding_both_replicas(svc, s, [a, b], "drained")
    assert s.adaptive_target() == 2 and worker not in s.workers_to_close()
    GATES.setdefault("drained", asyncio.Event()).set()
    assert await calls == [7, 7]  # both finished where they ran
    await scaling
    assert s.adaptive_target() == 1 and s.workers_to_close() == [worker]
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_adaptive_cluster_grows_for_replicas_and_shrinks_back():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import dask
    from distributed import Client, LocalCluster
    from distributed.utils_test import poll_for

    config = {**FAST, "distributed.scheduler.validate": True}
    with dask.config.set(config), LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as lc_, Client(lc_) as client:
        lc_.adapt(minimum=1, maximum=3, interval="200ms", wait_count=2)
        svc = Sleeper.options(max_concurrency=1, max_replicas_per_worker=1, autoscaling={
            "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1,
            "upscale_delay": "200ms", "downscale_delay": "1s"}).as_service(0.02,
                                                                          client=client)
        first = svc.replicas()[0]["worker"]
        stop = threading.Event()

        def caller(k: int) -> int:
            calls = 0
            while not stop.is_set():
                x = k * 100_000 + calls
                assert svc.work.route(x).result(timeout=60) == x + 1
                calls += 1
            return calls

        with ThreadPoolExecutor(6) as pool:
            running = [pool.submit(caller, k) for k in range(6)]
            poll_for(lambda: [r["state"] for r in svc.replicas()] == ["healthy"] * 3,
                     timeout=60)
            assert len(client.scheduler_info(n_workers=-1)["workers"]) == 3  # it grew
            assert len({r["worker"] for r in svc.replicas()}) == 3
            stop.set()
            assert sum(f.result(timeout=60) for f in running) > 0
        poll_for(lambda: len(svc.replicas()) == 1, timeout=30)
        poll_for(lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 1,
                 timeout=40, fail_func=lambda: print(client.run_on_scheduler(_adaptive_state),
                                                     list(lc_._adaptive.log)[-3:]))
        (row,) = svc.replicas()
        assert row["state"] == "healthy" and row["worker"] in client.scheduler_info(
            n_workers=-1)["workers"]
        assert svc.work.route(1).result(timeout=30) == 2
        print("first worker", first, "kept", row["worker"])
        svc.shutdown()


def _adaptive_state(dask_scheduler) -> dict:
    ext = dask_scheduler.extensions[EXT]
    return {"target": dask_scheduler.adaptive_target(),
            "to_close": dask_scheduler.workers_to_close(),
            "demand": ext.demand(), "workers": {a: ws.status.name for a, ws in
                                                dask_scheduler.workers.items()},
            "slots": [(str(m.id), m.state.value, m.workers, m.waiting_for_worker,
                       m.launching, m.starting)
                      for d in ext.deployments.values() for m in d.slots.values()]}


@pytest.mark.timeout(120)
def test_the_burst_benchmark_spreads_a_burst_over_the_replicas_it_causes():
    """``dask-services bench replicated``'s burst: every call answered, replicas added, and
    calls queued on the first replica moved to them."""
    from distributed import Client, LocalCluster

    from benchmarks import replicated_scaling

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc_, Client(lc_) as client:
        result = replicated_scaling.burst(client, calls=150)
    assert result["calls"] == 150 and result["replicas_max"] > 1 and result["moved"] > 0
    assert "queued calls moved to added replicas" in replicated_scaling.report(
        {"gang": {"1 rank": {"p50_ms": 1, "p99_ms": 1}}, "autoscaling": {
            "callers": 16, "service_ms": 20, "p99_back_under_3x_after_s": None, "added": 0,
            "removed": 0, "replicas_max": 1, "replicas_end": 1, "calls": 0, "failed": 0,
            "decisions": []}, "burst": result})
