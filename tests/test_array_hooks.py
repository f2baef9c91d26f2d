"""Fails loudly if a dask upgrade moves the hook the "service" rechunk method is registered on."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytestmark = pytest.mark.timeout(30)


def test_rechunk_is_wrapped_where_array_rechunk_finds_it():
    import dask.array as da
    from dask.array.core import Array

    import dask_services  # noqa: F401
    from dask_services.array import _rechunk

    module = importlib.import_module("dask.array.rechunk")
    assert module.rechunk is _rechunk._rechunk, "dask.array.rechunk.rechunk was replaced"
    assert da.rechunk is _rechunk._rechunk
    # Array.rechunk imports the function from the module at call time
    assert "from dask.array.rechunk import rechunk" in inspect.getsource(Array.rechunk)
    # the signature the wrapper forwards
    assert list(inspect.signature(_rechunk._dask_rechunk).parameters) == [
        "x", "chunks", "threshold", "block_size_limit", "balance", "method",
    ]
    # dask's helpers the wrapper normalizes and validates with
    assert callable(module._validate_rechunk) and callable(module._balance_chunksizes)
    assert 'config.get("array.rechunk.method"' in inspect.getsource(
        module._choose_rechunk_method)


def test_unknown_methods_still_refused_by_dask():
    import dask.array as da

    with pytest.raises(NotImplementedError, match="Unknown rechunking method"):
        da.ones((4, 4), chunks=2).rechunk(4, method="nope")


def test_numpys_huge_page_switch_is_where_output_chunks_find_it():
    """Rechunk output chunks are allocated with numpy's huge-page advice off (``_memory.py``,
    ``without_huge_page_advice``); without the switch they get the advice again, and every
    large allocation its huge-page faults."""
    from dask_services import _memory

    assert _memory._set_madvise_hugepage is not None, (
        "numpy._core.multiarray._set_madvise_hugepage is gone: without_huge_page_advice "
        "no longer turns numpy's huge-page advice off")
    assert isinstance(_memory._get_madvise_hugepage(), bool)


def test_fusion_hook_where_array_optimization_finds_it():
    """``array/_fusion`` wraps ``fuse_linear_task_spec`` where dask.array's ``optimize`` looks
    it up, and reads what ``Task.fuse`` and dask's fusion make: a task running a subgraph
    (the dict of its tasks first) and an ``Alias`` of it under the chain's last key."""
    from dask._task_spec import Alias, Task, TaskRef, _execute_subgraph

    import dask_services  # noqa: F401
    from dask_services.array import _fusion

    optimization = importlib.import_module("dask.array.optimization")
    assert getattr(optimization.fuse_linear_task_spec, "keeps_consumer_keys", False)
    assert "fuse_linear_task_spec(dsk, keys=keys)" in inspect.getsource(optimization.optimize)
    first = Task(("a", 0), abs, -1)
    second = Task(("b", 0), abs, TaskRef(("a", 0)))
    fused = Task.fuse(first, second, key=("a-b", 0))
    assert fused.func is _execute_subgraph and fused.has_subgraph()
    assert fused.args[0] == {("a", 0): first, ("b", 0): second}
    assert fused.substitute({}, key=("b", 0)).key == ("b", 0)
    assert Alias(("b", 0), target=("a-b", 0)).target == ("a-b", 0)
    assert _fusion.fuses_a_copy(fused, frozenset({abs}))


def test_what_consumers_fused_into_claims_rely_on():
    """``_claim_fusion`` and ``graph.Consumer`` run a consumer task (perhaps a fused one) on
    the value of its one dependency by calling it with ``{dependency: value}``, and rewrite
    the tasks using a renamed output with ``substitute``; a plain object among a task's
    arguments is not taken for a dependency.  The scheduler plugin relies on distributed
    scheduling a task that waits for a worker once that worker runs tasks again."""
    from dask._task_spec import Task, TaskRef
    from distributed.scheduler import SchedulerState

    from dask_services.graph import Consumer

    consumer = Task(("sum", 0), sum, TaskRef(("out", 0)))
    assert consumer({("out", 0): [1, 2, 3]}) == 6
    fused = Task.fuse(Task(("neg", 0), list, TaskRef(("out", 0))), Task(
        ("sum", 0), sum, TaskRef(("neg", 0))))
    assert Consumer(fused)((4, 5)) == 9
    renamed = consumer.substitute({("out", 0): ("out-x", 0)})
    assert renamed.dependencies == {("out-x", 0)}
    assert renamed({("out-x", 0): [1]}) == 1
    carrying = Task(("claim", 0), lambda c: c, Consumer(consumer))
    assert carrying.dependencies == set()
    from distributed.scheduler import Scheduler

    assert hasattr(SchedulerState, "bulk_schedule_unrunnable_after_adding_worker")
    assert "bulk_schedule_unrunnable_after_adding_worker" in inspect.getsource(
        Scheduler.handle_worker_status_change)


def test_the_array_optimizer_is_taken_where_fuse_consumers_is_carried():
    """``array/_fusion`` wraps ``Array.__dask_optimize__`` (dask's ``GlobalMethod``, whose
    default is ``dask.array.optimization.optimize``) to carry ``fuse-consumers`` to where
    distributed optimizes the graph; ``HLGExpr.from_collection`` takes it from the
    collection when ``compute()`` is called."""
    from dask._expr import HLGExpr
    from dask.array.core import Array
    from dask.array.optimization import optimize
    from dask.context import GlobalMethod

    import dask_services  # noqa: F401
    from dask_services.array import _fusion, _rechunk  # noqa: F401

    wrapped = Array.__dict__["__dask_optimize__"]
    assert getattr(wrapped, "carries_consumer_fusion", False)
    assert isinstance(wrapped.dasks, GlobalMethod)
    assert wrapped.dasks.__get__(None, Array) is optimize
    assert "collection.__dask_optimize__ if optimize_graph" in inspect.getsource(
        HLGExpr.from_collection)
