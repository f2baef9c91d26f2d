"""Errors, restarts and cancellation of service tasks (in-process cluster, validation on)."""

from __future__ import annotations

import asyncio

import dask
import pytest
from distributed import Event
from distributed.utils_test import async_poll_for
from services import Recorder
from utils import after_gate, assert_errs, assert_nothing_left, events_of, service_cluster

import dask_services
from dask_services import Service

pytestmark = pytest.mark.timeout(90)


def inc(x):
    return x + 1


@pytest.mark.parametrize(
    "hook", ["start", "all_started", "add_key", "all_inputs_done"]
)
@service_cluster()
async def test_hook_raising_errs_every_output(c, s, a, b, hook):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=3, fail_in=hook))
    for fut in outs:
        await assert_errs(fut, ValueError, f"boom in {hook}")
    started = {e[1] for e in events_of("start")}
    await async_poll_for(lambda: {e[1] for e in events_of("stop")} == started, timeout=5)
    assert len(events_of("stop")) == len(started)  # exactly once each
    del outs, fut
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_concierge_error_keeps_type_and_message(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(
        dask_services.service_task(Recorder, xs, outputs=2, fail_in="concierge.error")
    )
    await assert_errs(outs[0], KeyError, "refused by the service")
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_concierge_restart_gives_new_run_and_ids(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = dask_services.service_task(Recorder, xs, outputs=2, restart_runs=2)
    assert await c.gather(c.compute(outs)) == [10, 10]
    runs = {e[4]["run_id"] for e in events_of("start")}
    assert len(runs) == 3
    ids = [e[1] for e in events_of("start")]
    assert len(ids) == len(set(ids)) == 6
    restarted = [e for e in s.get_events("dask_services") if e[1]["action"] == "restarted"]
    assert len(restarted) == 2 and "asked by the test" in restarted[0][1]["detail"]
    await assert_nothing_left(s, [a, b])


@service_cluster(config={"dask_services.restarts": 1})
async def test_too_many_restarts_is_a_clear_error(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, restart_runs=5))
    exc = await assert_errs(outs[0], dask_services.TooManyRestarts, "asked by the test")
    assert "dask_services.restarts=1" in str(exc)
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_cancel_mid_run_stops_every_instance(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, gate="never"))
    await async_poll_for(lambda: len(events_of("all_inputs_done")) == 2, timeout=10)
    await c.cancel(outs)
    del outs
    await async_poll_for(lambda: len(events_of("stop")) == 2, timeout=10)
    cancelled = [e for e in s.get_events("dask_services") if e[1]["action"] == "cancelled"]
    assert cancelled
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_producing_unknown_or_duplicate_keys_is_refused(c, s, a, b):
    class Bad(dask_services.Service):
        async def all_inputs_done(self):
            if self.id != self.leader:
                return
            with pytest.raises(dask_services.ProduceKeyError, match="not an output"):
                await self.concierge.produce_key("nope", 1)
            for out in self.output_keys:
                assert await self.concierge.produce_key(out, 1) is True
            with pytest.raises(dask_services.ProduceKeyError, match="already produced"):
                await self.concierge.produce_key(self.output_keys[0], 2)

    outs = dask_services.service_task(Bad, [], outputs=2)
    assert await c.gather(c.compute(outs)) == [1, 1]
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_output_produced_by_two_instances_fails_the_task(c, s, a, b):
    class Twice(dask_services.Service):
        async def all_inputs_done(self):
            await self.concierge.produce_key(self.output_keys[0], str(self.id))

    outs = c.compute(dask_services.service_task(Twice, [], outputs=2))
    await assert_errs(outs[1], dask_services.ProduceKeyError, "produced twice")
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_outputs_produced_before_a_failure_keep_their_values(c, s, a, b):
    """A run that fails errs its outputs not yet produced; one produced before keeps its
    value (its downstream tasks may have used it already), as a task finished before
    another fails keeps its result."""
    class ProducesThenFails(dask_services.Service):
        async def all_inputs_done(self):
            if self.id == self.leader:
                assert await self.concierge.produce_key(self.output_keys[0], "first")
                raise ValueError("boom after the first output")

    outs = c.compute(dask_services.service_task(ProducesThenFails, [], outputs=2))
    await assert_errs(outs[1], ValueError, "boom after the first output")
    assert await outs[0] == "first"
    del outs
    await assert_nothing_left(s, [a, b])


async def produced_while_paused(c, s, paused: list, gate: str) -> list:
    """A service task's two outputs, produced while the workers ``paused`` are paused by the
    test (after every input reached the instances, which then wait at ``gate``)."""
    from distributed.core import Status

    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, gate=gate))
    await async_poll_for(lambda: len(events_of("all_inputs_done")) == 2, timeout=20)
    for w in paused:
        w.status = Status.paused
    await async_poll_for(lambda: all(s.workers[w.address].status == Status.paused
                                     for w in paused), timeout=10)
    Recorder.gates[gate].set()
    return outs


# paused by the test: the memory monitor must not resume them
@service_cluster(timeout=60, config={"distributed.worker.memory.pause": False})
async def test_an_output_produced_on_a_paused_worker_waits_for_it(c, s, a, b):
    """A worker paused for lack of memory runs no task, so the claim of an output it
    produced has no worker to run on (``no-worker``) until it resumes: that is no loss,
    and no run starts again."""
    from distributed.core import Status

    outs = await produced_while_paused(c, s, [a, b], "paused")
    keys = [f.key for f in outs]
    await async_poll_for(lambda: all(s.tasks[k].state == "no-worker" for k in keys),
                         timeout=10)
    for w in (a, b):
        w.status = Status.running
    assert await c.gather(outs) == [10, 10]
    actions = [e["action"] for _, e in s.get_events("dask_services")]
    assert "restarted" not in actions, actions
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=60, config={"distributed.worker.memory.pause": False})
async def test_an_output_produced_on_a_paused_worker_that_then_leaves_is_produced_again(
        c, s, a, b):
    """Every output produced (the run is over) while both workers are paused; one resumes,
    the other leaves with the output it produced: a new run produces that output again."""
    from distributed.core import Status

    outs = await produced_while_paused(c, s, [a, b], "leaves")
    keys = [f.key for f in outs]
    await async_poll_for(lambda: all(s.tasks[k].state == "no-worker" for k in keys),
                         timeout=10)
    b.status = Status.running
    await a.close()
    assert await c.gather(outs) == [10, 10]
    starts = [e for _, e in s.get_events("dask_services") if e["action"] == "started"]
    assert len(starts) == 2, s.get_events("dask_services")
    del outs
    await assert_nothing_left(s, [b])


@service_cluster(timeout=60, config={"distributed.worker.memory.pause": False})
async def test_an_output_waits_for_a_paused_worker_only_so_long(c, s, a, b, monkeypatch):
    """The values a paused worker holds for claims cannot be spilled, so it might never
    resume: past the grace period its output counts as lost and the run starts again
    (here on the same worker, which then resumes)."""
    from distributed.core import Status

    from dask_services import scheduler

    monkeypatch.setattr(scheduler, "UNPLACED_CLAIM_GRACE", 0.5)
    monkeypatch.setattr(scheduler, "UNPLACED_CLAIM_CHECK", 0.1)
    outs = await produced_while_paused(c, s, [a], "grace")

    def restarted() -> bool:
        return any(e["action"] in ("restarted", "rescheduled") or
                   (e["action"] == "started" and e["run_id"] > 1)
                   for _, e in s.get_events("dask_services"))

    await async_poll_for(restarted, timeout=20)
    a.status = Status.running
    assert await c.gather(outs) == [10, 10]
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=60, config={"distributed.worker.memory.pause": False})
async def test_a_paused_worker_gives_freed_memory_back(c, s, a, b, monkeypatch):
    """Process memory pauses a worker, and nothing runs there until it resumes (a run's
    claims, its service task itself); the memory freed before stays counted in glibc's
    heap until trimmed, which distributed never does.  While paused, the memory check
    trims, at most once a second, with a run live or not; not while running."""
    from distributed.core import Status

    from dask_services import worker as worker_module

    trims = []
    monkeypatch.setattr(worker_module, "release_freed_memory", lambda: trims.append(1))
    ext = a.extensions["dask_services"]
    for w in (a, b):  # only the checks this test makes
        w.extensions["dask_services"]._memory_check.stop()
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2, gate="trim"))
    await async_poll_for(lambda: len(events_of("all_inputs_done")) == 2, timeout=20)
    await ext._check_memory()
    assert not trims  # running
    a.status = Status.paused
    await ext._check_memory()
    assert len(trims) == ext.trims_while_paused == 1
    await ext._check_memory()
    assert len(trims) == 1  # not again within the second
    ext._trimmed_at -= worker_module.TRIM_WHILE_PAUSED_EVERY_S
    await ext._check_memory()
    assert len(trims) == 2
    a.status = Status.running
    Recorder.gates["trim"].set()
    assert await c.gather(outs) == [10, 10]
    del outs
    await assert_nothing_left(s, [a, b])
    await ext._check_memory()
    assert len(trims) == 2  # running
    a.status = Status.paused  # no run here any more: what waits may be anyone's
    ext._trimmed_at -= worker_module.TRIM_WHILE_PAUSED_EVERY_S
    await ext._check_memory()
    assert len(trims) == 3
    a.status = Status.running


@pytest.mark.parametrize("step", ["_register", "_order_inputs", "_restrict_handoff"])
@service_cluster()
async def test_a_failure_taking_in_the_graph_errs_the_service_task(c, s, a, b, step):
    """distributed logs an exception out of a scheduler plugin's graph intake and goes on
    with the graph: the service task then waited for ever for a run nothing prepared.  It
    fails now, naming what went wrong, and the next graph runs."""
    plugin = s.plugins["dask_services"]

    def broken(*args, **kwargs):
        raise RuntimeError("intake broke here")

    setattr(plugin, step, broken)
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2))
    for fut in outs:
        exc = await assert_errs(fut, dask_services.ServiceGraphError,
                                "could not take in service task")
        assert "RuntimeError: intake broke here" in str(exc)
    s.validate_state()
    delattr(plugin, step)
    del outs, fut
    await assert_nothing_left(s, [a, b])
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2))
    assert len(await c.gather(outs)) == 2


@service_cluster()
async def test_a_cloned_service_rechunk_is_refused_naming_clone_and_leaves_nothing(
        c, s, a, b):
    """dask.graph_manipulation.clone() renames a graph's keys but not the keys inside its
    tasks: the cloned claims still name the original service task.  Refused, the plugin
    kept each such claim as an output of that service task for good."""
    import dask.array as da
    import numpy as np
    from dask.graph_manipulation import clone

    x = da.from_array(np.arange(160_000.0).reshape(400, 400), chunks=(50, 400))
    y = x.rechunk((400, 50), method="service")
    plugin = s.plugins["dask_services"]
    for _ in range(2):
        futures = c.compute([y, clone(y, omit=x)])
        errors = [await f.exception() for f in futures]
        assert any(isinstance(e, dask_services.ServiceGraphError)
                   and "clone() and bind() rename them" in str(e) for e in errors), errors
        del futures, errors
        await assert_nothing_left(s, [a, b])
        assert not plugin.output_of


@service_cluster()
async def test_graph_manipulation_of_service_task_outputs(c, s, a, b):
    """``wait_on`` of service task outputs failed in dask (a ``Delayed`` rebuilt looked for
    a graph layer named like its tuple key); it now orders them as for any ``Delayed``.
    ``clone`` (and ``bind`` with the outputs as children) rename the service task's keys
    but not those inside its tasks: refused as the graph is built, naming what to do,
    where the computation's outputs were cancelled with "lost dependencies"."""
    from dask.graph_manipulation import bind, checkpoint, clone, wait_on

    from dask_services.examples import AllReduce

    xs = [dask.delayed(i) for i in range(4)]
    outs = dask_services.service_task(AllReduce, xs, outputs=4)
    waited = wait_on(*outs)
    assert all(w.key != o.key for w, o in zip(waited, outs, strict=True))
    assert await c.gather(c.compute(list(waited))) == [6] * 4
    after = bind(dask.delayed(sum)(xs), outs)  # outputs as parents
    assert await c.compute(after) == 6
    assert await c.compute(checkpoint(*outs)) is None
    for rebuild in (lambda: clone(*outs), lambda: bind(outs[0], xs[0])):
        with pytest.raises(dask_services.ServiceGraphError,
                           match=r"clone\(\), or bind\(\) with service task outputs as "
                                 r"children.*call service_task\(\) again"):
            rebuild()
    await assert_nothing_left(s, [a, b])


class FailsOnZero(Service):
    """Fails as the input ``0`` is handed off; sums the others otherwise."""

    async def add_key(self, key, data):
        if data == 0:
            raise ValueError("input 0 cannot be handed off")

    async def all_inputs_done(self):
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, 1)


@service_cluster(nthreads=[("127.0.0.1", 2)] * 2)
async def test_a_run_failing_while_inputs_still_compute_errs_at_once(c, s, a, b):
    """A hand-off failed while another input was still computing: the service task waits
    for that input, so no worker could raise the error for it, and the error reached the
    client only once every input was computed (for nothing). The scheduler errs it now,
    and the input computed for it alone is released."""
    gate = Event("gate-of-a-slow-input")
    xs = [dask.delayed(inc)(-1), dask.delayed(inc)(1),
          dask.delayed(after_gate)(2, "gate-of-a-slow-input")]
    outs = c.compute(dask_services.service_task(FailsOnZero, xs, outputs=2))
    for fut in outs:
        exc = await asyncio.wait_for(
            assert_errs(fut, ValueError, "input 0 cannot be handed off"), 20)
    # with the traceback of where it was raised, as when a worker raises it
    assert any("in add_key" in note for note in exc.__notes__), exc.__notes__
    # released while computing, as nothing wants it any more
    await async_poll_for(lambda: s.tasks.get(xs[-1].key) is None
                         or s.tasks[xs[-1].key].state == "released", timeout=10)
    await gate.set()
    s.validate_state()
    del outs, fut, exc
    await assert_nothing_left(s, [a, b])


def raises_after_gate(name: str):
    Event(name).wait()
    raise KeyError("an input failed")


@service_cluster(nthreads=[("127.0.0.1", 2)] * 2)
async def test_an_input_erring_while_the_run_is_live_stops_its_instances(c, s, a, b):
    """The run started with the first hand-offs; then another input raised. distributed
    errs the waiting service task through its input, and the run's instances stop while
    the client still holds the erred outputs (the plugin passes the service task's
    ``erred`` from any state on to its machine)."""
    gate = Event("gate-of-a-failing-input")
    xs = [dask.delayed(inc)(1), dask.delayed(inc)(2),
          dask.delayed(raises_after_gate)("gate-of-a-failing-input")]
    outs = c.compute(dask_services.service_task(Recorder, xs, outputs=2))
    await async_poll_for(lambda: len(events_of("add_key")) == 2, timeout=10)
    started = {e[1] for e in events_of("start")}
    assert started and not events_of("stop")
    await gate.set()
    for fut in outs:
        await assert_errs(fut, KeyError, "an input failed")
    # while the client still holds the erred outputs
    await async_poll_for(lambda: {e[1] for e in events_of("stop")} == started, timeout=10)
    s.validate_state()
    del outs, fut
    await assert_nothing_left(s, [a, b])
