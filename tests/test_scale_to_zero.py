"""Replicated services that scale to zero replicas when idle (``min_replicas: 0``) and
back up when a call comes: the pure policy, then on clusters."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import tempfile
from unittest import mock

import dask
import pytest
from distributed.utils_test import async_poll_for
from replicated_batch_stream_services import Streamer
from replicated_services import GATES, Adder
from test_autoscaling import FAST, policy
from test_replicated import assert_nothing_left, call_from_task, cluster, until_equal

from dask_services._messages import loads_exception
from dask_services.replicated import ServiceUnavailable
from dask_services.replicated._autoscale import AutoscalingConfig, Decision

pytestmark = pytest.mark.timeout(60)
EXT = "dask_services_replicated"
TO_ZERO = {"min_replicas": 0, "max_replicas": 2, "target_ongoing_requests": 1,
           "upscale_delay": "60s", "downscale_delay": "100ms"}


def asking_every(seconds: float):
    """Waiting calls ask the scheduler again every ``seconds`` (``WAKE_ASK_S``)."""
    from dask_services.replicated import _waking

    return mock.patch.object(_waking, "WAKE_ASK_S", seconds)


def count_wake_asks(s) -> list[int]:
    """The callers each ``replicated_wake`` request reaching the scheduler ``s`` counts,
    from now on (appended as they arrive)."""
    asks: list[int] = []
    wake = s.handlers["replicated_wake"]

    async def counted(comm, **kwargs):
        asks.append(kwargs.get("callers", 1))
        return await wake(comm, **kwargs)

    s.handlers["replicated_wake"] = counted
    return asks


def test_min_replicas_zero_is_valid_and_max_replicas_zero_is_not():
    config = AutoscalingConfig.from_options({"min_replicas": 0, "max_replicas": 3})
    assert config.initial(1) == 1 and config.initial(0) == 0
    assert AutoscalingConfig.from_options({"min_replicas": 0, "max_replicas": 2,
                                           "initial_replicas": 0}).initial(1) == 0
    for bad, match in [({"min_replicas": -1}, "min_replicas must be an integer >= 0"),
                       ({"min_replicas": 0, "max_replicas": 0},
                        "max_replicas must be an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            AutoscalingConfig.from_options(bad)


def test_scales_to_zero_after_the_downscale_delay_and_up_from_it_at_once():
    p = policy(min_replicas=0, upscale_delay="60s", downscale_delay="30s")
    assert p.observe(0, 1, 0) is None
    assert p.observe(30, 1, 0).target == 0
    assert p.observe(31, 0, 0) is None  # idle at zero: stays
    decision = p.observe(32, 0, 3)  # calls wait: up now, not after upscale_delay
    assert decision == Decision(0, 2, "3 calls waiting with no healthy replica")
    # more callers while the first replicas start: up again at once
    assert p.observe(33, 2, 6, none_ready=True).target == 3
    assert p.observe(34, 3, 6) is None  # one healthy: upscale_delay again
    assert policy(min_replicas=0, max_replicas=1).observe(0, 0, 5).target == 1
    # calls made between samples, none under way at one: not idle, one replica stays
    p = policy(min_replicas=0, downscale_delay="30s")
    assert p.observe(0, 2, 0, called=True) is None
    assert p.observe(30, 2, 0, called=True).target == 1
    assert p.observe(100, 1, 0, called=True) is None
    assert p.observe(101, 1, 0) is None and p.observe(131, 1, 0).target == 0
    # a floor set by svc.scale(n) keeps replicas; scale(0) lifts it
    assert policy(min_replicas=0, downscale_delay=0).observe(0, 2, 0, floor=2) is None


@cluster(config=FAST)
async def test_an_idle_service_scales_to_zero_and_a_call_brings_a_replica_back(
        c, s, *workers):
    svc = await Adder.options(name="to-zero", autoscaling=TO_ZERO).as_service(5, client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    assert await svc.add.route(1) == 6
    await async_poll_for(lambda: not dep.active(), timeout=20)  # idle: scaled to zero
    await async_poll_for(lambda: not any(
        w.extensions[EXT].replicas for w in workers), timeout=20)
    assert (await svc.replicas()) == []
    # a call waits for a replica, without upscale_delay (60 s) nor counting as a
    # failure: the autoscaler is told of it at once
    assert await svc.add.route(2) == 7
    events = [e for _, e in await c.get_events("dask_services")
              if e["action"] == "replicas-autoscaled"]
    assert [(e["from"], e["to"]) for e in events][-2:] == [(1, 0), (0, 1)], events
    assert events[-1]["reason"] == "1 calls waiting with no healthy replica"
    assert dep.callers_waiting == 0
    # back to zero, then many callers at once, a fan-out and a stream among them
    await async_poll_for(lambda: not dep.active(), timeout=20)
    results = await asyncio.gather(*(svc.add.route(i) for i in range(20)),
                                   svc.add.fanout(100))
    assert list(results[:20]) == [i + 5 for i in range(20)]
    assert results[20] and set(results[20]) == {105}
    assert dep.callers_waiting == 0
    # a task on a worker calling through the handle wakes it too
    await async_poll_for(lambda: not dep.active(), timeout=20)
    assert await c.submit(call_from_task, svc, 1) == 6
    s.validate_state()
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_calls_wait_for_a_slow_setup_however_few_retries_are_allowed(
        c, s, *workers):
    with dask.config.set({"dask_services.replicated.call-retries": 0}):
        svc = await Adder.options(name="slow-wake", autoscaling={
            **TO_ZERO, "initial_replicas": 0}).as_service(
            1, setup_gate="wake-setup", client=c)
        dep = s.extensions[EXT].deployments[svc.name]
        assert not dep.slots  # initial_replicas 0: deployed with none
        calls = [asyncio.ensure_future(svc.add.route(i)) for i in range(5)]
        # the replica woken is in its setup, the callers wait for it
        await async_poll_for(lambda: "wake-setup-reached" in GATES, timeout=20)
        await async_poll_for(lambda: dep.callers_waiting == 5, timeout=20)
        assert not any(call.done() for call in calls)
        # the five waiting asked for max_replicas (2) at once, not one replica and then
        # another after upscale_delay (60 s)
        await async_poll_for(lambda: len(dep.active()) == 2, timeout=20)
        GATES["wake-setup"].set()
        assert await asyncio.gather(*calls) == [1, 2, 3, 4, 5]
        assert dep.callers_waiting == 0
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_a_setup_failing_on_waking_fails_the_waiting_calls_with_its_error(
        c, s, *workers):
    with tempfile.TemporaryDirectory() as tmp, dask.config.set(
            {"dask_services.replicated.setup-attempts": 1}):
        flag = os.path.join(tmp, "refuse")
        svc = await Adder.options(name="wake-fails", autoscaling={
            **TO_ZERO, "initial_replicas": 0}).as_service(
            0, fail_if_exists=flag, client=c)
        open(flag, "w").close()
        with pytest.raises(FileExistsError, match="setup refused"):
            await svc.add.route(1)
        dep = s.extensions[EXT].deployments[svc.name]
        assert dep.callers_waiting == 0
        # the failed replica is scaled away once idle; the next call tries again
        await async_poll_for(lambda: not dep.active(), timeout=20)
        os.remove(flag)
        assert await svc.add.route(1) == 1
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_a_stream_wakes_the_service_and_scale_zero_lifts_the_floor(c, s, *workers):
    svc = await Streamer.options(name="stream-wake", autoscaling=TO_ZERO).as_service(
        client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    await svc.scale(1)  # a floor: stays at one replica however idle
    assert dep.floor == 1
    s.extensions[EXT]._autoscale_all()
    assert len(dep.active()) == 1
    await svc.scale(0)  # the floor lifted: down to zero now
    await async_poll_for(lambda: not dep.active(), timeout=20)
    assert [x async for x in svc.count.stream(3)] == [0, 1, 2]
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_scale_zero_is_refused_without_min_replicas_zero(c, s, *workers):
    svc = await Adder.options(name="no-zero", autoscaling={
        "min_replicas": 1, "max_replicas": 2}).as_service(client=c)
    with pytest.raises(ValueError, match=r"n >= 1, got 0.*min_replicas: 0"):
        await svc.scale(0)
    plain = await Adder.options(name="plain").as_service(client=c)
    with pytest.raises(ValueError, match=r"n >= 1, got 0"):
        await plain.scale(0)
    # a service that does not scale to zero and has no healthy replica fails as before
    assert not s.extensions[EXT].deployments[plain.name].scales_to_zero()
    # the scheduler refuses it too, whoever asks (the handle refuses first)
    answer = await c.scheduler.replicated_scale(name=plain.name, n=0, timeout=5,
                                                uid=plain._uid)
    assert isinstance(loads_exception(answer["exception"]), ValueError)
    assert len(s.extensions[EXT].deployments[plain.name].active()) == 1
    await svc.shutdown()
    await plain.shutdown()
    await assert_nothing_left(s, workers)



@cluster(config=FAST)
async def test_a_cancelled_call_stops_counting_in_the_load(c, s, *workers):
    with asking_every(0.2):
        svc = await Adder.options(name="cancelled-wake", autoscaling={
            **TO_ZERO, "initial_replicas": 0}).as_service(
            1, setup_gate="held-setup", client=c)
        dep = s.extensions[EXT].deployments[svc.name]
        call = asyncio.ensure_future(svc.add.route(1))
        await async_poll_for(lambda: dep.callers_waiting == 1, timeout=20)
        call.cancel()
        await async_poll_for(lambda: dep.callers_waiting == 0, timeout=10)
        GATES["held-setup"].set()
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_a_service_in_steady_use_of_short_calls_keeps_a_replica(c, s, *workers):
    svc = await Adder.options(name="steady", autoscaling=TO_ZERO).as_service(client=c)
    ext = s.extensions[EXT]
    dep = ext.deployments[svc.name]
    (rid, worker), = ext.placed().items()
    reports = []
    # calls one after another (none under way at most samples) over four heartbeats of
    # the replica's worker, each longer than downscale_delay (100 ms)
    while len(reports) < 5:
        assert await svc.add.route(1) == 1
        when = ext.reports.updated.get(worker)
        if when is not None and when not in reports:
            reports.append(when)
    assert [str(m.id) for m in dep.active().values()] == [rid]
    events = [e for _, e in await c.get_events("dask_services")
              if e["action"] == "replicas-autoscaled"]
    assert not events, events
    # idle now: to zero
    await async_poll_for(lambda: not dep.active(), timeout=20)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_a_burst_at_zero_is_spread_over_the_replicas_it_asked_for(c, s, *workers):
    """The callers let go when the first replica turns healthy send their calls to it;
    the other replicas the burst asked for turn healthy before those calls land (the
    spreading passes they cause find nothing queued yet): once landed, they are spread."""
    from dask_services.replicated._handle import ReplicatedService

    svc = await Adder.options(name="burst-zero", max_concurrency=1, autoscaling={
        **TO_ZERO, "max_replicas": 3, "initial_replicas": 0, "downscale_delay": "60s"}
    ).as_service(0, setup_gates="burst-setup", client=c)
    dep = s.extensions[EXT].deployments[svc.name]
    send = ReplicatedService._send
    landing = asyncio.Event()

    async def held_send(self, target, msg):  # the calls' way to the replica, held
        if msg.get("method") == "wait_then_whoami":
            await landing.wait()
        return await send(self, target, msg)

    ReplicatedService._send = held_send
    try:
        burst = [asyncio.ensure_future(svc.wait_then_whoami.route("burst-calls"))
                 for _ in range(12)]
        await async_poll_for(lambda: dep.callers_waiting == 12 and len(dep.active()) == 3,
                             timeout=20)
        GATES.setdefault("burst-setup-1", asyncio.Event()).set()  # one healthy
        await async_poll_for(lambda: dep.callers_waiting == 0, timeout=20)  # let go
        for n in (2, 3):
            GATES.setdefault(f"burst-setup-{n}", asyncio.Event()).set()
        await async_poll_for(lambda: all(m.state.value == "healthy"
                                         for m in dep.active().values()), timeout=20)
        await async_poll_for(lambda: dep.rebalancer.task is not None
                             and dep.rebalancer.task.done(), timeout=20)
        landing.set()  # the calls land, all on the first replica

        async def spread() -> list[int]:
            return sorted(r["in_flight"] + r["queued"] for r in await svc.replicas())

        await until_equal(spread, [4, 4, 4])
    finally:
        ReplicatedService._send = send
    GATES["burst-calls"].set()
    served = await asyncio.gather(*burst)
    assert sorted(collections.Counter(served).values()) == [4, 4, 4]
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_the_calls_waiting_for_a_wake_share_their_asks_to_the_scheduler(
        c, s, *workers):
    """A handle asks the scheduler for a woken replica once for all its waiting calls,
    saying how many wait (one ask per call opened a connection each: 4,000 calls of 10 ms
    from zero took 6 s longer than with the replicas up), and calls made while the ask
    waits are counted at once; what the calls get is unchanged."""
    svc = await Adder.options(name="shared-wake", autoscaling={
        **TO_ZERO, "max_replicas": 3, "initial_replicas": 0}).as_service(
        1, setup_gate="shared-setup", client=c)
    asks = count_wake_asks(s)
    dep = s.extensions[EXT].deployments[svc.name]
    first = [asyncio.ensure_future(svc.add.route(i)) for i in range(200)]
    await async_poll_for(lambda: dep.callers_waiting == 200, timeout=20)
    later = [asyncio.ensure_future(svc.add.route(i)) for i in range(200, 250)]
    await async_poll_for(lambda: dep.callers_waiting == 250, timeout=20)
    assert 1 <= len(asks) <= 10, len(asks)
    await async_poll_for(lambda: len(dep.active()) == 3, timeout=20)
    GATES["shared-setup"].set()
    assert await asyncio.gather(*first, *later) == [i + 1 for i in range(250)]
    assert dep.callers_waiting == 0
    s.validate_state()
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_waiting_calls_cancelled_one_by_one_stop_counting(c, s, *workers):
    with asking_every(0.2):
        svc = await Adder.options(name="cancelled-shared-wake", autoscaling={
            **TO_ZERO, "initial_replicas": 0}).as_service(
            1, setup_gate="held-shared-setup", client=c)
        dep = s.extensions[EXT].deployments[svc.name]
        calls = [asyncio.ensure_future(svc.add.route(i)) for i in range(3)]
        await async_poll_for(lambda: dep.callers_waiting == 3, timeout=20)
        calls[0].cancel()
        await async_poll_for(lambda: dep.callers_waiting == 2, timeout=10)
        for call in calls[1:]:
            call.cancel()
        await async_poll_for(lambda: dep.callers_waiting == 0, timeout=10)
        # a later call waits afresh, and gets its answer
        call = asyncio.ensure_future(svc.add.route(5))
        await async_poll_for(lambda: dep.callers_waiting == 1, timeout=10)
        GATES["held-shared-setup"].set()
        assert await call == 6
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_a_handles_newer_ask_replaces_its_count_and_callers_are_let_go_once(
        c, s, *workers):
    """The scheduler keeps the count of a handle's newest ask: the ask it replaces is
    answered at once, an older one arriving late is not counted, and the callers are
    counted once as let go, however many of the handle's asks see the replica healthy."""
    svc = await Adder.options(name="newest-ask", autoscaling={
        **TO_ZERO, "initial_replicas": 0}).as_service(
        1, setup_gate="newest-ask-setup", client=c)
    ext = s.extensions[EXT]
    dep = ext.deployments[svc.name]
    released: list[int] = []

    async def counted() -> None:  # without the pass (which ends the count's window)
        released.append(dep.rebalancer.woken_released)

    dep.rebalancer._spread_woken_once_landed = counted

    def ask(seq: int, callers: int, timeout: float = 20):
        return asyncio.ensure_future(c.scheduler.replicated_wake(
            name=svc.name, uid=svc._uid, timeout=timeout, callers=callers,
            asker="one-handle", seq=seq))

    first = ask(1, 5)
    await async_poll_for(lambda: dep.callers_waiting == 5, timeout=20)
    second = ask(3, 8)
    assert (await first)["status"] == "pending"  # replaced: answered at once
    assert dep.callers_waiting == 8
    assert (await ask(2, 3))["status"] == "pending"  # older, late: not counted
    assert dep.callers_waiting == 8
    GATES["newest-ask-setup"].set()
    assert (await second)["status"] == "ok"
    assert (await ask(4, 8))["status"] == "ok"  # the same callers, asking again
    assert released == [8]
    assert dep.callers_waiting == 0
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(config=FAST)
async def test_a_call_that_waits_past_deploy_timeout_says_what_the_replicas_wait_for(
        c, s, *workers):
    with dask.config.set({"dask_services.replicated.deploy-timeout": "500ms"}):
        svc = await Adder.options(name="wake-timeout", autoscaling={
            **TO_ZERO, "initial_replicas": 0}).as_service(
            1, setup_gate="never-set-up", client=c)
        asks = count_wake_asks(s)
        # the deadline comes before the scheduler's first answer (every 2 s): the
        # reason is asked for at the deadline, once for the calls that reach it together
        calls = await asyncio.gather(*(svc.add.route(i) for i in range(200)),
                                     return_exceptions=True)
        assert all(isinstance(e, ServiceUnavailable) for e in calls), calls[:3]
        assert re.search(r"deploy-timeout\): .*setup\(\) still running on", str(calls[0]))
        assert len(asks) <= 10, len(asks)
        GATES["never-set-up"].set()
        await svc.shutdown()
    await assert_nothing_left(s, workers)
