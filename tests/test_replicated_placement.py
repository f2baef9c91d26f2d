"""Where replicas go (``_placement``), without a cluster: eligible workers and the choice
among them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from distributed.core import Status

from dask_services.replicated._placement import eligible_workers, place, resources_held

pytestmark = pytest.mark.timeout(30)


def worker(address: str, name: str | None = None, status=Status.running, **resources):
    return SimpleNamespace(address=address, name=name or address, status=status,
                           resources=resources)


def deployment(name: str, placed: list[list[str]] = (), *, resources=None, workers=None,
               per_worker=None, ranks=1):
    """A deployment whose slots hold ranks on the workers ``placed`` (one list a slot)."""
    return SimpleNamespace(
        name=name, resources=resources or {}, workers=workers,
        max_replicas_per_worker=per_worker, procs_per_replica=ranks,
        slots={i: SimpleNamespace(workers=list(ws)) for i, ws in enumerate(placed)})


def test_a_replica_goes_where_its_service_has_fewest_then_where_all_have_fewest():
    a, b, c = worker("a"), worker("b"), worker("c")
    dep = deployment("svc", [["a"]])
    other = deployment("other", [["b"], ["b"]])
    assert place(dep, [dep, other], [a, b, c], 3, frozenset()) == (["c"], "")
    # c is being left: taken only when nothing else will do
    assert place(dep, [dep, other], [a, b, c], 3, frozenset({"c"})) == (["b"], "")
    assert place(dep, [dep, other], [c], 3, frozenset({"c"})) == (["c"], "")


def test_a_gang_takes_distinct_workers_all_at_once_or_none_with_the_reason():
    dep = deployment("gang", ranks=3)
    assert place(dep, [dep], [worker("a"), worker("b"), worker("c")], 3,
                 frozenset())[0] == ["a", "b", "c"]
    dep.workers = ["a", "b"]  # (``place`` takes the eligible workers it is given)
    workers, why = place(dep, [dep], [worker("a"), worker("b")], 3, frozenset())
    assert workers is None
    assert why == "waiting for 3 workers at once with workers=['a', 'b']: 2 eligible of 3 running"


def test_eligible_workers_keep_to_names_limits_status_and_free_resources():
    a = worker("tcp://a", name="alpha", GPU=2)
    b = worker("tcp://b", GPU=1)
    c = worker("tcp://c", GPU=4, status=Status.closing_gracefully)
    d = worker("tcp://d", GPU=4)
    dep = deployment("svc", [["tcp://d"]], resources={"GPU": 1}, per_worker=1,
                     workers=["alpha", "tcp://b", "tcp://c", "tcp://d"])
    # b's one GPU is held by a replica stopping there; d already has this service's one
    used = resources_held([dep], {("tcp://b", "old-replica"): {"GPU": 1}})
    assert used == {"tcp://b": {"GPU": 1}, "tcp://d": {"GPU": 1}}
    assert [ws.address for ws in eligible_workers(dep, [a, b, c, d], used)] == ["tcp://a"]
    # without the limit d has 3 GPUs left; without the stop b has its one
    dep.max_replicas_per_worker = None
    assert [ws.address for ws in eligible_workers(dep, [a, b, c, d], resources_held([dep], {}))
            ] == ["tcp://a", "tcp://b", "tcp://d"]


def test_the_reason_names_every_constraint_that_leaves_too_few_workers():
    dep = deployment("svc", [["a"]], resources={"GPU": 1}, per_worker=1)
    workers, why = place(dep, [dep], [], 2, frozenset())
    assert workers is None
    assert why == ("waiting for a worker with resources={'GPU': 1} free, fewer than 1 "
                   "replicas of svc (max_replicas_per_worker): 0 eligible of 2 running")
