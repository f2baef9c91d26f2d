"""Endpoints that let out what an ``Exception`` handler does not catch fail their own
call, on worker processes: the worker goes on, the replica answers the next call, and
nothing is re-sent (a ``KeyboardInterrupt`` let out of a task stopped the worker's event
loop, and the re-sent call the next worker's; a ``StopIteration`` cannot be set on a
future, so its call waited for ever holding the replica's only slot)."""

from __future__ import annotations

import concurrent.futures
import re
from concurrent.futures import ThreadPoolExecutor

import dask
import pytest
from distributed import Client, LocalCluster
from unruly_services import Coded, Unruly, UnrulyHooks, UnrulySyncHooks
from utils import removed_workers, validate_scheduler

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WAIT = 30  # no call may take longer: each either answers at once or hangs


@pytest.fixture(scope="module")
def unruly():
    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        svc = Unruly.options(replicas=1).as_service(client=client)
        try:
            yield client, svc
        finally:
            svc.shutdown()


def pids(client) -> dict[str, int]:
    import os

    return client.run(os.getpid)


@pytest.mark.parametrize("endpoint, args, match", [
    ("interrupted", (), r"unruly-\w+\.interrupted raised KeyboardInterrupt: async stop"),
    ("generator_exit", (), r"unruly-\w+\.generator_exit raised GeneratorExit$"),
    ("next_of_empty", (), r"next_of_empty raised StopIteration \(a next\(\) on an exhausted "
                          r"iterator\? give next\(\) a default\)"),
    ("batch_next_of_empty", (1,), r"raised StopIteration \(a next\(\) on an exhausted"),
    # Python's own "coroutine raised StopIteration" named neither the endpoint nor the cause
    ("async_next_of_empty", (), r"unruly-\w+\.async_next_of_empty raised StopIteration \(a "
                                r"next\(\) on an exhausted iterator\? give next\(\) a default\)"),
    ("async_batch_next_of_empty", (1,), r"batched endpoint unruly-\w+\.async_batch_next_of_empty "
                                        r"raised StopIteration \(a next\(\) on an exhausted"),
])
def test_an_endpoint_raising_it_fails_its_call_and_the_replica_goes_on(
        unruly, endpoint, args, match):
    client, svc = unruly
    before = pids(client)
    with pytest.raises(RuntimeError, match=match):
        getattr(svc, endpoint).route(*args).result(timeout=WAIT)
    # the replica's only slot was given back, on the same worker process
    assert svc.echo.route(7).result(timeout=WAIT) == 7
    assert pids(client) == before
    assert [r["state"] for r in svc.replicas()] == ["healthy"]
    validate_scheduler(client)


def test_exceptions_given_as_results_of_a_batch_fail_their_own_callers(unruly):
    client, svc = unruly
    before = pids(client)
    requests = ["kb", 3, "stop", "exit", 5, "genexit"]
    with ThreadPoolExecutor(len(requests)) as pool:  # callers at once: batches of 4 and 2
        calls = [svc.slots.route(r) for r in requests]
        outcomes = list(pool.map(lambda call: _outcome(call), calls))
    assert outcomes[1] == 6 and outcomes[4] == 10
    for i, name in [(0, "KeyboardInterrupt"), (2, "StopIteration"), (3, "SystemExit"),
                    (5, "GeneratorExit")]:
        assert isinstance(outcomes[i], RuntimeError), outcomes[i]
        assert re.search(r"batched endpoint unruly-\w+\.slots", str(outcomes[i]))
        assert f"returned {name}" in str(outcomes[i])
    assert pids(client) == before
    assert svc.echo.route(1).result(timeout=WAIT) == 1


@pytest.mark.parametrize("endpoint", ["interrupted_stream", "interrupted_stream_sync"])
def test_a_generator_raising_keyboard_interrupt_ends_its_stream_with_the_error(
        unruly, endpoint):
    client, svc = unruly
    before = pids(client)
    items = []
    with pytest.raises(RuntimeError, match=rf"streaming endpoint unruly-\w+\.{endpoint} raised "
                                           r"KeyboardInterrupt\('(async )?generator stop'\)"):
        for item in getattr(svc, endpoint).stream():
            items.append(item)
    assert items == [0]
    assert pids(client) == before
    assert svc.echo.route(2).result(timeout=WAIT) == 2


@pytest.mark.parametrize("endpoint", ["stopped_stream", "stopped_stream_sync"])
def test_a_generator_raising_stop_iteration_names_itself(unruly, endpoint):
    # (Python's own "(async) generator raised StopIteration" named neither)
    client, svc = unruly
    items = []
    with pytest.raises(RuntimeError, match=rf"streaming endpoint unruly-\w+\.{endpoint} raised "
                                           r"StopIteration \(a next\(\) on an exhausted"):
        for item in getattr(svc, endpoint).stream():
            items.append(item)
    assert items == [0]
    assert svc.echo.route(2).result(timeout=WAIT) == 2


def test_a_call_cancelled_by_a_sync_caller(unruly):
    """``Call.cancel()``, the sync caller's ``task.cancel()``: the caller stops waiting;
    what the replica had taken runs to its end there."""
    client, svc = unruly
    call = svc.sleeps.route(0.5)
    assert call.cancel() is True
    assert call.done()
    with pytest.raises(concurrent.futures.CancelledError):
        call.result(timeout=WAIT)
    done = svc.sleeps.route(0)
    assert done.result(timeout=WAIT) == 0
    assert done.cancel() is False  # finished: nothing to cancel
    assert svc.echo.route(3).result(timeout=WAIT) == 3


def _outcome(call):
    try:
        return call.result(timeout=WAIT)
    except Exception as e:  # noqa: BLE001 - the outcome is what the test looks at
        return e


def test_an_endpoint_exception_whose_init_takes_other_arguments_keeps_its_type(unruly):
    """It came to the caller as a ``RuntimeError``: pickle remakes an exception as
    ``cls(*args)``, which its ``__init__`` refuses."""
    client, svc = unruly
    with pytest.raises(Coded, match="5: from a replica") as info:
        svc.coded.route(5).result(timeout=WAIT)
    assert info.value.code == 5
    assert [r["state"] for r in svc.replicas()] == ["healthy"]


LET_OUT = [
    ("kb", r"raised KeyboardInterrupt\('in a hook'\), which is not an Exception"),
    ("exit", r"raised SystemExit\(3\), which is not an Exception"),
    ("genexit", r"raised GeneratorExit\(\), which is not an Exception"),
    ("stop", r"raised StopIteration \(a next\(\) on an exhausted iterator\?"),
]
HOOKS = [UnrulyHooks, UnrulySyncHooks]


@pytest.mark.parametrize("cls", HOOKS, ids=["async", "sync"])
@pytest.mark.parametrize("what, match", LET_OUT, ids=[w for w, _ in LET_OUT])
def test_a_setup_letting_it_out_fails_the_deployment_and_the_worker_goes_on(
        unruly, cls, what, match):
    """``setup()``, ``check_health()`` and ``stop()`` of a replica letting out a
    ``KeyboardInterrupt``, ``SystemExit`` or ``GeneratorExit`` stopped its worker's event
    loop (every worker a relaunch reached, in the end none running); a ``StopIteration``
    out of a plain-``def`` one could never be its outcome."""
    client, _ = unruly
    before = pids(client)
    with pytest.raises(RuntimeError, match=r"setup\(\) of replica \S+ " + match):
        cls.options(replicas=1).as_service("setup", what, client=client)
    assert pids(client) == before
    validate_scheduler(client)


@pytest.mark.parametrize("cls", HOOKS, ids=["async", "sync"])
@pytest.mark.parametrize("what", ["kb", "stop"])
def test_a_probe_letting_it_out_relaunches_the_replica_and_the_worker_goes_on(
        unruly, tmp_path, cls, what):
    from distributed.utils_test import poll_for

    client, _ = unruly
    before = pids(client)
    flag = tmp_path / "failing"
    svc = cls.options(replicas=1).as_service("check_health", what, str(flag), client=client)
    try:
        first = svc.replicas()[0]["id"]
        flag.touch()  # the next probe fails, and the replica is relaunched
        poll_for(lambda: [r["id"] for r in svc.replicas()] not in ([first], []), timeout=30)
        flag.unlink()
        assert svc.ok.route().result(timeout=WAIT) == 1
        assert pids(client) == before
    finally:
        svc.shutdown()
    validate_scheduler(client)


@pytest.mark.parametrize("cls", HOOKS, ids=["async", "sync"])
@pytest.mark.parametrize("what", [w for w, _ in LET_OUT])
def test_a_stop_letting_it_out_is_logged_and_the_worker_goes_on(unruly, cls, what):
    client, _ = unruly
    before = pids(client)
    svc = cls.options(replicas=1).as_service("stop", what, client=client)
    assert svc.ok.route().result(timeout=WAIT) == 1
    svc.shutdown()
    assert pids(client) == before
    assert client.run(lambda dask_worker: dask_worker.status.name) == dict.fromkeys(
        before, "running")
    validate_scheduler(client)


def test_a_setup_that_kills_its_worker_fails_past_allowed_failures(tmp_path):
    """A ``setup()`` that ends its worker's process (a model too large for it, a crash in
    native code) was relaunched on every next worker until the deployment timed out (17
    workers killed in 300 s on two). A worker that dies while it starts the replica now
    counts as a task's worker does: past ``distributed.scheduler.allowed-failures`` the
    replica is unhealthy and the deployment fails saying ``setup()`` may be what kills
    them; nothing stays on the workers."""
    from distributed.utils_test import poll_for

    from dask_services.replicated import DeploymentError

    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
              "distributed.scheduler.allowed-failures": 2}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
        local_directory=str(tmp_path),
    ) as cluster, Client(cluster) as client:
        with pytest.raises(DeploymentError) as info:
            UnrulyHooks.options(replicas=1).as_service("setup", "die", client=client)
        message = str(info.value)
        assert "a worker died while it started the replica 3 times in a row" in message
        assert "allowed-failures=2" in message and "setup() itself" in message
        client.wait_for_workers(2, timeout=60)
        # one death counted once: a relaunch placed on the dying worker before its
        # removal counted a second loss for it
        assert len(removed_workers(client)) == 3
        poll_for(lambda: not any(client.run(lambda dask_worker: len(
            dask_worker.extensions["dask_services_replicated"].replicas)).values()),
            timeout=20)
        validate_scheduler(client)


def test_a_check_health_that_kills_its_worker_ends_unhealthy_past_allowed_failures(tmp_path):
    """A ``check_health()`` that ends its worker's process was relaunched on every next
    worker, one killed per health period, for as long as the service was deployed (a
    healthy replica's lost worker did not count). A worker that dies while the scheduler's
    probe of the replica runs now counts as one dying while it starts the replica: past
    ``distributed.scheduler.allowed-failures`` in a row the replica is unhealthy, saying
    ``check_health()`` may be what kills them, and calls fail naming it; nothing stays on
    the workers."""
    from distributed.utils_test import poll_for

    from dask_services.replicated import ServiceUnavailable

    flag = tmp_path / "failing"
    flag.touch()  # from the first probe on
    config = {"distributed.scheduler.validate": True, "distributed.worker.validate": True,
              "distributed.scheduler.allowed-failures": 1,
              "dask_services.replicated.health-check-period": "200ms"}
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
        local_directory=str(tmp_path),
    ) as cluster, Client(cluster) as client:
        svc = UnrulyHooks.options(replicas=1).as_service("check_health", "die", str(flag),
                                                         client=client)
        try:
            poll_for(lambda: [r["state"] for r in svc.replicas()] == ["unhealthy"],
                     timeout=60)
            (replica,) = svc.replicas()
            assert "a worker died while the health probe of the replica ran 2 times in a " \
                   "row" in replica["last_error"]
            assert "allowed-failures=1" in replica["last_error"]
            assert "check_health() itself" in replica["last_error"]
            with pytest.raises(ServiceUnavailable, match=r"check_health\(\) itself"):
                svc.ok.route().result(timeout=WAIT)
            client.wait_for_workers(2, timeout=60)
            assert len(removed_workers(client)) == 2
            # an unhealthy replica is neither probed nor launched again: nothing after
            (decided,) = [i for i, e in enumerate(svc.story())
                          if e["what"] == "healthy -> unhealthy"]
            assert not [e for e in svc.story()[decided:] if e["what"] in ("Launch", "StartOn")]
        finally:
            svc.shutdown()
        poll_for(lambda: not any(client.run(lambda dask_worker: len(
            dask_worker.extensions["dask_services_replicated"].replicas)).values()),
            timeout=20)
        validate_scheduler(client)
