"""An output's lone consumer runs in the output's claim (``_claim_fusion``): one task per
output, the same results as numpy, and nothing fused that must stay a task of its own."""

from __future__ import annotations

from collections import Counter

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import Task
from distributed import Event, Variable, wait
from distributed.utils_test import async_poll_for, poll_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import (
    assert_errs,
    assert_nothing_left,
    kill,
    service_cluster,
    service_events,
    validate_scheduler,
)

import dask_services  # noqa: F401
from dask_services.graph import (
    ConsumingClaimSpec,
    HandOffSpec,
    OutputClaimSpec,
    ServiceTaskSpec,
)

pytestmark = pytest.mark.timeout(120)

A = np.arange(400 * 300.0).reshape(400, 300)


def all_to_all(a: np.ndarray = A) -> da.Array:
    """Row chunks to column chunks: one service task, every output needs every input."""
    return da.from_array(a, chunks=(50, a.shape[1])).rechunk((a.shape[0], 50),
                                                              method="service")


def graph_of(*collections) -> dict:
    """The graph dask.array's optimization makes of ``collections``, computed together."""
    keys = [c.__dask_keys__() for c in collections]
    merged: dict = {}
    for c in collections:
        merged.update(c.__dask_graph__())
    return dict(collections[0].__dask_optimize__(merged, keys))


def claims(graph: dict) -> Counter:
    return Counter(type(v).__name__ for v in graph.values()
                   if isinstance(v, OutputClaimSpec))


def service_tasks(graph: dict) -> list[ServiceTaskSpec]:
    return [v for v in graph.values() if isinstance(v, ServiceTaskSpec)]


def test_the_sum_of_every_output_runs_in_its_claim():
    y = all_to_all()
    total = y.sum()
    graph = graph_of(total)
    assert claims(graph) == {"ConsumingClaimSpec": 6}
    with dask.config.set({"dask_services.fuse-consumers": False}):
        unfused = graph_of(total)
    assert claims(unfused) == {"OutputClaimSpec": 6}
    assert len(unfused) == len(graph) + 6  # a chunk sum per output
    # the claims took the chunk sums' keys, which the partial sums name as before
    chunk_sums = [k for k, v in unfused.items()
                  if type(v) is Task and v.dependencies <= set(y.__dask_keys__()[0])]
    (service,) = service_tasks(graph)
    assert service.definition.output_keys == tuple(sorted(chunk_sums))
    assert set(chunk_sums) <= set(graph)
    assert all(isinstance(graph[k], ConsumingClaimSpec) for k in chunk_sums)
    # a new service task (and hand-offs) of its own: the outputs are other values
    (plain,) = service_tasks(unfused)
    assert service.key != plain.key
    assert not set(service.definition.handoff_keys) & set(plain.definition.handoff_keys)
    assert dask.compute(total, scheduler="sync")[0] == A.sum()


def _plus_one(b):
    return b + 1


@pytest.mark.parametrize("case", [
    "output asked for", "setting off", "dask's fusion off",
])
def test_what_is_not_fused(case):
    y = all_to_all()
    collection, expected = (y, A) if case == "output asked for" else (y.sum(), A.sum())
    setting = {"setting off": {"dask_services.fuse-consumers": False},
               "dask's fusion off": {"optimization.fuse.active": False}}.get(case, {})
    with dask.config.set(setting):
        graph = graph_of(collection)
        result = dask.compute(collection, scheduler="sync")[0]
    assert claims(graph) == {"OutputClaimSpec": 6}, claims(graph)
    np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("case", ["two consumers", "consumer of two keys"])
def test_outputs_with_other_consumers_stay_claims(case):
    y = all_to_all()
    if case == "two consumers":
        collection, expected = y.sum(axis=0) + y.max(axis=0), A.sum(0) + A.max(0)
    else:
        other = da.from_array(A, chunks=(400, 50))
        collection, expected = (y * other).sum(), (A * A).sum()
    graph = graph_of(collection)
    assert claims(graph) == {"OutputClaimSpec": 6}, claims(graph)
    np.testing.assert_array_equal(dask.compute(collection, scheduler="sync")[0], expected)


def test_a_consumer_asked_for_is_fused_under_its_own_key():
    z = all_to_all().map_blocks(_plus_one)
    graph = graph_of(z)
    assert claims(graph) == {"ConsumingClaimSpec": 6}
    assert set(graph) >= set(z.__dask_keys__()[0])
    np.testing.assert_array_equal(dask.compute(z, scheduler="sync")[0], A + 1)


def test_some_outputs_fused_and_others_not():
    """The first column block also feeds a max: it stays a claim (renamed with its service
    task, its max naming the new key); the other five take their sums in."""
    y = all_to_all()
    z = da.concatenate([y.sum(axis=0), y[:, :50].max(axis=0)])
    graph = graph_of(z)
    assert claims(graph) == {"ConsumingClaimSpec": 5, "OutputClaimSpec": 1}
    (plain,) = [k for k, v in graph.items() if type(v) is OutputClaimSpec]
    assert plain not in y.__dask_graph__()
    expected = np.concatenate([A.sum(axis=0), A[:, :50].max(axis=0)])
    np.testing.assert_array_equal(dask.compute(z, scheduler="sync")[0], expected)


def test_a_rechunk_feeding_another_rechunk_stays_as_it_is():
    """The first rechunk's outputs feed the second's hand-offs: renaming them would leave
    the second service task's inputs under their old names, so the first is not fused;
    the second's outputs take their sums in."""
    y = all_to_all().rechunk((50, 300), method="service")
    graph = graph_of(y.sum())
    services = service_tasks(graph)
    assert len(services) == 2
    fused = [t for t in services if any(isinstance(graph.get(k), ConsumingClaimSpec)
                                        for k in t.definition.output_keys)]
    assert len(fused) == 1
    (first,) = [t for t in services if t is not fused[0]]
    assert set(first.definition.output_keys) <= set(graph)  # its keys as they were
    assert set(fused[0].definition.input_keys) <= set(graph)
    assert dask.compute(y.sum(), scheduler="sync")[0] == A.sum()


def test_a_chain_of_blockwise_steps_is_one_consumer():
    graph = graph_of((all_to_all() + 1).sum())
    assert claims(graph) == {"ConsumingClaimSpec": 6}
    assert dask.compute((all_to_all() + 1).sum(), scheduler="sync")[0] == (A + 1).sum()


def _fails_on_the_third_column_block(b, block_info=None):
    if block_info[None]["chunk-location"] == (0, 2):
        raise ValueError("no negative numbers here: column block 2")
    return b.sum(keepdims=True)


def test_a_consumers_error_is_the_outputs_error():
    z = all_to_all().map_blocks(_fails_on_the_third_column_block, chunks=(1, 1),
                                dtype=float).sum()
    assert claims(graph_of(z)) == {"ConsumingClaimSpec": 6}
    with pytest.raises(ValueError, match="column block 2"):
        dask.compute(z, scheduler="sync")


@st.composite
def cases(draw):
    rows = draw(st.integers(2, 60))
    cols = draw(st.integers(2, 60))
    row_chunks = draw(st.integers(1, rows))
    col_chunks = draw(st.integers(1, cols))
    consumer = draw(st.sampled_from(["sum", "sum1", "plus-max", "slice", "mean"]))
    return rows, cols, row_chunks, col_chunks, consumer


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_property_fused_consumers_give_numpys_results(case):
    rows, cols, row_chunks, col_chunks, consumer = case
    a = np.random.default_rng(rows * cols).standard_normal((rows, cols))
    y = da.from_array(a, chunks=(row_chunks, cols)).rechunk((rows, col_chunks),
                                                             method="service")
    z, expected = {
        "sum": (y.sum(), a.sum()),
        "sum1": (y.sum(axis=1), a.sum(axis=1)),
        "plus-max": ((y + 1).max(axis=0), (a + 1).max(axis=0)),
        "slice": (y[::2, 1:].sum(axis=0), a[::2, 1:].sum(axis=0)),
        "mean": (y.mean(axis=0), a.mean(axis=0)),
    }[consumer]
    np.testing.assert_allclose(dask.compute(z, scheduler="sync")[0], expected)


@service_cluster(timeout=90)
async def test_on_a_cluster_the_claims_run_the_sums(c, s, a, b):
    arr = np.arange(600 * 400.0).reshape(600, 400)
    x = c.persist(da.from_array(arr, chunks=(50, 400)))
    y = x.rechunk((600, 50), method="service")
    z = c.compute(y.sum(axis=0))
    np.testing.assert_array_equal(await z, arr.sum(axis=0))
    s.validate_state()
    kinds = Counter(type(ts.run_spec).__name__ for ts in s.tasks.values())
    assert kinds["ConsumingClaimSpec"] == 8 and not kinds["OutputClaimSpec"], kinds
    del z
    # an error of a consumer is its output's, and the run leaves nothing behind
    bad = c.compute(y.map_blocks(_fails_on_the_third_column_block, chunks=(1, 1),
                                 dtype=float).sum())
    await assert_errs(bad, ValueError, "column block 2")
    del bad, x, y
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_one_rechunk_consumed_three_ways_at_once(c, s, a, b):
    """Its sums, its maxima, the rechunked array itself and a mix, asked for at the same
    time: four service tasks (three fused, one not), no key with two meanings, numpy's
    results."""
    arr = np.arange(600 * 400.0).reshape(600, 400)
    x = c.persist(da.from_array(arr, chunks=(50, 400)))
    y = x.rechunk((600, 50), method="service")
    sums, maxima = c.compute(y.sum(axis=0)), c.compute(y.max(axis=0))
    held = c.persist(y)
    mixed = c.compute(da.concatenate([y.sum(axis=0), y[:, :50].max(axis=0)]))
    np.testing.assert_array_equal(await sums, arr.sum(axis=0))
    np.testing.assert_array_equal(await maxima, arr.max(axis=0))
    np.testing.assert_array_equal(await c.compute(held), arr)
    np.testing.assert_array_equal(
        await mixed, np.concatenate([arr.sum(axis=0), arr[:, :50].max(axis=0)]))
    services = {k for k, ts in s.tasks.items() if isinstance(ts.run_spec, ServiceTaskSpec)}
    assert len(services) == 4, services
    s.validate_state()
    del sums, maxima, held, mixed, x, y
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_a_consumer_key_fused_in_one_graph_and_not_in_the_next(c, s, a, b):
    """A consumer's key means a fused claim in one graph and a plain task (or another
    service task's claim) in the next: the scheduler keeps the meaning it knows, and the
    service task that came with the other one owns no such output.  The output map took
    the later service task as their owner: with a result of the first graph held, the
    third graph waited for ever on an output no run wanted."""
    arr = np.arange(400 * 400.0).reshape(400, 400)
    y = da.from_array(arr, chunks=(20, 400)).rechunk((400, 20), method="service")
    held = c.compute(y.sum())  # every chunk's sum fused into its claim
    assert await held == arr.sum()
    # chunk (0, 0) has two consumers here: its sum is a plain task, the rest fused
    assert await c.compute(y.sum() + y[0, 0]) == arr.sum() + arr[0, 0]
    assert await c.compute(y.sum()) == arr.sum()  # hung
    s.validate_state()
    # the sums of a persisted y are plain tasks with the fused ones' keys, sent at once
    kept = c.persist(y)
    await wait(kept)
    plain, fused = c.compute(kept.sum()), c.compute(y.sum())
    mixed = c.compute((kept + y).sum())
    assert [await plain, await fused, await mixed] == [arr.sum(), arr.sum(), 2 * arr.sum()]
    s.validate_state()
    del held, kept, plain, fused, mixed, y
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_claims_made_for_a_kept_key_are_forgotten(c, s, a, b):
    """A fused result held, then the same sums unfused: distributed keeps the held keys'
    fused claims and still makes the chunks' claims the unfused specs depend on, which
    nothing needs.  They, their service task and its hand-offs stayed on the scheduler
    for its life."""
    arr = np.arange(400 * 400.0).reshape(400, 400)
    y = da.from_array(arr, chunks=(20, 400)).rechunk((400, 20), method="service")
    held = c.compute(y.sum())
    assert await held == arr.sum()
    with dask.config.set({"dask_services.fuse-consumers": False}):
        assert await c.compute(y.sum()) == arr.sum()
        assert await c.compute(y.sum() + y[0, 0]) == arr.sum() + arr[0, 0]
    s.validate_state()
    del held, y
    await assert_nothing_left(s, [a, b])


@service_cluster(timeout=90)
async def test_a_fused_service_task_whose_outputs_are_all_kept_keys_is_forgotten(c, s, a, b):
    """Unfused sums held, then the same sums fused: every output of the fused service task
    is a key the scheduler keeps as a plain task, so it owns none and nothing needs it;
    it and its hand-offs are forgotten at once, not kept beside the held result."""
    arr = np.arange(400 * 400.0).reshape(400, 400)
    y = da.from_array(arr, chunks=(20, 400)).rechunk((400, 20), method="service")
    with dask.config.set({"dask_services.fuse-consumers": False}):
        held = c.compute(y.sum())
        assert await held == arr.sum()
    plugin = s.extensions["dask_services"]
    (unfused,) = plugin.machines
    assert await c.compute(y.sum()) == arr.sum()
    await async_poll_for(lambda: list(plugin.machines) == [unfused], timeout=5)
    handoffs = [k for k, ts in s.tasks.items() if isinstance(ts.run_spec, HandOffSpec)]
    assert handoffs and {plugin.handoff_of.get(k) for k in handoffs} == {unfused}
    s.validate_state()
    del held, y
    await assert_nothing_left(s, [a, b])


def _fails_once_on_the_third_column_block(b, block_info=None):
    from distributed import Variable

    if block_info[None]["chunk-location"] == (0, 2):
        failed = Variable("consumer-failed-once")
        if not failed.get(timeout=5):
            failed.set(True)
            raise ValueError("fails the first time only")
    return b.sum(keepdims=True)


@service_cluster(timeout=60)
async def test_a_consumer_retried_after_an_error_finds_its_output_again(c, s, a, b):
    """``compute(..., retries=1)``: the claim whose consumer raised runs again where the
    output was produced, and finds it there; one run of the service task."""
    await Variable("consumer-failed-once", client=c).set(False)
    arr = np.arange(600 * 400.0).reshape(600, 400)
    x = c.persist(da.from_array(arr, chunks=(50, 400)))
    z = x.rechunk((600, 50), method="service").map_blocks(
        _fails_once_on_the_third_column_block, chunks=(1, 1), dtype=float).sum()
    total = c.compute(z, retries=1)
    assert await total == arr.sum()
    assert await Variable("consumer-failed-once", client=c).get() is True
    starts = [e for _, e in s.get_events("dask_services") if e["action"] == "started"]
    assert len(starts) == 1, s.get_events("dask_services")
    del total, x, z
    await assert_nothing_left(s, [a, b])


def _nothing_held_on(worker) -> bool:
    ext = worker.extensions["dask_services"]
    return not ext.host.instances and not ext.produced


@pytest.mark.parametrize("release", ["cancel", "del"])
@service_cluster(timeout=60)
async def test_a_consumer_failing_on_one_output_leaves_nothing_behind(c, s, a, b, release):
    """A consumer run by one output's claim raises: the other outputs' claims are wanted
    by nothing any more (their consumers erred with it). While the client holds the failed
    result, the run ends and no worker holds an instance or a produced value (as with
    ``tasks``, the scheduler keeps the failed graph's tasks); once it lets go of it,
    neither scheduler nor workers keep anything (the service task was left behind for
    good, and with it its run's state, when its last consumer had been cut from it)."""
    arr = np.arange(600 * 400.0).reshape(600, 400)
    z = all_to_all(arr).map_blocks(_fails_on_the_third_column_block, chunks=(1, 1),
                                   dtype=float).sum()
    total = c.compute(z)
    await assert_errs(total, ValueError, "column block 2")
    await async_poll_for(lambda: _nothing_held_on(a) and _nothing_held_on(b), timeout=10)
    s.validate_state()
    if release == "cancel":
        await c.cancel(total, force=True)
    del total, z
    await assert_nothing_left(s, [a, b])
    # and the same graph, without the failure, still gives numpy's result
    ok = all_to_all(arr).map_blocks(lambda b: b.sum(keepdims=True), chunks=(1, 1),
                                    dtype=float).sum()
    assert await c.compute(ok) == arr.sum()


def _gated_sum(b, block_info=None):
    if block_info[None]["chunk-location"] == (0, 0):
        Variable("gated-consumer-worker").set(__import__("distributed").get_worker().address)
        Event("gated-consumer-open").wait(120)
    return b.sum(keepdims=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_claim_lost_while_its_consumer_runs_is_produced_and_consumed_again(small_cluster):
    """The worker running a consuming claim dies while the consumer runs (its output's value
    already taken): a new run produces that output again, the consumer runs again, and the
    total is numpy's."""
    _, client, _ = small_cluster
    x = da.random.RandomState(3).random_sample((2000, 1600), chunks=(100, 1600))
    z = x.rechunk((2000, 100), method="service").map_blocks(_gated_sum, chunks=(1, 1),
                                                            dtype=float).sum()
    gate = Event("gated-consumer-open", client=client)
    where = Variable("gated-consumer-worker", client=client)
    future = client.compute(z)
    victim = where.get(timeout=60)
    kill(client, victim)
    poll_for(lambda: victim not in client.scheduler_info()["workers"], timeout=60)
    gate.set()
    assert future.result(timeout=120) == pytest.approx(x.compute().sum())
    validate_scheduler(client)
    # the output lost with the worker came from a run after the kill
    starts = [e for e in service_events(client) if e["action"] == "started"]
    assert len(starts) >= 2, service_events(client)


@service_cluster(timeout=90)
async def test_the_same_graph_again_while_claims_run_is_no_collision(c, s, a, b, caplog):
    """A running claim has no edge to its service task (its value is produced): the same
    graph submitted again differs from it in that edge, which distributed logged as a key
    collision that "can cause failures and deadlocks".  The edge is the framework's own
    and the running claim is kept, as it should be: nothing is logged, the result is
    right."""
    import asyncio
    import logging
    from unittest import mock

    from dask_services import graph as graph_module

    x = c.persist(da.from_array(A, chunks=(50, A.shape[1])))
    y = x.rechunk((A.shape[0], 50), method="service")
    gate = asyncio.Event()  # the workers are in this process, on this loop
    claim = graph_module._claim_output_async

    async def held_claim(*args):
        await gate.wait()
        return await claim(*args)

    plugin = s.extensions["dask_services"]
    with mock.patch.object(graph_module, "_claim_output_async", held_claim):
        first = c.compute(y)
        await async_poll_for(lambda: plugin.cut, timeout=20)
        with caplog.at_level(logging.WARNING, logger="distributed.scheduler"):
            second = c.compute(y)
            await async_poll_for(lambda: sum(isinstance(k, str) and k.startswith("finalize")
                                             for k in s.tasks) == 2, timeout=10)
        gate.set()
        got = await second
    collisions = [r.getMessage()[-300:] for r in caplog.records
                  if "Detected different `run_spec`" in r.getMessage()]
    assert not collisions, collisions
    np.testing.assert_array_equal(got, A)
    np.testing.assert_array_equal(await first, A)
    del first, second, x, y
    await assert_nothing_left(s, [a, b])


def test_a_collision_other_than_the_cut_edge_is_still_logged():
    """The filter drops only the collision of a running claim's cut edge."""
    import logging

    from dask_services.scheduler import OwnEdgeCollisions

    plugin = type("Plugin", (), {})()
    plugin.cut = {("out", 0): "tcp://w"}
    plugin.output_of = {("out", 0): "service-1"}
    drop = OwnEdgeCollisions(plugin)

    def record(key, old, new):
        msg = (f"{OwnEdgeCollisions.PREFIX}{key!r} between two consecutive calls to "
               f"`update_graph`. ... old dependencies: {old}\nnew dependencies: {new}\n")
        return logging.LogRecord("distributed.scheduler", logging.WARNING, __file__, 1,
                                 msg, None, None)

    assert not drop.filter(record(("out", 0), set(), frozenset({"service-1"})))
    assert not drop.filter(record(("out", 0), set(), {"service-1"}))
    assert drop.filter(record(("out", 0), set(), frozenset({"service-1", "other"})))
    assert drop.filter(record(("out", 0), {"x"}, {"service-1"}))
    assert drop.filter(record(("out", 1), set(), {"service-1"}))
    plugin.cut = {}
    assert drop.filter(record(("out", 0), set(), {"service-1"}))


def _needs_a_gpu(block: np.ndarray) -> np.ndarray:
    from distributed import get_worker

    if "GPU" not in get_worker().state.total_resources:
        raise RuntimeError("a consumer needing a GPU ran on a worker without one")
    return block


@service_cluster(nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}}), ("127.0.0.1", 1)],
                 timeout=90)
async def test_a_consumer_needing_resources_runs_where_they_are(c, s, gpu, cpu):
    """A consumer run in its output's claim was freed of the resources its annotation
    asks for, with the claim (which runs where the output was produced, whatever that
    worker has): on a worker without them in 5 of 6 runs.  Its output is now produced
    on a worker that has them."""
    arr = np.arange(400 * 400.0).reshape(400, 400)
    with dask.annotate(resources={"GPU": 1}):
        x = da.from_array(arr, chunks=(50, 400))
        y = x.rechunk((400, 50), method="service").map_blocks(_needs_a_gpu, dtype=float)
        z = c.compute(y.sum(axis=0))
    np.testing.assert_array_equal(await z, arr.sum(axis=0))
    # (the consumers ran in the claims, each on the worker with the GPU)
    kinds = Counter(type(ts.run_spec).__name__ for ts in s.tasks.values())
    assert kinds["ConsumingClaimSpec"] == 8, kinds
    s.validate_state()
    del z
    await assert_nothing_left(s, [gpu, cpu])


def test_fuse_consumers_off_where_compute_is_called_is_carried_to_the_optimizer():
    """distributed optimizes an array's graph where it builds it, on the scheduler, after
    ``compute()`` returned: ``fuse-consumers: false`` set around ``compute()`` on the
    client did not reach it.  The optimizer taken in the block carries it."""
    from dask._expr import HLGExpr

    total = all_to_all().sum()
    with dask.config.set({"dask_services.fuse-consumers": False}):
        expr = HLGExpr.from_collection(total, optimize_graph=True)
    graph = dict(expr.__dask_graph__())  # optimized here, the block over
    assert claims(graph) == {"OutputClaimSpec": 6}, claims(graph)
    assert claims(dict(HLGExpr.from_collection(total, optimize_graph=True)
                       .__dask_graph__())) == {"ConsumingClaimSpec": 6}


@service_cluster(timeout=90)
async def test_fuse_consumers_off_around_compute_holds_on_a_cluster(c, s, a, b):
    arr = np.arange(400 * 400.0).reshape(400, 400)
    y = da.from_array(arr, chunks=(20, 400)).rechunk((400, 20), method="service")
    with dask.config.set({"dask_services.fuse-consumers": False}):
        total = c.compute(y.sum())
    assert await total == arr.sum()
    kinds = Counter(type(ts.run_spec).__name__ for ts in s.tasks.values())
    assert not kinds["ConsumingClaimSpec"] and kinds["OutputClaimSpec"] == 20, kinds
    del total
    await assert_nothing_left(s, [a, b])
