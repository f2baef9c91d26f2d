"""The shuffle's target partitions equal those of dask's own partitioning step."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dask_services.dataframe._partitioning import target_partitions

pytestmark = pytest.mark.timeout(120)

COLUMNS = {
    "i": lambda rng, n: rng.integers(-5, 5, n),
    "f": lambda rng, n: np.where(rng.random(n) < 0.2, np.nan, rng.integers(0, 5, n)),
    "s": lambda rng, n: pd.array(rng.integers(0, 5, n).astype(str), dtype="str"),
    "n": lambda rng, n: pd.array(np.where(rng.random(n) < 0.3, None, rng.integers(0, 9, n)),
                                 dtype="Int64"),
    "c": lambda rng, n: pd.Categorical(rng.integers(0, 3, n)),
    "t": lambda rng, n: pd.to_datetime(rng.integers(0, 10, n), unit="D", utc=True),
    7: lambda rng, n: rng.integers(0, 3, n).astype("uint8"),
    "b": lambda rng, n: rng.random(n) < 0.5,
    "f4": lambda rng, n: rng.integers(0, 5, n).astype("float32"),
    "o": lambda rng, n: np.array([("x", 1, None)[i] for i in rng.integers(0, 3, n)],
                                 dtype=object),
    "d": lambda rng, n: pd.to_datetime(rng.integers(0, 10, n), unit="D"),
    "td": lambda rng, n: pd.to_timedelta(rng.integers(0, 10, n), unit="s"),
    "F": lambda rng, n: pd.array(np.where(rng.random(n) < 0.3, None, rng.random(n)),
                                 dtype="Float64"),
    "cs": lambda rng, n: pd.Categorical(np.array(["a", "b", "c"])[rng.integers(0, 3, n)]),
    # every bit pattern of a float that pandas hashes alike: NaNs, -0.0 and 0.0
    "z": lambda rng, n: np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -1.5, 2**60])[
        rng.integers(0, 7, n)],
    "u8": lambda rng, n: rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2),
}


def expected(df, assign):
    return AssignPartitioningIndex.operation(df, *assign)[assign[1]].to_numpy()


@settings(max_examples=60, deadline=None)
# -0.0 and a NaN with its sign bit set: pandas 2 hashes their bit patterns, pandas 3 hashes
# them as 0.0 and NaN
@example(rows=5, on=["z"], npartitions=3, seed=0, meta_from_other_dtype=False)
@given(
    rows=st.integers(0, 60),
    on=st.lists(st.sampled_from(list(COLUMNS) + ["idx"]), min_size=1, max_size=3,
                unique=True),
    npartitions=st.one_of(st.integers(1, 40), st.integers(40, 70_000)),
    seed=st.integers(0, 2**16),
    meta_from_other_dtype=st.booleans(),
)
def test_target_partitions_equal_dasks(rows, on, npartitions, seed, meta_from_other_dtype):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({name: make(rng, rows) for name, make in COLUMNS.items()})
    df.index = pd.Index(rng.integers(0, 4, rows), name="idx")
    meta = df.iloc[:0]
    if meta_from_other_dtype:  # meta says float where the partition holds ints
        meta = meta.astype({"i": "float64"})
    assign = (on, "_partitions", npartitions, meta, False)
    np.testing.assert_array_equal(target_partitions(df, assign), expected(df, assign))


def test_index_shuffle_and_series_use_dasks_own_function():
    s = pd.Series(np.arange(20) % 7, name="x", index=np.arange(20) * 3)
    assign = (["_index"], "_partitions", 5, s.iloc[:0], True)
    np.testing.assert_array_equal(target_partitions(s, assign), expected(s, assign))
    df = s.to_frame()
    assign = (["_index"], "_partitions", 5, df.iloc[:0], True)
    np.testing.assert_array_equal(target_partitions(df, assign), expected(df, assign))


def test_duplicate_column_names_use_dasks_own_function():
    df = pd.DataFrame([[1, 2, 3], [4, 5, 6]], columns=["a", "a", "b"])
    assign = (["b"], "_partitions", 3, df.iloc[:0], False)
    np.testing.assert_array_equal(target_partitions(df, assign), expected(df, assign))
