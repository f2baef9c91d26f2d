"""Fails loudly if a dask upgrade moves the hook the "service" shuffle method is registered on."""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.timeout(30)


def test_shuffle_lower_is_wrapped():
    from dask.dataframe.dask_expr._shuffle import RearrangeByColumn, Shuffle, SimpleShuffle

    import dask_services  # noqa: F401
    from dask_services.dataframe import _expr

    assert Shuffle._lower is _expr._lower, "Shuffle._lower was replaced after registration"
    assert _expr._dask_lower.__qualname__ == "Shuffle._lower"
    # the operands ServiceShuffle is built with, in this order
    assert SimpleShuffle._parameters == [
        "frame", "partitioning_index", "npartitions_out", "ignore_index", "options",
        "original_partitioning_index", "_partitions",
    ]
    # every hash shuffle goes through Shuffle(..., method) with a "_partitions" column
    src = inspect.getsource(RearrangeByColumn._lower)
    assert "Shuffle(" in src and '"_partitions"' in src
    assert "self.method or get_default_shuffle_method()" in inspect.getsource(_expr._dask_lower)


def test_broadcast_join_choice_is_wrapped():
    from dask.dataframe.dask_expr._merge import BlockwiseMerge, BroadcastJoin, Merge

    import dask_services  # noqa: F401
    from dask_services.dataframe import _expr

    assert Merge.__dict__["is_broadcast_join"] is _expr._broadcast_join_choice
    dask_choice = inspect.getsource(_expr._dask_is_broadcast_join.func)
    # dask names the methods that may broadcast; "service" decides as "tasks" does
    assert '"tasks"' in dask_choice and "self.shuffle_method" in dask_choice
    assert "shuffle_method" in Merge._parameters
    assert "shuffle_method" not in BroadcastJoin._parameters  # left to dask's own choice
    assert BlockwiseMerge.is_broadcast_join is False


def test_unknown_methods_still_refused_by_dask():
    import dask.dataframe as dd
    import pandas as pd

    df = dd.from_pandas(pd.DataFrame({"a": [1, 2, 3]}), npartitions=2)
    with pytest.raises(ValueError, match="not supported"):
        df.shuffle("a", shuffle_method="nope").compute(scheduler="sync")


def test_partitioning_step_we_take_in():
    # ServiceShuffle takes AssignPartitioningIndex's operands and computes its column in
    # the instances (dataframe/_partitioning.py)
    from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex

    assert AssignPartitioningIndex._parameters == [
        "frame", "partitioning_index", "index_name", "npartitions_out", "meta",
        "index_shuffle",
    ]
    params = list(inspect.signature(AssignPartitioningIndex.operation).parameters)
    assert params == ["df", "index", "name", "npartitions", "meta", "index_shuffle"]
    src = inspect.getsource(AssignPartitioningIndex.operation)
    assert "_is_numeric_cast_type(dtype)" in src and "np.float64" in src
    assert "partitioning_index(index, npartitions)" in src


def test_service_shuffle_has_no_partitioning_tasks():
    import dask.dataframe as dd
    import pandas as pd
    from dask.utils import key_split

    import dask_services  # noqa: F401

    df = dd.from_pandas(pd.DataFrame({"a": range(20), "b": 1.0}), npartitions=4)
    for shuffled in (df.shuffle("a", shuffle_method="service"),
                     df.shuffle("a", shuffle_method="service")[["b"]],
                     df.shuffle("a", shuffle_method="service").b):
        graph = shuffled.optimize().__dask_graph__()
        names = {key_split(k) for k in graph}
        assert "assignpartitioningindex" not in names and "operation" not in names, names
        assert sum(key_split(k).startswith("shufflehandoffs") for k in graph) == 4


def test_fusion_we_rely_on():
    # ShuffleHandOffs is fused with the blockwise steps making its input: the fused
    # expression's first step is the hand-offs, and a fused task runs its steps as a
    # subgraph whose output key is args[1] (graph._fused_task_ending_in)
    from dask._task_spec import Task, TaskRef, _execute_subgraph
    from dask.dataframe.dask_expr._expr import Fused

    src = inspect.getsource(Fused._task)
    assert "Task.fuse(*internal_tasks, key=name)" in src
    assert "self.exprs[0]" in inspect.getsource(Fused._meta.func)
    a = Task(("a", 0), int, "1")
    b = Task(("b", 0), str, TaskRef(("a", 0)))
    fused = Task.fuse(a, b, key=("f", 0))
    assert fused.func is _execute_subgraph and fused.has_subgraph()
    assert fused.args[1] == ("b", 0)
    assert not fused.is_coro
    # a persisted frame's hand-offs take its keys (ShuffleHandOffs.input_key)
    from dask.dataframe.dask_expr.io import FromGraph

    assert "keys" in FromGraph._parameters


def test_compute_fusion_hook():
    # dataframe/_compute_fusion.py: dask.compute and Client.compute optimize
    # FinalizeCompute(expr) with Expr.optimize, whose default leaves blockwise steps unfused;
    # FinalizeCompute carries our optimize, which fuses with optimize_blockwise_fusion
    import dask.base
    from dask._expr import Expr, FinalizeCompute
    from dask.dataframe.dask_expr import _expr as df_expr
    from distributed import Client

    import dask_services  # noqa: F401
    from dask_services.dataframe import _compute_fusion

    assert FinalizeCompute.__dict__["optimize"] is _compute_fusion._optimize
    assert _compute_fusion._dask_optimize is Expr.optimize
    assert inspect.signature(Expr.optimize).parameters["fuse"].default is False
    for source in (inspect.getsource(dask.base.compute), inspect.getsource(Client.compute)):
        assert "FinalizeCompute(expr)" in source and "expr.optimize()" in source
    assert "optimize_blockwise_fusion(self)" in inspect.getsource(df_expr.Expr.fuse)
    assert df_expr.FinalizeComputeDF.__mro__[1] is FinalizeCompute
