"""A service task moved by work stealing while it waits in a worker's queue."""

from __future__ import annotations

import asyncio

import pytest
from distributed import Event
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services

pytestmark = pytest.mark.timeout(120)


class FailsWhenInputsAreDone(dask_services.Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        raise ValueError("deliberate failure")


class Sums(dask_services.Service):
    async def start(self, *args, **kwargs):
        self.total = 0

    async def add_key(self, key, data):
        self.total += data

    async def all_inputs_done(self):
        totals = await asyncio.gather(*(p.total_of() for p in self.peers.values()))
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, sum(totals))

    @dask_services.rpc
    async def total_of(self):
        return self.total


def hold(event_name):
    Event(event_name).wait(60)
    return 1


def _run_state(s, key):
    machine = s.extensions["dask_services"].machines.get(key)
    if machine is not None and machine.failure is not None:
        return "FAILED"
    return None if machine is None or machine.run is None else machine.run.phase.name


@pytest.mark.parametrize("service", [FailsWhenInputsAreDone, Sums])
@service_cluster()
async def test_an_outcome_reaches_a_service_task_stolen_after_it_was_sent(c, s, a, b,
                                                                          service):
    """The run's outcome went to the worker in whose queue the service task waited (its
    only thread busy); work stealing then moved the task to another worker, with no
    transition the plugin sees, and there it waited for ever while the run was over
    (the status table said "failed")."""
    inputs = c.map(lambda x: x, range(40), workers=[a.address])
    await c.gather(inputs)
    busy = Event("busy")
    outs = dask_services.submit(service, inputs, outputs=1, client=c)
    # queued on a behind the hand-offs (given before it), ahead of the service task
    # (ready once they are all done): the service task waits behind it in a's queue
    # (lowest priority: a takes it once the hand-offs are done, before the service task
    # reaches it, which needs a round trip to the scheduler)
    blocker = c.submit(hold, "busy", workers=[a.address], pure=False, priority=-100)
    blocked_by = blocker.key
    blocked_by = blocker.key
    machines = s.extensions["dask_services"].machines
    await asyncio.wait_for(_until(lambda: machines), 30)
    (service_key,) = machines
    ts = s.tasks[service_key]
    await asyncio.wait_for(_until(lambda: _run_state(s, service_key) in ("FAILED", "FINISHED")
                                  and a.state.executing_count == 1
                                  and blocked_by in {t.key for t in a.state.executing}),
                           30)
    assert ts.state == "processing" and ts.processing_on.address == a.address
    assert a.state.tasks[service_key].state == "ready"  # not started: it may be stolen
    # the outcome was sent to a, where the task waits behind the blocker: now stolen
    s.extensions["stealing"].move_task_request(ts, ts.processing_on, s.workers[b.address])
    await asyncio.wait_for(_until(lambda: ts.processing_on is not None
                                  and ts.processing_on.address == b.address), 30)
    if service is FailsWhenInputsAreDone:  # (before, it waited on b for ever)
        await asyncio.wait_for(assert_errs(outs[0], ValueError, "deliberate failure"), 30)
    await busy.set()  # (a produced Sums' output: its claim waits behind the blocker)
    await blocker
    if service is Sums:
        assert await asyncio.wait_for(c.gather(outs), 30) == [sum(range(40))]
    del outs, inputs, blocker
    await assert_nothing_left(s, [a, b])


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)
