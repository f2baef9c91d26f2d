"""Fails loudly when a dask/distributed upgrade moves something dask-services relies on.

The scheduler plugin edits scheduler task state directly (see dask_services/scheduler.py);
these are the versions it was written and tested against.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from importlib.metadata import version

import pytest
from distributed.utils_test import gen_test

pytestmark = pytest.mark.timeout(30)

TESTED = {"dask": "2026.8.0", "distributed": "2026.8.0"}


@pytest.mark.parametrize("package", sorted(TESTED))
def test_pinned_versions(package):
    assert version(package) == TESTED[package], (
        f"dask-services was tested with {package}=={TESTED[package]}, found "
        f"{version(package)}; run the whole suite, fix what breaks, then update the pins in "
        "pyproject.toml and here"
    )


def test_scheduler_internals_we_use():
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
    from distributed.scheduler import Scheduler, TaskState

    for attr in ("dependencies", "dependents", "waiting_on", "waiters", "worker_restrictions",
                 "loose_restrictions", "resource_restrictions", "processing_on", "who_has",
                 "run_spec", "priority", "state", "who_wants"):
        assert attr in TaskState.__slots__ or hasattr(TaskState, attr), attr
    for method in ("transitions", "stimulus_queue_slots_maybe_opened", "log_event",
                   "register_worker_plugin", "validate_state", "add_plugin"):
        assert callable(getattr(Scheduler, method, None)), method
    # set_restrictions replaces a task's worker restrictions, and only them (the plugin
    # sets loose_restrictions itself; a string is one worker, None none)
    src = inspect.getsource(Scheduler.set_restrictions)
    assert "ts.worker_restrictions = set(restrictions) if restrictions else None" in src
    assert "loose_restrictions" not in src
    # worker extensions' heartbeat data reaches the scheduler extension of the same name
    # (replicated services and the core each receive their own)
    assert "self.extensions[name].heartbeat(ws, data)" in inspect.getsource(
        Scheduler.heartbeat_worker)
    assert "stimulus_id" in inspect.signature(SchedulerPlugin.remove_worker).parameters
    assert callable(SchedulerPlugin.log_event) and callable(SchedulerPlugin.add_worker)
    # a worker being retired reaches plugins only as an event: the scheduler marks it
    # closing gracefully (logging the change, with its stimulus) before moving its data,
    # and plugins' log_event sees every event logged (runs restart at once; replicas move)
    status_change = inspect.getsource(Scheduler.handle_worker_status_change)
    assert '"action": "worker-status-change"' in status_change
    assert '"status": ws.status.name' in status_change and '"stimulus_id"' in status_change
    retire = inspect.getsource(Scheduler.retire_workers)
    assert retire.index("Status.closing_gracefully") < retire.index("_track_retire_worker")
    assert "self._broker.publish(topic, msg)" in inspect.getsource(Scheduler.log_event)
    from distributed.broker import Broker

    assert "plugin.log_event(name, msg)" in inspect.getsource(Broker.publish)
    # outputs produced on a retiring worker are taken into memory there as the change is
    # logged (``_land_outputs_of_retiring``): before the worker leaves ``running``, which
    # the plugin does itself, and before the retirement's first look at what it holds
    assert status_change.index("self.log_event(") < status_change.index(
        "self.running.discard(ws)")
    assert retire.index("self.handle_worker_status_change(") < retire.index(
        "amm.run_once()")
    # ... those whose claims wait without a worker (it was paused) placed on it first:
    # the no-worker -> processing transition picks among the running workers, and the
    # idle and saturated sets it may add the worker to are cleared after the logging
    assert ("no-worker", "processing") in Scheduler._TRANSITIONS_TABLE
    assert "decide_worker_non_rootish(ts)" in inspect.getsource(
        Scheduler._transition_no_worker_processing)
    assert status_change.index("self.log_event(") < status_change.index(
        "self.idle.pop(ws.address, None)") < status_change.index(
        "self.saturated.discard(ws)")
    # ... as a worker's task-finished message takes a task into memory: the handler, and
    # the fields the processing -> memory transition reads
    src = inspect.getsource(Scheduler.handle_task_finished)
    assert "self.stimulus_task_finished(" in src and "self.send_all(" in src
    assert "elif ts.state == \"memory\":" in inspect.getsource(Scheduler.stimulus_task_finished)
    assert {"nbytes", "type", "typename", "worker", "startstops"} <= set(
        inspect.signature(Scheduler._transition_processing_memory).parameters)
    assert callable(TaskState.set_nbytes) and callable(TaskState.get_nbytes)
    assert "run_id" in TaskState.__slots__ and "type" in TaskState.__slots__
    assert "elif ts.run_id != run_id:" in inspect.getsource(Scheduler.stimulus_task_finished)
    # ... and where the worker cannot make one, distributed's message of a worker letting
    # go of a key: the scheduler drops the replica and releases a key left with none (a
    # failure the claim reports once its key is in memory is not taken: the task is not
    # processing any more)
    assert '"release-worker-data": self.release_worker_data' in inspect.getsource(
        Scheduler.__init__)
    src = inspect.getsource(Scheduler.release_worker_data)
    assert "self.remove_replica(ts, ws)" in src and '{key: "released"}' in src
    assert 'ts.state != "processing"' in inspect.getsource(Scheduler.stimulus_task_erred)
    params = inspect.signature(SchedulerPlugin.update_graph).parameters
    assert {"scheduler", "keys", "tasks"} <= set(params)
    assert "stimulus_id" in inspect.signature(SchedulerPlugin.transition).parameters
    assert {"key", "start", "finish"} <= set(inspect.signature(WorkerPlugin.transition).parameters)
    # the transition table entries our restarts go through
    table = Scheduler._TRANSITIONS_TABLE
    for edge in [("processing", "released"), ("memory", "released"), ("released", "waiting"),
                 ("no-worker", "released"), ("waiting", "processing")]:
        assert edge in table, edge
    # a waiting service task erred by the plugin (ErrWaitingServiceTask) goes through
    # released, where a task with a blame is not sent back to waiting, then to erred,
    # which reports the blamed task's exception (pickled bytes, as KilledWorker's are)
    assert ("waiting", "erred") not in table and ("released", "erred") in table
    for attr in ("exception", "exception_text", "traceback", "traceback_text",
                 "exception_blame"):
        assert attr in TaskState.__slots__ or hasattr(TaskState, attr), attr
    src = inspect.getsource(Scheduler._transition_waiting_released)
    assert "elif not ts.exception_blame and (ts.who_wants or ts.waiters):" in src
    src = inspect.getsource(Scheduler._transition_released_erred)
    assert '"exception": failing_ts.exception' in src


def test_adaptive_internals_replicas_rely_on():
    """Replicas count in an adaptive cluster (``replicated/_adaptive.py``): Adaptive asks
    the scheduler's ``adaptive_target`` handler, which has no plugin hook (so it is
    wrapped), and ``workers_to_close`` filters candidates through every plugin's
    ``valid_workers_downscaling`` (so replica workers are never retired)."""
    from distributed.deploy.adaptive import Adaptive
    from distributed.diagnostics.plugin import SchedulerPlugin
    from distributed.scheduler import Scheduler

    assert "self.scheduler.adaptive_target(" in inspect.getsource(Adaptive.target)
    assert "self.scheduler.workers_to_close(" in inspect.getsource(Adaptive.workers_to_close)
    assert '"adaptive_target": self.adaptive_target' in inspect.getsource(Scheduler.__init__)
    assert "self.workers_to_close()" in inspect.getsource(Scheduler.adaptive_target)
    assert "plugin.valid_workers_downscaling(self, valid_workers)" in inspect.getsource(
        Scheduler.workers_to_close)
    assert callable(SchedulerPlugin.valid_workers_downscaling)
    assert list(inspect.signature(Scheduler.adaptive_target).parameters) == [
        "self", "target_duration"]


def test_worker_internals_we_use():
    from distributed.worker import Worker, get_worker, secede, thread_state

    assert callable(secede) and callable(get_worker)
    assert hasattr(thread_state, "__dict__")
    src = inspect.getsource(Worker.execute)
    assert "ts.dependencies" in src  # claims run with the scheduler's (cut) dependencies
    # hand-offs and claims are coroutine tasks (graph.py): the worker awaits them on its
    # event loop, with the worker in _worker_cvar, which tells them they run on a cluster
    assert "run_spec.is_coro" in src and "_run_task_async" in src
    from distributed.worker import _run_task, _run_task_async, _worker_cvar

    assert "await task(data)" in inspect.getsource(_run_task_async)
    assert _worker_cvar.name == "_worker_cvar"
    assert "set_thread_state" in inspect.getsource(_run_task)  # thread_state.key is set
    # the replica plugin learns that its worker is retired from the status the scheduler
    # sends it (``replicated/_worker.py``: ``_watch_status``), before the scheduler closes
    # it; the worker's close then tears the plugin down before stopping its listeners
    assert "worker-status-change" in inspect.getsource(Worker.__init__)
    assert list(inspect.signature(Worker.handle_worker_status_change).parameters) == [
        "self", "status", "stimulus_id"]
    # a task fetched instead of run (in flight when the scheduler asked for it to be run)
    # is reported with this stimulus: the scheduler plugin runs such a hand-off again
    from dask_services.scheduler import FETCHED_NOT_RUN

    assert f'stimulus_id=f"{FETCHED_NOT_RUN}{{time()}}"' in inspect.getsource(
        Worker.gather_dep)
    close = inspect.getsource(Worker.close)
    assert close.index("plugin_remove") < close.index("_stop_listeners")
    # an output taken into memory on a retiring worker: the produced value becomes the
    # key's data through the stimulus scatter uses, which tells the scheduler nothing
    # (it took the key into memory itself), for a claim not started (through released);
    # a retiring worker still serves its data to the workers the retirement moves it to
    from distributed.worker_state_machine import UpdateDataEvent, WorkerState

    assert {"data", "stimulus_id"} <= {f.name for f in dataclasses.fields(UpdateDataEvent)}
    released_memory = inspect.getsource(WorkerState._transition_released_memory)
    assert "self._transition_to_memory(\n            ts, value, False," in released_memory
    assert 'elif "released" not in (start, finish):' in inspect.getsource(
        WorkerState._transition)
    assert "if self.status == Status.paused:" in inspect.getsource(Worker.get_data)


def test_workers_measure_results_with_dask_sizeof_dispatch():
    """``produce_key(nbytes=)`` reaches the worker through dask's ``sizeof`` dispatch
    (``_known_sizes.py``): the worker and its spill buffer must measure with it."""
    import dask.sizeof
    import distributed.sizeof
    import distributed.spill
    import distributed.worker
    from distributed.worker import _run_task_async

    assert distributed.sizeof.sizeof is dask.sizeof.sizeof
    assert "return sizeof(obj)" in inspect.getsource(distributed.sizeof.safe_sizeof)
    assert distributed.worker.sizeof is distributed.sizeof.safe_sizeof
    assert '"nbytes": sizeof(result)' in inspect.getsource(_run_task_async)
    assert distributed.spill.safe_sizeof is distributed.sizeof.safe_sizeof
    assert "return safe_sizeof(value)" in inspect.getsource(distributed.spill)
    assert callable(dask.sizeof.sizeof.dispatch) and callable(dask.sizeof.sizeof.register)


def test_task_spec_fusion_hook():
    from dask._task_spec import GraphNode, Task

    assert isinstance(GraphNode.block_fusion, property)
    assert "block_fusion" in inspect.getsource(
        __import__("dask._task_spec", fromlist=["fuse_linear_task_spec"]).fuse_linear_task_spec
    )
    assert Task.__call__ is not GraphNode.__call__


def test_scheduler_orders_graphs_through_dask_order_attribute():
    # dask_services.graph.install_order replaces dask.order.order: the scheduler must look
    # it up on the module for every new graph (not hold its own reference), and call it
    # with the graph only, so that our order sees the output claims it hides
    import dask.order
    from distributed import scheduler

    assert "offload(dask.order.order, dsk=dsk)" in inspect.getsource(scheduler)
    assert "dependencies" in inspect.signature(dask.order.order).parameters


def test_batched_send_internals_we_use():
    # dask_services._streams.flush sends a run's control messages without waiting out the
    # stream's interval
    from distributed.batched import BatchedSend

    stream = BatchedSend(interval="10ms")
    for attr in ("buffer", "next_deadline", "waker"):
        assert hasattr(stream, attr), attr
    assert "time() < self.next_deadline" in inspect.getsource(BatchedSend._background_send)


@gen_test()
async def test_flush_sends_without_waiting_out_the_interval():
    from distributed.batched import BatchedSend

    from dask_services._streams import flush

    class Comm:
        def __init__(self) -> None:
            self.batches: list = []
            self.arrived = asyncio.Event()

        async def write(self, msg, serializers=None, on_error=None) -> int:
            self.batches.append(msg)
            self.arrived.set()
            return 1

        def closed(self) -> bool:
            return False

        async def close(self) -> None:
            pass

    async def next_batch() -> list:
        await asyncio.wait_for(comm.arrived.wait(), 10)
        comm.arrived.clear()
        return comm.batches[-1]

    stream, comm = BatchedSend(interval="1h"), Comm()
    stream.start(comm)
    stream.send("first")  # an idle stream sends at once, then waits an hour before the next
    assert await next_batch() == ["first"]
    stream.send("second")
    flush(stream)
    assert await next_batch() == ["second"]
    stream.please_stop = True
    stream.waker.set()


def test_every_way_of_computing_sends_through_graph_to_futures():
    """``_auto_install`` installs dask_services where a client sends a graph: every client
    method that computes must send through ``Client._graph_to_futures(expr, keys, ...)``,
    which looks it up on the class (so the wrapper is found)."""
    from distributed import Client

    import dask_services  # noqa: F401  (wraps the method)

    assert getattr(Client._graph_to_futures, "installs_dask_services", False)
    assert list(inspect.signature(Client._graph_to_futures.__wrapped__).parameters)[:3] == [
        "self", "expr", "keys"]
    for method in (Client.compute, Client.persist, Client.get):
        assert "self._graph_to_futures(" in inspect.getsource(method), method
    # dask.compute() and .compute() with a distributed client go through Client.get:
    # tests/test_auto_install.py computes so
    # an asynchronous client's graph is held while it installs: the graph and every other
    # message leave through the instance's ``_send_to_scheduler``, looked up per call
    assert "self._send_to_scheduler(" in inspect.getsource(Client._graph_to_futures.__wrapped__)
    for method in (Client._release_key, Client._cancel):
        assert "self._send_to_scheduler(" in inspect.getsource(method), method


def test_current_worker_context_variable():
    """``get_worker()`` reads a private context variable, which the framework sets around
    instance hooks, peer calls and replica methods (``_worker_context.py``)."""
    import contextvars

    from distributed.worker import _worker_cvar, get_worker

    from dask_services._worker_context import as_worker

    assert isinstance(_worker_cvar, contextvars.ContextVar)
    marker = object()
    with as_worker(marker):  # type: ignore[arg-type]
        assert get_worker() is marker
    with pytest.raises(ValueError, match="No worker found"):
        get_worker()


def test_peer_payloads_pass_through_the_comm_protocol():
    """Peer-call payloads are registered with distributed's ``dask`` serializer family and
    reach the handler as frames, deserialized only by the framework (``_payload.py``)."""
    import numpy as np
    from distributed.protocol import dumps, loads
    from distributed.protocol.serialize import to_serialize

    from dask_services._payload import Packed, pack, unpack

    array = np.arange(1000)
    packed = asyncio.run(pack((array,), "test"))
    message = loads(dumps({"payload": to_serialize(packed)}))
    arrived = message["payload"]
    assert isinstance(arrived, Packed)
    (back,) = asyncio.run(unpack(arrived, "test"))
    np.testing.assert_array_equal(back, array)


def test_thread_pool_internals_the_service_threads_grow_with():
    """``_threads.ServiceThreads`` adds a thread while a stopped instance's job still runs
    by raising the pool's capacity and starting a thread: both are ThreadPoolExecutor's
    own, so a Python upgrade that renames them must fail here, not leave runs waiting."""
    import concurrent.futures

    from dask_services import _threads

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        assert getattr(pool, _threads.CAPACITY_ATTRIBUTE) == 1
        assert callable(getattr(pool, _threads.THREAD_START_METHOD))
        source = inspect.getsource(type(pool).submit) + inspect.getsource(
            getattr(type(pool), _threads.THREAD_START_METHOD))
        assert _threads.CAPACITY_ATTRIBUTE in source
    finally:
        pool.shutdown()


@pytest.mark.parametrize("nthreads", [1, 2, 64])
def test_the_memory_share_of_a_worker_without_a_limit_is_what_auto_gives(nthreads):
    """``_memory_share`` mirrors ``memory_limit="auto"`` from distributed's
    ``system.MEMORY_LIMIT`` and dask's ``system.CPU_COUNT``."""
    import logging

    from distributed.worker_memory import parse_memory_limit

    from dask_services._memory_share import memory_to_plan_on

    auto = parse_memory_limit("auto", nthreads, logger=logging.getLogger(__name__))
    assert memory_to_plan_on(None, nthreads) == auto


def test_span_internals_the_thread_time_of_runs_is_reported_through():
    """``_worker_environment.thread_time_used`` digests ``("execute", span_id, prefix,
    activity, "seconds")`` on the worker, which distributed's spans attribute to the span
    of the service task's group (``TaskGroup.span_id``, sent to the instances)."""
    from distributed.scheduler import TaskGroup
    from distributed.spans import CONTEXTS_WITH_SPAN_ID
    from distributed.worker import Worker

    assert "execute" in CONTEXTS_WITH_SPAN_ID
    assert list(inspect.signature(Worker.digest_metric).parameters) == [
        "self", "name", "value"]
    assert "span_id" in TaskGroup.__annotations__
