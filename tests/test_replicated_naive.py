"""Replicated services written or called naively: each mistake is the call's own error,
with its message, never a lost connection re-sent to other replicas, a stale view of the
deployment or a wait without a reason."""

from __future__ import annotations

import asyncio
import collections
import gc
import re
import sys
import threading

import dask
import pytest
from distributed.utils_test import async_poll_for
from replicated_services import Adder
from test_replicated import assert_nothing_left, cluster

import dask_services
from dask_services.replicated import DeploymentError, ServiceShutdown, ServiceUnavailable
from dask_services.replicated._options import ReplicaOptions

pytestmark = pytest.mark.timeout(60)

RUNS: collections.Counter = collections.Counter()  # endpoint runs, by argument
GATE: dict[str, asyncio.Event] = {}


class Naive(dask_services.Service):
    """Endpoints making the mistakes a service's author makes."""

    @dask_services.endpoint
    async def lock_for_zero(self, i: int):
        RUNS[i] += 1
        return threading.Lock() if i == 0 else i

    @dask_services.endpoint
    def sync_lock(self):
        RUNS["sync"] += 1
        return threading.Lock()

    @dask_services.endpoint
    async def echo(self, x):
        return x

    @dask_services.endpoint
    async def database_timeout(self):
        raise TimeoutError("the database did not answer within 5 s")

    @dask_services.endpoint
    async def awaits_a_cancelled_task(self):
        RUNS["cancelled"] += 1
        helper = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        helper.cancel()
        await helper

    @dask_services.endpoint
    async def exits(self):
        RUNS["exit"] += 1
        sys.exit("leaving")

    @dask_services.endpoint
    def interrupted(self):
        RUNS["interrupted"] += 1
        raise KeyboardInterrupt("stop now")

    @dask_services.endpoint(batch_size=4)
    async def batch_exits(self, requests):
        RUNS["batch exit"] += 1
        sys.exit("leaving with a batch")

    @dask_services.endpoint
    async def peers_async(self):
        return sorted(self.peers)

    @dask_services.endpoint
    def peers_sync(self):
        return sorted(self.peers)

    @dask_services.endpoint
    async def whoami(self):
        return str(self.id)

    @dask_services.endpoint
    def whoami_sync(self):
        return str(self.id)

    @dask_services.endpoint
    async def ask_everyone(self):
        return sorted([await self.peers[sid].whoami() for sid in self.peers]
                      + [await self.peers[sid].whoami_sync() for sid in self.peers])

    @dask_services.endpoint
    def ask_everyone_sync(self):
        return sorted(self.peers[sid].whoami().result() for sid in self.peers)

    @dask_services.endpoint
    async def tokens_then_wait(self, n: int):
        for i in range(n):
            yield i
        await GATE.setdefault("never", asyncio.Event()).wait()

    @dask_services.endpoint
    async def wait_forever(self):
        await GATE.setdefault("never", asyncio.Event()).wait()

    @dask_services.endpoint
    async def class_(self):
        return "a name ending with _"


class SetupTimesOut(dask_services.Service):
    async def setup(self):
        raise TimeoutError("could not download the model within 3 s")


@cluster()
async def test_an_unsendable_result_fails_its_own_call_once(c, s, *workers):
    RUNS.clear()
    svc = await Naive.options(replicas=1).as_service(client=c)
    # six calls made in one turn of the loop travel in one message: one bad result must
    # neither fail the others nor have them all re-sent
    results = await asyncio.gather(*(svc.lock_for_zero.route(i) for i in range(6)),
                                   return_exceptions=True)
    assert isinstance(results[0], TypeError), results
    assert "the result of" in str(results[0]) and "lock_for_zero" in str(results[0])
    assert "cannot be sent back to the caller" in str(results[0])
    assert results[1:] == [1, 2, 3, 4, 5]
    assert RUNS == {i: 1 for i in range(6)}
    with pytest.raises(TypeError, match="sync_lock .* cannot be sent back"):
        await svc.sync_lock.route()
    assert RUNS["sync"] == 1
    # the two calls whose result could not be sent count as errors (they counted as
    # successes), the five others as successes
    (figures,) = await svc.metrics()
    assert (figures["calls"], figures["errors"]) == (7, 2), figures
    # an argument that cannot be sent is the caller's error, raised before anything is sent
    with pytest.raises(TypeError, match="the arguments of .*echo cannot be sent"):
        await svc.echo.route(threading.Lock())
    with pytest.raises(TypeError, match="the arguments of .*tokens_then_wait cannot be"):
        async for _ in svc.tokens_then_wait.stream(threading.Lock()):
            pass
    (row,) = await svc.replicas()
    assert row["state"] == "healthy"
    assert await svc.echo.route(7) == 7
    await svc.shutdown()
    await assert_nothing_left(s, workers)


def divide(a, b):
    return a / b


@cluster()
async def test_futures_and_collections_among_setup_arguments_are_computed_first(c, s,
                                                                                *workers):
    # they reached setup() as they were: a Future or a Delayed in place of its value
    offset = c.submit(sum, [3, 4])
    svc = await Adder.options(replicas=2).as_service(
        offset, delays={"never": dask.delayed(float)(0)}, client=c)
    assert await svc.add.fanout(1) == [8, 8]
    await svc.scale(3)  # a replica added later is set up with the same values
    assert await svc.add.fanout(1) == [8, 8, 8]
    await svc.shutdown()
    del offset
    await assert_nothing_left(s, workers)
    # the computation of the arguments left nothing behind
    await async_poll_for(lambda: not s.tasks, timeout=10)
    # one that fails raises its error, leaving nothing; one dask.delayed cannot find (in
    # a dict subclass) is refused, not passed as it is
    with pytest.raises(ZeroDivisionError) as failed:
        await Adder.options(replicas=1).as_service(dask.delayed(divide)(1, 0), client=c)
    assert "(computing the setup arguments of as_service())" in failed.value.__notes__
    del failed
    with pytest.raises(TypeError, match=re.escape(
            "delays['x'] (a Delayed) of the setup arguments of as_service() cannot be "
            "computed where it is")):
        await Adder.options(replicas=1).as_service(
            0, delays=collections.OrderedDict(x=dask.delayed(1)), client=c)
    gc.collect()
    await async_poll_for(lambda: not s.tasks, timeout=10)
    assert not s.extensions["dask_services_replicated"].deployments


@cluster()
async def test_a_future_as_an_argument_of_a_call_is_refused_or_computed(c, s, *workers):
    svc = await Naive.options(replicas=1).as_service(client=c)
    value = c.submit(sum, [3, 4])
    for call, named in [(lambda: svc.echo.route(value), r"argument 0 \(a Future\) of "
                                                        r"svc.echo.route\(\)"),
                        (lambda: svc.echo.fanout(x=dask.delayed(1)),
                         r"x \(a Delayed\) of svc.echo.fanout\(\)"),
                        (lambda: svc.tokens_then_wait.stream(value),
                         r"argument 0 \(a Future\) of svc.tokens_then_wait.stream")]:
        with pytest.raises(TypeError, match=named + ".*send their arguments as they are.*"
                                                    r"svc\.\w+\.submit\(\.\.\.\)"):
            call()
    assert await svc.echo.submit(value, client=c) == 7  # a task: resolved first
    with pytest.raises(TypeError, match=r"argument 0 \(a Delayed\) of svc.echo.submit\(\): "
                                        r"submit\(\) resolves futures"):
        svc.echo.submit(dask.delayed(1), client=c)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_timeout_error_of_the_service_keeps_its_message(c, s, *workers):
    svc = await Naive.options(replicas=1).as_service(client=c)
    with pytest.raises(TimeoutError, match="the database did not answer"):
        await svc.database_timeout.route()
    # sync code waits through .result(): the same error, not "did not finish within"
    call = await asyncio.to_thread(svc.database_timeout.route)
    with pytest.raises(TimeoutError, match="the database did not answer"):
        await asyncio.to_thread(call.result, 10)
    # a wait that does time out still says so
    GATE.clear()
    call = await asyncio.to_thread(svc.wait_forever.route)
    with pytest.raises(TimeoutError, match="wait_forever did not finish within 0.2 s"):
        await asyncio.to_thread(call.result, 0.2)
    await svc.shutdown(timeout=0.1)
    with pytest.raises(TimeoutError, match="could not download the model"):
        await SetupTimesOut.options(replicas=1).as_service(client=c)
    await assert_nothing_left(s, workers)


@cluster()
async def test_an_endpoint_letting_out_cancelled_error_or_system_exit_fails_its_call(
        c, s, *workers):
    RUNS.clear()
    svc = await Naive.options(replicas=1).as_service(client=c)
    with pytest.raises(RuntimeError, match="awaits_a_cancelled_task raised CancelledError "
                                           "without being cancelled"):
        await svc.awaits_a_cancelled_task.route()
    with pytest.raises(RuntimeError, match="exits raised SystemExit: leaving"):
        await svc.exits.route()
    with pytest.raises(RuntimeError, match=r"batch_exits raised SystemExit\('leaving with a "
                                           r"batch'\), which is not an Exception"):
        await svc.batch_exits.route(1)
    with pytest.raises(RuntimeError, match=r"naive-\w+\.interrupted raised "
                                           r"KeyboardInterrupt\('stop now'\) in its thread"):
        await svc.interrupted.route()
    assert RUNS == {"cancelled": 1, "exit": 1, "batch exit": 1,
                    "interrupted": 1}  # none was re-sent
    assert all(w.status.name == "running" for w in workers)
    assert await svc.echo.route(1) == 1
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_peers_are_every_healthy_replica_from_the_first_call(c, s, *workers):
    svc = await Naive.options(replicas=3).as_service(client=c)
    ids = sorted(r["id"] for r in await svc.replicas())
    # the endpoints read self.peers before anything refreshed their handles' tables
    assert await svc.peers_sync.fanout() == [ids] * 3
    assert await svc.peers_async.fanout() == [ids] * 3
    await svc.shutdown()
    # one call at a time (max_concurrency=1): a replica calling every peer, itself
    # included, runs its own endpoint in place instead of waiting for its own slot
    svc = await Naive.options(replicas=1, max_concurrency=1).as_service(client=c)
    ((only,),) = [[r["id"] for r in await svc.replicas()]]
    assert await svc.ask_everyone.route() == [only, only]
    assert await svc.ask_everyone_sync.route() == [only]
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster()
async def test_a_load_reported_by_a_replica_ages_with_the_table(c, s, *workers):
    svc = await Naive.options(replicas=2).as_service(client=c)
    await svc.echo.route(1)
    busy, idle = (r.id for r in svc._table)
    # an answer from a replica that was busy then: without a later answer from it (the
    # router no longer picks it) the figure would stand for ever
    svc._reported[busy] = 5
    assert {v.id: v.load for v in svc._views(svc._healthy())}[busy] == 5
    await svc.refresh()
    assert {v.id: v.load for v in svc._views(svc._healthy())} == {busy: 0, idle: 0}
    await svc.shutdown()


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_a_stream_cut_by_shutdown_raises_service_shutdown(c, s, *workers):
    GATE.clear()
    svc = await Naive.options(replicas=1).as_service(client=c)
    got = []
    with pytest.raises(ServiceShutdown, match="stream was cancelled"):
        async for x in svc.tokens_then_wait.stream(2):
            got.append(x)
            if x == 1:
                stopping = asyncio.ensure_future(svc.shutdown(timeout=0.1))
    assert got == [0, 1]
    await stopping
    await assert_nothing_left(s, workers)


@cluster()
async def test_endpoint_names_the_handle_uses_or_ending_with_an_underscore(c, s, *workers):
    class Story(dask_services.Service):
        @dask_services.endpoint
        async def story(self):
            return "told"

    with pytest.raises(TypeError, match=r"\['story'\] of Story clash"):
        await Story.options(replicas=1).as_service(client=c)

    class Ranked(dask_services.Service):
        @property
        def rank(self):  # dask_services sets rank on every replica
            return 0

        @dask_services.endpoint
        async def which(self):
            return self.rank

    with pytest.raises(TypeError, match=r"Ranked defines 'rank' \(a property without a "
                                        r"setter, in Ranked\), "
                                        r"but dask_services sets this on every replica"):
        await Ranked.options(replicas=1).as_service(client=c)
    replicated = s.extensions.get("dask_services_replicated")  # refused before installing
    assert replicated is None or not replicated.deployments
    svc = await Naive.options(replicas=1).as_service(client=c)
    assert "class_" in svc.endpoints
    assert await svc.class_.route() == "a name ending with _"
    await svc.shutdown()


@cluster()
async def test_a_deployment_that_cannot_be_placed_says_why(c, s, *workers):
    with dask.config.set({"dask_services.replicated.deploy-timeout": "300ms"}):
        with pytest.raises(DeploymentError, match=r"waiting for a worker with "
                                                  r"resources=\{'GPU': 1\} free: 0 eligible "
                                                  r"of 3 running"):
            await Naive.options(replicas=1, resources={"GPU": 1}).as_service(client=c)
        svc = await Naive.options(replicas=1, max_replicas_per_worker=1).as_service(client=c)
        with pytest.raises(ServiceUnavailable,
                           match=r"max_replicas_per_worker.*still aims at 4 replicas.*"
                                 r"svc.scale\(1\) gives them up"):
            await svc.scale(4)
        await svc.scale(1)
        await async_poll_for(lambda: len(s.extensions["dask_services_replicated"]
                                         .deployments[svc.name].slots) == 1, 10)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


def test_options_checked_when_made():
    with pytest.raises(ValueError, match="amounts must be > 0"):
        Naive.options(resources={"GPU": -1})
    with pytest.raises(TypeError, match="resource names to amounts"):
        Naive.options(resources={"GPU": True})
    with pytest.raises(ValueError, match="initial_replicas must be an integer"):
        Naive.options(autoscaling={"min_replicas": 1, "max_replicas": 2,
                                   "initial_replicas": True})
    with pytest.raises(ValueError, match=r"batch_wait=...\) must be a duration.*'x'"):
        dask_services.endpoint(batch_size=2, batch_wait="x")
    # LocalCluster names its workers 0, 1, ...: a name may be given as the int
    assert ReplicaOptions.merged({"workers": [0, "tcp://127.0.0.1:1"]}).workers == (
        "0", "tcp://127.0.0.1:1")


@cluster()
async def test_a_worker_named_by_an_int_hosts_the_replica(c, s, a, b, w3):
    svc = await Naive.options(replicas=1, workers=[b.name]).as_service(client=c)
    (row,) = await svc.replicas()
    assert row["worker"] == b.address
    await svc.shutdown()
    await assert_nothing_left(s, [a, b, w3])


class SetsItsRankInInit(dask_services.Service):
    """Keeps ``self.rank`` of its own from ``__init__``: the framework sets ``rank`` on
    every replica right after making it."""

    def __init__(self):
        self.rank = "mine"

    def setup(self):
        pass

    @dask_services.endpoint
    def ping(self):
        return self.rank


@cluster()
async def test_a_replica_attribute_of_the_framework_set_in_init_is_refused(c, s, *workers):
    with pytest.raises(TypeError, match=r"SetsItsRankInInit.__init__ sets self.rank, but "
                                        r"dask_services sets this on every replica"):
        await SetsItsRankInInit.options(replicas=2).as_service(client=c)
    await assert_nothing_left(s, workers)

