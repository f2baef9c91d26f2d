"""Hand-off tasks that return while their input is still being taken (``hand-off-buffer``)."""

from __future__ import annotations

import asyncio
import socket
import threading

import dask
import numpy as np
import pytest
from dask.sizeof import sizeof
from dask.utils import key_split
from distributed import Worker, wait
from distributed.core import Status
from distributed.utils_test import async_poll_for
from services import GatedTaker, RestartsOnceAtTheBarrier, SizeRecorder
from utils import assert_nothing_left, events_of, service_cluster

import dask_services
from dask_services._pending_inputs import PendingInputs

pytestmark = pytest.mark.timeout(90)


def block(i: int) -> np.ndarray:
    return np.full(1000, i, dtype="f8")  # 8 kB


def handoff_states(s) -> list[str]:
    return [ts.state for k, ts in s.tasks.items() if "handoff" in str(k)]


def test_pending_inputs_admits_up_to_its_limit():
    pending = PendingInputs(100)
    assert pending.admit(60)
    assert not pending.admit(41)  # would pass the limit
    assert pending.admit(40)
    pending.release(60)
    assert (pending.bytes, pending.count) == (40, 1)
    assert not PendingInputs(0).admit(1)
    assert PendingInputs(0).admit(0)  # an empty input


@pytest.fixture
def gated():
    GatedTaker.reset()
    yield GatedTaker
    GatedTaker.reset()


@service_cluster()
async def test_hand_offs_finish_before_their_inputs_are_taken(c, s, a, b, gated):
    futs = c.map(block, range(10))
    await wait(futs)
    outs = dask_services.submit(gated, futs, outputs=2, client=c)
    # every hand-off finishes while every add_key still waits for the gate ...
    await async_poll_for(lambda: handoff_states(s) and all(
        st == "memory" for st in handoff_states(s)), timeout=30)
    await async_poll_for(lambda: gated.entered == 10, timeout=30)
    assert not any(o.done() for o in outs)  # ... and the barrier waits for the inputs
    assert sum(w.extensions["dask_services"].pending_inputs.count for w in (a, b)) == 10
    gated.gate.set()
    expected = np.sum([block(i) for i in range(10)], axis=0)
    for got in await c.gather(outs):
        np.testing.assert_array_equal(got, expected)
    del outs, futs
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("limit", ["0", "4 kiB"])  # none, or less than one 8 kB input
@service_cluster()
async def test_hand_offs_wait_past_the_buffer(c, s, a, b, gated, limit):
    for w in (a, b):  # the workers read the setting when they start: set it there
        w.extensions["dask_services"].pending_inputs.limit = dask.utils.parse_bytes(limit)
    futs = c.map(block, range(4))
    await wait(futs)
    outs = dask_services.submit(gated, futs, outputs=1, client=c)
    await async_poll_for(lambda: gated.entered >= 1, timeout=30)
    # an add_key is under way: its hand-off cannot have finished
    assert "memory" not in handoff_states(s)
    gated.gate.set()
    expected = np.sum([block(i) for i in range(4)], axis=0)
    np.testing.assert_array_equal(await c.gather(outs[0]), expected)
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_add_key_sees_the_size_its_worker_measured(c, s, a, b):
    SizeRecorder.seen = {}
    futs = c.map(block, range(6))
    await wait(futs)
    outs = dask_services.submit(SizeRecorder, futs, outputs=2, client=c)
    await c.gather(outs)
    assert SizeRecorder.seen == {f.key: sizeof(block(0)) for f in futs}
    hosts = [w.extensions["dask_services"].host for w in (a, b)]
    assert not any(inst.input_sizes for h in hosts for inst in h.instances.values())
    del outs, futs


def _wide_partition(i: int):
    import pandas as pd

    rng = np.random.default_rng(i)
    return pd.DataFrame({"key": rng.integers(0, 1000, 20_000), "value": rng.random(20_000)})


@service_cluster(config={"dask_services.hand-off-buffer": "0 B"}, timeout=30)
async def test_fused_hand_offs_that_wait_on_one_thread_workers_do_not_deadlock(c, s, a, b):
    """A hand-off fused with the task that makes its input holds the worker's only task
    thread while it waits for the instance to take an input the hand-off buffer has no
    room for; the instance splits it (320 kB: in a thread, not on the event loop) in
    threads of its own, not behind the waiting one."""
    import dask.dataframe as dd
    import pandas as pd

    assert a.state.nthreads == b.state.nthreads == 1
    assert sizeof(_wide_partition(0)) > 2**18  # split in a thread, not on the event loop
    # made inside the graph: fused hand-offs
    df = dd.from_map(_wide_partition, range(6), meta=_wide_partition(0).iloc[:0],
                     enforce_metadata=False)
    shuffled = df.shuffle("key", shuffle_method="service")
    # every hand-off is the end of the task that makes its input (as ``compute()`` and
    # ``persist()`` optimize), which it depends on no more
    shuffled = shuffled.optimize()
    graph = dict(shuffled.__dask_graph__())
    (service_key,) = [k for k in graph if key_split(k) == "shuffle-service"]
    handoffs = graph[service_key].dependencies
    assert len(handoffs) == 6 and not any(graph[k].dependencies for k in handoffs)
    got = await c.compute(shuffled)
    expected = pd.concat([_wide_partition(i) for i in range(6)])
    pd.testing.assert_frame_equal(got.sort_values(["key", "value"]).reset_index(drop=True),
                                  expected.sort_values(["key", "value"]).reset_index(drop=True))
    await assert_nothing_left(s, [a, b])


def test_service_threads_are_as_many_as_task_threads_unless_configured():
    from types import SimpleNamespace

    from dask_services.worker import service_threads

    worker = SimpleNamespace(state=SimpleNamespace(nthreads=3))
    for config, expected in ((None, 3), (1, 1), (5, 5)):
        with dask.config.set({"dask_services.threads": config}):
            pool = service_threads(worker)
            assert pool.threads == pool.executor._max_workers == expected
            pool.shutdown()
    for bad in (0, -2, "four", 1.5):
        with dask.config.set({"dask_services.threads": bad}), \
                pytest.raises(ValueError, match="dask_services.threads must be"):
            service_threads(worker)


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_joining_worker_pushes_its_input_again_when_a_push_fails(c, s, a, b,
                                                                         monkeypatch):
    """A worker that joined after the run started hands its input to a participant over
    the network; when that push's connection fails, it asks the scheduler again and pushes
    again, instead of failing the service task."""
    from distributed import Worker
    from distributed.comm.core import CommClosedError
    from services import Recorder

    from dask_services.worker import ServiceWorkerPlugin

    Recorder.reset()
    port, late_address = free_address()  # the joining worker's, known beforehand
    first = c.submit(inc_one, 1, workers=[a.address], key="on-a")
    late_input = c.submit(inc_one, 10, workers=[late_address], key="on-late")
    outs = dask_services.submit(Recorder, [first, late_input], outputs=2, client=c)
    await async_poll_for(lambda: len(events_of("add_key")) == 1, timeout=10)
    # the hand-off of the late input runs where that input is made (else another worker
    # could fetch the input and take the participant's path)
    service_key = s.tasks[outs[0].key].run_spec.service_key
    handoff = s.tasks[service_key].run_spec.definition.handoff_keys[1]
    s.set_restrictions({handoff: late_address})  # strictly: not loosened elsewhere
    monkeypatch.setattr(s.extensions["dask_services"], "_restrict_handoff", lambda hts: None)
    pushes = []
    push = ServiceWorkerPlugin._push_input

    async def fails_once(self, *args, **kwargs):
        # patched before the worker starts: it makes its input as soon as it joins
        pushes.append(args[2])
        if len(pushes) == 1:
            raise CommClosedError("connection to the participant closed")
        await push(self, *args, **kwargs)

    monkeypatch.setattr(ServiceWorkerPlugin, "_push_input", fails_once)
    async with Worker(s.address, nthreads=1, name="late", host="127.0.0.1",
                      port=port) as late:
        assert await c.gather(outs) == [2 + 11] * 2
        assert pushes == ["on-late", "on-late"]  # the path under test was taken
        del outs, first, late_input
        await assert_nothing_left(s, [a, b, late])


@service_cluster(nthreads=[("127.0.0.1", 2)] * 2)
async def test_a_hand_off_lost_with_a_worker_outside_the_run_runs_again_where_its_input_went(
        c, s, a, b, monkeypatch):
    """A worker that joined after the run started pushed its input to a participant, then
    died before the run had all its inputs: the hand-off's result is lost and it runs
    again.  Run on the other participant (where the test's restrictions would put it), that
    one's instance would take the input a second time (a shuffle's rows twice, a
    rechunk's sums wrong); it runs where the input went instead, whose instance ignores
    it, and every input counts once, without a restart."""
    from distributed import Worker
    from services import Recorder

    from dask_services.worker import ServiceWorkerPlugin

    Recorder.reset()
    HELD.clear()
    port, late_address = free_address()  # the joining worker's, known beforehand
    first = c.submit(inc_one, 1, workers=[a.address], key="on-a")
    late_input = c.submit(inc_one, 10, workers=[late_address], key="on-late")
    last = c.submit(held_back, 100, key="held")  # keeps the run from having every input
    outs = dask_services.submit(Recorder, [first, late_input, last], outputs=2, client=c)
    await async_poll_for(lambda: len(events_of("add_key")) == 1, timeout=10)
    service_key = s.tasks[outs[0].key].run_spec.service_key
    handoff = s.tasks[service_key].run_spec.definition.handoff_keys[1]
    s.set_restrictions({handoff: late_address})
    monkeypatch.setattr(s.extensions["dask_services"], "_restrict_handoff", lambda hts: None)
    pushed_to = []
    push = ServiceWorkerPlugin._push_input

    async def recorded(self, address, *args, **kwargs):
        pushed_to.append(address)
        # run again, the hand-off can only go to the participant the push did not reach
        other = a.address if address == b.address else b.address
        s.set_restrictions({handoff: {late_address, other}})
        await push(self, address, *args, **kwargs)

    monkeypatch.setattr(ServiceWorkerPlugin, "_push_input", recorded)
    async with Worker(s.address, nthreads=1, name="late", host="127.0.0.1",
                      port=port) as late:
        await async_poll_for(lambda: len(events_of("add_key")) == 2
                             and s.tasks[handoff].state == "memory", timeout=10)
        assert len(pushed_to) == 1  # the path under test was taken
        s.tasks["on-late"].loose_restrictions = True  # lost, it is made again elsewhere
        await late.close()  # not retired: what it held is lost
    await async_poll_for(lambda: s.tasks[handoff].state == "memory", timeout=10)
    ran_again_on = {ws.address for ws in s.tasks[handoff].who_has}
    HELD.set()
    assert await c.gather(outs) == [2 + 11 + 101] * 2
    assert ran_again_on == set(pushed_to)
    assert s.extensions["dask_services"].machines[service_key].restarts == 0
    del outs, first, late_input, last
    await assert_nothing_left(s, [a, b])


HELD = threading.Event()  # in-process workers: released by the test


def held_back(x: int) -> int:
    HELD.wait(30)
    return x + 1


def free_address() -> tuple[int, str]:
    """A free port on this host, and a worker's address on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return port, f"tcp://127.0.0.1:{port}"


def inc_one(x: int) -> int:
    return x + 1


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2, worker_kwargs={"memory_limit": "600 MB"})
async def test_the_hand_off_buffer_is_at_most_a_32nd_of_the_memory_limit(c, s, a, b):
    for w in (a, b):
        assert w.extensions["dask_services"].pending_inputs.limit == 600_000_000 // 32


@service_cluster()
async def test_an_adaptive_cluster_does_not_close_a_worker_a_running_service_task_needs(
        c, s, a, b, gated):
    """``Scheduler.workers_to_close`` (what an adaptive cluster retires) leaves out the
    workers of a live run, and of outputs produced but not yet in memory; a worker that
    joins meanwhile, outside the run, may go."""
    from distributed import Worker

    futs = c.map(block, range(10))
    await wait(futs)
    assert len(s.workers_to_close(n=2)) == 2
    outs = dask_services.submit(gated, futs, outputs=2, client=c)
    await async_poll_for(lambda: gated.entered == 10, timeout=30)
    assert s.workers_to_close(n=2) == []
    async with Worker(s.address, nthreads=1) as extra:
        assert s.workers_to_close(n=3) == [extra.address]
    (service_key,) = s.extensions["dask_services"].machines
    gated.gate.set()
    await c.gather(outs)
    # the service task (long-running: distributed keeps its worker) returns once every
    # output has landed, which may come after the client has them
    await async_poll_for(lambda: service_key not in s.tasks
                         or s.tasks[service_key].state != "processing", timeout=10)
    assert len(s.workers_to_close(n=2)) == 2  # the run is over
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_a_run_is_named_to_a_pushing_hand_off_only_while_it_runs_there(c, s, a, b,
                                                                            gated):
    # ``service_run_info`` is how a hand-off on a worker without an instance finds one
    # to push its input to; a stale execution (its release not yet known on its worker)
    # must not be told the run that release led to, or its input reaches two instances
    futs = c.map(block, range(4))
    await wait(futs)
    outs = dask_services.submit(gated, futs, outputs=1, client=c)
    await async_poll_for(lambda: handoff_states(s) and all(
        st == "memory" for st in handoff_states(s)), timeout=30)
    plugin = s.extensions["dask_services"]
    (service_key,) = plugin.machines
    info = plugin.run_info(service_key)  # the live run, to whoever asks
    assert info is not None and set(info["peers"].values()) <= {a.address, b.address}
    handoffs = [k for k in s.tasks if "handoff" in str(k)]
    for key in handoffs:  # finished: not processing anywhere
        for worker in (a.address, b.address):
            assert plugin.run_info(service_key, handoff_key=key, worker=worker) is None
    assert plugin.run_info(service_key, handoff_key="no-such-task", worker=a.address) is None
    gated.gate.set()
    expected = np.sum([block(i) for i in range(4)], axis=0)
    np.testing.assert_array_equal((await c.gather(outs))[0], expected)
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_a_participant_being_retired_restarts_the_run_at_once(c, s, a, b, x, gated):
    """``retire_workers`` (and a worker's ``lifetime``) mark the worker closing
    gracefully, then move what it holds before it leaves: the live run restarts on the
    other workers when the retirement starts, not once the worker has gone, and the result
    is the same.  The restart counts."""
    futs = c.map(block, range(10))
    await wait(futs)
    outs = dask_services.submit(gated, futs, outputs=2, client=c)
    await async_poll_for(lambda: gated.entered == 10, timeout=30)  # live, held at the gate
    plugin = s.extensions["dask_services"]
    (service_key,) = plugin.machines
    machine = plugin.machines[service_key]
    assert b.address in machine.run.ids
    assert b.address in await c.retire_workers([b.address])
    assert b.address not in s.workers
    (restarted,) = [(when, msg["detail"]) for when, msg in s.get_events("dask_services")
                    if msg.get("action") == "restarted"]
    (left,) = [when for when, msg in s.get_events(b.address)
               if msg.get("action") == "remove-worker"]
    assert f"worker {b.address} is being retired" in restarted[1]
    assert restarted[0] < left  # restarted before the worker left
    gated.gate.set()
    expected = np.sum([block(i) for i in range(10)], axis=0)
    for got in await c.gather(outs):
        np.testing.assert_array_equal(got, expected)
    assert machine.restarts == 1
    assert b.address not in machine.finished_on
    del outs, futs
    await assert_nothing_left(s, [a, x])


class HeldFetches(Worker):
    """A worker whose fetches from other workers complete, data received, but are
    held until ``release`` is set before the worker takes them in: a transfer under way
    while the scheduler goes on."""

    def __init__(self, *args, **kwargs):
        self.fetched = asyncio.Event()
        self.release = asyncio.Event()
        super().__init__(*args, **kwargs)

    async def gather_dep(self, *args, **kwargs):
        done = await super().gather_dep(*args, **kwargs)
        self.fetched.set()
        await self.release.wait()
        return done


@pytest.fixture
def restarts_once():
    RestartsOnceAtTheBarrier.reset()
    yield RestartsOnceAtTheBarrier
    RestartsOnceAtTheBarrier.reset()


# (not paused by the memory monitor, which would resume b, paused here by hand)
@service_cluster(nthreads=[("127.0.0.1", 1)], config={"distributed.worker.memory.pause": False})
async def test_a_receipt_fetched_instead_of_run_again_hands_its_input_off_again(
        c, s, b, restarts_once):
    """The service task's worker fetches the hand-offs' receipts; a restart releases
    the hand-offs while a fetch is under way and the scheduler sends them to that worker
    to run again, where distributed takes the fetched receipt for the result.  Its input
    never reached the new run, which waited for ever: such a hand-off runs again."""
    async with HeldFetches(s.address, nthreads=1) as x:
        await dask_services.install_async(c)
        futs = c.map(block, range(4), workers=[b.address])
        await wait(futs)
        outs = dask_services.submit(restarts_once, futs, outputs=1, workers=[x.address],
                                    client=c)
        await x.fetched.wait()  # x has the receipts from b, not yet taken in
        handoffs = [k for k in s.tasks if "handoff" in str(k)]
        assert all(x.state.tasks[k].state == "flight" for k in handoffs)
        b.status = Status.paused  # the hand-offs run again on x only
        await async_poll_for(lambda: s.workers[b.address].status == Status.paused, 10)
        restarts_once.gate.set()  # the restart releases the hand-offs
        await async_poll_for(lambda: all(
            x.state.tasks.get(k) is not None and x.state.tasks[k].state == "resumed"
            for k in handoffs), timeout=10)  # in flight on x, and to be run there
        x.release.set()
        expected = np.sum([block(i) for i in range(4)], axis=0)
        np.testing.assert_array_equal((await c.gather(outs))[0], expected)
        (machine,) = s.extensions["dask_services"].machines.values()
        assert machine.restarts == 1
        b.status = Status.running
        x.validate_state()  # a worker of the test's own, which gen_cluster does not check
        del outs, futs
        await assert_nothing_left(s, [x, b])
