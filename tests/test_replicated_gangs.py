"""Replicas of several ranks (``options(procs_per_replica=n)``)."""

from __future__ import annotations

import asyncio
import os

import dask
import pytest
from distributed import Worker
from distributed.utils_test import async_poll_for
from gang_services import Sharded, UnrulyGang
from test_replicated import assert_nothing_left, cluster, hosted

from dask_services.replicated import _lifecycle as lc
from dask_services.replicated._options import endpoint_ranks

pytestmark = pytest.mark.timeout(60)

FOUR_WORKERS = [("127.0.0.1", 1)] * 4
EXT = "dask_services_replicated"


def machines(s, name: str) -> list[lc.ReplicaMachine]:
    return list(s.extensions[EXT].deployments[name].slots.values())


def test_endpoint_ranks_option():
    assert endpoint_ranks(Sharded, "total") == "all"
    assert endpoint_ranks(Sharded, "info") == "first"
    import dask_services

    with pytest.raises(ValueError, match="ranks"):
        dask_services.endpoint(ranks="some")


def test_gang_machine_lost_rank_stops_the_others():
    m = lc.ReplicaMachine("s.0", size=3)
    (launch,) = m.start()
    actions = m.handle(lc.Placed(launch.id, "a", ("b", "c")))
    assert actions == [lc.StartOn(launch.id, "a", ("b", "c"))]
    assert m.workers == ("a", "b", "c")
    m.handle(lc.SetupSucceeded(launch.id))
    assert m.state is lc.ReplicaState.HEALTHY
    actions = m.handle(lc.WorkerLost("b"))
    assert actions[0] == lc.Stop(launch.id, "a", drain=False, others=("c",))
    assert m.state is lc.ReplicaState.RECOVERING and m.workers == ()
    assert isinstance(actions[-1], lc.Launch) and actions[-1].exclude == {"b"}
    assert "rank 1 lost" in (m.last_error or "")
    m.validate()
    # waiting holds nothing, and says why
    m.handle(lc.NoWorker(m.id, "waiting for 3 workers at once: 2 eligible of 2 running"))
    assert m.waiting_for_worker and m.workers == () and "3 workers" in m.last_error
    m.validate()


@cluster(nthreads=FOUR_WORKERS)
async def test_gang_ranks_all_gather_and_first_rank_endpoints(c, s, *workers):
    svc = await Sharded.options(replicas=2, procs_per_replica=2).as_service(client=c)
    ms = machines(s, svc.name)
    placed = [w for m in ms for w in m.workers]
    assert len(placed) == 4 and len(set(placed)) == 4  # every rank on a worker of its own
    assert sorted(len(v) for v in hosted(workers).values()) == [1, 1, 1, 1]
    info = await svc.info.route()
    assert info["rank"] == 0 and info["world_size"] == 2 and info["ranks"] == [0, 1]
    assert info["id"] in {str(m.id) for m in ms}
    assert await svc.total.route(10) == 10 * (1 + 2)
    results = await asyncio.gather(*(svc.total.route(i) for i in range(20)))
    assert results == [3 * i for i in range(20)]
    # every rank ran every call of its replica; ranks="first" ran on rank 0 only
    counts = await svc.calls_per_rank.fanout()
    assert len(counts) == 2 and all(a == b for a, b in counts)
    assert sum(a for a, _ in counts) == 21
    assert await svc.ordered.route(50) == list(range(50))
    assert await svc.out_of_order.route() == [2, 1, 3]  # each call starts when awaited
    assert sorted(await svc.sync_total.fanout(5)) == [5, 5]  # rank 0's result
    rows = await svc.replicas()
    assert [r["state"] for r in rows] == ["healthy", "healthy"]
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_setup_talks_to_the_other_ranks(c, s, *workers):
    svc = await Sharded.options(procs_per_replica=3).as_service(barrier=True, client=c)
    assert await svc.total.route(1) == 1 + 2 + 3
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_setup_failing_on_one_rank_stops_the_gang(c, s, *workers):
    with pytest.raises(ValueError, match="setup refused on rank 1"):
        await Sharded.options(procs_per_replica=2).as_service(fail_rank=1, barrier=True,
                                                               client=c)
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_lost_rank_relaunches_the_whole_gang(c, s, *workers):
    svc = await Sharded.options(procs_per_replica=2).as_service(client=c)
    (m,) = machines(s, svc.name)
    old_id, old_workers = m.id, m.workers
    calls = [asyncio.ensure_future(svc.total.route(i, delay=0.2)) for i in range(6)]
    await async_poll_for(lambda: any(h for h in hosted(workers).values()), timeout=20)
    victim = next(w for w in workers if w.address == old_workers[1])
    await victim.close()
    assert await asyncio.gather(*calls) == [3 * i for i in range(6)]  # re-sent
    await async_poll_for(lambda: m.state is lc.ReplicaState.HEALTHY, timeout=20)
    assert m.id != old_id and victim.address not in m.workers
    assert await svc.total.route(7) == 21
    story = await svc.story()
    assert any("rank 1 lost" in e["detail"] or "healthy -> recovering" in e["what"]
               for e in story)
    await svc.shutdown()
    await assert_nothing_left(s, [w for w in workers if w is not victim])


@cluster(nthreads=[("127.0.0.1", 1, {"resources": {"slot": 1}})] * 3)
async def test_gangs_competing_for_workers_wait_holding_none(c, s, *workers):
    a = await Sharded.options(procs_per_replica=2, resources={"slot": 1},
                              name="a").as_service(client=c)
    deploying = asyncio.ensure_future(Sharded.options(
        procs_per_replica=2, resources={"slot": 1}, name="b").as_service(client=c))
    await async_poll_for(lambda: "b" in s.extensions[EXT].deployments
                         and machines(s, "b")[0].waiting_for_worker, timeout=10)
    (mb,) = machines(s, "b")
    assert mb.state is lc.ReplicaState.UNINITIALIZED and mb.workers == ()  # holds none
    assert "2 workers at once" in mb.last_error and "1 eligible" in mb.last_error
    from dask_services.replicated import ReplicatedService, ServiceUnavailable

    waiting = ReplicatedService("b", Sharded, {}, a._transport)
    rows = await waiting.replicas()
    assert rows[0]["state"] == "uninitialized" and "2 workers" in rows[0]["last_error"]
    # a call says what the replica waits for, as replicas() does
    with dask.config.set({"dask_services.replicated.call-retries": 1}):
        with pytest.raises(ServiceUnavailable, match=r"no healthy replica \(.*waiting for "
                                                     r"2 workers at once.*1 eligible"):
            await waiting.total.route(2)
        with pytest.raises(ServiceUnavailable, match="waiting for 2 workers at once"):
            await waiting.total.fanout(2)
    async with Worker(s.address, nthreads=1, resources={"slot": 1}) as extra:
        b = await deploying
        assert extra.address in machines(s, "b")[0].workers
        assert await b.total.route(2) == 6 and await a.total.route(2) == 6
        await b.shutdown()
        await a.shutdown()
        await assert_nothing_left(s, [*workers, extra])


# ------------------------------------------------------------------ worker processes


def _process_cluster(**kwargs):
    import dask
    from distributed import LocalCluster

    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
              "dask_services.replicated.health-check-period": "200ms"}
    kwargs.setdefault("n_workers", 3)
    with dask.config.set(config):
        return LocalCluster(threads_per_worker=1, processes=True, dashboard_address=":0",
                            **kwargs)


def _hosted_by_process(client) -> dict[str, int]:
    return client.run(lambda dask_worker: len(dask_worker.extensions[EXT].replicas))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rank_worker_killed_under_load():
    from concurrent.futures import ThreadPoolExecutor

    from distributed import Client
    from distributed.utils_test import poll_for
    from utils import kill, validate_scheduler

    from dask_services.replicated import ServiceUnavailable

    with _process_cluster() as lc_, Client(lc_) as client:
        svc = Sharded.options(procs_per_replica=2, max_concurrency=4).as_service(
            client=client)
        rank1 = client.run_on_scheduler(lambda dask_scheduler: [
            m.workers for m in dask_scheduler.extensions[EXT].deployments[svc.name]
            .slots.values()][0][1])
        old = svc.replicas()[0]["id"]

        def caller(k: int) -> tuple[int, list[str]]:
            good, errors = 0, []
            for i in range(15):
                try:
                    assert svc.total.route(i + k, 0.05).result(timeout=60) == 3 * (i + k)
                    good += 1
                except ServiceUnavailable as e:  # a clear error, never a wrong result
                    errors.append(str(e))
            return good, errors

        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(caller, k * 100) for k in range(4)]
            poll_for(lambda: svc.replicas()[0]["in_flight"] > 0, timeout=30)
            kill(client, rank1)
            outcomes = [f.result(timeout=100) for f in running]
        good = sum(g for g, _ in outcomes)
        errors = [e for _, es in outcomes for e in es]
        print(f"answered {good} of 60, clear errors: {errors[:2]}")
        assert good + len(errors) == 60 and good >= 50
        poll_for(lambda: svc.replicas()[0]["state"] == "healthy"
                 and svc.replicas()[0]["id"] != old, timeout=60)
        assert svc.total.route(5).result(timeout=30) == 15
        validate_scheduler(client)
        svc.shutdown()
        poll_for(lambda: not any(_hosted_by_process(client).values()), timeout=20)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gangs_competing_for_too_few_worker_processes():
    from distributed import Client
    from distributed.utils_test import poll_for

    from dask_services.replicated import ReplicatedService

    with _process_cluster(resources={"slot": 1}) as lc_, Client(lc_) as client:
        opts = {"procs_per_replica": 2, "resources": {"slot": 1}}
        a = Sharded.options(name="a", **opts).as_service(client=client)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            b_future = pool.submit(
                lambda: Sharded.options(name="b", **opts).as_service(client=client))
            b_view = ReplicatedService("b", Sharded, {}, a._transport)

            def waiting() -> bool:
                try:
                    rows = b_view.replicas()
                except Exception:
                    return False
                return bool(rows) and "2 workers at once" in (rows[0]["last_error"] or "")

            poll_for(waiting, timeout=30)
            (row,) = b_view.replicas()
            assert row["state"] == "uninitialized" and row["worker"] is None
            assert "1 eligible of 3 running" in row["last_error"]
            assert a.total.route(1).result(timeout=30) == 3  # a is unaffected
            lc_.scale(4)
            b = b_future.result(timeout=90)
        assert b.total.route(2).result(timeout=30) == 6
        b.shutdown()
        a.shutdown()
        poll_for(lambda: not any(_hosted_by_process(client).values()), timeout=20)


@pytest.fixture(scope="module")
def unruly_gang():
    from distributed import Client

    with _process_cluster(n_workers=2) as lc_, Client(lc_) as client:
        svc = UnrulyGang.options(procs_per_replica=2).as_service(client=client)
        try:
            yield client, svc
        finally:
            svc.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("endpoint", ["on_every_rank", "on_every_rank_sync",
                                      "through_rank_calls"])
@pytest.mark.parametrize("what, match", [
    ("kb", r"raised KeyboardInterrupt\('on rank 1'\), which is not an Exception"),
    ("exit", r"raised SystemExit\(3\), which is not an Exception"),
    ("genexit", r"raised GeneratorExit\(\), which is not an Exception"),
    ("stop", r"raised StopIteration \(a next\(\) on an exhausted iterator\?"),
])
def test_a_rank_letting_it_out_fails_the_call_and_the_gang_goes_on(
        unruly_gang, endpoint, what, match):
    """Rank 1's part of a call (an endpoint run on every rank, or an ``@rpc`` method rank
    0 calls) let a ``KeyboardInterrupt``, ``SystemExit`` or ``GeneratorExit`` out of the
    task running it: it stopped the worker's event loop, the call was re-sent to the
    relaunched gang and stopped the next worker, until the retries ran out (a
    ``ServiceUnavailable`` after 9 attempts); a ``StopIteration`` from a sync endpoint
    would never be the outcome of its future."""
    from utils import validate_scheduler

    client, svc = unruly_gang
    before = client.run(os.getpid)
    with pytest.raises(RuntimeError, match=match):
        getattr(svc, endpoint).route(what).result(timeout=30)
    assert svc.on_every_rank.route("nothing").result(timeout=30) == 0
    assert client.run(os.getpid) == before
    assert [r["state"] for r in svc.replicas()] == ["healthy"]
    validate_scheduler(client)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_call_that_kills_a_rank_fails_past_allowed_failures():
    """A call whose part on rank 1 ends rank 1's process (an endpoint run on every rank,
    or an ``@rpc`` method rank 0 calls) was re-sent to each relaunched gang as if rank 1
    had merely been unreachable: it killed a worker per attempt until the call retries
    ran out (9 attempts, 6-7 workers). A rank lost while it had the call now counts as a
    replica lost so: past ``distributed.scheduler.allowed-failures`` the call fails
    saying it may be what kills them, as ``KilledWorker`` says of a task."""
    from distributed import Client
    from distributed.utils_test import poll_for
    from utils import validate_scheduler

    from dask_services.replicated import ServiceUnavailable

    with _process_cluster() as lc_, Client(lc_) as client:
        svc = UnrulyGang.options(procs_per_replica=2).as_service(client=client)
        for endpoint in ("on_every_rank", "through_rank_calls"):
            with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
                with pytest.raises(ServiceUnavailable) as info:
                    getattr(svc, endpoint).route("die").result(timeout=100)
            message = str(info.value)
            assert "lost on 2 replicas while they had it" in message, message
            assert "allowed-failures=1" in message and "was lost while it had" in message
            poll_for(lambda: [r["state"] for r in svc.replicas()] == ["healthy"],
                     timeout=60)
            assert svc.on_every_rank.route("nothing").result(timeout=30) == 0
        validate_scheduler(client)
        svc.shutdown()
        poll_for(lambda: not any(_hosted_by_process(client).values()), timeout=20)
