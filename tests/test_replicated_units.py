"""Replicated services without a cluster: admission queue, routers, options, metrics."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from utils import suspended_in, until

import dask_services
from dask_services.replicated import (
    LeastLoaded,
    PowerOfTwo,
    ReplicaView,
    RoundRobin,
    ServiceOverloaded,
    ServiceShutdown,
)
from dask_services.replicated._errors import CallMoved
from dask_services.replicated._metrics import ReplicaMetrics
from dask_services.replicated._options import ReplicaOptions, endpoints, unconfigured
from dask_services.replicated._queue import CallGate
from dask_services.replicated._rebalance import shed_plan, spread_move
from dask_services.replicated._routing import make_router
from dask_services.service import ServiceId

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_gate_admits_max_concurrency_then_queues_then_refuses():
    async def main():
        gate = CallGate(max_concurrency=2, max_queued=1, name="r")
        await gate.acquire()
        await gate.acquire()
        assert gate.in_flight == 2
        waiter = asyncio.ensure_future(gate.acquire())
        await until(lambda: suspended_in(waiter, "CallGate.acquire", gate))
        assert gate.queued == 1 and not waiter.done()
        with pytest.raises(ServiceOverloaded, match="max_queued=1"):
            await gate.acquire()
        gate.release()  # hands the slot to the waiter
        await waiter
        assert gate.in_flight == 2 and gate.queued == 0

    run(main())


def test_gate_is_first_come_first_served_and_cancel_safe():
    async def main():
        gate = CallGate(1, 10)
        await gate.acquire()
        order = []

        async def call(i):
            await gate.acquire()
            order.append(i)
            gate.release()

        tasks = [asyncio.ensure_future(call(i)) for i in range(4)]
        await until(lambda: all(suspended_in(t, "CallGate.acquire", gate) for t in tasks))
        assert gate.queued == 4
        tasks[1].cancel()  # a caller that gave up leaves the queue
        await asyncio.wait([tasks[1]])
        assert tasks[1].cancelled() and gate.queued == 3
        gate.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == [0, 2, 3]
        assert gate.in_flight == 0

    run(main())


def test_gate_close_fails_queued_calls_and_refuses_new_ones():
    async def main():
        gate = CallGate(1, 5, name="replica x")
        await gate.acquire()
        waiter = asyncio.ensure_future(gate.acquire())
        await until(lambda: suspended_in(waiter, "CallGate.acquire", gate))  # queued
        gate.close()
        with pytest.raises(ServiceShutdown, match="replica x"):
            await waiter
        with pytest.raises(ServiceShutdown):
            await gate.acquire()
        idle = asyncio.ensure_future(gate.wait_idle())
        await until(lambda: suspended_in(idle, "Event.wait", gate._idle))
        assert not idle.done() and gate.in_flight == 1  # the running call holds its slot
        gate.release()
        await idle

    run(main())


def test_shed_gives_back_the_last_movable_queued_calls_and_keeps_the_order_of_the_rest():
    """Replicas were added: the last queued calls that nothing holds here go back
    (``CallMoved``), the others (a session's) stay, in their order, and
    a sync call queued for a thread goes back as an async one does."""

    async def main():
        gate = CallGate(1, 10, name="replica x")
        executor = ThreadPoolExecutor(1)
        await gate.acquire()  # running
        order = []

        async def call(i, movable):
            await gate.acquire(movable=movable)
            order.append(i)
            gate.release()
            return i

        tasks = [asyncio.ensure_future(call(i, movable=i != 4)) for i in range(5)]
        await until(lambda: all(suspended_in(t, "CallGate.acquire", gate) for t in tasks))
        in_thread = gate.admit_to_thread(executor, lambda: "sync", movable=True)
        assert (gate.in_flight, gate.queued) == (1, 6)
        # keep 3 of 7: the thread call and calls 3, 2 and 1 go; call 4 is held here
        assert gate.shed(3, "gave the call back") == 4
        with pytest.raises(CallMoved, match="replica x gave the call back"):
            await gate.outcome(in_thread)
        for i in (1, 2, 3):
            with pytest.raises(CallMoved):
                await tasks[i]
        assert (gate.in_flight, gate.queued) == (1, 2)
        assert gate.shed(0, "again") == 1  # call 0; call 4 stays whatever keep says
        assert gate.queued == 1
        gate.release()
        assert await tasks[4] == 4 and order == [4]
        assert [t.exception().__class__ for t in tasks[:4]] == [CallMoved] * 4
        assert gate.in_flight == 0 and gate.shed(0, "nothing queued") == 0
        executor.shutdown()

    run(main())


def test_the_queued_calls_of_a_caller_gone_are_given_back_and_the_others_keep_their_order():
    """A caller left the cluster: its queued calls, async and sync, session or not, go
    back (``CallMoved``), the running one finishes, other callers' calls and a batch
    waiting for a slot stay in their order, and nothing is kept of the calls gone."""

    async def main():
        gate = CallGate(1, 10, name="replica x")
        executor = ThreadPoolExecutor(1)
        await gate.acquire(caller="gone")  # running: it finishes
        order = []

        async def call(i, caller, internal=False):
            await gate.acquire(caller=caller, movable=i % 2 == 0, internal=internal)
            order.append(i)
            gate.release()
            return i

        callers = ["gone", "stays", "gone", "stays", None, "gone"]
        tasks = [asyncio.ensure_future(call(i, c)) for i, c in enumerate(callers)]
        batch = asyncio.ensure_future(call(6, "gone", internal=True))
        await until(lambda: all(suspended_in(t, "CallGate.acquire", gate)
                                for t in [*tasks, batch]))
        gone_sync = gate.admit_to_thread(executor, lambda: "sync", caller="gone")
        kept_sync = gate.admit_to_thread(executor, lambda: "kept", caller="stays")
        assert (gate.in_flight, gate.queued) == (1, 8)
        assert gate.give_back_calls_of({"gone"}, "gave the call back: its caller "
                                                 "left") == 4
        with pytest.raises(CallMoved, match="replica x gave the call back: its caller"):
            await gate.outcome(gone_sync)
        for i in (0, 2, 5):
            with pytest.raises(CallMoved):
                await tasks[i]
        assert (gate.in_flight, gate.queued) == (1, 4)
        assert gate.give_back_calls_of({"gone"}, "again") == 0
        gate.release()
        assert await gate.outcome(kept_sync) == "kept"
        await asyncio.gather(tasks[1], tasks[3], tasks[4], batch)
        assert order == [1, 3, 4, 6]
        assert gate._callers == {} and gate.in_flight == 0 and gate.queued == 0
        executor.shutdown()

    run(main())


def test_the_held_calls_of_a_caller_gone_leave_the_batch_they_wait_for():
    """Calls held for a batch while the replica is busy: those of a caller that left go
    back (``CallMoved``), counted out of the gate's queue; the others run as one batch,
    and nothing is kept of any of them once done."""
    from dask_services.replicated._batching import Batcher

    async def main():
        gate = CallGate(1, 10, name="replica x")
        batches = []

        async def run_batch(requests):
            batches.append(requests)
            return requests

        batcher = Batcher(gate, "svc.work", size=4, wait=0.0, run=run_batch,
                          track=lambda task: None)
        await gate.acquire()  # busy: the batch waits for the slot
        futures = [batcher.enqueue(i, caller="gone" if i % 2 else "stays")
                   for i in range(4)]
        await until(lambda: suspended_in(batcher._flusher, "CallGate.acquire", gate))
        assert gate.queued == 4
        assert batcher.give_back_calls_of({"gone"}, "gave the call back") == 2
        assert gate.queued == 2
        for i in (1, 3):
            with pytest.raises(CallMoved, match="replica x gave the call back"):
                await futures[i]
        gate.release()
        assert await asyncio.gather(futures[0], futures[2]) == [0, 2]
        assert batches == [[0, 2]]
        await until(lambda: gate.in_flight == 0)
        assert batcher._callers == {} and gate.queued == 0

    run(main())


def test_shed_skips_a_thread_call_whose_caller_was_just_cancelled():
    """The caller's cancellation cancels the call's future at once and takes it out of
    the queue a step later: a shed in between failed on it and left the calls it had
    already taken out of the queue neither failed nor started (their callers hung)."""

    async def main():
        gate = CallGate(1, 10, name="replica x")
        executor = ThreadPoolExecutor(1)
        block = threading.Event()
        try:
            running = gate.admit_to_thread(executor, functools.partial(block.wait, 10))
            first = gate.admit_to_thread(executor, lambda: "first", movable=True)
            last = gate.admit_to_thread(executor, lambda: "last", movable=True)
            waiting = [asyncio.ensure_future(gate.outcome(c)) for c in (first, last)]
            await until(lambda: all(suspended_in(t, "CallGate.outcome", gate)
                                    for t in waiting))
            waiting[1].cancel()  # the caller of the last call goes away
            # the first goes back; the last is its cancelled caller's to take out
            assert gate.shed(0, "gave the call back") == 1
            with pytest.raises(CallMoved):
                await waiting[0]
            block.set()
            await gate.outcome(running)
            await asyncio.gather(*waiting, return_exceptions=True)
            assert waiting[1].cancelled() and gate.queued == 0
            await until(lambda: gate.in_flight == 0)
        finally:
            block.set()  # a failed assertion must not leave the thread waiting
            executor.shutdown(wait=False)

    run(main())


def test_shed_plan_asks_replicas_above_the_even_share():
    # a burst of 20 queued on one replica, two added: each ends near 20 / 3
    assert shed_plan({"a": (1, 19), "b": (0, 0), "c": (0, 0)}) == {"a": 7}
    # nothing queued, or at the share already: nobody is asked
    assert shed_plan({"a": (4, 0), "b": (0, 0)}) == {}
    assert shed_plan({"a": (2, 1), "b": (1, 2)}) == {}
    assert shed_plan({"a": (1, 30)}) == {}  # one replica: nowhere to go
    assert shed_plan({"a": (1, 5), "b": (1, 4), "c": (0, 0)}) == {"a": 4, "b": 4}


def test_spread_move_moves_from_the_most_crowded_to_a_worker_two_ranks_short():
    # all three on the first worker back after a restart; two more joined
    assert spread_move({"a": 3}, {"a", "b", "c"}, {"a": [0, 1, 2]}) == (0, "a")
    # one moved (leaving, so not counted; its new replica starting on b counts there)
    assert spread_move({"a": 2, "b": 1}, {"a", "b", "c"}, {"a": [1, 2]}) == (1, "a")
    assert spread_move({"a": 1, "b": 1, "c": 1}, {"a", "b", "c"}, {"a": [2]}) is None
    # a difference of one cannot be evened out; nor can a worker that is not eligible
    assert spread_move({"a": 2, "b": 1}, {"a", "b"}, {"a": [0, 1], "b": [2]}) is None
    assert spread_move({"a": 3}, {"a"}, {"a": [0, 1, 2]}) is None
    # only healthy replicas move: none movable, nothing to do
    assert spread_move({"a": 3}, {"a", "b"}, {}) is None


def test_thread_calls_follow_each_other_without_the_event_loop():
    """With a sync call running and more queued, the thread that ends one call starts the
    next itself: the queued calls run while the event loop is blocked."""

    async def main():
        gate = CallGate(1, 10)
        executor = ThreadPoolExecutor(1)
        go, last_started = threading.Event(), threading.Event()
        ran = []

        def call(i):
            ran.append(i)
            if i == 0:
                go.wait(5)
            if i == 2:
                last_started.set()
            return i

        calls = [gate.admit_to_thread(executor, functools.partial(call, i)) for i in range(3)]
        assert gate.in_flight == 1 and gate.queued == 2
        go.set()
        assert last_started.wait(5), "the queued calls waited for the event loop"
        assert [await gate.outcome(c) for c in calls] == [0, 1, 2]
        assert ran == [0, 1, 2]
        await until(lambda: gate.in_flight == 0)  # the last thread gave its slot back
        executor.shutdown()

    run(main())


def test_thread_calls_keep_first_come_first_served_with_other_calls():
    """A call waiting for a slot on the event loop (an async endpoint's) ends the chain of
    thread calls and goes first; a queued thread call whose caller gave up never runs;
    closing fails the queued ones."""

    async def main():
        gate = CallGate(1, 10, name="replica x")
        executor = ThreadPoolExecutor(1)
        go = threading.Event()
        order = []

        def call(i):
            if i == 0:
                go.wait(5)
            order.append(i)
            return i

        first = gate.admit_to_thread(executor, functools.partial(call, 0))

        async def on_the_loop():
            await gate.acquire()
            order.append("async")
            gate.release()

        waiter = asyncio.ensure_future(on_the_loop())
        await until(lambda: suspended_in(waiter, "CallGate.acquire", gate))
        then = gate.admit_to_thread(executor, functools.partial(call, 1))
        given_up = asyncio.ensure_future(gate.outcome(
            gate.admit_to_thread(executor, functools.partial(call, 2))))
        last = gate.admit_to_thread(executor, functools.partial(call, 3))
        await until(lambda: suspended_in(given_up, "CallGate.outcome", gate))
        given_up.cancel()
        await asyncio.wait([given_up])
        assert gate.queued == 3  # the async call, 1 and 3
        go.set()
        assert await gate.outcome(first) == 0
        await waiter
        assert await gate.outcome(then) == 1 and await gate.outcome(last) == 3
        assert order == [0, "async", 1, 3]

        go.clear()
        blocked = gate.admit_to_thread(executor, functools.partial(call, 0))
        queued = gate.admit_to_thread(executor, functools.partial(call, 4))
        gate.close()
        with pytest.raises(ServiceShutdown, match="replica x"):
            await gate.outcome(queued)
        with pytest.raises(ServiceShutdown):
            gate.admit_to_thread(executor, functools.partial(call, 5))
        go.set()
        assert await gate.outcome(blocked) == 0
        await until(lambda: gate.in_flight == 0)
        assert 4 not in order and 5 not in order
        executor.shutdown()

    run(main())


def test_thread_call_errors_reach_their_caller_and_free_the_slot():
    async def main():
        gate = CallGate(1, 10)
        executor = ThreadPoolExecutor(1)

        def fail():
            raise ValueError("bad input")

        calls = [gate.admit_to_thread(executor, fail), gate.admit_to_thread(executor, lambda: 7)]
        with pytest.raises(ValueError, match="bad input"):
            await gate.outcome(calls[0])
        assert await gate.outcome(calls[1]) == 7
        await until(lambda: gate.in_flight == 0)
        executor.shutdown()
        with pytest.raises(RuntimeError, match="shutdown"):  # the replica's executor is gone
            await gate.outcome(gate.admit_to_thread(executor, lambda: 8))
        await until(lambda: gate.in_flight == 0)

    run(main())


class Unprintable(BaseException):
    def __str__(self):
        raise RuntimeError("no text")


def test_thread_calls_interrupted_are_answered_and_free_the_slot():
    """An exception that is not an ``Exception`` out of a thread call (even one that
    cannot be printed) fails that call with a ``RuntimeError`` naming it; the next runs."""
    async def main():
        gate = CallGate(1, 10)
        executor = ThreadPoolExecutor(1)

        def interrupted(exc):
            raise exc

        calls = [gate.admit_to_thread(executor, functools.partial(interrupted, exc),
                                      what=f"svc.call{i}")
                 for i, exc in enumerate([KeyboardInterrupt(), SystemExit("leaving"),
                                          Unprintable()])]
        after = gate.admit_to_thread(executor, lambda: 7)
        for call, message in zip(calls, [r"svc.call0 raised KeyboardInterrupt in its thread",
                                         r"svc.call1 raised SystemExit\('leaving'\) in its",
                                         r"svc.call2 raised Unprintable in its thread"],
                                 strict=True):
            with pytest.raises(RuntimeError, match=message):
                await gate.outcome(call)
        assert await gate.outcome(after) == 7
        await until(lambda: gate.in_flight == 0)
        executor.shutdown()

    run(main())


def views(*loads):
    return [ReplicaView(ServiceId(f"r{i}"), f"w{i}", load) for i, load in enumerate(loads)]


def test_routers():
    rr = RoundRobin()
    picks = [rr.choose(views(0, 0, 0)).id for _ in range(4)]
    assert sorted(picks[:3]) == ["r0", "r1", "r2"] and picks[3] == picks[0]  # in turn
    # fresh routers (one per task calling the service) start at different replicas
    assert len({RoundRobin().choose(views(0, 0, 0)).id for _ in range(60)}) == 3
    assert len({LeastLoaded().choose(views(0, 0, 0)).id for _ in range(60)}) == 3
    ll = LeastLoaded()
    assert ll.choose(views(3, 1, 2)).id == "r1"
    assert {ll.choose(views(0, 0, 5)).id for _ in range(4)} == {"r0", "r1"}  # ties take turns
    p2 = PowerOfTwo(seed=1)
    picks = [p2.choose(views(0, 9, 9, 9)).id for _ in range(200)]
    assert picks.count("r0") > 200 * 0.4  # r0 wins every draw it is part of (half of them)
    assert "r0" not in {p2.choose(views(9, 0)).id for _ in range(20)}


def test_router_specs():
    class Mine:
        def choose(self, replicas):
            return replicas[-1]

    assert isinstance(make_router("round_robin"), RoundRobin)
    assert isinstance(make_router(Mine), Mine)
    mine = Mine()
    assert make_router(mine) is mine
    with pytest.raises(ValueError, match="unknown router 'fastest'.*least_loaded"):
        make_router("fastest")
    with pytest.raises(TypeError, match="choose"):
        make_router(42)


class Model(dask_services.Service):
    service_options = {"replicas": 2, "max_queued": 7}

    @dask_services.endpoint
    async def predict(self, x):
        return x

    def helper(self):
        pass


def test_options_chain_and_class_defaults():
    configured = Model.options(replicas=3).options(max_concurrency=4)
    opts = ReplicaOptions.merged(configured.service_options)
    assert (opts.replicas, opts.max_concurrency, opts.max_queued) == (3, 4, 7)
    assert ReplicaOptions.merged(Model.service_options).replicas == 2
    assert configured.__name__ == "Model" and issubclass(configured, Model)
    assert unconfigured(configured) is Model
    assert endpoints(configured) == ["predict"]


@pytest.mark.parametrize("bad, match", [
    ({"replicas": 0}, "replicas"),
    ({"replicas": 1.5}, "replicas"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"max_queued": -1}, "max_queued"),
    ({"router": "nope"}, "unknown router"),
    ({"workers": "tcp://a"}, "list of worker"),
    ({"workers": 1}, r"list of worker addresses or names, e.g. \[1\]"),
    ({"workers": []}, "no worker"),
    ({"resources": {"GPU": "one"}}, "resources"),
    ({"replica": 2}, r"unknown option\(s\) \['replica'\]"),
])
def test_bad_options_fail_early(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Model.options(**bad)


def test_endpoint_names_may_not_hide_handle_methods():
    class Clash(dask_services.Service):
        @dask_services.endpoint
        def scale(self):
            pass

    from dask_services.replicated._handle import check_names

    with pytest.raises(TypeError, match="scale"):
        check_names(Clash)


def test_metrics_quantiles():
    m = ReplicaMetrics(window=100)
    for i in range(1, 201):
        m.record(i / 1000, error=(i % 50 == 0))
    s = m.summary()
    assert s["calls"] == 200 and s["errors"] == 4
    assert s["p50_ms"] == pytest.approx(150) and s["p99_ms"] == pytest.approx(199)
    assert math.isnan(ReplicaMetrics().summary()["p50_ms"])


def test_a_handle_whose_client_was_closed_says_what_to_do_without_another():
    from distributed import default_client

    from dask_services.replicated._transport import Transport

    class ClosedClientTransport(Transport):
        caller = "client-closed"

        def closed(self) -> bool:
            return True

    with pytest.raises(ValueError, match="No clients"):
        default_client()  # no other client: nothing to fall back on
    svc = dask_services.ReplicatedService("svc", object, {}, ClosedClientTransport())
    with pytest.raises(ValueError, match="the Client that service svc's handle used was "
                                         "closed; create a distributed.Client"):
        svc.replicas()


def test_rank_calls_on_a_worker_whose_replicas_closed_are_answered_at_once():
    """A rank call for a rank not started yet waits for its start; once the worker's
    replicas are closed no start comes (they are refused), so waiting calls, and later
    ones, are answered "gone" at once instead of after ``setup-timeout``."""
    from types import SimpleNamespace

    from distributed.core import Status

    from dask_services.replicated import _gang
    from dask_services.replicated._worker import ReplicaWorker

    async def main():
        ext = ReplicaWorker()
        ext.worker = SimpleNamespace(address="tcp://w", status=Status.closing, handlers={},
                                     extensions={})
        waiting = asyncio.ensure_future(
            _gang.rank_rpc(ext, "svc.0/1", 0, 0, "m", None, timeout=600))
        while not _gang._arrivals(ext):  # the call waits for its rank to start
            await asyncio.sleep(0)
        await ext.close()
        gone = {"status": "gone", "message": "rank svc.0/1 is not running on tcp://w"}
        assert await asyncio.wait_for(waiting, 10) == gone
        assert await asyncio.wait_for(
            _gang.rank_rpc(ext, "svc.0/1", 0, 0, "m", None, timeout=600), 10) == gone
        assert not _gang._arrivals(ext)

    run(main())
