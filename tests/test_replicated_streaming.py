"""Streaming endpoints: generators on the replica, ``svc.gen.stream(...)`` at the caller."""

from __future__ import annotations

import asyncio
import gc

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.core import Status
from distributed.utils_test import async_poll_for
from replicated_batch_stream_services import (
    GATES,
    RECORD,
    Streamer,
    stream_from_async_task,
    stream_from_task,
)
from test_replicated import (
    RETIRE_FAST,
    assert_nothing_left,
    cluster,
    healthy_count,
)

import dask_services

pytestmark = pytest.mark.timeout(60)


def hosted_replica(workers, svc):
    (rep,) = [r for w in workers
              for r in w.extensions["dask_services_replicated"].replicas.values()
              if r.name == svc.name]
    return rep


def idle(rep) -> bool:
    """Nothing of a stream left on the replica: no task, no slot, nothing queued."""
    return not rep.running and rep.gate.in_flight == 0 and rep.gate.queued == 0


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_stream_consumed_fully_async_and_sync_generators(c, s, *workers):
    RECORD.clear()
    svc = await Streamer.options(replicas=1).as_service(client=c)
    assert [x async for x in svc.count.stream(5)] == [0, 1, 2, 3, 4]
    assert [x async for x in svc.count_sync.stream(3)] == [0, 1, 2]
    assert [x async for x in svc.count.stream(0)] == []
    assert RECORD["count"][-1] == "finally" and RECORD["count_sync"][-1] == "finally"
    with pytest.raises(TypeError, match="streaming endpoint"):
        svc.count.route(3)
    with pytest.raises(TypeError, match="not a streaming endpoint"):
        svc.add.stream(3)
    assert await svc.add.route(1) == 2  # the pooled connection is clean after streams
    rep = hosted_replica(workers, svc)
    assert idle(rep)
    (m,) = await svc.metrics()
    assert m["calls"] == 4 and m["errors"] == 0
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_backpressure_holds_the_generator(c, s, *workers):
    RECORD.clear()
    with dask.config.set({"dask_services.replicated.stream-window": 3}):
        svc = await Streamer.options(replicas=1).as_service(client=c)
        for name in ("forever", "forever_sync"):
            stream = svc.__getattr__(name).stream(name)
            assert await stream.__anext__() == 0  # the caller has taken one item
            # the replica runs ahead by the window only, then waits for the caller
            await async_poll_for(lambda n=name: len(RECORD[n]) >= 4, 10)
            rep = hosted_replica(workers, svc)
            for _ in range(5):  # round trips through the replica's loop: time to run on
                await svc.add.route(0)
            assert RECORD[name] == [0, 1, 2, 3], RECORD[name]
            assert [await stream.__anext__() for _ in range(5)] == [1, 2, 3, 4, 5]
            await async_poll_for(lambda n=name: len(RECORD[n]) >= 9, 10)
            assert RECORD[name] == list(range(9))
            await stream.aclose()
            assert RECORD[name][-1] == "finally"
            assert idle(rep)
        await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_cancelled_streams_leave_nothing_on_the_replica(c, s, *workers):
    RECORD.clear()
    svc = await Streamer.options(replicas=1).as_service(client=c)
    rep = hosted_replica(workers, svc)
    # break out of the loop: the iterator is dropped, the connection broken
    async for x in svc.forever.stream("break"):
        if x == 2:
            break
    gc.collect()
    await async_poll_for(lambda: RECORD["break"][-1:] == ["finally"] and idle(rep), 10)
    # async with: closed on leaving the block (waits for the replica's answer)
    async with svc.forever_sync.stream("with") as stream:
        async for x in stream:
            if x == 3:
                break
    assert RECORD["with"][-1] == "finally" and idle(rep)

    # the caller's task is cancelled while it waits for an item
    async def consume(tag: str) -> None:
        async for _ in svc.tokens.stream("a b c d e f", delay=5):
            pass

    task = asyncio.ensure_future(consume("cancelled"))
    await async_poll_for(lambda: rep.gate.in_flight == 1, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await async_poll_for(lambda: idle(rep), 10)
    assert await svc.add.route(1) == 2
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_error_mid_stream_raises_after_the_items_before_it(c, s, *workers):
    svc = await Streamer.options(replicas=1).as_service(client=c)
    for name in ("fail_after", "fail_after_sync"):
        got = []
        with pytest.raises(ValueError, match="failed after 3 items"):
            async for x in svc.__getattr__(name).stream(3):
                got.append(x)
        assert got == [0, 1, 2]
    (row,) = await svc.replicas()
    assert row["state"] == "healthy"
    (m,) = await svc.metrics()
    assert m["errors"] == 2  # counted before the caller read the error
    # the replica lets go of the stream's slot once the caller has hung up, after that
    await async_poll_for(lambda: idle(hosted_replica(workers, svc)), 10)
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_a_stream_is_one_running_call(c, s, *workers):
    svc = await Streamer.options(replicas=1, max_concurrency=1, max_queued=0).as_service(
        client=c)
    stream = svc.forever.stream("slot")
    assert await stream.__anext__() == 0
    with pytest.raises(dask_services.ServiceOverloaded):
        await svc.add.route(1)
    await stream.aclose()
    assert await svc.add.route(1) == 2
    await svc.shutdown()
    await assert_nothing_left(s, workers)


@pytest.mark.slow
def test_streams_on_worker_processes_from_sync_code_and_tasks(tmp_path):
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                      dashboard_address=":0", local_directory=str(tmp_path)) as lc, \
            Client(lc) as client:
        dask_services.install(client)
        svc = Streamer.options(replicas=2).as_service(client=client)
        prompt = "the quick brown fox jumps over the lazy dog"
        assert list(svc.tokens.stream(prompt)) == prompt.split()
        assert list(svc.slow_tokens.stream(prompt, 0.001)) == prompt.split()
        with pytest.raises(ValueError, match="failed after 2 items"):
            list(svc.fail_after_sync.stream(2))
        for x in svc.forever.stream("sync-break"):  # dropped at the break: cancelled
            if x == 5:
                break
        with svc.forever_sync.stream("sync-with") as stream:
            assert next(stream) == 0
        assert client.submit(stream_from_task, svc, prompt).result() == prompt.split()
        assert client.submit(stream_from_async_task, svc, prompt).result() == prompt.split()
        rows = svc.replicas()
        assert all(r["in_flight"] == 0 and r["queued"] == 0 for r in rows)
        assert [svc.add.route(i).result() for i in range(4)] == [1, 2, 3, 4]
        svc.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stream_that_kills_its_worker_fails_past_allowed_failures(tmp_path):
    """A generator ending its worker's process before its first item was re-sent as if
    its replica had merely been unreachable: it killed a worker per attempt until the
    call retries ran out (9 attempts). A connection broken once the stream was asked for
    counts as a call lost in flight does: past ``distributed.scheduler.allowed-failures``
    the stream fails saying it may be what kills them."""
    from distributed.utils_test import poll_for

    from dask_services.replicated import ServiceUnavailable

    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=":0", local_directory=str(tmp_path)) as lc, \
            Client(lc) as client:
        svc = Streamer.as_service(client=client)
        with dask.config.set({"distributed.scheduler.allowed-failures": 1}), \
                pytest.raises(ServiceUnavailable) as info:
            list(svc.ends_its_process.stream())
        message = str(info.value)
        assert "ends_its_process (stream): the call was lost on 2 replicas" in message
        assert "allowed-failures=1" in message
        poll_for(lambda: [r["state"] for r in svc.replicas()] == ["healthy"], timeout=60)
        assert list(svc.count.stream(3)) == [0, 1, 2]
        svc.shutdown()


@pytest.mark.parametrize("method, last, errors", [("fine", "done", 0), ("fails", "error", 1)])
def test_a_stream_is_counted_before_its_last_message_goes_out(method, last, errors):
    """A caller that has read a stream's end (or its error) and then asks for
    ``svc.metrics()`` finds the call counted: the replica counts it before writing that
    message, not once the caller has hung up."""
    from types import SimpleNamespace

    from dask_services.replicated import _streaming
    from dask_services.replicated._metrics import ReplicaMetrics
    from dask_services.replicated._queue import CallGate

    class Generators:
        async def fine(self, n):
            for i in range(n):
                yield i

        async def fails(self, n):
            yield n
            raise ValueError("failed")

    class Comm:
        def __init__(self, metrics):
            self.metrics = metrics
            self.written = []
            self.finished = asyncio.Event()
            self.credit_sent = False

        async def read(self):
            if not self.credit_sent:
                self.credit_sent = True
                return {"op": "credit", "n": 10}
            await self.finished.wait()
            return {"op": "end"}

        async def write(self, msg):
            self.written.append((msg["status"], self.metrics.calls, self.metrics.errors))
            if msg["status"] in ("done", "error"):
                self.finished.set()

        def abort(self):
            pass

    async def main():
        metrics = ReplicaMetrics()
        rep = SimpleNamespace(gate=CallGate(1, 0), metrics=metrics, running=set(),
                              service=Generators(), executor=None, cancelled=False,
                              name="generators-1")
        comm = Comm(metrics)
        await _streaming.serve(rep, comm, method, (2,), {}, window=10)
        assert comm.written[-1] == (last, 1, errors), comm.written
        assert all(calls == 0 for status, calls, _ in comm.written[:-1])
        assert (metrics.calls, metrics.errors) == (1, errors)  # counted once
        assert rep.gate.in_flight == 0 and not rep.running

    asyncio.run(main())


@cluster(nthreads=[("127.0.0.1", 1)])
async def test_a_stream_cut_by_shutdown_raises_service_shutdown(c, s, *workers):
    """``svc.shutdown()`` while the caller is behind (the replica wrote its window of items
    and waits for credit): past the timeout the stream ends with ``ServiceShutdown``, also
    when the replica's last word is lost with the connection."""
    svc = await Streamer.options(replicas=1).as_service(client=c)
    stream = svc.forever.stream("cut")
    assert await stream.__anext__() == 0
    await svc.shutdown(timeout=0.2)
    got = []
    with pytest.raises(dask_services.ServiceShutdown, match="shut down"):
        async for x in stream:
            got.append(x)
    assert got == list(range(1, len(got) + 1))
    await assert_nothing_left(s, workers)


@cluster(nthreads=[("127.0.0.1", 1)] * 2,
         config={"dask_services.replicated.drain-timeout": "300ms"})
async def test_a_stream_cut_by_a_scale_down_before_its_first_item_is_not_run_again(
        c, s, a, b):
    # it answered "gone" and the caller opened it again on another replica: the
    # generator ran twice
    RECORD.pop("s1", None)
    RECORD.pop("s2", None)
    GATES.pop("first-item", None)
    svc = await Streamer.options(replicas=2, max_replicas_per_worker=1).as_service(client=c)

    async def first_item(tag):
        async for item in svc.gated_first.stream("first-item", tag):
            return item

    one = asyncio.ensure_future(first_item("s1"))
    await async_poll_for(lambda: RECORD.get("s1") == ["started"], timeout=10)
    two = asyncio.ensure_future(first_item("s2"))
    await async_poll_for(lambda: RECORD.get("s2") == ["started"], timeout=10)
    await svc.scale(1)
    done, running = await asyncio.wait([one, two], timeout=30,
                                       return_when=asyncio.FIRST_COMPLETED)
    (cut,) = done
    with pytest.raises(dask_services.ServiceUnavailable, match="scale-down"):
        await cut
    GATES.setdefault("first-item", asyncio.Event()).set()
    (kept,) = running
    assert await kept in ("s1", "s2")
    assert RECORD["s1"] == ["started"] and RECORD["s2"] == ["started"]  # once each
    await svc.shutdown()
    await assert_nothing_left(s, [a, b])



@cluster(config=RETIRE_FAST)
async def test_a_retired_workers_replica_streams_to_the_end(c, s, *workers):
    """A stream past its first item when its replica's worker is retired goes on to its
    end there (the old replica drains), though the worker closes meanwhile."""
    RECORD.clear()
    svc = await Streamer.options(replicas=1).as_service(client=c)
    (row,) = await svc.replicas()
    leaving = next(w for w in workers if w.address == row["worker"])
    plugin = leaving.extensions["dask_services_replicated"]
    stream = svc.count.stream(6, "retired")
    assert await stream.__anext__() == 0
    assert leaving.address in await asyncio.wait_for(c.retire_workers([leaving.address]),
                                                     30)
    await async_poll_for(lambda: healthy_count(s, svc) == 1, timeout=20)
    await async_poll_for(lambda: plugin.closed, timeout=20)  # closing its replicas
    assert leaving.status == Status.closing  # held open by the drain
    assert [item async for item in stream] == [1, 2, 3, 4, 5]
    assert RECORD["retired"] == [0, 1, 2, 3, 4, 5, "finally"]  # one run, to its end
    await async_poll_for(lambda: leaving.status == Status.closed, timeout=20)
    await svc.shutdown()
    await assert_nothing_left(s, [w for w in workers if w is not leaving])
