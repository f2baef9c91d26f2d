"""Services written naively or called wrongly still work: peer calls that fail leave their
channel usable, producing an output nobody needs is not an error, and ``get_worker()``
works in every hook of an instance and every method of a replica."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import threading
import weakref
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, futures_of, get_worker, wait
from distributed.protocol import pickle as distributed_pickle
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster, poll_for
from services import PidReporter
from utils import assert_errs, assert_nothing_left, kill, service_cluster

import dask_services
from dask_services import PeerCallError, RPCRefused, Service, ServiceId, rpc

pytestmark = pytest.mark.timeout(60)


def inc(x):
    return x + 1


# ------------------------------------------------------------------ peer calls


def _cannot_load() -> None:
    raise ValueError("this value cannot be loaded here")


class LoadsNowhere:
    """Pickles fine; unpickling it raises (a type the receiving worker cannot import)."""

    def __reduce__(self):
        return (_cannot_load, ())


class Bad:
    """Peer calls that fail, one per way a call can fail."""

    @staticmethod
    async def not_marked(peer):
        return await peer.not_marked()

    @staticmethod
    async def raw_not_marked(peer):
        # What an older or misbehaving sender does: the call takes a sequence number and
        # the receiver refuses the method.
        source = peer._source
        seq = source.next_seq_out.get(peer.id, 0)
        source.next_seq_out[peer.id] = seq + 1
        return await peer._host.call_peer(source, peer.id, seq, "not_marked", (), {})

    @staticmethod
    async def unsendable_argument(peer):
        return await peer.echo(threading.Lock())

    @staticmethod
    async def argument_loads_nowhere(peer):
        return await peer.echo(LoadsNowhere())

    @staticmethod
    async def raises_in_target(peer):
        return await peer.boom()

    @staticmethod
    async def unsendable_result(peer):
        return await peer.lock()


REMOTE_ONLY = {"unsendable_argument", "argument_loads_nowhere", "unsendable_result"}
EXPECTED = {
    "not_marked": RPCRefused,
    "raw_not_marked": RPCRefused,
    "unsendable_argument": PeerCallError,
    "argument_loads_nowhere": PeerCallError,
    "raises_in_target": ZeroDivisionError,
    "unsendable_result": PeerCallError,
}


class ChannelCheck(Service):
    """The leader interleaves failing calls with ordered ``record`` calls to one peer, first
    one at a time, then all at once, then awaits calls out of the order they were made in,
    and produces what happened."""

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    cases=(), **kwargs: Any) -> None:
        self.cases = list(cases)
        self.log: list[int] = []
        self.report: dict = {}

    async def all_started(self) -> None:
        if self.id != self.leader:
            return
        others = [sid for sid in self.peers if sid != self.id]
        peer = self.peers[others[0] if others else self.id]
        errors, n = [], 0
        for case in self.cases:  # one at a time
            await peer.record(n)
            n += 1
            try:
                await getattr(Bad, case)(peer)
            except Exception as exc:
                errors.append((case, type(exc).__name__, str(exc)))
            else:
                errors.append((case, None, ""))
        calls = []  # all at once: each failure between two ordered calls
        for case in self.cases:
            calls.append(peer.record(n))
            calls.append(getattr(Bad, case)(peer))
            n += 1
        calls.append(peer.record(n))
        n += 1
        together = await asyncio.gather(*calls, return_exceptions=True)
        expected = list(range(n))
        # Out of order: a call made and never awaited, then two awaited in the reverse of
        # the order they were made in. Each starts when awaited, and the channel goes on.
        forgotten = peer.record(-1)
        first, second = peer.record(n), peer.record(n + 1)
        forgotten.close()
        await second
        await first
        await peer.record(n + 2)
        expected += [n + 1, n, n + 2]
        self.report = {
            "errors": errors,
            "together": [type(r).__name__ for r in together[1::2]],
            "log": await peer.log_of(),
            "expected_log": expected,
        }

    async def all_inputs_done(self) -> None:
        if self.id == self.leader:
            for out in self.output_keys:
                await self.concierge.produce_key(out, self.report)

    @rpc
    async def record(self, i: int) -> None:
        self.log.append(i)

    @rpc
    async def log_of(self) -> list[int]:
        return list(self.log)

    @rpc
    async def echo(self, value: Any) -> Any:
        return value

    @rpc
    async def boom(self) -> None:
        1 / 0  # noqa: B018

    @rpc
    async def lock(self) -> Any:
        return threading.Lock()

    async def not_marked(self) -> None:
        raise AssertionError("a method not marked @rpc ran")


def check_report(report: dict, cases: list[str]) -> None:
    assert report["log"] == report["expected_log"], "calls after a failed one were lost"
    for case, name, message in report["errors"]:
        assert name == EXPECTED[case].__name__, (case, name, message)
    assert report["together"] == [EXPECTED[c].__name__ for c in cases]
    messages = {case: message for case, _, message in report["errors"]}
    if "not_marked" in messages:
        assert "@dask_services.rpc" in messages["not_marked"]
    if "unsendable_argument" in messages:
        assert "could not be serialized" in messages["unsendable_argument"]
        assert "echo()" in messages["unsendable_argument"]
    if "argument_loads_nowhere" in messages:
        assert "could not be deserialized" in messages["argument_loads_nowhere"]
        assert "cannot be loaded here" in messages["argument_loads_nowhere"]
    if "unsendable_result" in messages:
        assert "the result of lock()" in messages["unsendable_result"]


@service_cluster()
async def test_failed_peer_calls_leave_the_channel_usable(c, s, a, b):
    cases = list(EXPECTED)
    with captured_logger("distributed.protocol.pickle") as log:
        (report,) = await c.gather(c.compute(
            dask_services.service_task(ChannelCheck, [], outputs=1, cases=cases)))
    check_report(report, cases)
    # each failure is the call's own error, named; not also three tracebacks in the log
    assert "Failed to serialize" not in log.getvalue()
    with captured_logger("distributed.protocol.pickle") as log:
        with pytest.raises(TypeError):
            distributed_pickle.dumps(threading.Lock())
    assert "Failed to serialize" in log.getvalue()  # distributed's own use still logs
    del report
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)])
async def test_failed_loopback_calls_leave_the_channel_usable(c, s, a):
    cases = [case for case in EXPECTED if case not in REMOTE_ONLY]
    (report,) = await c.gather(c.compute(
        dask_services.service_task(ChannelCheck, [], outputs=1, cases=cases)))
    check_report(report, cases)
    del report
    await assert_nothing_left(s, [a])


def test_failed_peer_calls_under_the_local_scheduler():
    cases = [case for case in EXPECTED if case not in REMOTE_ONLY]
    (report,) = dask.compute(
        *dask_services.service_task(ChannelCheck, [], outputs=1, cases=cases),
        scheduler="sync",
    )
    check_report(report, cases)


# ------------------------------------------------------------------ unwanted outputs


class ProducesEverything(Service):
    """The natural first version: instance *i* (in the order of the peers) produces every
    n-th of ``output_keys``, whether the run needs it or not."""

    kept: list[tuple[int, Any, bool]] = []  # (run id, key, produce_key's answer)

    async def add_key(self, key, data) -> None:
        self.total = getattr(self, "total", 0) + data

    async def all_started(self) -> None:
        self.total = getattr(self, "total", 0)

    async def all_inputs_done(self) -> None:
        totals = await asyncio.gather(*(p.total_of() for p in self.peers.values()))
        me = sorted(self.peers).index(self.id)
        for i, key in enumerate(self.output_keys):
            if i % len(self.peers) == me:
                kept = await self.concierge.produce_key(key, (i, sum(totals)))
                self.kept.append((self.concierge.run_id, key, kept))

    @rpc
    async def total_of(self) -> int:
        return self.total


@service_cluster()
async def test_producing_an_output_the_run_does_not_need_is_a_no_op(c, s, a, b):
    """Seed 002's partial recomputation, with a service that produces every output."""
    ProducesEverything.kept.clear()
    inputs = [dask.delayed(inc)(i) for i in range(6)]
    outs = dask_services.service_task(ProducesEverything, inputs, outputs=4)
    futures = c.compute(outs)
    await wait(futures)
    assert all(kept for _, _, kept in ProducesEverything.kept)
    del futures[:2]  # keep the last two outputs only
    await async_poll_for(lambda: outs[0].key not in s.tasks, timeout=5)
    again = await c.gather(c.compute(outs))
    assert again == [(i, 21) for i in range(4)]
    second = [(key, kept) for run, key, kept in ProducesEverything.kept if run > 1]
    assert sorted(map(str, (key for key, kept in second if kept))) == sorted(
        [str(outs[0].key), str(outs[1].key)])
    assert sorted(map(str, (key for key, kept in second if not kept))) == sorted(
        [str(outs[2].key), str(outs[3].key)])
    s.validate_state()
    del futures, again
    await assert_nothing_left(s, [a, b])


class ProducesStrangers(Service):
    async def all_inputs_done(self) -> None:
        if self.id == self.leader:
            await self.concierge.produce_key("not-an-output", 1)


@service_cluster()
async def test_producing_a_key_that_is_not_an_output_still_fails(c, s, a, b):
    (fut,) = c.compute(dask_services.service_task(ProducesStrangers, [], outputs=1))
    await assert_errs(fut, dask_services.ProduceKeyError, "is not an output of service task")
    del fut
    await assert_nothing_left(s, [a, b])


class ProducesWhatItOwns(Service):
    """Every instance produces every output it owns, wanted or not (the default
    placement); records who owned what."""

    owned: list[tuple[ServiceId, Any, ServiceId]] = []

    async def all_inputs_done(self) -> None:
        for i, key in enumerate(self.output_keys):
            owner = self.concierge.owner(key)
            self.owned.append((self.id, key, owner))
            if owner == self.id:
                await self.concierge.produce_key(key, i)


@service_cluster()
async def test_owner_answers_for_outputs_a_partial_compute_does_not_want(c, s, a, b):
    """``concierge.owner(key)`` for an output this run does not need (one output of four
    computed) names an instance all the same, the same one on every instance."""
    ProducesWhatItOwns.owned.clear()
    outs = dask_services.service_task(ProducesWhatItOwns, [], outputs=4)
    assert await c.compute(outs[2]) == 2
    by_key: dict = {}
    for _, key, owner in ProducesWhatItOwns.owned:
        by_key.setdefault(key, set()).add(owner)
    assert len(by_key) == 4 and all(len(owners) == 1 for owners in by_key.values())
    assert len({sid for sid, _, _ in ProducesWhatItOwns.owned}) == 2  # both instances asked
    await assert_nothing_left(s, [a, b])


class AsksOwnerOfAStranger(Service):
    async def all_inputs_done(self) -> None:
        self.concierge.owner("not-an-output")


@service_cluster()
async def test_owner_of_a_key_that_is_not_an_output_fails(c, s, a, b):
    (fut,) = c.compute(dask_services.service_task(AsksOwnerOfAStranger, [], outputs=1))
    await assert_errs(fut, dask_services.ProduceKeyError,
                      "'not-an-output' is not an output of service task")
    del fut
    await assert_nothing_left(s, [a, b])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_recomputing_an_output_lost_with_its_worker_tolerates_unneeded_outputs():
    validation = {"distributed.scheduler.validate": True, "distributed.worker.validate": True}
    with dask.config.set(validation), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        dask_services.install(client)
        inputs = [dask.delayed(inc)(i) for i in range(6)]
        outs = dask_services.service_task(ProducesEverything, inputs, outputs=4)
        futures = client.compute(outs)
        wait(futures)
        holders = client.who_has(futures)
        victim = next(iter(holders[futures[0].key]))
        survivor = next(w for w in client.scheduler_info()["workers"] if w != victim)
        kill(client, victim)
        # The outputs held by the dead worker are recomputed by a new run whose instances
        # also produce the outputs that survived: those are dropped, not an error.
        assert client.gather(futures) == [(i, 21) for i in range(4)]
        starts = [e for _, e in client.get_events("dask_services")
                  if e["action"] == "started"]
        assert len(starts) >= 2, "no new run recomputed the lost outputs"
        assert any(survivor in ws for ws in client.who_has(futures).values())
        client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.validate_state())
        poll_for(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_service_task_lost_after_its_run_finished_runs_again_with_every_input():
    """The run finished and every output landed, but the worker running the service task
    died before the task reached memory: the new run needs every input again, including
    those whose hand-offs survived on the other worker (they gave them to the old run)."""
    validation = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
                  # a hand-off runs where its input is (loosely): under load, stealing
                  # moved them all to one worker and the case was not set up (1 CI run)
                  "distributed.scheduler.work-stealing": False}
    with dask.config.set(validation), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        dask_services.install(client)
        workers = sorted(client.scheduler_info()["workers"])
        inputs = [client.persist(dask.delayed(inc)(i), workers=[workers[i % 2]],
                                 allow_other_workers=True) for i in range(6)]
        wait(futures_of(inputs))
        plugin = cluster.scheduler.extensions["dask_services"]
        held: list[str] = []
        deliver = plugin._notify

        def hold_the_first_outcome(service_key, worker, error, stimulus_id):
            # the service task stays processing on ``worker`` after its run finished
            if held:
                deliver(service_key, worker, error, stimulus_id)
            else:
                held.append(worker)

        plugin._notify = hold_the_first_outcome
        outs = dask_services.service_task(ProducesEverything, inputs, outputs=4)
        futures = client.compute(outs)
        wait(futures)
        poll_for(lambda: held, timeout=10)
        victim = held[0]
        survivor = next(w for w in workers if w != victim)

        def state(dask_scheduler, keys=None):
            tasks = dask_scheduler.tasks
            if keys is None:  # the hand-offs
                keys = [k for k in tasks if str(k).startswith("('handoff-")]
            return {str(k): (tasks[k].state, [ws.address for ws in tasks[k].who_has or ()])
                    for k in keys if k in tasks}

        assert any(survivor in holders for _, holders in
                   client.run_on_scheduler(state).values()), \
            "no hand-off survives the kill: the case is not set up"
        kill(client, victim)
        poll_for(lambda: client.run_on_scheduler(
            lambda dask_scheduler: victim not in dask_scheduler.workers), timeout=30)
        out_keys = [f.key for f in futures]
        poll_for(lambda: all(st == "memory" for st, _ in
                             client.run_on_scheduler(state, keys=out_keys).values()),
                 timeout=60)
        assert client.gather(futures) == [(i, 21) for i in range(4)]
        client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.validate_state())
        poll_for(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=30)


# ------------------------------------------------------------------ get_worker()


class WhereAmI(Service):
    """Records ``get_worker().address`` in every hook, against the concierge's address."""

    seen: list[tuple[str, str, str]] = []  # (hook, get_worker().address, concierge.address)

    def _note(self, hook: str) -> None:
        try:
            address = get_worker().address
        except ValueError as exc:
            address = f"error: {exc}"
        self.seen.append((hook, address, self.concierge.address))

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    **kwargs: Any) -> None:
        self.concierge = concierge
        self._note("start")

    async def all_started(self) -> None:
        self._note("all_started")
        await asyncio.gather(*(p.ping() for p in self.peers.values()))

    async def add_key(self, key, data) -> None:
        self._note("add_key")

    async def all_inputs_done(self) -> None:
        self._note("all_inputs_done")
        in_thread = await self.concierge.run_in_executor(lambda: get_worker().address)
        self.seen.append(("run_in_executor", in_thread, self.concierge.address))
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, 1)

    @rpc
    async def ping(self) -> None:
        self._note("rpc")

    async def stop(self) -> None:
        self._note("stop")


@service_cluster()
async def test_get_worker_in_every_hook_of_an_instance(c, s, a, b):
    WhereAmI.seen.clear()
    inputs = c.map(inc, range(4))
    outs = dask_services.submit(WhereAmI, inputs, outputs=2, client=c)
    assert await c.gather(outs) == [1, 1]
    hooks = {"start", "all_started", "add_key", "all_inputs_done", "run_in_executor", "rpc",
             "stop"}
    await async_poll_for(lambda: sum(h == "stop" for h, _, _ in WhereAmI.seen) == 2,
                         timeout=10)
    assert {h for h, _, _ in WhereAmI.seen} == hooks
    wrong = [(h, got, want) for h, got, want in WhereAmI.seen if got != want]
    assert not wrong
    del outs, inputs
    await assert_nothing_left(s, [a, b])


class WorkerEcho(Service):
    """A replicated service whose every method asks ``get_worker()``."""

    def setup(self) -> None:
        self.setup_on = get_worker().address

    @dask_services.endpoint
    def sync_where(self) -> tuple[str, str]:
        return get_worker().address, self.setup_on

    @dask_services.endpoint
    async def async_where(self) -> str:
        return get_worker().address

    def check_health(self) -> bool:
        try:
            WorkerEcho.probed_on.append(get_worker().address)
        except ValueError as exc:
            WorkerEcho.probed_on.append(f"error: {exc}")
        return True

    async def stop(self) -> None:
        WorkerEcho.stopped_on.append(get_worker().address)

    stopped_on: list[str] = []
    probed_on: list[str] = []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=45, config={
    "dask_services.replicated.health-check-period": "50ms"})
async def test_get_worker_in_every_method_of_a_replica(c, s, a, b):
    WorkerEcho.stopped_on.clear()
    WorkerEcho.probed_on.clear()
    await dask_services.install_async(c)
    svc = await WorkerEcho.options(replicas=2).as_service(client=c)
    rows = await svc.replicas()
    hosts = {r["worker"] for r in rows}
    for _ in range(4):
        where, setup_on = await svc.sync_where.route()
        assert where == setup_on and where in hosts
        assert await svc.async_where.route() in hosts
    await async_poll_for(lambda: len(WorkerEcho.probed_on) >= 4, timeout=10)
    assert set(WorkerEcho.probed_on) == hosts
    await svc.shutdown()
    assert sorted(WorkerEcho.stopped_on) == sorted(r["worker"] for r in rows)
    s.validate_state()


# ------------------------------------------------------------------ restarts


@service_cluster()
async def test_a_requested_restart_with_futures_as_inputs_restarts_once(c, s, a, b):
    """Releasing the service task and its hand-offs in one batch let a hand-off start the
    next run before the service task left processing: that run was restarted once more as if
    an input had been lost, and its instances could receive an input twice."""
    from services import Recorder

    Recorder.reset()
    xs = c.map(inc, range(4))
    outs = dask_services.submit(Recorder, xs, outputs=2, client=c, restart_runs=1)
    assert await c.gather(outs) == [10, 10]
    actions = [(e["action"], e["detail"]) for _, e in await c.get_events("dask_services")]
    assert [a for a, _ in actions] == ["started", "restarted", "started", "finished"], actions
    del outs, xs
    await assert_nothing_left(s, [a, b])


# ------------------------------------------------------------------ naive authors' mistakes


class NeedsArguments(Service):
    """Instances are made with no arguments: parameters belong in ``start``."""

    def __init__(self, scale):
        self.scale = scale

    async def add_key(self, key, data):
        pass


class CancelsItsHelper(Service):
    """Awaits a task it cancelled itself: a CancelledError leaves ``all_inputs_done``."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        helper = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        helper.cancel()
        await helper


class ProducesNothing(Service):
    async def add_key(self, key, data):
        pass


class ForgetsToAwaitProduceKey(Service):
    async def add_key(self, key, data):
        self.total = getattr(self, "total", 0) + data

    async def all_inputs_done(self):
        totals = await asyncio.gather(*(p.total_of() for p in self.peers.values()))
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                self.concierge.produce_key(key, sum(totals))  # the await forgotten

    @rpc
    async def total_of(self) -> int:
        return getattr(self, "total", 0)


@service_cluster(config={"dask_services.unproduced-timeout": "200ms"})
async def test_outputs_never_produced_fail_with_what_to_do_instead_of_waiting(c, s, a, b):
    outs = c.compute(dask_services.service_task(ProducesNothing, [dask.delayed(1)],
                                                outputs=3))
    for out in outs:
        exc = await assert_errs(out, dask_services.OutputsNotProducedError,
                                "3 of the 3 wanted outputs were not produced")
        assert "await concierge.produce_key(key, value)" in str(exc)
        assert "dask_services.unproduced-timeout" in str(exc)
    del outs, out, exc
    await assert_nothing_left(s, [a, b])


@service_cluster(config={"dask_services.unproduced-timeout": "200ms"})
async def test_a_forgotten_await_on_produce_key_loses_no_output(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(6)]
    with pytest.warns(RuntimeWarning, match="was never awaited"):
        outs = c.compute(dask_services.service_task(ForgetsToAwaitProduceKey, xs,
                                                    outputs=4))
        assert await c.gather(outs) == [21] * 4
        del outs
        gc.collect()  # the coroutines not awaited warn when they are collected
    await assert_nothing_left(s, [a, b])


class ProducesAfterItsHooksReturn(Service):
    """Produces from a task of its own that runs once ``all_inputs_done`` has returned:
    the scheduler then watches for outputs that never come."""

    async def add_key(self, key, data):
        self.total = getattr(self, "total", 0) + data

    async def all_inputs_done(self):
        mine = [k for k in self.concierge.wanted_outputs if self.concierge.owner(k) == self.id]

        async def produce():
            totals = await asyncio.gather(*(p.total_of() for p in self.peers.values()))
            for key in mine:
                await self.concierge.produce_key(key, sum(totals))

        self.producing = asyncio.ensure_future(produce())

    @rpc
    async def total_of(self) -> int:
        return getattr(self, "total", 0)


@service_cluster()
async def test_the_wait_for_unproduced_outputs_ends_with_its_service_task(c, s, a, b):
    """A run whose outputs came after its hooks returned leaves no timer on the scheduler
    once its service task is forgotten (the default wait is a minute, per run)."""
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(ProducesAfterItsHooksReturn, xs, outputs=4))
    values = await c.gather(outs)
    assert values == [10] * 4
    assert s.extensions["dask_services"].timers  # watched while it ran
    del outs
    await assert_nothing_left(s, [a, b])


class ProducesFromAThread(Service):
    """Builds and produces its outputs in a service thread, handing each produce_key
    coroutine to the event loop with ``asyncio.run_coroutine_threadsafe``."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        loop = asyncio.get_running_loop()
        mine = [k for k in self.concierge.wanted_outputs if self.concierge.owner(k) == self.id]

        def work():
            for key in mine:
                coro = self.concierge.produce_key(key, key[1] * 10)
                asyncio.run_coroutine_threadsafe(coro, loop).result()

        await self.concierge.run_in_executor(work)


def threads_calling(monkeypatch, name: str) -> list[threading.Thread]:
    """The threads that call ``WorkerEnvironment.<name>`` (which sends on the worker's
    batched stream), in order, from now on."""
    from dask_services.worker import WorkerEnvironment

    threads: list[threading.Thread] = []
    method = getattr(WorkerEnvironment, name)

    def recording(self, *args):
        threads.append(threading.current_thread())
        return method(self, *args)

    monkeypatch.setattr(WorkerEnvironment, name, recording)
    return threads


@service_cluster()
async def test_produce_key_made_in_a_thread_produces_on_the_event_loop(c, s, a, b,
                                                                      monkeypatch):
    threads = threads_calling(monkeypatch, "produced")
    xs = [dask.delayed(inc)(i) for i in range(4)]
    outs = c.compute(dask_services.service_task(ProducesFromAThread, xs, outputs=4))
    assert await c.gather(outs) == [0, 10, 20, 30]
    assert len(threads) == 4
    assert all(t is threading.main_thread() for t in threads), threads
    del outs
    await assert_nothing_left(s, [a, b])


class FailsFromAThread(Service):
    """Reports an error with ``concierge.error`` from a service thread, then waits."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        def work():
            self.concierge.error(ValueError("the thread found bad data"))

        await self.concierge.run_in_executor(work)
        await asyncio.Event().wait()  # stopped by the run's failure


@service_cluster()
async def test_concierge_error_from_a_thread_is_carried_out_on_the_event_loop(c, s, a, b,
                                                                             monkeypatch):
    threads = threads_calling(monkeypatch, "failed")
    outs = c.compute(dask_services.service_task(FailsFromAThread, [dask.delayed(1)],
                                                outputs=2))
    for out in outs:
        await assert_errs(out, ValueError, "the thread found bad data")
    assert threads and all(t is threading.main_thread() for t in threads), threads
    del outs, out
    await assert_nothing_left(s, [a, b])


class ForgetsToAwaitRunInExecutor(Service):
    """Calls ``run_in_executor`` without ``await``, then looks whether the function ran;
    and calls it in a thread with an event loop of its own (``asyncio.run``)."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        ran = threading.Event()
        self.concierge.run_in_executor(ran.set)  # the await forgotten
        loop = asyncio.get_running_loop()
        seen = await loop.run_in_executor(None, ran.wait, 20)
        in_thread = await loop.run_in_executor(
            None, lambda: asyncio.run(self.concierge.run_in_executor(int, "12", base=3)))
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, (seen, in_thread))


@service_cluster()
async def test_a_forgotten_await_on_run_in_executor_still_runs_the_function(c, s, a, b):
    with pytest.warns(RuntimeWarning, match="was never awaited"):
        outs = c.compute(dask_services.service_task(ForgetsToAwaitRunInExecutor,
                                                    [dask.delayed(1)], outputs=2))
        assert await c.gather(outs) == [(True, 5)] * 2
        del outs
        gc.collect()
    await assert_nothing_left(s, [a, b])


def test_a_forgotten_await_on_run_in_executor_under_the_local_scheduler():
    with pytest.warns(RuntimeWarning, match="was never awaited"):
        outs = dask_services.service_task(ForgetsToAwaitRunInExecutor, [dask.delayed(1)],
                                          outputs=2)
        assert dask.compute(*outs, scheduler="sync") == ((True, 5),) * 2
        gc.collect()


def test_a_forgotten_await_on_produce_key_under_the_local_scheduler():
    xs = [dask.delayed(inc)(i) for i in range(6)]
    with pytest.warns(RuntimeWarning, match="was never awaited"):
        outs = dask_services.service_task(ForgetsToAwaitProduceKey, xs, outputs=4)
        assert dask.compute(*outs, scheduler="sync") == (21,) * 4
        gc.collect()


class ExitsInAddKey(Service):
    async def add_key(self, key, data):
        raise SystemExit(3)


class InterruptedWhenInputsAreDone(Service):
    async def add_key(self, key, data):
        pass

    def all_inputs_done(self):
        raise KeyboardInterrupt


class PeerMethodExits(Service):
    """The leader calls ``exits`` on the other instance, which raises ``SystemExit``; the
    caller lets the error out."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        if self.id == self.leader:
            others = [sid for sid in self.peers if sid != self.id]
            await self.peers[others[0] if others else self.id].exits()

    @rpc
    async def exits(self):
        raise SystemExit("bye")


class ExitsWhenStopped(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, key)

    async def stop(self):
        raise SystemExit(4)


@pytest.mark.parametrize("service, match", [
    (ExitsInAddKey, "ExitsInAddKey.add_key() raised SystemExit(3)"),
    (InterruptedWhenInputsAreDone,
     "InterruptedWhenInputsAreDone.all_inputs_done() raised KeyboardInterrupt()"),
    (PeerMethodExits, "PeerMethodExits.exits() raised SystemExit('bye')"),
])
@service_cluster()
async def test_a_system_exit_out_of_a_service_fails_the_run_not_the_worker(c, s, a, b,
                                                                            service, match):
    xs = [dask.delayed(inc)(i) for i in range(2)]
    outs = c.compute(dask_services.service_task(service, xs, outputs=2))
    for out in outs:
        exc = await assert_errs(out, RuntimeError, match)
        assert "raise an Exception to fail the run" in str(exc)
    del outs, out, exc
    assert a.status.name == b.status.name == "running"
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_a_system_exit_out_of_stop_is_logged_and_the_worker_goes_on(c, s, a, b):
    with captured_logger("dask_services") as log:
        outs = c.compute(dask_services.service_task(ExitsWhenStopped, [dask.delayed(1)],
                                                    outputs=2))
        assert len(await c.gather(outs)) == 2
        del outs
        await assert_nothing_left(s, [a, b])
    assert "ExitsWhenStopped.stop() raised SystemExit(4)" in log.getvalue()
    assert a.status.name == b.status.name == "running"
    assert await c.submit(inc, 1) == 2


def test_a_system_exit_out_of_a_service_under_the_local_scheduler():
    outs = dask_services.service_task(ExitsInAddKey, [dask.delayed(1)], outputs=1)
    with pytest.raises(RuntimeError, match=r"add_key\(\) raised SystemExit\(3\)"):
        dask.compute(*outs, scheduler="sync")


class NextOfEmptyInAThread(Service):
    """``next()`` of an exhausted iterator in a function given to ``run_in_executor``."""

    async def add_key(self, key, data):
        await self.concierge.run_in_executor(next, iter([]))


@service_cluster()
async def test_a_stop_iteration_out_of_run_in_executor_fails_the_run(c, s, a, b):
    # (a future cannot carry StopIteration: the run waited at inputs-done for ever)
    outs = c.compute(dask_services.service_task(NextOfEmptyInAThread,
                                                [dask.delayed(inc)(i) for i in range(2)],
                                                outputs=2))
    for out in outs:
        exc = await asyncio.wait_for(assert_errs(
            out, RuntimeError, "next given to concierge.run_in_executor raised StopIteration"),
            30)
        assert "give next() a default" in str(exc)
    del outs, out, exc
    await assert_nothing_left(s, [a, b])


def test_a_stop_iteration_out_of_run_in_executor_under_the_local_scheduler():
    outs = dask_services.service_task(NextOfEmptyInAThread, [dask.delayed(1)], outputs=1)
    with pytest.raises(RuntimeError, match="next given to concierge.run_in_executor raised "
                                           "StopIteration"):
        dask.compute(*outs, scheduler="sync")


class NextOfEmptyInAddKey(Service):
    """``next()`` of an exhausted iterator in an ``async`` hook."""

    async def add_key(self, key, data):
        next(iter([]))


class NextOfEmptyInAPlainHook(Service):
    """The same in a hook written as a plain ``def``."""

    def add_key(self, key, data):
        pass

    def all_inputs_done(self):
        next(iter([]))


class NextOfEmptyInAPeerMethod(Service):
    """The same in an ``@rpc`` method, which a hook calls."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        await self.peers[self.id].empty()

    @dask_services.rpc
    async def empty(self):
        return next(iter([]))


@pytest.mark.parametrize("service, named", [
    (NextOfEmptyInAddKey, "NextOfEmptyInAddKey.add_key()"),
    (NextOfEmptyInAPlainHook, "NextOfEmptyInAPlainHook.all_inputs_done()"),
    (NextOfEmptyInAPeerMethod, "NextOfEmptyInAPeerMethod.empty()"),
])
@service_cluster()
async def test_a_stop_iteration_out_of_a_hook_names_the_hook(c, s, a, b, service, named):
    # (Python's own "coroutine raised StopIteration" named neither the hook nor the cause)
    outs = c.compute(dask_services.service_task(service, [dask.delayed(inc)(i)
                                                          for i in range(2)], outputs=2))
    for out in outs:
        exc = await assert_errs(out, RuntimeError, f"{named} raised StopIteration")
        assert "give next() a default" in str(exc)
    del outs, out, exc
    await assert_nothing_left(s, [a, b])


def test_a_stop_iteration_out_of_a_hook_under_the_local_scheduler():
    outs = dask_services.service_task(NextOfEmptyInAPlainHook, [dask.delayed(1)], outputs=1)
    with pytest.raises(RuntimeError, match=r"NextOfEmptyInAPlainHook.all_inputs_done\(\) "
                                           "raised StopIteration"):
        dask.compute(*outs, scheduler="sync")


@service_cluster()
async def test_a_class_that_cannot_be_instantiated_fails_its_outputs(c, s, a, b):
    outs = c.compute(dask_services.service_task(NeedsArguments, [dask.delayed(1)],
                                                outputs=2))
    for out in outs:
        await assert_errs(out, TypeError, "missing 1 required positional argument")
    del outs, out
    await assert_nothing_left(s, [a, b])  # no instance directory either


@service_cluster()
async def test_a_cancelled_error_out_of_a_hook_fails_the_run(c, s, a, b):
    outs = c.compute(dask_services.service_task(CancelsItsHelper, [dask.delayed(1)],
                                                outputs=2))
    for out in outs:
        await assert_errs(out, RuntimeError,
                          "CancelsItsHelper.all_inputs_done() raised asyncio.CancelledError")
    del outs, out
    await assert_nothing_left(s, [a, b])


class HasAKeyProperty(Service):
    """Defines ``key``, which the framework sets on every instance, as a read-only property
    (and ``params`` as a method, which the framework's dict would silently replace)."""

    @property
    def key(self):
        return "mine"

    def params(self):
        return {}

    async def add_key(self, key, data):
        pass


class DefaultsALeader(Service):
    """A plain class attribute named like a framework attribute: a default the framework's
    value shadows, which is fine."""

    leader = None

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                self.concierge.produce_key(key, self.leader is not None)


class KeepsItsParams(Service):
    """``params`` as a property with a setter, ``key`` a ``__slots__`` member: both take the
    framework's values, so they are fine."""

    __slots__ = ("key",)

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, value):
        self._params = dict(value, seen_by_setter=True)

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                self.concierge.produce_key(key, (self.params, self.key is not None))


class RefusesALeader(Service):
    """Refuses an attribute in ``__setattr__``, which no check of the class can see."""

    def __setattr__(self, name, value):
        if name == "leader":
            raise AttributeError("RefusesALeader takes no leader")
        super().__setattr__(name, value)

    async def add_key(self, key, data):
        pass


def test_a_method_or_property_named_like_a_framework_attribute_is_refused_at_once():
    with pytest.raises(TypeError) as info:
        dask_services.service_task(HasAKeyProperty, [dask.delayed(1)], outputs=1)
    message = str(info.value)
    assert ("HasAKeyProperty defines 'key' (a property without a setter, in "
            "HasAKeyProperty)") in message
    assert "'params' (a method, in HasAKeyProperty)" in message
    assert "dask_services sets these on every instance of a service task" in message
    assert "rename yours" in message
    # a subclass inherits the clash, named with the class that defines it
    child = type("Child", (HasAKeyProperty,), {})
    with pytest.raises(TypeError, match=r"Child defines 'key' \(a property without a "
                                        r"setter, in "
                                        r"HasAKeyProperty\)"):
        dask_services.service_task(child, [dask.delayed(1)], outputs=1)
    outs = dask_services.service_task(KeepsItsParams, [dask.delayed(1)], outputs=1, n=2)
    assert dask.compute(*outs, scheduler="sync") == (({"n": 2, "seen_by_setter": True},
                                                       True),)


class SetsItsParamsInInit(Service):
    """Keeps a value of its own as ``self.params``, set in ``__init__``: the framework
    sets ``params`` (the service task's keyword parameters) right after making the
    instance, which replaced it without a word before."""

    def __init__(self):
        self.params = {"weights": None}

    async def add_key(self, key, data):
        pass


@service_cluster()
async def test_an_attribute_of_the_framework_set_in_init_fails_the_run_naming_it(c, s, a, b):
    outs = c.compute(dask_services.service_task(SetsItsParamsInInit, [dask.delayed(1)],
                                                outputs=2, lr=0.5))
    for out in outs:
        await assert_errs(out, TypeError, "SetsItsParamsInInit.__init__ sets self.params, "
                                          "but dask_services sets this on every instance "
                                          "of a service task")
    exc = await assert_errs(outs[0], TypeError, "rename it, e.g. with a leading "
                                                "underscore (self._params)")
    assert "(it sets id, key, peers, input_keys, output_keys, concierge, leader, " \
        "params)" in str(exc)
    del outs, out
    await assert_nothing_left(s, [a, b])  # no instance directory either


def test_an_attribute_of_the_framework_set_in_init_under_the_local_scheduler():
    outs = dask_services.service_task(SetsItsParamsInInit, [dask.delayed(1)], outputs=1)
    with pytest.raises(TypeError, match=r"SetsItsParamsInInit.__init__ sets self.params"):
        dask.compute(*outs, scheduler="sync")


@service_cluster()
async def test_a_class_attribute_named_like_a_framework_attribute_is_a_default(c, s, a, b):
    outs = c.compute(dask_services.service_task(DefaultsALeader, [dask.delayed(1)],
                                                outputs=2))
    assert await c.gather(outs) == [True, True]  # the framework's leader, not the default
    del outs
    await assert_nothing_left(s, [a, b])


class CancelsItself(Service):
    """Cancels the task its hook runs in: nothing but the service's own code does so."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        asyncio.current_task().cancel()
        await asyncio.sleep(0)


class CallsPeersInStart(Service):
    """Every instance waits in ``start`` for the others, which answer only once started."""

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader):
        await super().start(id, key, peers, input_keys, output_keys, concierge, leader)
        await asyncio.gather(*(p.hello() for p in peers.values()))

    async def add_key(self, key, data):
        pass

    @rpc
    async def hello(self):
        return "hi"


class YieldsInAHook(Service):
    """A leftover ``yield`` makes ``add_key`` a generator function: calling it runs nothing."""

    async def add_key(self, key, data):
        self.seen = True
        yield

    async def all_inputs_done(self):
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                self.concierge.produce_key(key, getattr(self, "seen", False))


def _not_loadable_by_the_scheduler(message):
    """An exception's loader that fails in the scheduler's plugin, as a class from a
    library installed on the workers and the client only does on the scheduler."""
    import inspect

    if any(f.filename.endswith(os.path.join("dask_services", "scheduler.py"))
           for f in inspect.stack()):
        raise ModuleNotFoundError("No module named 'gpulib' (not on the scheduler)")
    return OnlyOnWorkers(message)


class OnlyOnWorkers(Exception):
    def __reduce__(self):
        return _not_loadable_by_the_scheduler, self.args


class RaisesAWorkerOnlyError(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        raise OnlyOnWorkers("device out of memory")


class Unprintable(Exception):
    """Cannot be pickled, and its ``__str__`` raises."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def __str__(self):
        raise AttributeError("no message")


class RaisesAnUnprintableError(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        raise Unprintable()


class ErrorsWith(Service):
    """Fails its run with ``concierge.error(reason)``, ``reason`` not an Exception."""

    reason: BaseException = KeyboardInterrupt("stop")

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        self.concierge.error(self.reason)


class ErrorsWithSystemExit(ErrorsWith):
    reason = SystemExit(3)


class ErrorsWithCancelledError(ErrorsWith):
    reason = asyncio.CancelledError("c")


class CountsForever(Service):
    """``counters()`` gives a figure no int can hold; outputs once ``gate`` is set."""

    gate: asyncio.Event

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        await self.gate.wait()
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                self.concierge.produce_key(key, 1)

    def counters(self):
        return {"bytes_spilled": float("inf"), "bytes_sent": float("nan")}


class EchoesItsParams(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                self.concierge.produce_key(key, sorted(self.params.items()))


@service_cluster()
async def test_parameters_named_like_the_frameworks_own_arguments_reach_start(c, s, a, b):
    # fn, wait_started, own_task... clashed with the framework's own function that runs
    # start(): a TypeError in a task nobody watched, and the run waited for ever
    params = {"fn": 1, "inst": 2, "wait_started": 3, "own_task": 4, "args": 5, "kwargs": 6}
    outs = c.compute(dask_services.service_task(EchoesItsParams, [dask.delayed(1)],
                                                outputs=2, **params))
    assert await c.gather(outs) == [sorted(params.items())] * 2
    del outs
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("service, error, match", [
    (CancelsItself, RuntimeError, "CancelsItself.all_inputs_done() was cancelled while its "
                                  "instance was not stopping, by the service's own code"),
    (CallsPeersInStart, dask_services.ServiceError,
     "peer method 'hello' called before CallsPeersInStart.start() returned (from start() "
     "or what it started): a peer answers only once its own start() has returned"),
    (YieldsInAHook, TypeError, "YieldsInAHook.add_key() is a generator function"),
    (RaisesAWorkerOnlyError, OnlyOnWorkers, "device out of memory"),
    (RaisesAnUnprintableError, RuntimeError,
     "test_naive_services.Unprintable: <its message could not be made: str() raised "
     "AttributeError>"),
    # raised where the service task waits, these restarted worker after worker (KilledWorker
    # in the end) or, a CancelledError, gave an UnboundLocalError
    (ErrorsWith, RuntimeError, "concierge.error() was given KeyboardInterrupt('stop'), "
                               "which is not an Exception"),
    (ErrorsWithSystemExit, RuntimeError, "was given SystemExit(3)"),
    (ErrorsWithCancelledError, RuntimeError, "was given CancelledError('c')"),
    # left an empty instance directory on every worker (the attributes are set before
    # the instance's directory is made now)
    (RefusesALeader, AttributeError, "RefusesALeader takes no leader"),
])
@service_cluster()
async def test_mistakes_fail_the_run_and_leave_nothing(c, s, a, b, service, error, match):
    # each hung (the run never failed), killed workers, gave results with add_key never
    # run (the generator) or left a directory behind (RefusesALeader)
    outs = c.compute(dask_services.service_task(service, [dask.delayed(1)], outputs=2))
    for out in outs:
        await assert_errs(out, error, match)
    if service is RaisesAWorkerOnlyError:
        # the scheduler, which cannot load it, says what it was; the client gets it itself
        detail = (await dask_services.status(c))["detail"].iloc[-1]
        assert ("test_naive_services.OnlyOnWorkers: device out of memory (this "
                "exception's class cannot be loaded here") in detail, detail
    del outs, out
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("service, error, match", [
    (CancelsItself, RuntimeError, "was cancelled while its instance was not stopping"),
    (CallsPeersInStart, dask_services.ServiceError, "make peer calls in all_started()"),
    (YieldsInAHook, TypeError, "YieldsInAHook.add_key() is a generator function"),
])
def test_mistakes_that_hung_fail_under_the_local_scheduler(service, error, match):
    outs = dask_services.service_task(service, [dask.delayed(1)], outputs=2)
    with pytest.raises(error, match=re.escape(match)):
        dask.compute(*outs, scheduler="sync")


@service_cluster()
async def test_counters_no_int_can_hold_keep_the_heartbeat(c, s, a, b):
    # an infinite figure raised OverflowError in the heartbeat: both workers closed
    CountsForever.gate = asyncio.Event()
    outs = c.compute(dask_services.service_task(CountsForever, [dask.delayed(1)],
                                                outputs=2))
    await async_poll_for(lambda: all(w.extensions["dask_services"].host.instances
                                     for w in (a, b)), timeout=10)
    await a.heartbeat()  # with the instances' counters
    await b.heartbeat()
    CountsForever.gate.set()
    assert await c.gather(outs) == [1, 1]
    assert a.status.name == b.status.name == "running" and len(s.workers) == 2
    del outs
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("service, error, match", [
    (NeedsArguments, TypeError, "missing 1 required positional argument"),
    (CancelsItsHelper, RuntimeError, "raised asyncio.CancelledError"),
    (ProducesNothing, dask_services.OutputsNotProducedError, "did not produce output"),
])
def test_naive_mistakes_raise_under_the_local_scheduler(service, error, match):
    outs = dask_services.service_task(service, [dask.delayed(1)], outputs=2)
    with pytest.raises(error, match=match):
        dask.compute(*outs, scheduler="sync")


HELD: list[weakref.ref] = []  # what FailsHoldingData's failing hook held


class FailsHoldingData(Service):
    """Fails with an exception whose traceback holds the hook's frame, which holds the
    exception and the hook's data: a reference cycle, freed by the garbage collector only."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        payload = np.ones(2_000_000)
        HELD.append(weakref.ref(payload))
        try:
            raise ValueError("failed holding 16 MB")
        except ValueError as e:
            error = e
        raise error


@service_cluster(config={"distributed.worker.memory.target": 0.01,
                         "distributed.worker.memory.spill": False,
                         "distributed.worker.memory.pause": False,
                         "distributed.worker.memory.terminate": False},
                 worker_kwargs={"memory_limit": "1 GiB"})
async def test_a_stopped_instance_memory_is_collected_when_memory_is_tight(c, s, a, b):
    """Above the worker's memory target (here: always), the memory of an instance that
    stopped on a failure is freed at once, not when the garbage collector next runs (a
    worker paused for memory stayed paused for up to a minute)."""
    HELD.clear()
    gc.disable()  # the collector runs only when asked
    try:
        outs = c.compute(dask_services.service_task(
            FailsHoldingData, [dask.delayed(inc)(i) for i in range(4)], outputs=2))
        for out in outs:
            await assert_errs(out, ValueError, "failed holding 16 MB")
        del outs, out
        await async_poll_for(lambda: not any(w.extensions["dask_services"].host.instances
                                             for w in (a, b)), timeout=10)
        # (before assert_nothing_left, which collects)
        assert HELD and all(ref() is None for ref in HELD), "the payload is still alive"
        await assert_nothing_left(s, [a, b])
    finally:
        gc.enable()


IGNORING_ENDS = threading.Event()  # the one thing that ends IgnoresItsCancellation's hooks


class IgnoresItsCancellation(Service):
    """The leader fails its run; the other instances' ``all_inputs_done`` catches its own
    cancellation in a loop (and a ``stop()`` that never returns): they would keep their
    instances, memory and directories for ever."""

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        if self.id == self.leader:
            raise ValueError("the leader fails")
        while not IGNORING_ENDS.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    async def stop(self):
        if self.id != self.leader:
            await asyncio.Event().wait()


@service_cluster(config={"dask_services.stop-grace": "300ms"})
async def test_a_hook_that_ignores_its_cancellation_does_not_keep_its_instance(c, s, a, b):
    IGNORING_ENDS.clear()
    try:
        with captured_logger("dask_services") as log:
            xs = [c.submit(inc, i, workers=[w.address], pure=False)
                  for i, w in enumerate([a, b, a, b])]
            outs = dask_services.submit(IgnoresItsCancellation, xs, outputs=2)
            for out in outs:
                await assert_errs(out, ValueError, "the leader fails")
            del outs, out, xs
            await assert_nothing_left(s, [a, b])
        warnings = log.getvalue()
        assert ("IgnoresItsCancellation of" in warnings
                and "all_inputs_done() still running 0.3 s after being cancelled"
                in warnings), warnings
        assert "did not return within 0.3 s" in warnings, warnings
    finally:
        IGNORING_ENDS.set()  # the abandoned hooks end with the test


def test_a_hook_that_ignores_its_cancellation_does_not_hang_the_local_scheduler():
    IGNORING_ENDS.clear()
    outs = dask_services.service_task(IgnoresItsCancellation, [dask.delayed(i) for i in range(2)],
                                      outputs=2)
    try:
        with dask.config.set({"dask_services.stop-grace": "200ms"}):
            with pytest.raises(ValueError, match="the leader fails"):
                dask.compute(*outs, scheduler="sync")
    finally:
        IGNORING_ENDS.set()


class ProducesLater(Service):
    """Produces from a task of its own, after ``all_inputs_done`` returned."""

    async def add_key(self, key, data):
        self.total = getattr(self, "total", 0) + data

    async def all_inputs_done(self):
        async def later():
            await asyncio.sleep(0.05)
            for key in self.concierge.wanted_outputs:
                if self.concierge.owner(key) == self.id:
                    await self.concierge.produce_key(key, self.total)

        self.later = asyncio.ensure_future(later())


def test_outputs_produced_after_the_hooks_returned_under_the_local_scheduler():
    outs = dask_services.service_task(ProducesLater, [dask.delayed(i) for i in range(4)],
                                      outputs=2)
    with dask.config.set({"dask_services.local-instances": 1}):
        assert dask.compute(*outs, scheduler="sync") == (6, 6)


class ErrorWithAMessage(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        self.concierge.error("bad input")  # a message, not an exception


class ProducesAListKey(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        if self.id == self.leader:
            await self.concierge.produce_key(list(self.output_keys[0]), 1)


class SumsWithPlainDefs(Service):
    def start(self, id, key, peers, input_keys, output_keys, concierge, leader, **kw):
        self.total = 0

    def add_key(self, key, data):
        self.total += data


def test_hooks_written_without_async_run():
    outs = dask_services.service_task(SumsWithPlainDefs, [dask.delayed(i) for i in range(4)],
                                      outputs=1)
    # the hooks ran (no "can't be used in 'await' expression"); nothing was produced
    with pytest.raises(dask_services.OutputLostError, match="did not produce output"):
        dask.compute(*outs, scheduler="sync")


class DoublesWithAPlainDefRPC(Service):
    async def all_inputs_done(self) -> None:
        doubled = [await peer.double(3) for peer in self.peers.values()]
        for key in self.output_keys:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, doubled)

    @rpc
    def double(self, x: int) -> int:
        return 2 * x


@service_cluster()
async def test_an_rpc_method_written_as_a_plain_def_answers(c, s, a, b):
    outs = dask_services.service_task(DoublesWithAPlainDefRPC, [], outputs=2)
    assert await c.gather(c.compute(outs)) == [[6, 6], [6, 6]]
    await assert_nothing_left(s, [a, b])


def test_an_rpc_method_written_as_a_plain_def_under_the_local_scheduler():
    outs = dask_services.service_task(DoublesWithAPlainDefRPC, [], outputs=2)
    with dask.config.set({"dask_services.local-instances": 2}):
        assert dask.compute(*outs, scheduler="sync") == ([6, 6], [6, 6])


@pytest.mark.parametrize("service, error, match", [
    (ErrorWithAMessage, TypeError, r"concierge.error\(\) takes an exception"),
    (ProducesAListKey, dask_services.ProduceKeyError, "keys are strings or tuples"),
])
def test_wrong_arguments_to_the_concierge_are_named(service, error, match):
    outs = dask_services.service_task(service, [dask.delayed(1)], outputs=2)
    with pytest.raises(error, match=match):
        dask.compute(*outs, scheduler="sync")


def test_a_parameter_named_like_a_start_argument_fails_at_graph_construction():
    with pytest.raises(TypeError, match=r"\['key'\] of ProducesNothing clash with"):
        dask_services.service_task(ProducesNothing, [dask.delayed(1)], outputs=1, key=1)


class TakesAName(dask_services.Service):
    """A parameter of start() named like an option of service_task() and submit()."""

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    name="<default>", priority=0, **params):
        self.tag = name

    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                await self.concierge.produce_key(out, self.tag)


def test_an_option_of_service_task_that_start_names_fails_at_graph_construction():
    # ``name=`` named the output keys and never reached start(), silently
    with pytest.raises(TypeError, match=re.escape(
            "name= given to service_task() is its own option, but TakesAName.start() has "
            "a parameter of that name, which would never receive it; rename")):
        dask_services.service_task(TakesAName, [dask.delayed(1)], outputs=1,
                                   name="resnet50")
    # not given, start() takes its default, as it would with any other parameter
    (out,) = dask_services.service_task(TakesAName, [dask.delayed(1)], outputs=1)
    assert dask.compute(out, scheduler="sync") == ("<default>",)
    # keyword parameters caught by **params are the service's: any name but the options
    outs = dask_services.service_task(ProducesNothing, [dask.delayed(1)], outputs=1,
                                      model="resnet50")
    assert "producesnothing" in str(outs[0].key)


@service_cluster()
async def test_a_start_parameter_named_like_an_option_of_submit_is_refused(c, s, a, b):
    with pytest.raises(TypeError, match=r"priority= given to submit\(\) is its own "
                                        r"option, but TakesAName.start\(\)"):
        dask_services.submit(TakesAName, [c.submit(abs, 1)], outputs=1, client=c,
                             priority=5)
    assert not s.extensions["dask_services"].machines


def test_a_lazy_parameter_fails_at_graph_construction():
    # a Delayed, a collection or a Future given as a parameter reached start() as it was,
    # an object standing for a value nothing computed
    import dask.array as da

    for params, named in [({"weights": dask.delayed(sum)([1, 2])}, "weights (a Delayed)"),
                          ({"table": da.ones(3)}, "table (a dask Array)"),
                          ({"n": 2, "sizes": [1, {"b": dask.delayed(3)}]},
                           "sizes[1]['b'] (a Delayed)")]:
        with pytest.raises(TypeError, match=re.escape(
                f"parameter(s) {named} of ProducesNothing: parameters reach every "
                "instance's start() as they are given")):
            dask_services.service_task(ProducesNothing, [dask.delayed(1)], outputs=1,
                                       **params)


@service_cluster()
async def test_a_future_as_a_parameter_of_submit_is_refused_before_anything_runs(c, s, a,
                                                                                b):
    weights = c.submit(sum, [1, 2])
    with pytest.raises(TypeError, match=r"weights \(a Future\) of ProducesNothing.*"
                                        r"pass the value among the inputs"):
        dask_services.submit(ProducesNothing, [c.submit(abs, 1)], outputs=1,
                             weights=weights, client=c)
    assert not [k for k in s.tasks if "service" in str(k)]
    assert await weights == 3


# ------------------------------------------------------------------ retries


class FailsFirstRuns(Service):
    """Sums its inputs; the leader's ``all_inputs_done`` raises in the first ``failures``
    runs (counted in a file, so that worker processes share the count)."""

    async def start(self, *args: Any, counter: str, failures: int, **kwargs: Any) -> None:
        await super().start(*args, **kwargs)
        self.counter, self.failures, self.total = counter, failures, 0

    async def add_key(self, key, data) -> None:
        self.total += data

    @rpc
    async def total_of(self) -> int:
        return self.total

    async def all_inputs_done(self) -> None:
        if self.id != self.leader:
            return
        with open(self.counter, "a") as f:
            f.write("x")
        with open(self.counter) as f:
            if len(f.read()) <= self.failures:
                raise ValueError("this run fails")
        total = sum([await self.peers[p].total_of() for p in self.peers])
        for key in self.output_keys:
            await self.concierge.produce_key(key, total)


@pytest.mark.parametrize("how", ["compute", "annotate", "submit"])
@service_cluster()
async def test_a_service_task_with_retries_runs_again_after_its_run_failed(c, s, a, b,
                                                                          tmp_path, how):
    """``retries=`` on a service task: a run that fails is followed by a new run, with
    every input handed off again (the hand-offs gave theirs to the failed run)."""
    counter = str(tmp_path / "runs")
    xs = [dask.delayed(inc)(i) for i in range(6)]
    if how == "annotate":
        with dask.annotate(retries=2):
            outs = dask_services.service_task(FailsFirstRuns, xs, outputs=3,
                                              counter=counter, failures=2)
        futures = c.compute(outs)
    elif how == "submit":  # a task option, as for client.submit (it became a parameter)
        futures = dask_services.submit(FailsFirstRuns, xs, outputs=3, client=c,
                                       counter=counter, failures=2, retries=2)
    else:
        outs = dask_services.service_task(FailsFirstRuns, xs, outputs=3,
                                          counter=counter, failures=2)
        futures = c.compute(outs, retries=2)
    assert await c.gather(futures) == [sum(range(1, 7))] * 3
    assert len((tmp_path / "runs").read_text()) == 3
    s.validate_state()
    del futures
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_a_service_task_whose_retries_are_used_up_errs(c, s, a, b, tmp_path):
    xs = [dask.delayed(inc)(i) for i in range(6)]
    outs = dask_services.service_task(FailsFirstRuns, xs, outputs=2,
                                      counter=str(tmp_path / "runs"), failures=10)
    futures = c.compute(outs, retries=1)
    for future in futures:
        await assert_errs(future, ValueError, "this run fails")
    assert len((tmp_path / "runs").read_text()) == 2
    s.validate_state()
    del futures, future
    await assert_nothing_left(s, [a, b])


# ------------------------------------------------------------------ worker resources

ONE_GPU_EACH = [("127.0.0.1", 1, {"resources": {"GPU": 1}})] * 2


@service_cluster(nthreads=ONE_GPU_EACH)
async def test_a_graph_annotated_with_worker_resources_runs(c, s, a, b, tmp_path):
    """``dask.annotate(resources=...)`` annotates the service task and its claims with the
    rest of the graph: the service task, waiting for its run, holds no unit (or the claims
    needing its worker's only unit never run), and the claims need none where their
    outputs were produced; the inputs keep theirs."""
    with dask.annotate(resources={"GPU": 1}):
        xs = [dask.delayed(inc)(i) for i in range(6)]
        outs = dask_services.service_task(FailsFirstRuns, xs, outputs=4,
                                          counter=str(tmp_path / "runs"), failures=0)
    futures = c.compute(outs)
    assert await c.gather(futures) == [sum(range(1, 7))] * 4
    inputs = [ts for ts in s.tasks.values() if str(ts.key).startswith("inc-")]
    assert inputs and all(ts.resource_restrictions == {"GPU": 1} for ts in inputs)
    s.validate_state()
    del futures
    await assert_nothing_left(s, [a, b])


class ProducesWhenLetGo(FailsFirstRuns):
    """Produces its outputs once the test sets ``let_go`` (reached: ``waiting``)."""

    waiting = threading.Event()
    let_go = threading.Event()

    async def all_inputs_done(self) -> None:
        if self.id == self.leader:
            type(self).waiting.set()
            await asyncio.get_running_loop().run_in_executor(None, type(self).let_go.wait)
        await super().all_inputs_done()


BLOCKERS_DONE = threading.Event()
BLOCKERS_STARTED = threading.Semaphore(0)


def block() -> None:
    """Keeps its worker's only thread busy until the test sets ``BLOCKERS_DONE``."""
    BLOCKERS_STARTED.release()
    BLOCKERS_DONE.wait()


@service_cluster()
async def test_outputs_released_before_their_claims_ran_are_dropped(c, s, a, b, tmp_path):
    """Every output produced, every claim waiting behind a busy worker thread, then the
    futures released: the producing workers drop every value, even those whose claims
    went after the service task was forgotten (no machine to decide any more)."""
    ProducesWhenLetGo.waiting.clear()
    ProducesWhenLetGo.let_go.clear()
    xs = [dask.delayed(inc)(i) for i in range(6)]
    futures = c.compute(dask_services.service_task(
        ProducesWhenLetGo, xs, outputs=6, counter=str(tmp_path / "runs"), failures=0))
    await asyncio.get_running_loop().run_in_executor(None, ProducesWhenLetGo.waiting.wait)
    BLOCKERS_DONE.clear()
    blockers = [c.submit(block, workers=[w.address], pure=False) for w in (a, b)]
    for _ in blockers:
        await asyncio.get_running_loop().run_in_executor(None, BLOCKERS_STARTED.acquire)
    ProducesWhenLetGo.let_go.set()
    plugin = s.extensions["dask_services"]
    await async_poll_for(lambda: len(plugin.cut) == 6, timeout=10)
    assert all(s.tasks[f.key].state == "processing" for f in futures)
    del futures
    try:
        await assert_nothing_left(s, [a, b])
    finally:
        BLOCKERS_DONE.set()
    await c.gather(blockers)


@service_cluster()
async def test_service_task_given_a_future_points_to_submit(c, s, a, b):
    future = c.submit(inc, 1)
    with pytest.raises(TypeError, match=r"got a Future; to run a service on futures use "
                                        r"dask_services.submit\("):
        dask_services.service_task(FailsFirstRuns, [future], outputs=1)
    assert await future == 2


# ------------------------------------------------------------------ service threads


class BlocksInAThread(PidReporter):
    """Its leader waits in a service thread (``concierge.run_in_executor``) on ``gate``,
    which nothing sets until the test ends: a job a cancellation cannot stop."""

    gate = threading.Event()
    entered = threading.Event()

    async def all_inputs_done(self) -> None:
        if self.id == self.leader:
            def wait() -> None:
                type(self).entered.set()
                type(self).gate.wait(60)

            await self.concierge.run_in_executor(wait)
        await super().all_inputs_done()


class UsesAThread(PidReporter):
    """Reports its pid from a service thread."""

    async def all_inputs_done(self) -> None:
        assert await self.concierge.run_in_executor(os.getpid) == os.getpid()
        await super().all_inputs_done()


async def cancel_a_run_blocked_in_a_thread(c, workers) -> None:
    """Start a run of ``BlocksInAThread``, cancel it once its job waits in a service
    thread, and return when its instances have stopped (the job still waits)."""
    BlocksInAThread.gate.clear()
    BlocksInAThread.entered.clear()
    futures = c.compute(dask_services.service_task(BlocksInAThread, [], outputs=2))
    await asyncio.get_running_loop().run_in_executor(None, BlocksInAThread.entered.wait, 20)
    await c.cancel(futures)
    del futures
    await async_poll_for(lambda: not any(w.extensions["dask_services"].host.instances
                                         for w in workers), timeout=20)


@service_cluster(config={"dask_services.stop-grace": "1s"})
async def test_a_cancelled_runs_blocked_thread_job_does_not_hold_up_later_runs(c, s, a, b):
    """With one service thread per worker, a cancelled run's job blocked in that thread
    made every later run on the worker wait until it returned (the shuffle's included).
    The job still running ``stop-grace`` after its instance stopped is warned about."""
    with captured_logger("dask_services") as log:
        await cancel_a_run_blocked_in_a_thread(c, (a, b))
        try:
            assert not BlocksInAThread.gate.is_set()
            outs = c.compute(dask_services.service_task(UsesAThread, [], outputs=4))
            assert await asyncio.wait_for(c.gather(outs), 30) == [os.getpid()] * 4
            del outs
            assert BlocksInAThread.entered.is_set() and not BlocksInAThread.gate.is_set()
            await async_poll_for(lambda: "1 concierge.run_in_executor job(s) still running 1 "
                                 "s after the instance stopped" in log.getvalue(), timeout=10)
        finally:
            BlocksInAThread.gate.set()
    await async_poll_for(lambda: all(w.extensions["dask_services"].threads.held == 0
                                     for w in (a, b)), timeout=10)
    assert not any(w.extensions["dask_services"].host.late_jobs.watches for w in (a, b))
    await assert_nothing_left(s, [a, b])


@service_cluster(config={"dask_services.stop-grace": "30s"})
async def test_a_cancelled_runs_thread_job_that_returns_soon_after_is_not_warned_about(
        c, s, a, b):
    """Cancelling a run whose job was under way in a service thread (a built-in shuffle's
    split, a rechunk's assembly) warned at once that the job was still running, though
    it returned moments later: noise for every cancelled shuffle.  Only a job still
    running ``stop-grace`` later is warned about; one that returns before is dropped."""
    with captured_logger("dask_services") as log:
        await cancel_a_run_blocked_in_a_thread(c, (a, b))
        assert any(w.extensions["dask_services"].host.late_jobs.watches for w in (a, b))
        BlocksInAThread.gate.set()  # the job returns, well within the grace
        await async_poll_for(lambda: not any(
            w.extensions["dask_services"].host.late_jobs.watches for w in (a, b)), timeout=10)
    assert "still running" not in log.getvalue()
    await assert_nothing_left(s, [a, b])


# ------------------------------------------------------------------ inputs are shared


@service_cluster()
async def test_an_instance_cannot_change_an_input_the_graph_shares(c, s, a, b):
    """An input's value is the graph's: computed alongside the service task, ``x`` came
    back changed by the instance (every run). A numpy input now comes read-only, and the
    error says to change a copy, which works."""
    import dask.array as da
    from services import ChangesACopy, ChangesItsInput

    x = da.arange(10.0, chunks=5) + 1
    (total,) = dask_services.service_task(ChangesItsInput, [x], outputs=1)
    total_f, x_f = c.compute([total, x])
    exc = await assert_errs(total_f, ValueError, "read-only")
    assert "change a copy: data = data.copy()" in " ".join(getattr(exc, "__notes__", ()))
    np.testing.assert_array_equal(await x_f, np.arange(10.0) + 1)
    del total_f, x_f, exc
    (total,) = dask_services.service_task(ChangesACopy, [x], outputs=1)
    total_f, x_f = c.compute([total, x])
    np.testing.assert_array_equal(await total_f, 2 * (np.arange(1.0, 6) + np.arange(6.0, 11)))
    np.testing.assert_array_equal(await x_f, np.arange(10.0) + 1)
    del total_f, x_f
    await assert_nothing_left(s, [a, b])


def test_a_local_run_cannot_change_the_callers_array():
    """Under dask's local schedulers an input may be the caller's own array."""
    from services import ChangesItsInput

    mine = np.arange(5.0)
    (total,) = dask_services.service_task(ChangesItsInput, [dask.delayed(mine)], outputs=1)
    for scheduler in ("sync", "threads"):
        with pytest.raises(ValueError, match="read-only"):
            dask.compute(total, scheduler=scheduler)
        np.testing.assert_array_equal(mine, np.arange(5.0))


class Blob:
    """A value the service leaves in a reference cycle, as a hook's frames held by the
    exception it raised hold its data."""


BLOBS: list[weakref.ref] = []


class LeavesACycleThenFails(Service):
    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    **params):
        pass

    async def add_key(self, key, data):
        blob = Blob()
        blob.me, blob.data = blob, np.ones(1_000_000)
        BLOBS.append(weakref.ref(blob))

    async def all_inputs_done(self):
        raise ValueError("the run fails, its garbage in a cycle")


@service_cluster()
async def test_memory_a_failed_run_left_in_reference_cycles_is_freed_at_once(c, s, a, b):
    # Python's collector runs on allocation counts, which a worker holding big arrays
    # and doing little else may not reach for minutes; distributed never asks for it.
    # With it off, only the worker's own collection after a run that did not finish
    # frees the cycle (it collected only when memory was above the worker's target).
    BLOBS.clear()
    enabled = gc.isenabled()
    gc.disable()
    try:
        outs = dask_services.service_task(LeavesACycleThenFails,
                                          [dask.delayed(i) for i in range(4)], outputs=2)
        with pytest.raises(ValueError, match="the run fails"):
            await c.compute(outs[0])
        assert len(BLOBS) == 4
        await async_poll_for(lambda: all(ref() is None for ref in BLOBS), timeout=10)
    finally:
        if enabled:
            gc.enable()


class Unmeasurable:
    """Pickles, but its ``__sizeof__`` raises."""

    def __init__(self, value):
        self.value = value

    def __sizeof__(self):
        raise RuntimeError("sizeof refuses")


class PassesUnmeasurable(Service):
    async def add_key(self, key, data):
        pass

    async def all_inputs_done(self):
        others = [sid for sid in sorted(self.peers) if sid != self.id]
        got = [(await self.peers[sid].echo(Unmeasurable(7))).value for sid in others]
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, got)

    @dask_services.rpc
    async def echo(self, thing):
        return Unmeasurable(thing.value * 2)


@service_cluster()
async def test_arguments_and_results_whose_sizeof_raises_pass_between_workers(c, s, a, b):
    # (refused as "could not be serialized", though they pickle, and pass on one worker)
    outs = c.compute(dask_services.service_task(
        PassesUnmeasurable, [dask.delayed(inc)(i) for i in range(2)], outputs=2))
    assert await asyncio.wait_for(c.gather(outs), 30) == [[14], [14]]
    del outs
    await assert_nothing_left(s, [a, b])
