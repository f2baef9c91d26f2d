"""The scheduler's calls to the replicated worker plugin (``replicated/_replica_rpc.py``),
without a cluster: a fake connection pool answers, fails or stays silent as a worker would,
and each call must turn that into its own answer, never an exception."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dask_services.replicated import _replica_rpc as rpc_calls
from dask_services.replicated._gang import rank_id

pytestmark = pytest.mark.timeout(30)


class FakeWorkers:
    """``scheduler.rpc``: ``pool(worker).handler(**kwargs)`` runs ``answers[handler]``
    with the worker and the arguments, recording each call."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[tuple[str, str, dict]] = []

    def __call__(self, worker):
        pool = self

        class Remote:
            def __getattr__(self, handler):
                async def call(**kwargs):
                    pool.calls.append((worker, handler, kwargs))
                    return await pool.answers[handler](worker, **kwargs)
                return call

        return Remote()


def deployment():
    return SimpleNamespace(name="svc", blob=b"blob", max_concurrency=2, max_queued=5,
                           uid="u1")


async def _raise(exc):
    raise exc


async def _never(*_, **__):
    await asyncio.Event().wait()


def test_a_rank_started_gets_the_workers_answer_with_its_gang():
    async def started(worker, **kwargs):
        return {"status": "ok", "worker": worker}

    pool = FakeWorkers(replicated_start=started)
    ranks = [("svc.0/0", "tcp://a"), ("svc.0/1", "tcp://b")]
    resp = asyncio.run(rpc_calls.start_rank(pool, deployment(), 1, ranks, lambda w: True))
    assert resp == {"status": "ok", "worker": "tcp://b"}
    [(worker, handler, kwargs)] = pool.calls
    assert (worker, handler) == ("tcp://b", "replicated_start")
    assert kwargs["id"] == "svc.0/1" and kwargs["rank"] == 1 and kwargs["ranks"] == ranks
    assert kwargs["uid"] == "u1" and kwargs["blob"] == b"blob"


def test_a_single_rank_is_started_without_gang_arguments():
    async def started(worker, **kwargs):
        return {"status": "ok"}

    pool = FakeWorkers(replicated_start=started)
    asyncio.run(rpc_calls.start_rank(pool, deployment(), 0, [("svc.0", "tcp://a")],
                                     lambda w: True))
    [(_, _, kwargs)] = pool.calls
    assert "rank" not in kwargs and "ranks" not in kwargs


def test_a_start_whose_connection_breaks_is_lost_with_the_reason():
    pool = FakeWorkers(replicated_start=lambda worker, **_: _raise(OSError("reset")))
    resp = asyncio.run(rpc_calls.start_rank(pool, deployment(), 0, [("svc.0", "tcp://a")],
                                            lambda w: True))
    assert resp == {"status": "lost", "error": "OSError: reset"}


def test_a_joining_worker_without_the_handler_is_asked_again_until_it_has_it():
    answers = iter([None, None, {"status": "ok"}])  # no handler yet: no answer

    async def start(worker, **kwargs):
        return next(answers)

    pool = FakeWorkers(replicated_start=start)
    resp = asyncio.run(rpc_calls.start_rank(pool, deployment(), 0, [("svc.0", "tcp://a")],
                                            lambda w: True))
    assert resp == {"status": "ok"} and len(pool.calls) == 3


def test_a_worker_gone_without_the_handler_is_lost_naming_the_missing_plugin():
    async def start(worker, **kwargs):
        return None

    pool = FakeWorkers(replicated_start=start)
    resp = asyncio.run(rpc_calls.start_rank(pool, deployment(), 0, [("svc.0", "tcp://a")],
                                            lambda w: False))
    assert resp["status"] == "lost" and len(pool.calls) == 1
    assert "tcp://a has no replicated_start handler" in resp["error"]
    assert "dask_services_replicated plugin" in resp["error"]


def test_a_stop_that_fails_is_logged_not_raised(caplog):
    pool = FakeWorkers(replicated_stop=lambda worker, **_: _raise(OSError("gone")))
    with caplog.at_level("INFO", logger="dask_services"):
        asyncio.run(rpc_calls.stop_rank(pool, "tcp://a", "svc.0", 0, "scale-down"))
    assert pool.calls == [("tcp://a", "replicated_stop",
                           {"id": "svc.0", "timeout": 0, "reason": "scale-down"})]
    assert "stopping replica svc.0 on tcp://a" in caplog.text and "gone" in caplog.text


@pytest.mark.parametrize(("answer", "expected"), [
    (lambda worker, **_: asyncio.sleep(0, {"status": "ok"}), None),
    (lambda worker, **_: asyncio.sleep(0, {"status": "error", "error": "bad state"}),
     "bad state"),
    (lambda worker, **_: _raise(OSError("reset")), "OSError: reset"),
])
def test_a_probe_answers_none_when_healthy_else_why(answer, expected):
    pool = FakeWorkers(replicated_health=answer)
    assert asyncio.run(rpc_calls.probe_rank(pool, "svc.0", 1, "tcp://b", 5)) == (
        expected, False)
    [(worker, _, kwargs)] = pool.calls
    assert worker == "tcp://b" and kwargs["id"] == str(rank_id("svc.0", 1))


def test_a_silent_probe_says_how_long_it_waited():
    pool = FakeWorkers(replicated_health=_never)
    error, in_flight = asyncio.run(rpc_calls.probe_rank(pool, "svc.0", 0, "tcp://a", 0.05))
    assert error == f"no answer from {rank_id('svc.0', 0)} within 0.05 s" and not in_flight


def test_a_probe_whose_connection_breaks_once_sent_says_its_worker_was_lost():
    """A broken connection once the probe was sent is told apart from one never made:
    the worker died while ``check_health`` ran, perhaps of it, which counts."""
    from distributed.comm import CommClosedError

    pool = FakeWorkers(replicated_health=lambda worker, **_: _raise(CommClosedError("eof")))
    error, in_flight = asyncio.run(rpc_calls.probe_rank(pool, "svc.0", 1, "tcp://b", 5))
    assert in_flight
    assert error == f"tcp://b was lost while its probe of {rank_id('svc.0', 1)} ran: " \
                    "CommClosedError: eof"


def test_figures_are_asked_once_per_worker_and_a_silent_worker_gives_none(monkeypatch):
    monkeypatch.setattr(rpc_calls, "STATS_TIMEOUT", 0.05)

    async def stats(worker, ids):
        if worker == "tcp://frozen":
            await asyncio.Event().wait()
        return {rid: {"calls": len(rid)} for rid in ids}

    pool = FakeWorkers(replicated_stats=stats)
    placed = {"s.0": "tcp://a", "s.10": "tcp://a", "s.2": "tcp://frozen"}
    found = asyncio.run(rpc_calls.replica_stats(pool, placed))
    assert found == {"s.0": {"calls": 3}, "s.10": {"calls": 4}}
    assert sorted((w, sorted(kw["ids"])) for w, _, kw in pool.calls) == [
        ("tcp://a", ["s.0", "s.10"]), ("tcp://frozen", ["s.2"])]


def test_shedding_gives_the_count_or_zero_from_a_silent_or_gone_worker(monkeypatch):
    monkeypatch.setattr(rpc_calls, "STATS_TIMEOUT", 0.05)

    async def shed(worker, id, keep, replicas):
        return 7 - keep

    table = [{"id": "s.1", "worker": "tcp://b"}]
    assert asyncio.run(rpc_calls.shed_calls(FakeWorkers(replicated_shed=shed),
                                            "tcp://a", "s.0", 2, table)) == 5
    assert asyncio.run(rpc_calls.shed_calls(FakeWorkers(replicated_shed=_never),
                                            "tcp://a", "s.0", 2, table)) == 0
    gone = FakeWorkers(replicated_shed=lambda worker, **_: _raise(OSError("closed")))
    assert asyncio.run(rpc_calls.shed_calls(gone, "tcp://a", "s.0", 2, table)) == 0
