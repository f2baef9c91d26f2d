"""``dask_services.story()``: what happened to a service task and its runs, in order."""

from __future__ import annotations

import asyncio

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import async_poll_for, captured_logger, gen_cluster, poll_for
from services import AllReduce, SlowSum
from utils import DASHBOARD, kill, pull_tables, service_cluster

import dask_services


def inc(x):
    return x + 1


def service_key_of(out) -> str:
    return out.__dask_graph__()[out.key].service_key


@service_cluster()
async def test_story_of_a_service_task_and_of_a_run_with_an_async_client(c, s, a, b):
    (out,) = dask_services.service_task(AllReduce, [dask.delayed(inc)(i) for i in range(3)],
                                        outputs=1)
    key = service_key_of(out)
    (fut,) = c.compute([out])
    assert await fut == 6
    # an output (a future) of the service task tells its story too
    by_output = await dask_services.story(c, fut)
    assert any(e["what"] == "Log" and "'finished'" in e["detail"] for e in by_output)
    del fut
    plugin = s.extensions["dask_services"]
    await async_poll_for(lambda: key not in plugin.machines, timeout=10)
    # forgotten service tasks keep their story
    entries = await dask_services.story(c, key)
    assert entries[:len(by_output)] == by_output
    assert entries == sorted(entries, key=lambda e: e["time"])
    sent = [(e["what"], e["detail"]) for e in entries if e["kind"] == "sent"]
    assert [w for w, _ in sent][:2] == ["PrepareRun", "StartInstances"]
    logs = [d for w, d in sent if w == "Log"]
    assert "'started'" in logs[0] and "'finished'" in logs[-1], logs
    assert entries[-1]["what"] == "ServiceTaskForgotten"
    # before its run exists, entries belong to no run; then all to run 1
    run_ids = [e["run_id"] for e in entries]
    run_id = next(r for r in run_ids if r is not None)
    assert set(run_ids) <= {None, run_id}
    assert all(e["stimulus_id"] for e in entries)
    assert await dask_services.story(c, run_id) == [e for e in entries
                                                    if e["run_id"] == run_id]
    # the run id as ``status()``'s table gives it (a numpy integer) is a run id too
    assert await dask_services.story(c, np.int64(run_id)) == [e for e in entries
                                                              if e["run_id"] == run_id]
    assert await dask_services.story(c, "no-such-key") == []


@service_cluster()
async def test_a_service_task_computed_again_keeps_the_stories_of_its_earlier_runs(c, s, a,
                                                                                   b):
    """The same graph computed twice, one after the other: one service task key, two
    forgotten machines; the second keeps telling the first run's story."""
    (out,) = dask_services.service_task(AllReduce, [dask.delayed(inc)(i) for i in range(3)],
                                        outputs=1)
    key = service_key_of(out)
    plugin = s.extensions["dask_services"]
    for _ in range(2):
        (fut,) = c.compute([out])
        assert await fut == 6
        del fut
        await async_poll_for(lambda: key not in plugin.machines, timeout=10)
    entries = await dask_services.story(c, key)
    run_ids = sorted({e["run_id"] for e in entries if e["run_id"] is not None})
    assert len(run_ids) == 2, run_ids
    for run_id in run_ids:
        logs = [e["detail"] for e in await dask_services.story(c, run_id)
                if e["what"] == "Log"]
        assert "'started'" in logs[0] and "'finished'" in logs[-1], logs


@service_cluster(config={"dask_services.story.runs": 3})
async def test_forgotten_service_tasks_keep_at_most_story_runs_runs_in_all(c, s, a, b):
    """A notebook computing the same cells again: the stories the scheduler keeps of
    forgotten service tasks are bounded in runs, not in tasks (100 tasks of 100 runs each
    were kept before)."""
    plugin = s.extensions["dask_services"]
    outs = [dask_services.service_task(AllReduce, [dask.delayed(inc)(i) for i in range(n)],
                                       outputs=1)[0] for n in (2, 3)]
    runs = []
    for out in (outs[0], outs[0], outs[1]):
        key = service_key_of(out)
        (fut,) = c.compute([out])
        await fut
        del fut
        await async_poll_for(lambda k=key: k not in plugin.machines, timeout=10)
        entries = await dask_services.story(c, key)
        runs.append(max(e["run_id"] for e in entries if e["run_id"] is not None))
    kept = {k: list(book) for k, book in plugin.archive.items()}
    assert sum(map(len, kept.values())) <= 3, kept
    # the oldest task's oldest runs went first; the latest run of each is still told
    for run_id in runs[1:]:
        assert await dask_services.story(c, run_id)
    assert await dask_services.story(c, runs[0]) == []


def test_keep_archive_within_drops_the_oldest_runs_first():
    from collections import OrderedDict

    from dask_services._run_log import keep_archive_within

    archive = OrderedDict((k, OrderedDict((r, f"{k}{r}") for r in runs))
                          for k, runs in [("b", []), ("a", [None, 1, 2]), ("c", [3, 4])])
    keep_archive_within(archive, 3)
    assert archive == OrderedDict([("a", OrderedDict([(2, "a2")])),
                                   ("c", OrderedDict([(3, "c3"), (4, "c4")]))])
    keep_archive_within(archive, 0)
    assert archive == OrderedDict()


def lost_worker(reason: str, worker: str) -> bool:
    """A restart reason that says a worker was lost (the run's own worker, or the worker
    that held an input the service task had received)."""
    return "lost with its worker" in reason or ("left the cluster" in reason
                                                and worker in reason)


def inputs_done(client) -> dict | None:
    """Run id and participants of the live run in phase inputs-done, if any."""

    def find(dask_scheduler) -> dict | None:
        for m in dask_scheduler.extensions["dask_services"].machines.values():
            run = m.live_run
            if run is not None and run.phase.value == "inputs-done":
                return {"run_id": run.run_id, "participants": list(run.participants)}
        return None

    return client.run_on_scheduler(find)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_story_tells_a_restart_after_a_worker_was_killed():
    validation = {"distributed.scheduler.validate": True, "distributed.worker.validate": True}
    with dask.config.set(validation), LocalCluster(
        n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        dask_services.install(client)
        outs = dask_services.service_task(SlowSum, [dask.delayed(inc)(i) for i in range(12)],
                                          outputs=4, delay=3.0)
        key = service_key_of(outs[0])
        futures = client.compute(outs)
        poll_for(lambda: inputs_done(client), timeout=60)
        first = inputs_done(client)
        victim = first["participants"][-1]
        kill(client, victim)
        assert client.gather(futures) == [sum(range(1, 13))] * 4

        story = dask_services.story(client, key)
        print("\n".join(f"{e['run_id']} {e['kind']:8} {e['what']:22} {e['detail'][:90]}"
                        for e in story))

        def index(kind: str, what: str, run_id: int | None = None, has: str = "",
                  after: int = -1) -> int:
            for i, e in enumerate(story):
                if i > after and e["kind"] == kind and e["what"] == what \
                        and (run_id is None or e["run_id"] == run_id) and has in e["detail"]:
                    return i
            raise AssertionError(f"no {kind} {what} {has!r} of run {run_id} after {after}")

        run1 = first["run_id"]
        started1 = index("sent", "Log", run1, "action='started'")
        lost = index("received", "WorkerLost", has=repr(victim))
        restarted = index("sent", "Log", run1, "action='restarted'")
        reason = story[restarted]["detail"]
        assert lost_worker(reason, victim), reason
        # the loss is what restarted the run: the same stimulus (the worker's removal)
        assert story[restarted]["stimulus_id"] == story[lost]["stimulus_id"]
        assert started1 < min(lost, restarted)
        started2 = index("sent", "Log", has="action='started'", after=max(lost, restarted))
        run2 = story[started2]["run_id"]
        assert run2 > run1
        finished2 = index("sent", "Log", run2, "action='finished'", after=started2)
        assert [e["time"] for e in story] == sorted(e["time"] for e in story)
        # the second run's own story: from its start to its finish
        own = dask_services.story(client, run2)
        assert {e["run_id"] for e in own} == {run2}
        assert own[0]["what"] == "RunNeeded" and story[finished2] in own
        del futures


@service_cluster()
async def test_story_of_a_replica_across_its_incarnations(c, s, a, b):
    from replicated_services import Adder

    svc = await Adder.options(replicas=1).as_service(1, client=c)
    (row,) = await svc.replicas()
    story = await svc.story(row["id"])
    steps = [(e["kind"], e["what"]) for e in story]
    assert steps == [("decided", "new replica"), ("sent", "Launch"),
                     ("received", "Placed"), ("decided", f"placed on {row['worker']}"),
                     ("sent", "StartOn"), ("received", "SetupSucceeded"),
                     ("decided", "uninitialized -> healthy"), ("sent", "StateChanged")], steps
    assert all(e["stimulus_id"] for e in story)
    # the replica's worker leaves: a new incarnation, and the story goes on
    leaving = a if row["worker"] == a.address else b
    await s.remove_worker(leaving.address, stimulus_id="test-remove-worker")
    await svc._refresh()

    async def moved() -> bool:
        rows = await svc.replicas()
        return rows[0]["state"] == "healthy" and rows[0]["id"] != row["id"]

    while not await moved():
        await asyncio.sleep(0.01)
    later = await svc.story(row["id"])  # any incarnation's id names the slot
    assert later[:len(story)] == story
    lost = next(e for e in later if e["what"] == "WorkerLost")
    assert lost["stimulus_id"] == "test-remove-worker" and lost["replica"] == row["id"]
    assert ("decided", "healthy -> recovering") in [(e["kind"], e["what"]) for e in later]
    assert later[-1]["what"] == "StateChanged" and "HEALTHY" in later[-1]["detail"]
    assert await svc.story() == later  # every replica: the only one
    await svc.shutdown()


@service_cluster(**DASHBOARD)
async def test_the_dashboard_shows_the_story_of_a_selected_run(c, s, a, b):
    pytest.importorskip("bokeh")
    (out,) = dask_services.service_task(AllReduce, [dask.delayed(inc)(i) for i in range(2)],
                                        outputs=1)
    (fut,) = c.compute([out])
    assert await fut == 3
    url = f"http://127.0.0.1:{s.http_server.port}/services"
    tables = await asyncio.to_thread(pull_tables, url)
    story = tables["dask-services-story"]  # the newest run is selected
    assert "StartInstances" in story["what"] and "RunNeeded" in story["what"]
    assert story["kind"][story["what"].index("RunNeeded")] == "received"


@gen_cluster(client=True)
async def test_an_async_client_reads_status_and_story_of_a_cluster_not_installed_yet(
        c, s, a, b):
    # the synchronous calls install first; awaited ones raised TypeError on the
    # scheduler's None (no handler yet) and the scheduler logged a missing handler
    assert "dask_services" not in s.extensions
    with captured_logger("distributed.core") as log:
        frame = await dask_services.status(c)
        assert len(frame) == 0 and "service" in frame.columns
        assert await dask_services.story(c, 1) == []
        assert await dask_services.story(c, "no-such-key") == []
    assert "No handler" not in log.getvalue()
    assert "dask_services" in s.extensions
