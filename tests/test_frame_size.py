"""The size of a frame from its dtypes is dask's ``sizeof`` of it (``_frame_size.py``)."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_services.dataframe import _frame_size
from dask_services.dataframe._frame_size import frame_sizeof, object_cell_bytes

pytestmark = pytest.mark.timeout(120)

NUMPY_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint64", "float32", "float64",
                "bool", "datetime64[ns]", "timedelta64[ns]", "complex128"]


@st.composite
def numeric_frames(draw) -> pd.DataFrame:
    dtypes = draw(st.lists(st.sampled_from(NUMPY_DTYPES), max_size=40))
    rows = draw(st.integers(0, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    columns = {}
    for i, dtype in enumerate(dtypes):
        values = rng.integers(0, 100, rows)
        columns[i] = values.astype(dtype) if dtype != "bool" else values > 50
    frame = pd.DataFrame(columns, index=pd.RangeIndex(rows))
    labels = draw(st.sampled_from(["range", "strings", "ints"]))
    if labels == "strings":  # of one length: dask's sample of them is exact
        frame.columns = [f"c{i:03d}" for i in range(len(dtypes))]
    elif labels == "ints":
        frame.columns = pd.Index(np.arange(len(dtypes)) * 7, dtype="int64")
    index = draw(st.sampled_from(["range", "ints", "dates"]))
    if index == "ints":
        frame.index = pd.Index(rng.integers(0, 10**6, rows))
    elif index == "dates":
        frame.index = pd.date_range("2026-01-01", periods=rows, freq="h")
    return frame


@settings(max_examples=300, deadline=None)
@given(numeric_frames())
def test_a_frame_of_numpy_dtypes_measures_as_dask_measures_it(frame):
    # dask's figure after ours: dask counts the lookup table of the column labels once
    # it is built, and ours builds it (to see that the labels are unique)
    assert frame_sizeof(frame) == sizeof(frame)


def test_a_wide_frame_of_interleaved_dtypes_measures_as_dask_measures_it():
    frame = pd.DataFrame(np.random.default_rng(0).random((300, 2000)))
    frame[5] = np.arange(300)  # a run of its own between floats
    frame[2000] = frame[0] > 0.5
    # dask's figure after ours: dask counts the lookup table of the column labels once
    # it is built, and ours builds it (to see that the labels are unique)
    assert frame_sizeof(frame) == sizeof(frame)


@pytest.mark.parametrize("frame", [
    pd.DataFrame({"a": [1, 2], "b": ["x", "yy"]}, dtype=object),
    pd.DataFrame({"a": pd.array([1, None], dtype="Int64"), "b": [1.0, 2.0]}),
    pd.DataFrame({"a": pd.Categorical(["x", "y"]), "b": [1, 2]}),
    pd.DataFrame({"a": pd.array(["x", "y"], dtype="string[pyarrow]")}),
    pd.DataFrame({"a": pd.date_range("2026-01-01", periods=2, tz="UTC")}),
    pd.DataFrame([[1.0, 2.0]], columns=["a", "a"]),  # dask counts a repeated label once
], ids=["object", "nullable", "categorical", "arrow-strings", "tz", "repeated-labels"])
def test_other_frames_are_measured_by_dask(frame, monkeypatch):
    asked = []

    def dask_sizeof(value):
        asked.append(value)
        return sizeof(value)

    monkeypatch.setattr(_frame_size, "sizeof", dask_sizeof)
    assert frame_sizeof(frame) == sizeof(frame)
    assert asked[0] is frame


def test_a_series_is_measured_by_dask():
    series = pd.Series(np.arange(10.0))
    assert frame_sizeof(series) == sizeof(series)


def test_cells_of_python_objects_are_measured_one_by_one():
    cells = np.array([b"x" * 10, b"y" * 5_000_000, "text", None, np.zeros(1000)], dtype=object)
    frame = pd.DataFrame({"k": np.arange(5), "o": cells, "v": np.ones(5),
                          "s": pd.array(["a", "bb", "ccc", "d", "e"],
                                        dtype=pd.StringDtype("python"))})
    rows, rest = object_cell_bytes(frame)
    expected = [sys.getsizeof(c) + sys.getsizeof(s) for c, s in zip(cells, frame.s, strict=True)]
    assert rows.tolist() == expected
    assert rows[1] > 5_000_000
    assert rest == sizeof(frame[["k", "v"]])
    assert object_cell_bytes(frame[["k", "v"]]) is None
    assert object_cell_bytes(pd.DataFrame({"s": ["a"]}, dtype="string[pyarrow]")) is None


def test_a_large_cell_among_small_rows_is_counted_in_its_group():
    """dask samples 100 cells of a column of objects: a group of the split got the large
    cell's bytes only if the sample drew it, and then every group got a share of it."""
    from dask_services import ServiceId
    from dask_services.dataframe._service import group_partitions, split_by_destination

    rows = 2_001
    cells = np.empty(rows, dtype=object)
    cells[:] = [b"s" * 100 for _ in range(rows)]
    cells[1_234] = b"L" * 5_000_000
    frame = pd.DataFrame({"key": np.arange(rows), "blob": cells})
    parts = np.arange(rows) % 8
    destination = group_partitions({p: ServiceId("ab"[p % 2]) for p in range(8)}, 8)
    out = split_by_destination(frame, parts, destination, nbytes=sizeof(frame))
    groups = [(partitions, nbytes) for batch in out.values()
              for _, partitions, _, nbytes in batch]
    (big,) = [nbytes for partitions, nbytes in groups if parts[1_234] in partitions]
    assert big > 5_000_000
    # ~250 rows of ~140 bytes a partition
    assert all(nbytes < 50_000 * len(partitions) for partitions, nbytes in groups
               if parts[1_234] not in partitions)
    total = sum(nbytes for _, nbytes in groups)
    assert total == pytest.approx(sum(map(sys.getsizeof, cells)) + rows * 8, rel=0.05)
