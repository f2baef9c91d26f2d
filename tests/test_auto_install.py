"""The client that sends a graph of service tasks installs dask_services on its cluster:
graphs built before their ``Client`` exists, or computed through a client that is not the
default one, run as those built with a default client do (``_auto_install.py``)."""

from __future__ import annotations

from unittest import mock

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, LocalCluster
from distributed.client import _get_global_client
from distributed.utils_test import async_poll_for, gen_cluster, gen_test
from utils import validate_scheduler

import dask_services
from dask_services._auto_install import runs_service_tasks
from dask_services.client import _installed
from dask_services.examples import AllReduce

pytestmark = pytest.mark.timeout(120)

VALIDATION = {"distributed.scheduler.validate": True, "distributed.worker.validate": True}

ARRAY = np.arange(60 * 60, dtype="float64").reshape(60, 60)
FRAME = pd.DataFrame({"a": np.arange(400) % 17, "b": np.arange(400.0)})


def all_to_all() -> da.Array:
    """Rows to columns: one region, so a service task."""
    return da.from_array(ARRAY, chunks=(10, 60)).rechunk((60, 10), method="service")


def graphs() -> dict:
    """One graph of each kind that makes service tasks, and what each computes to; the
    last ones hide their service tasks in a collection inside an operand, or in layers
    rebuilt without their mark."""
    (total,) = dask_services.service_task(
        AllReduce, [dask.delayed(float)(i) for i in range(6)], outputs=1)
    shuffled = dd.from_pandas(FRAME, npartitions=5).shuffle("a", shuffle_method="service")
    columns = [str(i) for i in range(60)]
    (optimized,) = dask.optimize(all_to_all()[:, :20])
    return {
        "rechunk": (all_to_all().sum(axis=0), ARRAY.sum(axis=0)),
        "shuffle": (shuffled.groupby("a").b.sum(), FRAME.groupby("a").b.sum()),
        "service_task": (total, 15.0),
        "delayed of a frame": (dask.delayed(len)(shuffled), len(FRAME)),
        "frame of an array": (dd.from_dask_array(all_to_all(), columns=columns).sum(),
                              pd.Series(ARRAY.sum(axis=0), index=columns)),
        "optimized": (optimized, ARRAY[:, :20]),
    }


def assert_equal(got, expected) -> None:
    if isinstance(expected, pd.Series):
        pd.testing.assert_series_equal(got.sort_index(), expected.sort_index())
    else:
        np.testing.assert_array_equal(got, expected)


def sent_expr(collection):
    """What ``Client.compute`` sends for ``collection``."""
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    return FinalizeCompute(collections_to_expr([collection])).optimize()


def test_what_is_recognized_as_holding_service_tasks():
    for name, (collection, _) in graphs().items():
        assert runs_service_tasks(sent_expr(collection)), name
    x = da.from_array(ARRAY, chunks=(10, 60))
    # copies of neighbouring chunks: tasks only, nothing to install
    local = x.rechunk((15, 60), method="service")
    assert not runs_service_tasks(sent_expr(local.sum()))
    assert not runs_service_tasks(sent_expr(x.rechunk((60, 10), method="tasks")))
    frame = dd.from_pandas(FRAME, npartitions=5)
    assert not runs_service_tasks(sent_expr(frame.shuffle("a", shuffle_method="tasks")))
    assert not runs_service_tasks(sent_expr(dask.delayed(sum)([1, 2])))
    assert not runs_service_tasks(None)


@pytest.mark.parametrize("kind", list(graphs()))
def test_a_graph_built_before_its_client_runs_through_a_client_that_is_not_the_default(kind):
    assert _get_global_client() is None
    collection, expected = graphs()[kind]
    with dask.config.set(VALIDATION), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False,
            dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        assert _get_global_client() is None and client not in _installed
        assert_equal(client.compute(collection).result(), expected)
        assert client in _installed
        assert all("dask_services" in w.extensions for w in cluster.workers.values())
        validate_scheduler(client)


def test_persist_and_dask_compute_install_through_the_default_client():
    assert _get_global_client() is None
    first = all_to_all()
    second = all_to_all().T
    with dask.config.set(VALIDATION), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False,
            dashboard_address=":0") as cluster, Client(cluster) as client:
        assert client not in _installed
        (got,) = dask.compute(second.sum(axis=1))
        np.testing.assert_array_equal(got, ARRAY.T.sum(axis=1))
        assert client in _installed
        _installed.discard(client)  # persist() installs too (again: harmless)
        persisted = client.persist(first)
        np.testing.assert_array_equal(persisted.compute(), ARRAY)
        assert client in _installed
        validate_scheduler(client)


@pytest.mark.parametrize("kind", list(graphs()))
@gen_cluster(client=True, timeout=60)
async def test_an_asynchronous_client_installs_before_its_graph_arrives(c, s, a, b, kind):
    collection, expected = graphs()[kind]
    assert c not in _installed and "dask_services" not in s.plugins
    future = c.compute(collection)
    assert_equal(await future, expected)
    assert c in _installed and "dask_services" in s.plugins
    s.validate_state()
    for w in (a, b):
        w.validate_state()


@pytest.mark.parametrize("kind", ["rechunk", "shuffle"])
@gen_test(timeout=60)
async def test_an_asynchronous_client_used_before_it_is_connected_installs(kind):
    """``cluster.get_client()`` in async code gives a client still connecting: computing
    at once, its install waited for nothing and failed, and every hand-off then raised
    "not installed" (distributed's own p2p test of a LocalCluster does this)."""
    collection, expected = graphs()[kind]
    with dask.config.set(VALIDATION):
        async with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                asynchronous=True, dashboard_address=":0") as cluster:
            client = cluster.get_client()
            assert client.status != "running"
            assert_equal(await client.compute(collection), expected)
            assert client in _installed
            assert "dask_services" in cluster.scheduler.plugins
            cluster.scheduler.validate_state()
            for w in cluster.workers.values():
                w.validate_state()


@gen_cluster(client=True, timeout=60)
async def test_submit_with_an_asynchronous_client(c, s, a, b):
    futures = dask_services.submit(AllReduce, c.map(abs, range(10)), outputs=2, client=c)
    assert await c.gather(futures) == [45, 45]
    assert c in _installed
    # one future, not in a list (it raised "'Future' object is not iterable")
    one = dask_services.submit(AllReduce, c.submit(abs, -7), outputs=1, client=c)
    assert await c.gather(one) == [7]


@gen_cluster(client=True, timeout=60)
async def test_what_an_asynchronous_client_sends_while_installing_keeps_its_order(c, s, a, b):
    from dask_services import _auto_install

    first = c.compute(all_to_all().sum(axis=0))
    assert c in _auto_install._holding  # installing: the graph is held
    second = c.compute(dd.from_pandas(FRAME, npartitions=5)
                       .shuffle("a", shuffle_method="service").b.sum())
    released = c.compute(all_to_all().sum(axis=1))
    key = released.key
    del released  # its release is held behind its graph, not sent before it
    plain = c.submit(sum, [1, 2])
    np.testing.assert_array_equal(await first, ARRAY.sum(axis=0))
    assert await second == FRAME.b.sum() and await plain == 3
    assert c not in _auto_install._holding and "_send_to_scheduler" not in vars(c)
    await async_poll_for(lambda: key not in s.tasks, timeout=10)  # forgotten, not waiting
    s.validate_state()


@gen_cluster(client=True, timeout=60)
async def test_an_asynchronous_client_that_cannot_install_is_told_how(c, s, a, b):
    from dask_services import client as client_module

    async def refused(client):
        raise OSError("the scheduler refused the plugin")

    (total,) = dask_services.service_task(AllReduce, [dask.delayed(float)(1)], outputs=1)
    with mock.patch.object(client_module, "install_async", refused), \
            pytest.raises(RuntimeError, match=r"not installed on this worker.*install"):
        await c.compute(total)
    assert c not in _installed and "dask_services" not in s.plugins
    assert "_send_to_scheduler" not in vars(c)


def test_graphs_are_not_searched_in_a_process_that_made_no_service_task(monkeypatch):
    from dask_services import _auto_install

    searched: list = []
    monkeypatch.setattr(_auto_install, "_made", False)
    monkeypatch.setattr(_auto_install, "runs_service_tasks",
                        lambda expr: searched.append(expr) or False)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        assert client.compute(dask.delayed(sum)([3, 4])).result() == 7
        assert client.compute(da.ones(10, chunks=5).sum()).result() == 10
        assert searched == [] and client not in _installed
        dask_services.service_task(AllReduce, [], outputs=1)  # one made: searched now
        assert _auto_install._made
        assert client.compute(dask.delayed(sum)([3, 4])).result() == 7
        assert len(searched) == 1


def test_a_failing_look_at_the_graph_never_fails_its_sending(monkeypatch):
    from dask_services import _auto_install

    def broken(expr):
        raise AttributeError("an expression of an unknown kind")

    monkeypatch.setattr(_auto_install, "runs_service_tasks", broken)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        assert client.submit(sum, [1, 2]).result() == 3
        assert dask.delayed(sum)([3, 4]).compute() == 7
        assert client not in _installed


def test_a_task_dict_sent_with_client_get_installs():
    (total,) = dask_services.service_task(
        AllReduce, [dask.delayed(float)(i) for i in range(4)], outputs=1)
    tasks = dict(total.__dask_graph__())
    with dask.config.set(VALIDATION), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False,
            dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        assert client.get(tasks, total.key) == 6.0
        assert client in _installed
        validate_scheduler(client)
