"""Received rows assembled column by column give what pandas' concatenation gives."""

from __future__ import annotations

import contextlib
import datetime
import pickle
import re
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from dask.dataframe.core import _concat
from hypothesis import example, given, settings
from hypothesis import strategies as st
from utils import assembled_in_two_windows

from dask_services.dataframe._rows import FrameRows, RowSource, concat_rows, takes_column_way
from dask_services.dataframe._service import assemble

pytestmark = pytest.mark.timeout(120)

COLUMNS = {
    "int": lambda rng, n: rng.integers(-5, 5, n),
    "float": lambda rng, n: rng.random(n),
    "bool": lambda rng, n: rng.random(n) < 0.5,
    "str": lambda rng, n: pd.array([None if x == 0 else f"s{x}" for x in rng.integers(0, 9, n)],
                                   dtype="str"),
    "python_string": lambda rng, n: pd.array([f"p{x}" for x in rng.integers(0, 9, n)],
                                             dtype="string[python]"),
    "nullable": lambda rng, n: pd.array([None if x == 0 else int(x)
                                         for x in rng.integers(0, 9, n)], dtype="Int64"),
    "time": lambda rng, n: pd.to_datetime(rng.integers(0, 10**9, n), unit="s", utc=True),
    "object": lambda rng, n: objects([(int(x),) for x in rng.integers(0, 9, n)]),
    "object_text": lambda rng, n: objects([f"o{x}" for x in rng.integers(0, 9, n)]),
    "object_time": lambda rng, n: objects([datetime.datetime(2020, 1, 1 + int(x))
                                           for x in rng.integers(0, 9, n)]),
}


def objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


INDEXES = {
    "range": lambda rng, n, i: pd.RangeIndex(n),
    "ints": lambda rng, n, i: pd.Index(rng.integers(0, 100, n), name="idx"),
    "text": lambda rng, n, i: pd.Index([f"r{i}-{k}" for k in range(n)], dtype="str"),
}


def frames(seed: int, columns: list[str], index: str, sizes: list[int]) -> list[pd.DataFrame]:
    rng = np.random.default_rng(seed)
    return [pd.DataFrame({c: pd.Series(COLUMNS[c](rng, n)).astype(object) if
                          c.startswith("object") else COLUMNS[c](rng, n) for c in columns},
                         index=INDEXES[index](rng, n, i)) for i, n in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16),
       columns=st.lists(st.sampled_from(sorted(COLUMNS)), min_size=1, max_size=4, unique=True),
       index=st.sampled_from(sorted(INDEXES)),
       sizes=st.lists(st.integers(0, 30), min_size=1, max_size=5),
       cuts=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.booleans()),
                     min_size=1, max_size=8),
       ignore_index=st.booleans())
def test_rows_concatenate_as_pandas_does(seed, columns, index, sizes, cuts, ignore_index):
    """Shares in memory and shares written to disk and read back (``spilled``) give what
    pandas gives for their slices."""
    sources = frames(seed, columns, index, sizes)
    meta = sources[0].iloc[:0]
    pieces, slices = [], []
    for k, (a, b, spilled) in enumerate(cuts):
        frame = sources[k % len(sources)]
        start, stop = sorted((int(a * len(frame)), int(b * len(frame))))
        rows = FrameRows(RowSource(frame), start, stop)
        assert rows.source.takes_column_way(meta)
        pieces.append(pickle.loads(pickle.dumps(rows, protocol=5)) if spilled else rows)
        slices.append(frame.iloc[start:stop])
    expected = pd.concat(slices, ignore_index=ignore_index)
    got = concat_rows(pieces, meta, ignore_index)
    # a share read back has its index's values: a RangeIndex slice comes back as integers
    any_spilled = any(spilled for _, _, spilled in cuts)
    pd.testing.assert_frame_equal(got, expected,
                                  check_index_type="equiv" if any_spilled else True,
                                  check_column_type=True)
    # and as pandas concatenates them, where a share of another dtype makes it take that way
    pd.testing.assert_frame_equal(
        pd.concat([p.frame(meta) for p in pieces], ignore_index=ignore_index), expected,
        check_index_type="equiv" if any_spilled else True, check_column_type=True)


def test_assemble_takes_pandas_way_where_columns_cannot():
    rng = np.random.default_rng(0)
    cat = [pd.DataFrame({"c": pd.Categorical(list(letters)), "x": rng.random(len(letters))})
           for letters in ("ab", "bc")]
    meta = cat[0].iloc[:0]
    assert not takes_column_way(cat[0], meta)
    out = assemble([(1, cat[1]), (0, FrameRows(RowSource(cat[0]), 0, 2))], meta, True)
    # what dask's own concatenation (``tasks``) gives: the union of the categories
    pd.testing.assert_frame_equal(out, _concat([cat[0], cat[1]]).reset_index(drop=True))
    assert set(out["c"].cat.categories) == {"a", "b", "c"}

    other = pd.DataFrame({"x": [1.0], "y": [2]})  # columns other than the meta's
    plain = pd.DataFrame({"y": [3], "x": [4.0]})
    assert not takes_column_way(other, plain.iloc[:0])
    out = assemble([(0, other), (1, plain)], plain.iloc[:0], False)
    pd.testing.assert_frame_equal(out, pd.concat([other, plain]))


def test_pickled_rows_take_only_their_own_rows():
    frame = pd.DataFrame({"x": np.arange(100_000, dtype="int64"),
                          "s": pd.array([str(i) for i in range(100_000)], dtype="str")})
    rows = FrameRows(RowSource(frame), 10, 20)
    blob = pickle.dumps(rows, protocol=5)
    assert len(blob) < 10_000  # the whole frame is over 1 MB
    back = pickle.loads(blob)
    assert isinstance(back, FrameRows)
    pd.testing.assert_frame_equal(back.frame(frame.iloc[:0]), frame.iloc[10:20])


def test_spilled_rows_are_their_arrays_only():
    """A share of a frame that takes the column way is written as its own rows' arrays, and
    read back it needs no frame to be assembled."""
    n = 100_000
    frame = pd.DataFrame({"x": np.arange(n, dtype="int64"),
                          "s": pd.array([None if i % 7 == 0 else str(i) for i in range(n)],
                                        dtype="str")},
                         index=pd.Index(np.arange(n) * 3, name="idx"))
    meta = frame.iloc[:0]
    source = RowSource(frame)
    assert source.takes_column_way(meta)
    blob = pickle.dumps(FrameRows(source, 10, 30), protocol=5)
    assert len(blob) < 10_000  # the whole frame is over 1 MB
    back = pickle.loads(blob)
    assert back.source._frame is None  # arrays, no frame
    out = assemble([(1, back), (0, FrameRows(source, 0, 10))], meta, False)
    pd.testing.assert_frame_equal(out, frame.iloc[:30])
    # a share of another dtype in the same output: pandas concatenates, the read-back
    # share is made a frame with the meta's columns
    other = pd.DataFrame({"x": [0.5], "s": ["z"]}, index=pd.Index([-1], name="idx"))
    out = assemble([(0, back), (1, other)], meta, False)
    pd.testing.assert_frame_equal(out, pd.concat([frame.iloc[10:30], other]))


# all inputs as arrays, some sent, a named index, the small pieces concatenated once
@example(seed=0, columns=["int", "str"], index="ints", sizes=[10, 12, 7], nparts=3,
         groups=1, last=-1, split="arrays", sent=[True, False, True, False, True],
         assign=False, small=True, ignore_index=False)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16),
       columns=st.lists(st.sampled_from(sorted(COLUMNS)), min_size=1, max_size=3, unique=True),
       index=st.sampled_from(sorted(INDEXES)),
       sizes=st.lists(st.integers(0, 25), min_size=1, max_size=5),
       nparts=st.integers(1, 7), groups=st.integers(1, 3), last=st.integers(-1, 3),
       split=st.sampled_from(["arrays", "frames", "mixed"]),
       sent=st.lists(st.booleans(), min_size=5, max_size=5),
       assign=st.booleans(), small=st.booleans(), ignore_index=st.booleans())
def test_small_inputs_split_as_arrays_assemble_as_pandas_does(
        seed, columns, index, sizes, nparts, groups, last, split, sent, assign, small,
        ignore_index):
    """Small inputs that take the column way are split as arrays (``ColumnWay``), their
    groups travel pickled (``sent``) or stay in memory, and, all split as arrays, all as
    frames or mixed, they assemble, both ways and cut at a window's edge, into what
    pandas gives each partition: its rows by input, then in their order."""
    from dask_services.dataframe import _service
    from dask_services.dataframe._service import group_partitions, split_input
    from dask_services.service import ServiceId

    rng = np.random.default_rng(seed)
    inputs = frames(seed, columns, index, sizes)
    targets = [rng.integers(0, nparts, len(f)) for f in inputs]
    meta = inputs[0].iloc[:0]
    way = _service.ColumnWay(meta)
    destination = group_partitions({p: ServiceId("a") for p in range(nparts)}, groups)
    received = []
    for i in rng.permutation(len(inputs)).tolist():  # arrival order is not input order
        as_arrays = split == "arrays" or (split == "mixed" and i % 2 == 0)
        if assign:  # the targets come from dask's partitioning step (mocked: these)
            df, column = inputs[i], None
            patch = mock.patch.object(_service, "target_partitions",
                                      return_value=targets[i])
        else:
            df, column = inputs[i].assign(_p=targets[i]), "_p"
            patch = contextlib.nullcontext()
        with patch:
            batches, _ = split_input(df, ("unused",) if assign else None, column, destination,
                                     nbytes=100, own=ServiceId("a"),
                                     column_way=way if as_arrays else None)
        for frame, parts, bounds, _ in batches.get(ServiceId("a"), []):
            assert isinstance(frame, FrameRows) == (as_arrays and len(df) > 0)
            if sent[i]:
                frame = pickle.loads(pickle.dumps(frame, protocol=5))
            received.append((i, frame, parts, bounds))
    for p, got in assembled_in_two_windows(received, destination, nparts, last, meta,
                                           ignore_index, small):
        pieces = [f[t == p] for f, t in zip(inputs, targets, strict=True)]
        pieces = [f for f in pieces if len(f)]
        expected = pd.concat(pieces) if pieces else meta
        if ignore_index:
            expected = expected.reset_index(drop=True)
        pd.testing.assert_frame_equal(got, expected, check_index_type="equiv")


def test_column_way_of_a_frame_is_found_from_its_columns():
    from dask_services.dataframe._rows import ColumnWay

    frame = pd.DataFrame({"x": [1, 2], "_p": [0, 1], "s": pd.array(["a", None], dtype="str")},
                         index=pd.Index([5, 6], name="i"))
    meta = frame.drop(columns="_p").iloc[:0]
    values, index, name = ColumnWay(meta).values_of(frame, "_p", dropping=True)
    assert [list(v) for v in values][0] == [1, 2] and values[1].dtype == meta.s.dtype
    assert list(index) == [5, 6] and name == "i"
    assert ColumnWay(meta).values_of(frame) is None  # "_p" is not one of the meta's
    assert ColumnWay(frame.iloc[:0]).values_of(frame.astype({"x": "float64"})) is None
    assert ColumnWay(meta).values_of(frame.drop(columns="_p")[["s", "x"]]) is None
    assert ColumnWay(meta).values_of(frame.drop(columns="_p").set_index("s", append=True)) \
        is None
    assert ColumnWay(meta).values_of(frame.drop(columns="_p").reset_index(drop=True)
                                     .set_axis(["a", "b"])) is None  # another index dtype
    odd = pd.DataFrame({"a": [1, 2], "k": [0, 1]}).set_axis(pd.Index([pd.NA, "k"], dtype=object),
                                                            axis=1)
    assert ColumnWay(odd.iloc[:, :1].iloc[:0]).values_of(odd, "k", dropping=True) is None
    categorical = frame.astype({"s": "category"})
    assert not ColumnWay(categorical.iloc[:0]).possible
    assert ColumnWay(categorical.iloc[:0]).values_of(categorical) is None


def test_wide_frames_take_pandas_way():
    """Past ``COLUMN_WAY_MAX_COLUMNS`` columns a frame's rows are taken and concatenated
    by pandas, block by block (the column way cost twice pandas' time at 2,000 columns);
    the result is the same."""
    from dask_services.dataframe._rows import COLUMN_WAY_MAX_COLUMNS

    rng = np.random.default_rng(0)
    for ncols, column_way in ((COLUMN_WAY_MAX_COLUMNS, True),
                              (COLUMN_WAY_MAX_COLUMNS + 1, False)):
        frames = [pd.DataFrame({f"c{j}": rng.random(5) if j % 3 else rng.integers(0, 9, 5)
                                for j in range(ncols)}) for _ in range(2)]
        meta = frames[0].iloc[:0]
        assert takes_column_way(frames[0], meta) is column_way
        out = assemble([(1, frames[1]), (0, FrameRows(RowSource(frames[0]), 0, 5))],
                       meta, True)
        pd.testing.assert_frame_equal(out, pd.concat(frames, ignore_index=True))


# dask's own concatenation of categoricals builds a frame column by column
@pytest.mark.filterwarnings("ignore:DataFrame is highly fragmented")
@settings(max_examples=25, deadline=None)
@given(ncols=st.integers(129, 300), seed=st.integers(0, 2**16),
       nframes=st.integers(1, 6), duplicate_labels=st.booleans(),
       ignore_index=st.booleans())
def test_wide_frames_concatenate_grouped_by_dtype_as_dask_does(ncols, seed, nframes,
                                                               duplicate_labels,
                                                               ignore_index):
    """Wide frames' columns are grouped by dtype for pandas' concatenation, then put back:
    the result is dask's concatenation's, whatever the frames' dtypes (a column of another
    dtype in one frame, categoricals of other categories, frames without rows) and
    labels."""
    from dask_services.dataframe._rows import concat_frames

    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 4, ncols)
    labels = [f"c{j % 7}" if duplicate_labels else f"c{j}" for j in range(ncols)]
    frames = []
    for i in range(nframes):
        n = int(rng.integers(0, 6))
        columns = []
        for kind in kinds:
            if kind == 0:
                columns.append(rng.random(n))
            elif kind == 1:
                columns.append(rng.integers(0, 9, n) if i % 2 else rng.random(n))
            elif kind == 2:
                columns.append(pd.Categorical(rng.choice(list("abc"[: i % 3 + 1]), n)))
            else:
                columns.append(pd.array(rng.integers(0, 9, n), dtype="Int64"))
        frame = pd.concat([pd.Series(c) for c in columns], axis=1) if n else \
            pd.DataFrame({j: pd.Series(c) for j, c in enumerate(columns)})
        frame.columns = labels
        frame.index = pd.RangeIndex(i * 10, i * 10 + n)
        frames.append(frame)
    for concat in (_concat, pd.concat):
        try:
            expected = concat(frames, ignore_index=ignore_index)
        except ValueError as exc:  # dask's, for duplicate labels with categoricals
            with pytest.raises(ValueError, match=re.escape(str(exc))):
                concat_frames(frames, ignore_index=ignore_index, concat=concat)
            continue
        got = concat_frames(frames, ignore_index=ignore_index, concat=concat)
        pd.testing.assert_frame_equal(got, expected)
