"""The service-task contract on a real (in-process) cluster, validation on."""

from __future__ import annotations

import dask
import numpy as np
import pytest
from distributed import Event, Future, futures_of, wait
from distributed.utils_test import async_poll_for
from services import ByPosition, Chatty, Recorder, Streamer, ident
from utils import assert_nothing_left, events_of, service_cluster

import dask_services
from dask_services.examples import AllReduce, SampleSort

pytestmark = pytest.mark.timeout(90)


def inc(x):
    return x + 1


@service_cluster()
async def test_allreduce_results_and_cleanup(c, s, a, b):
    futs = c.map(inc, range(20))
    outs = dask_services.submit(AllReduce, futs, outputs=5, client=c)
    assert all(isinstance(f, Future) for f in outs)
    assert await c.gather(outs) == [sum(range(1, 21))] * 5
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_input_keys_come_in_the_order_given(c, s, a, b, w):
    # they were sorted by the inputs' priorities: a service telling its inputs apart by
    # position returned its outputs permuted, on a cluster only
    xs = [dask.delayed(ident)(i) for i in range(6)]
    outs = dask_services.service_task(ByPosition, xs, outputs=6)
    assert list(dask.compute(*outs, scheduler="sync")) == list(range(6))
    futs = [c.submit(ident, i, priority=i) for i in range(6)]  # input i has priority i
    for _ in range(2):
        assert await c.gather(dask_services.submit(ByPosition, futs, outputs=6, client=c)) \
            == list(range(6))
    # task options of submit are task options, as for client.submit (they became
    # parameters of the service, silently)
    outs = dask_services.submit(ByPosition, futs, outputs=6, client=c, name="pinned",
                                workers=[w.address])
    assert await c.gather(outs) == list(range(6))
    assert {ws for f in outs for ws in (await c.who_has([f]))[f.key]} == {w.address}
    del futs, outs
    await assert_nothing_left(s, [a, b, w])


@service_cluster()
async def test_hooks_order_arguments_and_placement(c, s, a, b):
    futs = c.map(inc, range(8))
    await wait(futs)
    holders = {f.key: {ws.address for ws in s.tasks[f.key].who_has} for f in futs}
    outs = dask_services.submit(Recorder, futs, outputs=3, client=c, answer=42)
    assert await c.gather(outs) == [sum(range(1, 9))] * 3

    starts = events_of("start")
    assert len(starts) == 2  # one instance per worker
    ids = sorted(e[1] for e in starts)
    assert all(isinstance(i, dask_services.ServiceId) for i in ids)
    assert {e[3] for e in starts} == {a.address, b.address}
    for _, _sid, key, _, info in starts:
        assert info["peers"] == ids  # every peer, itself included
        assert info["input_keys"] == [f.key for f in futs]  # priority order
        assert info["output_keys"] == [o.key for o in outs]
        assert info["leader"] == starts[0][4]["leader"]
        assert info["kwargs"]["answer"] == 42
        assert key == s.tasks[outs[0].key].run_spec.service_key
    # add_key exactly once per input, on a worker that held it
    added = events_of("add_key")
    assert sorted(e[2] for e in added) == sorted(holders)
    for _, _, key, address in added:
        assert address in holders[key]
    # all_started precedes any all_inputs_done; every instance stops exactly once
    kinds = [e[0] for e in Recorder.events]
    assert max(i for i, k in enumerate(kinds) if k == "all_started") < min(
        i for i, k in enumerate(kinds) if k == "all_inputs_done"
    )
    await async_poll_for(lambda: len(events_of("stop")) == 2, timeout=5)
    assert sorted(e[1] for e in events_of("stop")) == ids
    # outputs are in memory where their owner lives
    assert all(len(s.tasks[o.key].who_has) == 1 for o in outs)
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 4)
async def test_participants_input_holders_through_the_client_api(c, s, a, b, w3, w4):
    """``participants="input-holders"`` from ``submit``: instances start only on the two
    workers holding the inputs, and the outputs are produced there; by default on all
    four.  A misspelt value fails when the graph is built."""
    futs = [c.submit(inc, i, workers=[(a, b)[i % 2].address]) for i in range(6)]
    await wait(futs)
    holders = {a.address, b.address}
    outs = dask_services.submit(Recorder, futs, outputs=4, client=c,
                                participants="input-holders")
    assert await c.gather(outs) == [sum(range(1, 7))] * 4
    assert {e[3] for e in events_of("start")} == holders
    assert {ws.address for o in outs for ws in s.tasks[o.key].who_has} <= holders
    del outs
    Recorder.reset()
    outs = dask_services.submit(Recorder, futs, outputs=4, client=c, name="everywhere")
    assert await c.gather(outs) == [sum(range(1, 7))] * 4
    assert {e[3] for e in events_of("start")} == {w.address for w in (a, b, w3, w4)}
    with pytest.raises(ValueError, match="participants='holders' is not one of"):
        dask_services.service_task(Recorder, [], outputs=1, participants="holders")
    del outs, futs
    await assert_nothing_left(s, [a, b, w3, w4])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 4)
async def test_a_run_with_fewer_participants_leaves_its_placement_group_as_it_was(
        c, s, a, b, w3, w4):
    """Service tasks of one ``placement=`` group agree on output i's worker; a run of the
    group whose participants are fewer places its outputs among them for itself only (it
    re-mapped the group: every later run put all its outputs on one worker)."""
    def where(outs) -> list[str]:
        return [next(iter(s.tasks[o.key].who_has)).address for o in outs]

    first = dask_services.submit(Recorder, c.map(inc, range(4)), outputs=4, client=c,
                                 placement="g", name="first")
    await wait(first)
    on_a = c.submit(inc, 10, workers=[a.address])
    narrow = dask_services.submit(Recorder, [on_a], outputs=4, client=c, placement="g",
                                  participants="input-holders", name="narrow")
    assert await c.gather(narrow) == [11] * 4
    assert set(where(narrow)) == {a.address}
    later = dask_services.submit(Recorder, c.map(inc, range(4, 8)), outputs=4, client=c,
                                 placement="g", name="later")
    await wait(later)
    assert where(later) == where(first) and len(set(where(first))) == 4
    del first, narrow, later, on_a
    await assert_nothing_left(s, [a, b, w3, w4])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 4)
async def test_participants_involved_leaves_out_workers_with_nothing_to_do(c, s, a, b, w3,
                                                                          w4):
    """``participants="involved"``: the input holders and the outputs' owners, outputs
    placed on the input holders first; a worker holding no input and owning no output
    starts no instance."""
    futs = [c.submit(inc, i, workers=[(a, b)[i % 2].address]) for i in range(6)]
    await wait(futs)
    holders = {a.address, b.address}
    for outputs in range(1, 5):
        Recorder.reset()
        outs = dask_services.submit(Recorder, futs, outputs=outputs, client=c,
                                    participants="involved", name=f"involved-{outputs}")
        assert await c.gather(outs) == [sum(range(1, 7))] * outputs
        started = {e[3] for e in events_of("start")}
        assert started >= holders and len(started) == max(2, outputs), (outputs, started)
        owners = {ws.address for o in outs for ws in s.tasks[o.key].who_has}
        assert len(owners) == outputs and owners <= started
        if outputs <= 2:
            assert owners <= holders
        del outs
        s.validate_state()
    del futs
    await assert_nothing_left(s, [a, b, w3, w4])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 4)
async def test_a_small_shuffle_on_a_larger_cluster_runs_where_its_data_is(c, s, a, b, w3,
                                                                          w4):
    import dask.dataframe as dd
    import pandas as pd

    pdf = pd.DataFrame({"k": np.arange(200) % 7, "v": np.arange(200.0)})
    df = c.persist(dd.from_pandas(pdf, npartitions=4), workers=[a.address, b.address])
    await wait(df)
    assert {ws.address for f in futures_of(df) for ws in s.tasks[f.key].who_has} == {
        a.address, b.address}
    started: list[str] = []
    seen = s.plugins["dask_services"]
    record = seen._event

    def recording(key, event, *args, **kwargs):
        if type(event).__name__ == "InstanceStarted":
            started.append(str(event.id))
        return record(key, event, *args, **kwargs)

    seen._event = recording
    try:
        got = await c.compute(df.shuffle("k", npartitions=2, shuffle_method="service"))
    finally:
        seen._event = record
    pd.testing.assert_frame_equal(got.sort_values("v"), pdf)
    assert len(started) == 2, started  # two instances: the holders own the two outputs
    s.validate_state()
    del df
    await assert_nothing_left(s, [a, b, w3, w4])


@service_cluster(nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)])
async def test_outputs_flow_downstream_while_service_runs(c, s, a, b):
    """Output 0 and its dependent reach memory while the service still waits for input 1."""
    ev = Event("release-second-input", client=c)

    def second(_):
        Event("release-second-input").wait()
        return 2

    x0 = dask.delayed(inc)(0, dask_key_name="x0")
    x1 = dask.delayed(second)(0, dask_key_name="x1")
    o0, o1 = dask_services.service_task(Streamer, [x0, x1], outputs=2)
    d0 = dask.delayed(inc)(o0, dask_key_name="d0")
    f_d0, f_o1 = c.compute([d0, o1])
    await wait(f_d0)
    assert await f_d0 == 11
    service_key = s.tasks[o0.key].run_spec.service_key
    assert s.tasks[service_key].state in ("waiting", "processing")  # not finished
    assert s.extensions["dask_services"].machines[service_key].live_run is not None
    assert not f_o1.done()
    s.validate_state()
    await ev.set()
    assert await f_o1 == 20
    del f_d0, f_o1
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_sample_sort(c, s, a, b):
    import random

    rng = random.Random(0)
    chunks = [[rng.randint(-50, 50) for _ in range(rng.randint(0, 30))] for _ in range(12)]
    futs = await c.scatter(chunks)
    outs = dask_services.submit(SampleSort, futs, outputs=4, client=c, samples_per_instance=8)
    parts = await c.gather(outs)
    assert [v for p in parts for v in p] == sorted(v for ch in chunks for v in ch)
    del outs, futs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_culled_outputs_are_not_produced(c, s, a, b):
    inputs = [dask.delayed(inc)(i) for i in range(6)]
    outs = dask_services.service_task(Recorder, inputs, outputs=5)
    picked = [outs[1], outs[3]]
    res = await c.gather(c.compute(picked))
    assert res == [21, 21]
    wanted = {frozenset(e[4]["wanted"]) for e in events_of("start")}
    assert wanted == {frozenset({outs[1].key, outs[3].key})}
    del res
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_partial_recomputation(c, s, a, b):
    """Seed 002: persist, drop some futures, compute everything again."""
    inputs = [dask.delayed(inc)(i) for i in range(6)]
    outs = dask_services.service_task(Recorder, inputs, outputs=4)
    futures = c.compute(outs)
    await wait(futures)
    first_runs = {e[4]["run_id"] for e in events_of("start")}
    del futures[:-2]  # keep the last two outputs only
    await async_poll_for(lambda: outs[0].key not in s.tasks, timeout=5)
    again = await c.gather(c.compute(outs))
    assert again == [21] * 4
    new_runs = [e[4] for e in events_of("start") if e[4]["run_id"] not in first_runs]
    assert new_runs and {frozenset(r["wanted"]) for r in new_runs} == {
        frozenset({outs[0].key, outs[1].key})
    }
    s.validate_state()
    del futures, again
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_two_services_at_once_and_composition(c, s, a, b):
    xs = [dask.delayed(inc)(i) for i in range(10)]
    sums = dask_services.service_task(AllReduce, xs, outputs=3)
    sorted_parts = dask_services.service_task(SampleSort, xs, outputs=2)
    # composition: the outputs of one service are the inputs of another
    maxes = dask_services.service_task(AllReduce, sums, outputs=2, op="max")
    r_sums, r_sorted, r_max = await c.gather(c.compute([sums, sorted_parts, maxes]))
    assert r_sums == [55] * 3
    assert r_sorted[0] + r_sorted[1] == list(range(1, 11))
    assert r_max == [55, 55]
    del r_sums, r_sorted, r_max
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_peer_rpc_order_loopback_and_refusals(c, s, a, b):
    outs = dask_services.service_task(Chatty, [], outputs=2)
    (res0, log0), (res1, log1) = await c.gather(c.compute(outs))
    for log in (log0, log1):
        assert [i for _, i in log] == list(range(50))
    for res in (res0, res1):
        assert res["loopback_identity"] is True
        assert res["remote_identity"] is False
        for name, outcome in res["refused"].items():
            assert outcome is not None, name
            assert outcome[0] == "RPCRefused", (name, outcome)
        assert "@dask_services.rpc" in res["refused"]["not_marked"][1]
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_restricted_service_task_uses_only_its_workers(c, s, a, b, w3):
    xs = [dask.delayed(inc)(i) for i in range(6)]
    with dask.annotate(workers=[a.address, b.address]):
        outs = dask_services.service_task(Recorder, xs, outputs=2)
    assert await c.gather(c.compute(outs)) == [21, 21]
    assert {e[3] for e in events_of("start")} == {a.address, b.address}
    await assert_nothing_left(s, [a, b, w3])


@service_cluster()
async def test_service_ids_are_never_reused(c, s, a, b):
    seen: set = set()
    for _ in range(3):
        Recorder.reset()
        xs = [dask.delayed(inc)(i) for i in range(2)]
        assert await c.gather(c.compute(dask_services.service_task(Recorder, xs, outputs=1)))
        ids = {e[1] for e in events_of("start")}
        assert not ids & seen
        seen |= ids
    await assert_nothing_left(s, [a, b])


def test_a_service_definition_names_its_participants_plainly():
    from dask_services.graph import PARTICIPANTS, ServiceDefinition

    common = dict(service_class=dask_services.Service, params={}, input_keys=(),
                  handoff_keys=(), output_keys=())
    for choice in PARTICIPANTS:
        assert ServiceDefinition(**common, participants=choice).participants == choice
    with pytest.raises(ValueError, match="participants='inputs' is not one of"):
        ServiceDefinition(**common, participants="inputs")
