"""Outputs a finished run produced on a worker that is then retired gracefully."""

from __future__ import annotations

import asyncio
import threading

import dask.array as da
import numpy as np
import pytest
from dask.sizeof import sizeof
from distributed import wait
from distributed.core import Status
from distributed.utils_test import async_poll_for
from services import Recorder
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services

pytestmark = pytest.mark.timeout(90)

_busy = threading.Event()
_gate = threading.Event()


def held_then_doubled(block: np.ndarray) -> np.ndarray:
    """A consumer that waits for ``_gate``, then doubles its block."""
    _gate.wait(timeout=60)
    return block * 2


def held_then_raises(block: np.ndarray) -> np.ndarray:
    """A consumer that waits for ``_gate``, then fails."""
    _gate.wait(timeout=60)
    raise ValueError("the consumer fails")


def block(i: int) -> np.ndarray:
    return np.full(1000, i, dtype="f8")


def hold_the_thread() -> int:
    """Holds its worker's only task thread until ``_busy`` is set."""
    _busy.wait(timeout=60)
    return 1


async def run_held_at_its_gate(c, s, a):
    """A run of ``Recorder`` over inputs on ``a`` and the other worker, every input handed
    off, held at its gate ``"retire"`` before producing: ``(outputs, inputs)``."""
    futs = c.map(block, range(4), workers=[a.address, *(w for w in s.workers
                                                        if w != a.address)])
    await c.gather(futs)
    outs = dask_services.submit(Recorder, futs, outputs=4, gate="retire", client=c)
    await async_poll_for(lambda: sum(e[0] == "all_inputs_done" for e in Recorder.events)
                         == 2, timeout=30)
    return outs, futs


async def outputs_waiting_on(c, s, a):
    """A run of ``Recorder`` over inputs on both workers, finished, two of its outputs
    produced on ``a`` and their claims queued behind a task holding ``a``'s only thread:
    ``(outputs, inputs, the busy task, the service key, the run id, the waiting keys)``."""
    outs, futs = await run_held_at_its_gate(c, s, a)
    busy = c.submit(hold_the_thread, workers=[a.address], allow_other_workers=True,
                    pure=False)
    await async_poll_for(lambda: a.state.executing_count == 1, timeout=30)
    Recorder.gates["retire"].set()  # the run finishes: two outputs produced on each
    plugin = s.extensions["dask_services"]
    (service_key,) = plugin.machines
    machine = plugin.machines[service_key]
    # finished: every output produced; not concluded: not every one taken yet
    await async_poll_for(lambda: machine.run is not None and not machine.run.live,
                         timeout=30)
    assert not machine.run.concluded
    waiting = [k for k, w in plugin.cut.items() if w == a.address]
    assert waiting  # produced on a, their claims queued behind the busy task
    assert all(s.tasks[k].state == "processing" for k in waiting)
    return outs, futs, busy, service_key, machine.run.run_id, waiting


def runs_started(s, service_key) -> list[int]:
    return [m["run_id"] for _, m in s.get_events("dask_services")
            if m.get("action") == "started" and m.get("key") == service_key]


def assert_moved_by_the_one_run(s, service_key, run_id, waiting, to, nbytes) -> None:
    """No new run made the outputs ``waiting``: they are on worker ``to`` alone, with the
    size the worker they were produced on measured."""
    assert runs_started(s, service_key) == [run_id]
    for k in waiting:
        assert {ws.address for ws in s.tasks[k].who_has} == {to.address}
        assert s.tasks[k].nbytes == nbytes


async def finished_with_claims_without_worker(s, a):
    """Once the only run has finished, its outputs produced on the paused worker ``a``
    wait without a worker: ``(the service key, the run id, those outputs)``."""
    plugin = s.extensions["dask_services"]
    await async_poll_for(lambda: len(plugin.machines) == 1, timeout=30)
    (service_key,) = plugin.machines
    machine = plugin.machines[service_key]
    await async_poll_for(lambda: machine.run is not None and not machine.run.live,
                         timeout=30)
    assert s.workers[a.address].status == Status.paused
    waiting = [k for k, w in plugin.cut.items() if w == a.address]
    assert waiting and all(s.tasks[k].state == "no-worker" for k in waiting)
    return service_key, machine.run.run_id, waiting


@pytest.fixture(autouse=True)
def _reset():
    Recorder.reset()
    _busy.clear()
    _gate.clear()
    yield
    _busy.set()
    _gate.set()
    Recorder.reset()


@service_cluster()
async def test_outputs_waiting_for_their_claims_move_with_the_retirement(c, s, a, b):
    """A retiring worker runs no task, so the claims of outputs produced there and not
    yet taken (queued behind a task that was running) would never run: the run that had
    finished produced them again once the worker left.  They are taken into the worker's
    memory when the retirement starts, and the retirement moves them like any data."""
    outs, futs, busy, service_key, run_id, waiting = await outputs_waiting_on(c, s, a)
    # the task that held the thread ends; a retiring worker starts no other
    assert a.address in await retired_then_set(c, s, a, _busy)
    assert a.address not in s.workers

    expected = np.sum([block(i) for i in range(4)], axis=0)
    for got in await c.gather(outs):
        np.testing.assert_array_equal(got, expected)
    assert_moved_by_the_one_run(s, service_key, run_id, waiting, b, sizeof(expected))
    assert all(s.tasks[k].type == "numpy.ndarray" for k in waiting)
    await busy
    del outs, futs, busy
    await assert_nothing_left(s, [b])


@service_cluster()
async def test_outputs_taken_into_memory_stay_where_a_retirement_is_given_up(c, s, a, b):
    """Retiring every worker is given up (no worker to move the data to): the outputs
    taken into memory as it started stay on their worker, which runs tasks again."""
    outs, futs, busy, service_key, run_id, waiting = await outputs_waiting_on(c, s, a)
    assert await c.retire_workers([a.address, b.address]) == {}  # neither could be
    # (the busy task still holds a's thread: only the retirement took them into memory)
    assert all(s.tasks[k].state == "memory" for k in waiting)
    await async_poll_for(lambda: all(ws.status == Status.running
                                     for ws in s.workers.values()), timeout=10)
    _busy.set()

    expected = np.sum([block(i) for i in range(4)], axis=0)
    for got in await c.gather(outs):
        np.testing.assert_array_equal(got, expected)
    assert runs_started(s, service_key) == [run_id]
    for k in waiting:
        assert {ws.address for ws in s.tasks[k].who_has} == {a.address}
    await busy
    del outs, futs, busy
    await assert_nothing_left(s, [a, b])


VALUES = np.arange(400 * 300.0).reshape(400, 300)


async def rechunk_consumed_by(c, s, a, consumer):
    """A service rechunk of ``VALUES`` whose outputs' only consumer (``consumer``, held
    at ``_gate``) runs in their claims, persisted, once its run finished with one claim
    on each worker running its consumer and the others waiting for the thread:
    ``(the input, the output, the service key, the run id, the claims waiting on a)``."""
    x = c.persist(da.from_array(VALUES, chunks=(50, 300)))
    await wait(x)
    out = c.persist(x.rechunk((400, 30), method="service").map_blocks(
        consumer, meta=np.empty((0, 0))))
    plugin = s.extensions["dask_services"]
    await async_poll_for(lambda: len(plugin.machines) == 1, timeout=30)
    (service_key,) = plugin.machines
    machine = plugin.machines[service_key]
    await async_poll_for(lambda: machine.run is not None and not machine.run.live
                         and a.state.executing_count == 1, timeout=30)
    waiting = [k for k, w in plugin.cut.items()
               if w == a.address and a.state.tasks[k].state == "ready"]
    assert waiting
    return x, out, service_key, machine.run.run_id, waiting


async def retired_then_set(c, s, a, event: threading.Event) -> dict:
    """What ``retire_workers([a])`` returns, ``event`` set once the retirement started."""
    retiring = asyncio.create_task(c.retire_workers([a.address]))
    await async_poll_for(lambda: a.address not in s.workers
                         or s.workers[a.address].status == Status.closing_gracefully,
                         timeout=10)
    event.set()
    return await asyncio.wait_for(retiring, 30)


@service_cluster()
async def test_outputs_whose_claims_run_their_consumer_move_with_the_retirement(c, s, a, b):
    """A rechunk's output whose only consumer runs in its claim (``_claim_fusion``) has no
    value of its own to take: the retiring worker runs the consumer itself, in a service
    thread (its task threads start nothing), and the result moves with its other data."""
    x, out, service_key, run_id, waiting = await rechunk_consumed_by(c, s, a,
                                                                     held_then_doubled)
    assert a.address in await retired_then_set(c, s, a, _gate)
    np.testing.assert_array_equal(await c.compute(out), VALUES * 2)
    # moved to b, with the size of the consumer's result
    assert_moved_by_the_one_run(s, service_key, run_id, waiting, b, 400 * 30 * 8)
    del out, x
    await assert_nothing_left(s, [b])


@service_cluster()
async def test_a_consumer_failing_on_a_retiring_worker_leaves_the_retirement_free(c, s, a, b):
    """The outputs taken in as a retirement starts are the scheduler's data on that worker:
    where the worker cannot make one (its consumer raises, in the service thread or in the
    claim that had started), it tells the scheduler, which lets go of it; else the
    retirement would wait for ever for data the worker does not have.  The error reaches
    the user through the new run that makes the output again."""
    x, out, *_ = await rechunk_consumed_by(c, s, a, held_then_raises)
    assert a.address in await retired_then_set(c, s, a, _gate)
    total = c.compute(out)
    await assert_errs(total, ValueError, "the consumer fails")
    del out, x, total
    await assert_nothing_left(s, [b])


class _Stream:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def test_a_claim_that_started_by_itself_is_followed_to_its_end():
    """A claim that was running (or had ended) when the scheduler took its output in
    reports its success itself; a failure, which the scheduler no longer takes, is told
    as the key being let go of, whether it came before or after the landing."""
    from types import SimpleNamespace

    from dask_services.worker import ServiceWorkerPlugin

    ext = ServiceWorkerPlugin.__new__(ServiceWorkerPlugin)
    ext.worker = SimpleNamespace(batched_stream=_Stream())
    ext.claims_after_landing = set()
    ext._claim_started("done", "memory", "s")  # ended well: its report is taken
    ext._claim_started("failed", "error", "s")  # ended badly before the landing
    ext._claim_started("running", "executing", "s")
    assert ext.claims_after_landing == {"running"}
    assert ext.worker.batched_stream.sent == [
        {"op": "release-worker-data", "key": "failed", "stimulus_id": "s"}]
    ext.transition("running", "executing", "error")  # ... and badly after it
    assert not ext.claims_after_landing
    assert [m["key"] for m in ext.worker.batched_stream.sent] == ["failed", "running"]
    ext._claim_started("again", "executing", "s")
    ext.transition("again", "executing", "memory")
    assert not ext.claims_after_landing and len(ext.worker.batched_stream.sent) == 2


# paused by the test: the memory monitor must not resume it
@service_cluster(config={"distributed.worker.memory.pause": False})
async def test_outputs_of_a_paused_worker_move_with_its_retirement(c, s, a, b):
    """A paused worker runs no task, so the claims of outputs produced there wait without
    a worker (``no-worker``), not on it; retired while paused, the worker would leave with
    them and a new run would make them again.  They are taken in as the retirement starts
    like the claims queued on a running worker."""
    outs, futs = await run_held_at_its_gate(c, s, a)
    a.status = Status.paused
    await async_poll_for(lambda: s.workers[a.address].status == Status.paused, timeout=10)
    Recorder.gates["retire"].set()
    service_key, run_id, waiting = await finished_with_claims_without_worker(s, a)

    assert a.address in await c.retire_workers([a.address])
    assert a.address not in s.workers
    expected = np.sum([block(i) for i in range(4)], axis=0)
    for got in await c.gather(outs):
        np.testing.assert_array_equal(got, expected)
    assert_moved_by_the_one_run(s, service_key, run_id, waiting, b, sizeof(expected))
    del outs, futs
    await assert_nothing_left(s, [b])


@service_cluster(config={"distributed.worker.memory.pause": False})
async def test_consumed_outputs_of_a_paused_worker_move_with_its_retirement(c, s, a, b):
    """The same for a rechunk whose outputs' only consumer runs in their claims: the
    paused, retiring worker runs the consumer in a service thread and the results move."""
    x = c.persist(da.from_array(VALUES, chunks=(50, 300)), workers=[b.address])
    await wait(x)
    plugin = s.extensions["dask_services"]
    prepare_run = plugin._prepare_run

    def prepare_run_then_pause(*args, **kwargs):
        # a takes part in the run (it was running), then pauses: it hands off nothing
        # (it holds no input), its instance works on, and its outputs' claims cannot start
        prepare_run(*args, **kwargs)
        a.status = Status.paused

    plugin._prepare_run = prepare_run_then_pause
    out = c.persist(x.rechunk((400, 30), method="service").map_blocks(
        lambda block: block * 2, meta=np.empty((0, 0))))
    service_key, run_id, waiting = await finished_with_claims_without_worker(s, a)

    assert a.address in await c.retire_workers([a.address])
    np.testing.assert_array_equal(await c.compute(out), VALUES * 2)
    assert_moved_by_the_one_run(s, service_key, run_id, waiting, b, 400 * 30 * 8)
    del out, x
    await assert_nothing_left(s, [b])
