"""Request batching: ``@endpoint(batch_size=..., batch_wait=...)``."""

from __future__ import annotations

import asyncio

import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import async_poll_for
from replicated_batch_stream_services import GATES, Batched
from test_replicated import assert_nothing_left, cluster

import dask_services
from dask_services.replicated import BatchResultError, ServiceOverloaded
from dask_services.replicated._load import ongoing

pytestmark = pytest.mark.timeout(60)


def hosted_replica(workers, svc):
    """The one replica of ``svc`` (in-process workers)."""
    (rep,) = [r for w in workers
              for r in w.extensions["dask_services_replicated"].replicas.values()
              if r.name == svc.name]
    return rep


def test_endpoint_decorator_validates():
    with pytest.raises(ValueError, match="batch_size"):
        dask_services.endpoint(batch_size=0)
    with pytest.raises(ValueError, match="needs batch_size"):
        dask_services.endpoint(batch_wait="5ms")
    with pytest.raises(TypeError, match="cannot also be batched"):
        @dask_services.endpoint(batch_size=2)
        def gen(self, xs):
            yield xs


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_calls_are_gathered_into_batches_async_and_sync(c, s, *workers):
    svc = await Batched.options(replicas=1).as_service(client=c)
    # batch_wait is 10 s: only full batches of 4 can have run this quickly
    assert await asyncio.gather(*(svc.double.route(i) for i in range(12))) == [
        2 * i for i in range(12)]
    assert await asyncio.gather(*(svc.double_sync.route(i) for i in range(8))) == [
        2 * i for i in range(8)]
    assert await svc.batch_sizes.route() == [4] * 5
    # a lone call waits batch_wait at most, then runs as a batch of one
    assert await svc.quick.route(1) == 2
    assert (await svc.batch_sizes.route())[-1] == 1
    with pytest.raises(TypeError, match="exactly one request"):
        svc.double.route(1, 2)
    with pytest.raises(TypeError, match="exactly one request"):
        await svc._call("double", (), {"x": 1})  # the replica refuses too
    (m,) = await svc.metrics()
    assert m["calls"] == 12 + 8 + 2 + 1 and m["errors"] == 0
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_failing_item_fails_only_its_caller(c, s, *workers):
    svc = await Batched.options(replicas=1).as_service(client=c)
    results = await asyncio.gather(*(svc.picky.route(x) for x in (1, -2, 3, 4)),
                                   return_exceptions=True)
    assert await svc.batch_sizes.route() == [4]  # one batch
    assert results[0] == 1 and results[2:] == [3, 4]
    assert isinstance(results[1], ValueError) and "negative request -2" in str(results[1])
    # a wrong-length result fails every caller of the batch, clearly
    results = await asyncio.gather(*(svc.short.route(x) for x in range(4)),
                                   return_exceptions=True)
    assert all(isinstance(r, BatchResultError) for r in results)
    assert "returned 3 results for a batch of 4" in str(results[0])
    # so does an exception raised by the method
    results = await asyncio.gather(*(svc.broken.route(x) for x in range(4)),
                                   return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "batch of 4 failed" in str(r)
               for r in results)
    (row,) = await svc.replicas()
    assert row["state"] == "healthy"
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_batches_under_concurrency_limits(c, s, *workers):
    """A batch takes one slot of max_concurrency; calls waiting to join one count as
    queued; every request of a running batch is a call running (as the replica reports
    it, and the autoscaler and routers weigh it)."""
    GATES.clear()
    svc = await Batched.options(replicas=1, max_concurrency=1, max_queued=3).as_service(
        client=c)
    rep = hosted_replica(workers, svc)
    first = [asyncio.ensure_future(svc.gated.route(f"a{i}")) for i in range(2)]
    await async_poll_for(lambda: rep.gate.in_flight == 1 and rep.gate.queued == 0, 10)
    held = [asyncio.ensure_future(svc.gated.route(f"b{i}")) for i in range(3)]
    await async_poll_for(lambda: rep.gate.queued == 3, 10)
    assert rep.gate.in_flight == 1  # the full second batch waits for the slot
    with pytest.raises(ServiceOverloaded, match="max_queued=3"):
        await svc.gated.route("c")
    assert (rep.gate.running, rep.gate.load) == (2, 5)
    (row,) = await svc.replicas()
    assert (row["in_flight"], row["queued"]) == (2, 3)  # (1, 3) before: batches counted
    # what the autoscaler weighs, from the workers' heartbeats
    deployments = s.extensions["dask_services_replicated"]
    (dep,) = deployments.deployments.values()
    await async_poll_for(lambda: ongoing(dep, deployments.reports) == 5, 10)
    GATES["batch"].set()
    assert await asyncio.gather(*first, *held) == ["a0", "a1", "b0", "b1", "b2"]
    assert await svc.batch_sizes.route() == [2, 2, 1]
    assert (rep.gate.in_flight, rep.gate.queued, rep.gate.running) == (0, 0, 0)
    (m,) = await svc.metrics()
    assert m["overloaded"] == 1
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_held_calls_fail_at_shutdown(c, s, *workers):
    GATES.clear()
    svc = await Batched.options(replicas=1, max_concurrency=1).as_service(client=c)
    rep = hosted_replica(workers, svc)
    running = [asyncio.ensure_future(svc.gated.route(f"a{i}")) for i in range(2)]
    await async_poll_for(lambda: rep.gate.in_flight == 1, 10)
    held = asyncio.ensure_future(svc.gated.route("never"))
    await async_poll_for(lambda: rep.gate.queued == 1, 10)
    stopping = asyncio.ensure_future(svc.shutdown(timeout=30))
    await async_poll_for(lambda: rep.closing, 10)
    with pytest.raises(dask_services.ServiceShutdown):
        await held
    GATES["batch"].set()
    assert await asyncio.gather(*running) == ["a0", "a1"]
    await stopping
    await assert_nothing_left(s, workers)


@pytest.mark.slow
def test_batching_on_worker_processes(tmp_path):
    """Many callers of a vectorized endpoint on worker processes: batches form, every
    caller gets its own result, and a failing item fails only its own caller."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0", local_directory=str(tmp_path)) as lc, \
            Client(lc) as client:
        dask_services.install(client)
        svc = Batched.options(replicas=2, max_concurrency=1).as_service(client=client)

        async def many() -> list:
            return await asyncio.gather(*(svc._call("vectorized", (float(i * i),), {})
                                          for i in range(200)))

        assert client.sync(many) == [float(i) for i in range(200)]
        sizes = sum(svc.batch_sizes.fanout().result(), [])
        assert sum(sizes) == 200 and max(sizes) > 1
        with svc.session():  # one replica, so that the four calls make one batch
            calls = [svc.picky.route(x) for x in (5, -1, 6, 7)]
        with pytest.raises(ValueError, match="negative request -1"):
            calls[1].result(timeout=30)
        assert [calls[i].result(timeout=30) for i in (0, 2, 3)] == [5, 6, 7]
        svc.shutdown()


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_calls_in_one_turn_share_a_message(c, s, *workers):
    """Calls to one replica made in the same turn of the loop travel as one
    ``replicated_calls`` message; each still gets its own result or error."""
    from replicated_services import Adder

    (w,) = workers
    svc = await Adder.options(replicas=1, max_concurrency=2).as_service(10, client=c)
    groups: list[int] = []
    handler = w.handlers["replicated_calls"]

    async def spy(comm, calls):
        groups.append(len(calls))
        return await handler(comm, calls)

    w.handlers["replicated_calls"] = spy
    calls = [svc.add.route(i) for i in range(20)] + [svc.fail.route("third wheel")]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[:20] == [i + 10 for i in range(20)]
    assert isinstance(results[20], ValueError) and "third wheel" in str(results[20])
    assert groups == [21]
    assert await svc.add.route(1) == 11  # a lone call goes on its own
    assert groups == [21]
    (m,) = await svc.metrics()
    assert (m["calls"], m["errors"]) == (22, 1)
    await svc.shutdown()
    await assert_nothing_left(s, workers)
