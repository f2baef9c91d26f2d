"""Replicated services when worker processes are killed (LocalCluster with nannies)."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import poll_for
from replicated_batch_stream_services import Streamer
from replicated_services import Adder, Tally
from utils import kill, pid_of, validate_scheduler

from dask_services.replicated import ServiceShutdown, ServiceUnavailable

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
              "dask_services.replicated.health-check-period": "200ms"}
    with dask.config.set(config), LocalCluster(
        n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        yield cluster, client


def hosted(client) -> dict[str, int]:
    """Replicas held by each worker's extension."""
    return client.run(lambda dask_worker: len(
        dask_worker.extensions["dask_services_replicated"].replicas))


def all_healthy(svc, n: int, avoid: str = "") -> bool:
    rows = svc.replicas()
    return (len(rows) == n and all(r["state"] == "healthy" for r in rows)
            and avoid not in {r["worker"] for r in rows})


def test_worker_killed_while_calls_are_in_flight(cluster):
    cluster, client = cluster
    svc = Adder.options(replicas=2, max_concurrency=4).as_service(1000, client=client)
    victim = svc.replicas()[0]
    calls = [svc.slow_add.route(i, 0.2) for i in range(40)]
    poll_for(lambda: any(r["id"] == victim["id"] and r["in_flight"] > 0
                         for r in svc.replicas()), timeout=30)
    kill(client, victim["worker"])
    answered, refused = 0, []
    for i, call in enumerate(calls):
        try:
            _, value = call.result(timeout=60)  # none hangs
        except ServiceUnavailable as e:
            refused.append(str(e))
        else:
            assert value == i + 1000
            answered += 1
    print(f"answered {answered}, refused {len(refused)}")
    assert answered == 40, refused  # the lost calls were re-sent to the other replica
    poll_for(lambda: all_healthy(svc, 2, avoid=victim["worker"]), timeout=60)
    assert svc.add.route(1).result(timeout=30) == 1001
    validate_scheduler(client)
    svc.shutdown()
    poll_for(lambda: not any(hosted(client).values()), timeout=10)
    assert not client.run_on_scheduler(lambda dask_scheduler: list(
        dask_scheduler.extensions["dask_services_replicated"].deployments))


def test_a_fanout_whose_replica_is_killed_says_which_was_lost(cluster):
    """Each call of a fanout is bound to its replica: one whose worker dies is not re-sent
    to another replica (which has had its own call), the fanout raises naming the lost
    replica, and a fanout asked again reaches the replacement."""
    cluster, client = cluster
    client.wait_for_workers(3, timeout=60)
    svc = Adder.options(replicas=2).as_service(1000, client=client)
    victim = svc.replicas()[0]
    call = svc.slow_add.fanout(1, 20)
    poll_for(lambda: all(r["in_flight"] == 1 for r in svc.replicas()), timeout=30)
    kill(client, victim["worker"])
    with pytest.raises(ServiceUnavailable,
                       match=f"replica {victim['id']} of {svc.name} was lost during "
                             "the call"):
        call.result(timeout=60)
    poll_for(lambda: all_healthy(svc, 2, avoid=victim["worker"]), timeout=60)
    answers = svc.slow_add.fanout(1, 0).result(timeout=30)
    assert sorted(value for _, value in answers) == [1001, 1001]
    assert victim["id"] not in {rid for rid, _ in answers}
    validate_scheduler(client)
    svc.shutdown(timeout=0)
    poll_for(lambda: not any(hosted(client).values()), timeout=30)


def test_a_call_that_kills_its_workers_is_not_resent_for_ever(cluster):
    """Calls are re-sent when their replica's worker dies; one that kills every worker it
    runs on is given up after distributed.scheduler.allowed-failures of them, as a task
    is (KilledWorker), instead of killing call-retries + 1 workers."""
    cluster, client = cluster
    svc = Adder.options(replicas=2).as_service(client=client)
    pids = set(client.run(os.getpid).values())
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        with pytest.raises(ServiceUnavailable, match="allowed-failures=1 allows: the call "
                                                     "itself may be what kills or freezes "
                                                     "them"):
            svc.die.route().result(timeout=90)
    poll_for(lambda: len(client.scheduler_info()["workers"]) == 3, timeout=60)
    assert len(pids - set(client.run(os.getpid).values())) == 2  # two workers, not more
    poll_for(lambda: all_healthy(svc, 2), timeout=60)
    assert svc.add.route(1).result(timeout=30) == 1
    svc.shutdown()
    validate_scheduler(client)


def test_session_moves_when_its_replica_worker_is_killed(cluster):
    cluster, client = cluster
    client.wait_for_workers(3, timeout=60)
    svc = Adder.options(replicas=3).as_service(client=client)
    with svc.session() as session:
        first = {svc.whoami.route().result(timeout=30) for _ in range(5)}
        assert first == {session.replica}
        (row,) = [r for r in svc.replicas() if r["id"] == session.replica]
        kill(client, row["worker"])
        moved = [svc.whoami.route().result(timeout=60) for _ in range(5)]
        assert len(set(moved)) == 1 and moved[0] != row["id"] == next(iter(first))
        assert session.replica == moved[0]
    poll_for(lambda: all_healthy(svc, 3, avoid=row["worker"]), timeout=60)
    svc.shutdown()
    poll_for(lambda: not any(hosted(client).values()), timeout=10)


def test_a_scattered_setup_argument_reaches_setup_as_its_value(cluster):
    # (a synchronous client computes lazy setup arguments before deploying; an
    # asynchronous one while it deploys: test_replicated_naive.py)
    cluster, client = cluster
    [offset] = client.scatter([1000], broadcast=True)
    svc = Adder.options(replicas=2).as_service(offset, client=client)
    assert svc.add.fanout(1).result(timeout=60) == [1001, 1001]
    svc.shutdown()
    poll_for(lambda: not any(hosted(client).values()), timeout=10)


def test_readme_example_runs(cluster):
    import re
    from pathlib import Path

    cluster, client = cluster
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                if "class Model" in b]
    ns: dict = {"__name__": "readme_replicated", "client": client}
    exec(compile(block, "README-replicated", "exec"), ns)
    svc = ns["svc"]
    assert ns["a"] == ns["b"]
    assert ns["y"] == [2, 4] and ns["total"] == 6 and len(ns["everyone"]) == 3
    with pytest.raises(ServiceShutdown, match="shut down"):
        svc.predict.route([1]).result()
    poll_for(lambda: not any(hosted(client).values()), timeout=10)


def test_calls_in_flight_on_a_frozen_worker_are_resent():
    """A replica's worker freezes (a native call holding the GIL; here SIGSTOP) with calls
    in flight: its connections stay open, but its health probe fails and the replica is
    relaunched elsewhere; the callers see it replaced and re-send the calls there instead
    of waiting for the frozen worker.  Once it wakes, nothing of the old replica stays."""
    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
              "dask_services.replicated.health-check-period": "200ms",
              "dask_services.replicated.health-check-timeout": "1s"}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        svc = Adder.options(replicas=2, max_concurrency=4).as_service(1000, client=client)
        victim = svc.replicas()[0]
        pid = pid_of(client, victim["worker"])
        calls = [svc.slow_add.route(i, 0.5) for i in range(8)]
        poll_for(lambda: any(r["id"] == victim["id"] and r["in_flight"] > 0
                             for r in svc.replicas()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        try:
            results = [call.result(timeout=30) for call in calls]  # not the frozen worker's
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [value for _, value in results] == [i + 1000 for i in range(8)]
        poll_for(lambda: all_healthy(svc, 2), timeout=60)
        assert victim["id"] not in {r["id"] for r in svc.replicas()}
        validate_scheduler(client)
        svc.shutdown()
        poll_for(lambda: not any(hosted(client).values()), timeout=30)


def test_streams_on_a_frozen_worker_are_resent_or_fail_clearly():
    """The replica's worker freezes: a stream not started there yet (no first item) is
    re-sent to the replica that replaces it; one past its first item fails with
    ``ServiceUnavailable`` saying the replica was replaced (items are not replayed),
    instead of both waiting for the frozen worker."""
    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
              "dask_services.replicated.health-check-period": "200ms",
              "dask_services.replicated.health-check-timeout": "1s"}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client, ThreadPoolExecutor(2) as pool:
        svc = Streamer.options(replicas=1).as_service(client=client)
        victim = svc.replicas()[0]
        pid = pid_of(client, victim["worker"])
        started = iter(svc.forever.stream("frozen"))
        assert next(started) == 0
        os.kill(pid, signal.SIGSTOP)
        try:
            fresh = pool.submit(lambda: list(svc.count.stream(5)))
            rest = pool.submit(lambda: list(started))
            assert fresh.result(timeout=30) == [0, 1, 2, 3, 4]
            with pytest.raises(ServiceUnavailable, match="was replaced by"):
                rest.result(timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        poll_for(lambda: all_healthy(svc, 1), timeout=60)
        assert victim["id"] not in {r["id"] for r in svc.replicas()}
        validate_scheduler(client)
        svc.shutdown()
        poll_for(lambda: not any(hosted(client).values()), timeout=30)


@pytest.mark.parametrize("endpoint", ["sync_work", "async_work", "batch_work",
                                      "stream:stream_work"])
def test_the_queued_calls_of_a_caller_killed_are_not_run_for_nobody(cluster, tmp_path,
                                                                    endpoint):
    """A client process killed with calls queued on a replica: they all ran, one after
    the other, for no one (100 calls of 0.2 s kept a replica busy 18.6 s). When the
    scheduler sees the client leave, the replicas give back its queued calls (a caller
    still there would send them again); the one running finishes."""
    import pickle
    import subprocess
    import sys

    _, client = cluster
    svc = Tally.options(replicas=1).as_service(client=client)
    try:
        handle_file = tmp_path / "svc.pkl"
        handle_file.write_bytes(pickle.dumps(svc))
        tests = os.path.dirname(__file__)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
        calls = 40 if endpoint != "stream:stream_work" else 12  # a thread per stream
        caller = subprocess.Popen(
            [sys.executable, os.path.join(tests, "caller_process.py"),
             client.scheduler.address, str(handle_file), endpoint, str(calls), "0.5"],
            stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert caller.stdout.readline().strip() == "sent"
            poll_for(lambda: svc.replicas()[0]["queued"] >= calls - 5, timeout=60)
        finally:
            caller.kill()
            caller.wait()
        poll_for(lambda: (svc.replicas()[0]["queued"], svc.replicas()[0]["in_flight"])
                 == (0, 0), timeout=10)
        ran = svc.ran_so_far.route().result(timeout=30)
        assert ran < calls // 2, f"{ran} of {calls} calls ran for a caller that was gone"
        assert svc.async_work.route(0).result(timeout=30) == ran + 1
    finally:
        svc.shutdown()
    validate_scheduler(client)


@pytest.mark.parametrize("endpoint", ["sync_work", "batch_work", "stream:stream_work"])
def test_a_caller_taken_for_gone_while_still_there_gets_every_call_answered(cluster,
                                                                            endpoint):
    """The scheduler may see a client leave that is still there (its connection to the
    scheduler broke and came back): its calls given back are sent again, and every one
    is answered, none lost and none failed."""
    from concurrent.futures import ThreadPoolExecutor

    _, client = cluster
    svc = Tally.options(replicas=1).as_service(client=client)
    try:
        calls = 12
        if endpoint.startswith("stream:"):
            def one_stream(_):
                return list(svc.stream_work.stream(0.2))

            with ThreadPoolExecutor(calls) as pool:
                pending = [pool.submit(one_stream, i) for i in range(calls)]
                poll_for(lambda: svc.replicas()[0]["queued"] >= calls - 3, timeout=60)
                given_back = _tell_the_replicas_the_client_left(client)
                answers = [p.result(timeout=60) for p in pending]
            assert all(len(a) == 1 for a in answers)
        else:
            pending = [getattr(svc, endpoint).route(0.2) for _ in range(calls)]
            poll_for(lambda: svc.replicas()[0]["queued"] >= calls - 3, timeout=60)
            given_back = _tell_the_replicas_the_client_left(client)
            answers = [p.result(timeout=60) for p in pending]
            assert all(isinstance(a, int) for a in answers)
        assert given_back >= calls - 4  # they were given back, and sent again
        assert svc.ran_so_far.route().result(timeout=30) == calls
        # sent again as they were: not counted as calls a rebalancing pass moved
        moved_in = client.run(lambda dask_worker: [
            rep.moved_in for rep in
            dask_worker.extensions["dask_services_replicated"].replicas.values()])
        assert sum(sum(m) for m in moved_in.values()) == 0
    finally:
        svc.shutdown()
    validate_scheduler(client)


def _tell_the_replicas_the_client_left(client) -> int:
    """What the scheduler's replicated plugin tells the replicas' workers when a client
    leaves, for a client that is still there (and another that left in the same turn of
    the loop: one message per worker for both): how many calls they gave back."""
    from dask_services.replicated._worker import EXTENSION

    client_id = client.id

    async def tell(dask_scheduler):
        plugin = dask_scheduler.extensions[EXTENSION]
        plugin.remove_client(dask_scheduler, client_id)
        plugin.remove_client(dask_scheduler, "client-that-never-called")
        await asyncio.sleep(0)  # the messages go at the loop's next turn
        told = list(plugin._callers_told)
        assert len(told) == 1, told  # the one replica's worker, once for both callers
        return sum(await asyncio.gather(*told))

    return client.run_on_scheduler(tell)
