"""Local schedulers, the submit API, graph rules, memory accounting."""

from __future__ import annotations

import dask
import numpy as np
import pytest
from distributed import Future
from distributed.utils_test import async_poll_for
from services import Hog, Recorder
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services
from dask_services.examples import AllReduce, SampleSort

pytestmark = pytest.mark.timeout(90)


def inc(x):
    return x + 1


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_local_schedulers_run_services_in_process(scheduler):
    xs = [dask.delayed(inc)(i) for i in range(10)]
    sums = dask_services.service_task(AllReduce, xs, outputs=3)
    parts = dask_services.service_task(SampleSort, xs, outputs=2)
    total = dask.delayed(sum)(sums)
    r_sums, r_parts, r_total = dask.compute(sums, parts, total, scheduler=scheduler)
    assert list(r_sums) == [55, 55, 55]
    assert r_parts[0] + r_parts[1] == list(range(1, 11))
    assert r_total == 165


def test_local_scheduler_errors_and_restarts():
    xs = [dask.delayed(inc)(i) for i in range(3)]
    with pytest.raises(ValueError, match="boom in add_key"):
        dask.compute(dask_services.service_task(Recorder, xs, outputs=1, fail_in="add_key"),
                     scheduler="sync")
    outs = dask_services.service_task(Recorder, xs, outputs=1, restart_runs=1)
    assert dask.compute(outs, scheduler="sync") == ([6],)
    with dask.config.set({"dask_services.restarts": 0}):
        outs = dask_services.service_task(Recorder, xs, outputs=1, restart_runs=5, name="r2")
        with pytest.raises(dask_services.TooManyRestarts):
            dask.compute(outs, scheduler="sync")


def test_service_task_validates_its_arguments():
    with pytest.raises(TypeError, match="subclass of dask_services.Service"):
        dask_services.service_task(object, [], outputs=1)
    with pytest.raises(TypeError, match="dask collections or Delayed"):
        dask_services.service_task(AllReduce, [1, 2], outputs=1)
    with pytest.raises(ValueError, match="outputs must be >= 0"):
        dask_services.service_task(AllReduce, [], outputs=-1)
    with pytest.raises(TypeError, match=r"is a string.*outputs=\['total'\]"):
        dask_services.service_task(AllReduce, [], outputs="total")
    with pytest.raises(TypeError, match="a number of outputs or a list of output keys, got "
                                        "a float"):
        dask_services.service_task(AllReduce, [], outputs=2.0)
    with pytest.raises(dask_services.ServiceGraphError, match=r"given twice.*\['a'\]"):
        dask_services.service_task(AllReduce, [], outputs=["a", "b", "a"])
    assert len(dask_services.service_task(AllReduce, [], outputs=np.int64(3))) == 3
    # (unhashable, it failed the scheduler plugin's intake, and the client waited for ever)
    with pytest.raises(TypeError, match=r"placement=\['g'\] is a list: .* a string"):
        dask_services.service_task(AllReduce, [], outputs=1, placement=["g"])
    x = dask.delayed(inc)(1)
    with pytest.raises(dask_services.ServiceGraphError, match="given twice"):
        dask_services.service_task(AllReduce, [x, x], outputs=1)
    with pytest.raises(dask_services.ServiceGraphError, match="both an input and an output"):
        dask_services.service_task(AllReduce, [x], outputs=[x.key])


def test_collections_as_inputs():
    import dask.array as da

    arr = da.arange(100, chunks=10)
    (total,) = dask_services.service_task(AllReduce, arr, outputs=1)
    assert np.array_equal(total.compute(scheduler="sync"), np.arange(100).reshape(10, 10).sum(0))


@service_cluster()
async def test_submit_with_futures_and_params(c, s, a, b):
    futs = c.map(inc, range(5))
    outs = dask_services.submit(AllReduce, futs, outputs=["total", "copy"], client=c, op="max")
    assert [o.key for o in outs] == ["total", "copy"]
    assert all(isinstance(o, Future) for o in outs)
    assert await c.gather(outs) == [5, 5]
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_installing_twice_is_harmless(c, s, a, b):
    await dask_services.install_async(c)
    await c.register_plugin(dask_services.scheduler.ServiceSchedulerPlugin())
    assert list(s.plugins).count("dask_services") == 1
    assert await c.gather(dask_services.submit(AllReduce, c.map(inc, range(3)), outputs=1,
                                               client=c)) == [6]
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_service_task_held_directly_is_rejected(c, s, a, b):
    from dask.delayed import Delayed

    xs = [dask.delayed(inc)(i) for i in range(2)]
    (out,) = dask_services.service_task(AllReduce, xs, outputs=1)
    service_key = out.__dask_graph__()[out.key].service_key
    fut = c.compute(Delayed(service_key, out.__dask_graph__()))
    await assert_errs(fut, dask_services.ServiceGraphError, "cannot be computed or held")
    assert str(service_key) in str(await fut.exception())
    del fut
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_task_depending_on_service_task_is_rejected(c, s, a, b):
    from dask._task_spec import Task, TaskRef
    from dask.delayed import Delayed

    xs = [dask.delayed(inc)(i) for i in range(2)]
    (out,) = dask_services.service_task(AllReduce, xs, outputs=1)
    graph = dict(out.__dask_graph__())
    service_key = graph[out.key].service_key
    graph["sneaky"] = Task("sneaky", repr, TaskRef(service_key))
    fut = c.compute(Delayed("sneaky", graph))
    await assert_errs(fut, dask_services.ServiceGraphError, "'sneaky' depends on service task")
    del fut
    await assert_nothing_left(s, [a, b])


@service_cluster(
    worker_kwargs={"memory_limit": "200 MB"},
    config={
        "distributed.worker.memory.target": 0.0001,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    },
)
async def test_memory_accounting_and_please_evict(c, s, a, b):
    Hog.evicted.clear()
    target = a.memory_manager.memory_target_fraction
    for w in (a, b):  # no memory target yet: nothing may be evicted
        w.memory_manager.memory_target_fraction = False
    outs = c.compute(dask_services.service_task(Hog, [], outputs=2))
    # While the hogs hold memory, the workers report it ...
    await async_poll_for(
        lambda: all(w.metrics["dask_services_managed_bytes"](w) >= 50_000_000
                    for w in (a, b)),
        timeout=10,
    )
    assert not Hog.evicted
    # ... and, once there is a target, the memory monitor asks them to evict, which lets
    # them finish.
    for w in (a, b):
        w.memory_manager.memory_target_fraction = target
    assert await c.gather(outs) == ["evicted", "evicted"]
    assert Hog.evicted and all(n > 0 for n in Hog.evicted)
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster(worker_kwargs={"memory_limit": "2 GB"})
async def test_metrics_reach_the_scheduler(c, s, a, b):
    outs = c.compute(dask_services.service_task(Recorder, [], outputs=1, gate="hold"))
    await async_poll_for(lambda: all(w.extensions["dask_services"].host.instances
                                     for w in (a, b)), timeout=10)
    await a.heartbeat()
    metrics = s.workers[a.address].metrics
    assert metrics["dask_services_managed_bytes"] > 0
    assert metrics["dask_services_spilled_bytes"] == 0
    Recorder.gates["hold"].set()
    with pytest.raises(ValueError, match="needs at least one input"):
        await outs[0]
    outs[0].release()
    del outs
    await assert_nothing_left(s, [a, b])


def test_in_process_cluster_gives_every_worker_its_own_extension():
    # LocalCluster(processes=False) talks over inproc comms, which hand every worker the
    # very same plugin object; a shuffle there used to wait forever
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client, LocalCluster

    pdf = pd.DataFrame({"a": np.arange(300) % 13, "b": np.arange(300.0)})
    with dask.config.set({"distributed.scheduler.validate": True,
                          "distributed.worker.validate": True}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith("inproc://")
        df = dd.from_pandas(pdf, npartitions=6)
        got = df.shuffle("a", shuffle_method="service").compute()
        pd.testing.assert_frame_equal(got.sort_values("b"), pdf)
        owners = client.run(
            lambda dask_worker: dask_worker.extensions["dask_services"].worker.address
        )
        assert owners == {address: address for address in owners}
        client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.validate_state())
