"""compute() of a computation containing a service shuffle is fused as persist() fuses it."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask._expr import FinalizeCompute
from dask.base import collections_to_expr
from distributed import get_task_stream
from utils import assert_nothing_left, service_cluster

import dask_services  # noqa: F401
from dask_services.dataframe._compute_fusion import _dask_optimize

pytestmark = pytest.mark.timeout(60)


def make(i: int, rows: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame({"key": rng.integers(0, 20, rows), "value": rng.random(rows)})


def source(npartitions: int = 6) -> dd.DataFrame:
    return dd.from_map(make, range(npartitions), meta=make(0).iloc[:0],
                       enforce_metadata=False)


def kind(key) -> str:
    """A task's kind: its key's name without the token (dask's ``key_split`` stops at
    a word starting with an underscore)."""
    return (key[0] if isinstance(key, tuple) else key).rsplit("-", 1)[0]


def kinds(*collections) -> set[str]:
    """The kinds of task ``dask.compute(*collections)`` sends to a scheduler."""
    expr = FinalizeCompute(collections_to_expr(list(collections))).optimize()
    return set(map(kind, expr.__dask_graph__()))


def test_compute_fuses_hand_offs_with_the_steps_making_their_inputs():
    shuffled = source().shuffle("key", shuffle_method="service")
    total = shuffled.map_partitions(len).sum()
    names = kinds(total)
    assert "make-_to_string_dtype-shufflehandoffs" in names, names
    assert "len-chunk" in names and "make" not in names, names
    # the same tasks as persist() and optimize() give
    assert names == set(map(kind, total.optimize().__dask_graph__()))


def test_setting_off_and_other_methods_compute_as_dask_does():
    total = source().shuffle("key", shuffle_method="service").map_partitions(len).sum()
    with dask.config.set({"dask_services.shuffle.fuse-compute": False}):
        names = kinds(total)
    assert {"make", "shufflehandoffs", "len", "chunk"} <= names, names
    for method in ("tasks", "p2p"):
        other = source().shuffle("key", shuffle_method=method).map_partitions(len).sum()
        expected = _dask_optimize(FinalizeCompute(collections_to_expr([other])))
        assert FinalizeCompute(collections_to_expr([other])).optimize()._name == \
            expected._name


def test_a_partition_used_twice_is_not_fused_into_the_hand_off():
    src = source()
    shuffled = src.shuffle("key", shuffle_method="service").map_partitions(len).sum()
    names = kinds(shuffled, src.value.sum())
    # the input partitions are made once, for the hand-offs and for the other sum
    assert "make-_to_string_dtype" in names and "shufflehandoffs" in names, names
    results = dask.compute(shuffled, src.value.sum(), scheduler="sync")
    expected = pd.concat([make(i) for i in range(6)])
    assert results == (len(expected), pytest.approx(expected.value.sum()))


def test_an_already_fused_expression_is_left_as_it_is():
    total = source().shuffle("key", shuffle_method="service").map_partitions(len).sum()
    optimized = total.optimize()
    expr = FinalizeCompute(collections_to_expr([optimized]))
    assert expr.optimize()._name == _dask_optimize(expr)._name


def chain_of_shuffles(steps: int) -> dd.DataFrame:
    """Each shuffle followed by a step that reads the shuffled frame twice: the paths
    through the expression double with each shuffle."""
    frame = source(4)
    for _ in range(steps):
        frame = frame.shuffle("key", shuffle_method="service")
        frame = frame.assign(value=frame.value + 1)
    return frame


def test_a_chain_of_shuffles_is_computed_unfused_where_fusing_it_costs_too_much():
    """dask's fusion walks an expression once per path to each step: a chain of 20
    shuffles each followed by such a step spent minutes in ``compute()`` before a task
    ran (3.8 s at 12).  Past ``MAX_FUSED_PATHS`` the chain runs as dask's own
    ``compute()`` runs it; a short one is still fused."""
    from dask_services.dataframe._compute_fusion import (
        MAX_FUSED_PATHS,
        fused_if_shuffled,
        paths_beyond,
    )

    long_chain = _dask_optimize(FinalizeCompute(chain_of_shuffles(20).expr))
    assert paths_beyond(long_chain, MAX_FUSED_PATHS)
    assert fused_if_shuffled(long_chain) is long_chain
    short_chain = _dask_optimize(FinalizeCompute(chain_of_shuffles(2).expr))
    assert not paths_beyond(short_chain, MAX_FUSED_PATHS)
    assert fused_if_shuffled(short_chain) is not short_chain
    expected = pd.concat([make(i) for i in range(4)]).value.sum() + 20 * 4 * 50
    assert dask.compute(chain_of_shuffles(20).value.sum(), scheduler="sync")[0] == \
        pytest.approx(expected)


@service_cluster()
async def test_compute_on_a_cluster_runs_fused_tasks_and_matches_pandas(c, s, a, b):
    src = source(8)
    shuffled = src.shuffle("key", shuffle_method="service")
    grouped = shuffled.map_partitions(lambda d: d.groupby("key").value.sum(),
                                      meta=("value", "f8"))
    async with get_task_stream(c) as stream:
        result = await c.compute(grouped)
    names = {kind(r["key"]) for r in stream.data}
    assert "make-_to_string_dtype-shufflehandoffs" in names, names
    assert not {"make", "shufflehandoffs"} & names, names
    expected = pd.concat([make(i) for i in range(8)]).groupby("key").value.sum()
    pd.testing.assert_series_equal(result.sort_index(), expected, check_names=False)
    await assert_nothing_left(s, [a, b])
