"""The "service" shuffle method against pandas and dask's own ``tasks`` method."""

from __future__ import annotations

import decimal
import re
from collections import Counter
from unittest import mock

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from dask.utils import key_split
from distributed import wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_nothing_left, held_up_spill_writes, service_cluster, until

import dask_services
from dask_services._run_placement import PlacementGroup
from dask_services.dataframe import shuffle
from dask_services.graph import HandOffSpec

pytestmark = pytest.mark.timeout(120)


def partitions(ddf, scheduler="sync"):
    return [ddf.partitions[i].compute(scheduler=scheduler) for i in range(ddf.npartitions)]


def assert_same_partitions(ddf, on, **kwargs):
    """Ours holds exactly the rows ``tasks`` holds, per partition, in the same order."""
    ours = partitions(ddf.shuffle(on, shuffle_method="service", **kwargs))
    ref = partitions(ddf.shuffle(on, shuffle_method="tasks", **kwargs))
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        if len(b):
            pd.testing.assert_frame_equal(a, b)
        else:
            assert len(a) == 0


def mixed_frame(n=60):
    rng = np.random.default_rng(0)
    k = rng.integers(0, 7, n)
    return pd.DataFrame({
        "k": k,
        "i8": rng.integers(-5, 5, n).astype("int8"),
        "f": rng.random(n),
        "b": rng.random(n) > 0.5,
        "Int64": pd.array(np.where(k % 3 == 0, None, k), dtype="Int64"),
        "boolean": pd.array(np.where(k % 2 == 0, None, k > 3), dtype="boolean"),
        "str": pd.Series([f"s{v}" if v % 4 else None for v in k], dtype="str"),
        "pa_int": pd.array(k, dtype="int64[pyarrow]"),
        "pa_str": pd.array([f"t{v}" for v in k], dtype="string[pyarrow]"),
        "cat": pd.Categorical([f"c{v % 3}" for v in k]),
        "dt_tz": pd.date_range("2024-01-01", periods=n, freq="h", tz="Europe/Berlin"),
        "td": pd.to_timedelta(np.arange(n), unit="s"),
        "dec": pd.array([decimal.Decimal(int(v)) / 4 for v in k],
                        dtype=pd.ArrowDtype(pa.decimal128(10, 2))),
        "lst": pd.array([[int(v), 1] for v in k], dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
        "st": pd.array([{"a": int(v), "b": "x"} for v in k],
                       dtype=pd.ArrowDtype(pa.struct([("a", pa.int64()), ("b", pa.string())]))),
        "obj": pd.Series([1, "a", 2.5, None, (1, 2), b"x"] * (n // 6), dtype=object),
        7: np.arange(n),  # a non-string column name
    })


def test_all_dtypes_survive_and_match_pandas():
    pdf = mixed_frame()
    with dask.config.set({"dataframe.convert-string": False}):  # keep the mixed object column
        ddf = dd.from_pandas(pdf, npartitions=5)
    out = shuffle(ddf, "k", npartitions=4)
    assert dict(out.dtypes) == dict(pdf.dtypes)
    parts = partitions(out)
    for p in parts:
        assert dict(p.dtypes) == dict(pdf.dtypes)
    result = pd.concat(parts).sort_index()
    pd.testing.assert_frame_equal(result, pdf)
    # rows with equal keys share one partition
    homes = [set(p["k"]) for p in parts]
    assert all(not (a & b) for i, a in enumerate(homes) for b in homes[i + 1:])


def test_same_partitions_as_tasks_method():
    pdf = mixed_frame()[["k", "f", "str", "cat", "Int64"]]
    ddf = dd.from_pandas(pdf, npartitions=6)
    for npartitions in (None, 2, 11):
        assert_same_partitions(ddf, "k", npartitions=npartitions)
    assert_same_partitions(ddf, ["k", "Int64"])


@pytest.mark.parametrize("groups", [1, 2, 32])
def test_large_and_small_pieces_of_one_group_are_assembled_together(groups):
    """Some inputs send a partition many rows (large pieces, buffered per partition), others
    few (small frames, buffered per group); every output still holds ``tasks``' rows."""
    rng = np.random.default_rng(5)

    def part(i):
        n = 3_000
        key = rng.integers(0, 500, n)
        if i < 2:  # these inputs put most of their rows in one partition
            key[: n * 3 // 4] = 7
        return pd.DataFrame({"key": key, "x": np.arange(n) + i * n,
                             "s": pd.array([f"v{k}" for k in key], dtype="str")})

    ddf = dd.from_pandas(pd.concat([part(i) for i in range(4)], ignore_index=True),
                         npartitions=4)
    with dask.config.set({"dask_services.shuffle.groups": groups}):
        assert_same_partitions(ddf, "key", npartitions=12)


@pytest.mark.parametrize("window_bytes", [1, 2**30])
def test_small_frames_spanning_groups_are_assembled_in_windows(monkeypatch, window_bytes):
    """Small inputs travel as one frame per destination that spans several groups; with a
    tiny window such frames are cut at the window's end and their rest carried over."""
    from dask_services.dataframe import _service

    monkeypatch.setattr(_service, "WINDOW_BYTES", window_bytes)
    rng = np.random.default_rng(11)
    df = pd.DataFrame({"key": rng.integers(0, 10**6, 3_000), "x": rng.random(3_000),
                       "s": pd.array(rng.integers(0, 50, 3_000).astype(str), dtype="str")})
    ddf = dd.from_pandas(df, npartitions=30)
    with dask.config.set({"dask_services.shuffle.groups": 8}):
        # all outputs in one computation (a partition at a time, each run has one output)
        ours, ref = (dask.compute(*ddf.shuffle("key", npartitions=40, shuffle_method=m)
                                  .to_delayed(), scheduler="sync")
                     for m in ("service", "tasks"))
    assert len(ours) == len(ref) == 40
    for a, b in zip(ours, ref, strict=True):
        pd.testing.assert_frame_equal(a, b)


def test_unknown_and_known_categories():
    pdf = pd.DataFrame({"k": list(range(20)), "c": pd.Categorical(list("abcd") * 5)})
    ddf = dd.from_pandas(pdf, npartitions=4)
    unknown = ddf.assign(c=ddf.c.cat.as_unknown())
    for frame in (ddf, unknown):
        res = shuffle(frame, "k", npartitions=3).compute(scheduler="sync").sort_index()
        assert isinstance(res.c.dtype, pd.CategoricalDtype)
        assert sorted(res.c.cat.categories) == list("abcd")
        assert list(res.c.astype(str)) == list(pdf.c.astype(str))


def test_empty_inputs_and_empty_frames():
    pdf = pd.DataFrame({"k": np.arange(10), "x": np.arange(10.0)})
    ddf = dd.from_pandas(pdf, npartitions=5)
    with_empty = ddf[ddf.k > 6]  # most input partitions are empty
    res = shuffle(with_empty, "k", npartitions=4).compute(scheduler="sync")
    pd.testing.assert_frame_equal(res.sort_index(), pdf[pdf.k > 6])
    empty = ddf[ddf.k > 100]
    res = shuffle(empty, "k").compute(scheduler="sync")
    assert len(res) == 0 and dict(res.dtypes) == dict(pdf.dtypes)


def test_a_frame_of_its_index_alone_keeps_its_rows():
    pdf = pd.DataFrame(index=pd.Index(np.arange(100), name="i"))  # no column
    ddf = dd.from_pandas(pdf, npartitions=3)
    for method in ("tasks", "service"):
        res = ddf.shuffle(ddf.index, npartitions=2, shuffle_method=method).compute(
            scheduler="sync")
        assert res.shape == (100, 0) and res.index.name == "i", (method, res)
    # a join with a set of ids held as an index
    left = pd.DataFrame({"k": np.arange(100) % 40, "a": np.arange(100.0)})
    ids = pd.DataFrame(index=pd.Index(np.arange(10, 30), name="kk"))
    res = dd.from_pandas(left, npartitions=5).merge(
        dd.from_pandas(ids, npartitions=2), left_on="k", right_index=True,
        shuffle_method="service").compute(scheduler="sync")
    expected = left.merge(ids, left_on="k", right_index=True)
    pd.testing.assert_frame_equal(res.sort_values("a"), expected.sort_values("a"))


def _adds_a_column(df: pd.DataFrame) -> pd.DataFrame:
    df["new"] = 1  # in place, as pandas allows
    return df


def test_empty_outputs_are_frames_of_their_own():
    """A consumer changing its (empty) partition in place changes nothing else: not the
    other outputs, not the collection's meta."""
    pdf = pd.DataFrame({"k": np.arange(40) % 3, "x": np.arange(40.0)})
    ddf = dd.from_pandas(pdf, npartitions=4)
    shuffled = ddf.shuffle("k", npartitions=12, shuffle_method="service")  # 9 empty
    res = shuffled.map_partitions(_adds_a_column).compute(scheduler="sync")
    assert len(res) == 40 and (res.new == 1).all()
    assert list(ddf._meta.columns) == ["k", "x"]
    assert list(shuffled._meta.columns) == ["k", "x"]
    assert len(shuffled.map_partitions(len).compute(scheduler="sync")) == 12


@pytest.mark.parametrize("split_out", [3, 16])
def test_empty_outputs_have_no_rows_where_the_meta_has_some(split_out):
    """dask's meta of a categorical ``value_counts`` step holds a zero count per category;
    an output partition that received no rows must not: the counts would appear twice."""
    pdf = pd.DataFrame({"c": pd.Categorical(list("abcde") * 40,
                                            categories=list("abcdefghij"))})
    ddf = dd.from_pandas(pdf, npartitions=4)
    expected = pdf.c.value_counts()
    for method in ("tasks", "service"):
        with dask.config.set({"dataframe.shuffle.method": method}):
            counts = ddf.c.value_counts(split_out=split_out)
            res = counts.compute(scheduler="sync")
            lengths = counts.map_partitions(len).compute(scheduler="sync").tolist()
        assert sorted(res.index) == sorted(expected.index), (method, res)
        pd.testing.assert_series_equal(res.sort_index(), expected.sort_index())
        assert sum(lengths) == len(expected), (method, lengths)
        if split_out > len(expected):
            assert 0 in lengths, (method, lengths)  # some output partitions received nothing


def _dtypes_of_partitions(collection) -> list[tuple[int, list[str]]]:
    parts = dask.compute(*collection.to_delayed(), scheduler="sync")
    return [(len(p), [str(d) for d in p.dtypes] + [str(p.index.dtype)]) for p in parts]


def test_empty_outputs_are_made_like_the_data_where_the_meta_differs():
    """An output partition that received no rows was made from the meta, whose dtypes
    can differ from the data's (a sum of ``Int8`` is ``Int64``, a ``map_partitions``
    whose ``meta=`` is wrong, the placeholder category of unknown categoricals): its
    partitions then disagreed among themselves, where ``tasks`` makes them all like the
    data (p2p is like the first)."""
    n = 8000
    pdf = pd.DataFrame({"k": np.arange(n) % 7,
                        "x": pd.array(np.arange(n) % 5, dtype="Int8")})
    ddf = dd.from_pandas(pdf, npartitions=4)
    floats = ddf.map_partitions(lambda p: p.assign(x=p.x.astype("float64")),
                                meta=ddf._meta)  # the meta says Int8
    cats = dd.from_pandas(pd.DataFrame({"k": np.arange(60) % 2,
                                        "c": pd.Categorical(list("abc") * 20)}), 4)
    cats = cats.assign(c=cats.c.cat.as_unknown())
    cases = {
        "groupby": lambda: ddf.groupby("k").agg({"x": "sum"}, split_out=4),
        "shuffle": lambda: floats.shuffle(on="k", npartitions=4),
        "unknown categories": lambda: cats.shuffle(on="k", npartitions=4),
    }
    for name, make in cases.items():
        got = {}
        for method in ("tasks", "service"):
            with dask.config.set({"dataframe.shuffle.method": method}):
                got[method] = _dtypes_of_partitions(make())
        assert any(rows == 0 for rows, _ in got["service"]), (name, got)
        assert got["service"] == got["tasks"], name
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        parts = dask.compute(*cats.shuffle(on="k", npartitions=4).to_delayed(),
                             scheduler="sync")
    assert all(list(p.c.cat.categories) == list("abc") for p in parts)


@pytest.mark.parametrize("selected", [[1, 1], [4, 4, 2, 4, 1]])
def test_a_partition_selected_twice_is_returned_twice(selected):
    pdf = pd.DataFrame({"k": np.arange(2000) % 300, "x": np.arange(2000.0)})
    ddf = dd.from_pandas(pdf, npartitions=6)
    ours, theirs = (ddf.shuffle("k", npartitions=6, shuffle_method=method)
                    .partitions[selected].compute(scheduler="sync")
                    for method in ("service", "tasks"))
    pd.testing.assert_frame_equal(ours, theirs)


def test_culled_outputs():
    pdf = mixed_frame()[["k", "f"]]
    ddf = dd.from_pandas(pdf, npartitions=4)
    ours = shuffle(ddf, "k", npartitions=5).partitions[[0, 3]].compute(scheduler="sync")
    ref = ddf.shuffle("k", npartitions=5, shuffle_method="tasks").partitions[[0, 3]].compute(
        scheduler="sync")
    pd.testing.assert_frame_equal(ours, ref)


def test_multiindex_columns_refused():
    pdf = pd.DataFrame(np.ones((4, 2)), columns=pd.MultiIndex.from_tuples([("a", 1), ("b", 2)]))
    ddf = dd.from_pandas(pdf, npartitions=2)
    with pytest.raises(NotImplementedError, match="MultiIndex columns"):
        shuffle(ddf, ("a", 1))
    # the method chosen by name or by the config: the same refusal, not a KeyError
    # from dask's partition column (a tuple here) that the graph cannot drop
    with pytest.raises(NotImplementedError, match="MultiIndex columns.*flatten them"):
        ddf.shuffle([("a", 1)], shuffle_method="service").compute(scheduler="sync")
    with dask.config.set({"dataframe.shuffle.method": "service"}), \
            pytest.raises(NotImplementedError, match="MultiIndex columns"):
        ddf.merge(ddf, on=[("a", 1)]).compute(scheduler="sync")


def test_the_wrapper_names_what_it_takes():
    pdf = pd.DataFrame({"k": [1, 2, 3], "x": [1.0, 2.0, 3.0]})
    ddf = dd.from_pandas(pdf, npartitions=2)
    with pytest.raises(TypeError, match="takes a dask DataFrame.*pandas.*from_pandas"):
        shuffle(pdf, "k")
    with pytest.raises(TypeError, match="always shuffles with 'service'.*shuffle_method='tasks'"):
        shuffle(ddf, "k", shuffle_method="tasks")
    # naming the method it uses anyway is fine
    assert shuffle(ddf, "k", shuffle_method=None).npartitions == 2  # None: dask's "default"
    ours = shuffle(ddf, "k", npartitions=2, shuffle_method="service").compute(scheduler="sync")
    pd.testing.assert_frame_equal(ours.sort_values("k"), pdf)
    pd.testing.assert_series_equal(
        shuffle(ddf.k, ddf.k).compute(scheduler="sync").sort_values(), pdf.k)


def test_stable_order_keeps_drop_duplicates_right():
    pdf = pd.DataFrame({"k": [1, 2, 1, 2, 1, 3] * 5, "v": range(30)})
    ddf = dd.from_pandas(pdf, npartitions=4)
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        res = ddf.drop_duplicates(subset="k", keep="first", split_out=3).compute(
            scheduler="sync")
    pd.testing.assert_frame_equal(
        res.sort_values("k"), pdf.drop_duplicates(subset="k", keep="first").sort_values("k"))


frames = st.integers(0, 2**32 - 1).flatmap(lambda seed: st.tuples(
    st.just(seed), st.integers(0, 80), st.integers(1, 6), st.integers(1, 7),
    st.sampled_from(["uniform", "skewed", "one-key"]),
))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames)
def test_property_matches_tasks_and_pandas(params):
    seed, n, nin, nout, dist = params
    rng = np.random.default_rng(seed)
    keys = {"uniform": rng.integers(0, 20, n), "skewed": rng.zipf(2.0, n) % 50,
            "one-key": np.zeros(n, dtype=int)}[dist]
    pdf = pd.DataFrame({
        "k": keys,
        "x": np.where(rng.random(n) < 0.2, np.nan, rng.random(n)),
        "s": pd.Series([None if v % 5 == 0 else f"v{v}" for v in keys], dtype="str"),
        "n": pd.array(np.where(rng.random(n) < 0.3, None, keys), dtype="Int64"),
    })
    ddf = dd.from_pandas(pdf, npartitions=nin, sort=False)
    parts = partitions(shuffle(ddf, "k", npartitions=nout))
    pd.testing.assert_frame_equal(pd.concat(parts).sort_index(),
                                  ddf.compute(scheduler="sync").sort_index())
    ref = partitions(ddf.shuffle("k", npartitions=nout, shuffle_method="tasks"))
    for a, b in zip(parts, ref, strict=True):
        assert list(a.index) == list(b.index)


@pytest.mark.parametrize("on", ["k", ["k", "s"], "frame", "series"])
@pytest.mark.parametrize("ignore_index", [True, False])
def test_result_index_agrees_with_meta(on, ignore_index):
    """With ``ignore_index=True`` the outputs keep the index exactly when dask's meta of the
    shuffle does (it does for every method but ``tasks``), whatever ``on`` is: column
    names, or a frame or series of key columns."""
    from dask.dataframe.utils import assert_eq

    n = 40
    pdf = pd.DataFrame(
        {"k": np.arange(n) % 7, "s": [f"s{i % 3}" for i in range(n)], "v": np.arange(n) / 2},
        index=pd.date_range("2024-01-01", periods=n, freq="h", name="timestamp"),
    )
    ddf = dd.from_pandas(pdf, npartitions=4)
    if on == "frame":
        key = ddf[["k", "s"]].copy()
    elif on == "series":
        key = ddf["k"].copy()
    else:
        key = on
    out = ddf.shuffle(key, ignore_index=ignore_index, shuffle_method="service")
    assert out._meta.index.name == "timestamp"
    for part in partitions(out):
        assert part.index.name == out._meta.index.name
        assert part.index.dtype == out._meta.index.dtype
    assert_eq(out, pdf)  # also checks every partition against the meta
    ref = partitions(ddf.shuffle(key, ignore_index=ignore_index, shuffle_method="tasks"))
    for a, b in zip(partitions(out), ref, strict=True):  # same rows, same order
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


@pytest.mark.parametrize("how", ["inner", "left", "right", "outer"])
def test_merges(how):
    rng = np.random.default_rng(1)
    left = pd.DataFrame({"k": rng.integers(0, 30, 200), "a": rng.random(200)})
    right = pd.DataFrame({"k": rng.integers(10, 40, 150), "b": rng.random(150)})
    dl, dr = dd.from_pandas(left, npartitions=5), dd.from_pandas(right, npartitions=3)
    expected = left.merge(right, on="k", how=how)

    def canon(df):
        return df.sort_values(list(df.columns)).reset_index(drop=True)

    res = dd.merge(dl, dr, on="k", how=how, shuffle_method="service").compute(scheduler="sync")
    pd.testing.assert_frame_equal(canon(res), canon(expected))
    # on the index, and mixed index / column
    ri = right.set_index("k")
    res = dl.merge(dd.from_pandas(ri, npartitions=3), left_on="k", right_index=True, how=how,
                   shuffle_method="service").compute(scheduler="sync")
    exp = left.merge(ri, left_on="k", right_index=True, how=how)
    pd.testing.assert_frame_equal(canon(res), canon(exp))


def test_set_index_sort_values_groupby_via_config():
    rng = np.random.default_rng(2)
    pdf = pd.DataFrame({"k": rng.integers(0, 50, 500), "x": rng.random(500),
                        "g": rng.integers(0, 9, 500)})
    ddf = dd.from_pandas(pdf, npartitions=6)
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        si = ddf.set_index("k").compute(scheduler="sync")
        sv = ddf.sort_values("x").compute(scheduler="sync")
        ga = ddf.groupby("g").x.sum(split_out=3).compute(scheduler="sync")
        gapply = ddf.groupby("g").apply(lambda d: d.x.max(), meta=("x", "f8")).compute(
            scheduler="sync")
    assert si.index.is_monotonic_increasing
    pd.testing.assert_frame_equal(si.reset_index().sort_values(["k", "x"], ignore_index=True),
                                  pdf.sort_values(["k", "x"], ignore_index=True)[si.reset_index()
                                                                                .columns])
    pd.testing.assert_frame_equal(sv.reset_index(drop=True),
                                  pdf.sort_values("x").reset_index(drop=True))
    pd.testing.assert_series_equal(ga.sort_index(), pdf.groupby("g").x.sum())
    pd.testing.assert_series_equal(gapply.sort_index(), pdf.groupby("g").x.max(),
                                   check_names=False)


def lowered_kinds(collection) -> set[str]:
    return {type(node).__name__ for node in collection.expr.lower_completely().walk()}


@pytest.mark.parametrize("how", ["inner", "left", "leftsemi"])
@pytest.mark.parametrize("broadcast", [True, None])
@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_few_partitions_joined_with_many_are_broadcast(c, s, a, b, how, broadcast):
    """As with ``tasks`` and ``p2p``: ``broadcast=True``, or 2 partitions joined with 64,
    broadcast the small side instead of shuffling both (``broadcast=True`` was ignored)."""
    rng = np.random.default_rng(3)
    big = pd.DataFrame({"k": rng.integers(0, 50, 3_000), "a": rng.random(3_000)})
    small = pd.DataFrame({"k": np.arange(40), "b": np.arange(40.0)})
    merged = dd.from_pandas(big, npartitions=64).merge(
        dd.from_pandas(small, npartitions=2), on="k", how=how, broadcast=broadcast,
        shuffle_method="service")
    assert "BroadcastJoin" in lowered_kinds(merged)
    # a left join shuffles the small side first (with the default method, as dask does)
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        res = await c.compute(merged)
    if how == "leftsemi":
        exp = big[big.k.isin(small.k)]
    else:
        exp = big.merge(small, on="k", how=how)
    cols = list(exp.columns)
    pd.testing.assert_frame_equal(res.sort_values(cols).reset_index(drop=True),
                                  exp.sort_values(cols).reset_index(drop=True))
    del res
    await assert_nothing_left(s, [a, b])


def test_broadcast_false_and_outer_joins_still_shuffle_both_sides():
    big = dd.from_pandas(pd.DataFrame({"k": range(640)}), npartitions=64)
    small = dd.from_pandas(pd.DataFrame({"k": range(40), "b": 1.0}), npartitions=2)
    for how, broadcast in (("inner", False), ("outer", True), ("outer", None)):
        merged = big.merge(small, on="k", how=how, broadcast=broadcast,
                           shuffle_method="service")
        kinds = lowered_kinds(merged)
        assert "BroadcastJoin" not in kinds and "ServiceShuffle" in kinds, (how, broadcast)


@service_cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_on_a_cluster_and_merge_alignment(c, s, a, b, w3):
    pdf = mixed_frame(120)
    ddf = dd.from_pandas(pdf, npartitions=6)
    ours = await c.compute(ddf.shuffle("k", npartitions=4, shuffle_method="service"))
    pd.testing.assert_frame_equal(ours.sort_index(), ddf.compute(scheduler="sync"))

    left = pd.DataFrame({"k": np.arange(300) % 40, "a": np.arange(300)})
    right = pd.DataFrame({"k": np.arange(100) % 50, "b": np.arange(100)})
    merged = dd.merge(dd.from_pandas(left, npartitions=5), dd.from_pandas(right, npartitions=4),
                      on="k", shuffle_method="service", npartitions=6)
    # the two shuffles of the merge produce partition i on the same worker
    placed: list[list[str]] = []
    place = PlacementGroup.place

    def recorded(self, output_keys, participants, workers):
        result = place(self, output_keys, participants, workers)
        placed.append(list(result.values()))
        return result

    with mock.patch.object(PlacementGroup, "place", recorded):
        res = await c.compute(merged)
    assert len(placed) == 2 and placed[0] == placed[1] and len(placed[0]) == 6, placed
    exp = left.merge(right, on="k")
    pd.testing.assert_frame_equal(res.sort_values(["k", "a", "b"]).reset_index(drop=True),
                                  exp.sort_values(["k", "a", "b"]).reset_index(drop=True))
    del ours, res
    await assert_nothing_left(s, [a, b, w3])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_shuffles_into_one_partition_one_after_another_take_turns(c, s, a, b):
    """Each new placement group starts where the last round-robin stopped: shuffles into
    one partition, one after another, do not all put it on the first worker."""
    placed: list[str] = []
    place = PlacementGroup.place

    def recorded(self, output_keys, participants, workers):
        result = place(self, output_keys, participants, workers)
        placed.extend(result.values())
        return result

    pdf = pd.DataFrame({"k": np.arange(200) % 7, "x": np.arange(200)})
    with mock.patch.object(PlacementGroup, "place", recorded):
        for i in range(4):
            got = await c.compute(dd.from_pandas(pdf.assign(x=pdf.x + i), npartitions=4)
                                  .shuffle("k", npartitions=1, shuffle_method="service"))
            assert len(got) == 200
            await assert_nothing_left(s, [a, b])
    assert len(placed) == 4 and set(placed) == {a.address, b.address}, placed


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_shuffle_places_its_outputs_over_the_workers_of_its_own_time(c, s, a, b):
    """A shuffle into N partitions shares its placement with the shuffles into N known to
    the scheduler at the same time (the two sides of a merge); once they are gone, the
    next one spreads over the workers there are then.  The first mapping stayed for the
    scheduler's life: after a shuffle restricted to one worker, or run before the cluster
    grew, every later shuffle into N put all its outputs where that first one did."""
    from distributed import Worker

    pdf = pd.DataFrame({"k": np.arange(2_000) % 97, "x": np.arange(2_000)})

    async def holders(frame) -> Counter:
        return Counter(w for ws in (await c.who_has(frame)).values() for w in ws)

    first = c.persist(dd.from_pandas(pdf, npartitions=4).shuffle(
        "k", npartitions=8, shuffle_method="service"), workers=[a.address])
    await wait(first)
    assert await holders(first) == {a.address: 8}
    del first
    async with Worker(s.address, nthreads=1) as w3:
        await c.wait_for_workers(3)
        later = c.persist(dd.from_pandas(pdf.assign(x=pdf.x + 1), npartitions=4).shuffle(
            "k", npartitions=8, shuffle_method="service"))
        await wait(later)
        spread = await holders(later)
        assert set(spread) == {a.address, b.address, w3.address}, spread
        assert max(spread.values()) <= 3, spread
        result = await c.compute(later)
        pd.testing.assert_frame_equal(result.sort_values("x"), pdf.assign(x=pdf.x + 1))
        del later, result
        await assert_nothing_left(s, [a, b, w3])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_small_inputs_travel_as_arrays_with_every_dtype(c, s, a, b):
    """Small inputs that take the column way (no categorical) are split, sent and
    assembled as arrays between real workers: every dtype, the index and the rows' order
    as pandas gives them."""
    from dask_services.dataframe import _service

    pdf = mixed_frame(120).drop(columns="cat")
    pdf.index = pd.Index(np.arange(120) * 3, name="idx")
    with dask.config.set({"dataframe.convert-string": False}):  # keep the mixed object column
        ddf = dd.from_pandas(pdf, npartitions=6)
    made = []

    def counted(*args):
        made.append(args)
        return rows_of_arrays(*args)

    rows_of_arrays = _service.rows_of_arrays
    with mock.patch.object(_service, "rows_of_arrays", counted):
        ours = await c.compute(ddf.shuffle("k", npartitions=4, shuffle_method="service"))
    assert made  # the arrays path was taken
    assert dict(ours.dtypes) == dict(pdf.dtypes)
    pd.testing.assert_frame_equal(ours.sort_index(), pdf)
    expected = ddf.shuffle("k", npartitions=4, shuffle_method="tasks").compute(scheduler="sync")
    pd.testing.assert_frame_equal(ours, expected)  # same partitions, same order
    del ours
    await assert_nothing_left(s, [a, b])


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_spill_under_way_as_outputs_are_assembled_loses_no_rows(c, s, a, b):
    """The worker's memory check asks the shuffle to spill at any time: one that starts
    as a window of outputs is assembled, its pieces handed to the I/O thread and not yet
    written, must not make those outputs without them (they lost every large piece, the
    rows of big input partitions, silently: 12 of 15 runs of a merge, shuffle and groupby
    chain on workers over their memory target)."""
    import asyncio

    from dask_services._spill import SpillBuffer
    from dask_services.dataframe._service import DataFrameShuffle

    pdf = pd.DataFrame({"k": np.arange(40_000) % 997, "x": np.arange(40_000.0)})
    ddf = dd.from_pandas(pdf, npartitions=4)  # 10,000 rows each: large pieces
    take, assemble = SpillBuffer.take, DataFrameShuffle._assemble_window
    spills: dict[int, asyncio.Future] = {}  # buffer -> its spill

    with held_up_spill_writes() as release:

        async def spill_then_assemble(self, *args):
            if not spills:
                # the first window's small pieces are out: a spill starts, its write held
                # up until the buffer's next take, once the window chose how to assemble
                spills[id(self.buffer)] = asyncio.ensure_future(self.buffer.spill())
                await until(lambda: self.buffer.writing_bytes)  # handed to the I/O thread
            return await assemble(self, *args)

        async def released_take(self, partition):
            if id(self) in spills:
                release.set()
            return await take(self, partition)

        with mock.patch.object(DataFrameShuffle, "_assemble_window", spill_then_assemble), \
                mock.patch.object(SpillBuffer, "take", released_take):
            ours = await c.compute(ddf.shuffle("k", npartitions=4,
                                               shuffle_method="service"))
    (spill,) = spills.values()
    assert await spill > 0  # it had pieces to write
    pd.testing.assert_frame_equal(ours.sort_values("x"), pdf)
    del ours
    await assert_nothing_left(s, [a, b])


def test_service_method_name_is_registered():
    assert dask_services.dataframe.METHOD == "service"


def test_hand_offs_are_fused_with_the_steps_making_their_input():
    pdf = mixed_frame()[["k", "f"]]
    ddf = dd.from_pandas(pdf, npartitions=4).map_partitions(lambda d: d.assign(g=d.f * 2))
    shuffled = ddf.shuffle("k", shuffle_method="service")
    graph = dict(shuffled.optimize().__dask_graph__())
    kinds = Counter(key_split(k) for k in graph)
    # a task per input partition maps it and hands it off: the map has no task of its own
    assert kinds.pop("lambda-shufflehandoffs") == 4 and "lambda" not in kinds, kinds
    ref = ddf.shuffle("k", shuffle_method="tasks")
    for ours, theirs in zip(partitions(shuffled), partitions(ref), strict=True):
        pd.testing.assert_frame_equal(ours, theirs)
    # an input with another consumer is computed once, and handed off by a task of its own
    both, total = dask.compute(shuffled, ddf.f.sum(), scheduler="sync")
    pd.testing.assert_frame_equal(both.sort_index(), ddf.compute(scheduler="sync"))
    assert total == pytest.approx(pdf.f.sum())


def test_a_shuffle_and_selections_of_it_computed_together():
    pdf = mixed_frame()[["k", "f"]]
    ddf = dd.from_pandas(pdf, npartitions=4)
    ours = ddf.shuffle("k", npartitions=5, shuffle_method="service")
    ref = ddf.shuffle("k", npartitions=5, shuffle_method="tasks")
    got = dask.compute(ours, ours.partitions[0], ours.partitions[[1, 3]], ours.head(2),
                       scheduler="sync")
    expected = dask.compute(ref, ref.partitions[0], ref.partitions[[1, 3]], ref.head(2),
                            scheduler="sync")
    for a, b in zip(got, expected, strict=True):
        pd.testing.assert_frame_equal(a, b)


def make_slice_of(i: int) -> pd.DataFrame:
    return mixed_frame(120)[["k", "f", "str"]].iloc[i * 20:(i + 1) * 20]


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_fused_hand_offs_on_a_cluster(c, s, a, b):
    made = dd.from_map(make_slice_of, range(6), meta=make_slice_of(0).iloc[:0],
                       enforce_metadata=False)
    ours = made.shuffle("k", npartitions=4, shuffle_method="service")
    ref = made.shuffle("k", npartitions=4, shuffle_method="tasks")
    got = await c.compute(ours.optimize())  # as persist() optimizes: fused
    pd.testing.assert_frame_equal(got, ref.compute(scheduler="sync"))
    # the inputs were made inside the hand-offs: no task of their own ran
    groups = [g for g in s.task_groups if g.startswith("make_slice_of")]
    assert groups and all("shufflehandoffs" in g for g in groups), groups
    # three shuffles of one input (so its tasks are not fused) computed at once
    got, *selections = await c.gather(c.compute(
        [ours, ours.partitions[2], ours.head(3, npartitions=2, compute=False)]))
    expected = dask.compute(ref, ref.partitions[2], ref.head(3, npartitions=2, compute=False),
                            scheduler="sync")
    for x, y in zip([got, *selections], expected, strict=True):
        pd.testing.assert_frame_equal(x, y)
    # a persisted input is handed off by its own keys, not through dask's alias tasks
    persisted = c.persist(made)
    await wait(persisted)
    held = {f.key for f in c.futures_of(persisted)}
    shuffled = persisted.shuffle("k", npartitions=4, shuffle_method="service").optimize()
    handoffs = [t for t in dict(shuffled.__dask_graph__()).values()
                if isinstance(t, HandOffSpec)]
    assert len(handoffs) == 6 and all(t.dependencies <= held for t in handoffs)
    pd.testing.assert_frame_equal(await c.compute(shuffled), expected[0])
    del got, selections, persisted, shuffled
    await assert_nothing_left(s, [a, b])


@pytest.mark.parametrize("index", [
    pd.date_range("2010-01-01", periods=60, freq="D"),
    pd.date_range("2010-01-01", periods=60, freq="h", tz="Europe/Paris"),
    pd.timedelta_range("1s", periods=60, freq="s"),
    pd.date_range("2010-01-01", periods=61, freq="D").delete(30),  # no frequency
])
@pytest.mark.parametrize("npartitions", [1, 3, 7])
def test_a_datetime_index_keeps_its_frequency_as_with_tasks(index, npartitions):
    """pandas keeps a frequency through a concatenation of contiguous slices of one; the
    partitions rebuilt from arrays had none (dask's ``groupby(...).shift(freq=...)`` test)."""
    pdf = pd.DataFrame({"k": np.arange(60) // 7 % 3, "x": np.arange(60.0)}, index=index)
    ddf = dd.from_pandas(pdf, npartitions=6, sort=False)
    ours = partitions(ddf.shuffle("k", npartitions=npartitions, shuffle_method="service"))
    ref = partitions(ddf.shuffle("k", npartitions=npartitions, shuffle_method="tasks"))
    for a, b in zip(ours, ref, strict=True):
        # (an empty partition's frequency differs between tasks' own partitions)
        pd.testing.assert_frame_equal(a, b, check_freq=len(b) > 0)
    expected = pdf.groupby("k").shift(periods=-2, freq=index.freq or "D")
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        got = ddf.groupby("k").shift(periods=-2, freq=index.freq or "D", meta=expected)
        got = got.compute(scheduler="sync")
    pd.testing.assert_frame_equal(got.sort_index(), expected.sort_index(), check_freq=True)


def test_an_input_partition_with_other_columns_than_its_meta_is_named():
    # it was handed back as it was: partitions with a column the collection's meta lacks
    pdf = pd.DataFrame({"k": np.arange(400) % 10, "x": np.arange(400.0)})

    def made(i, how):
        part = pdf.iloc[i * 100:(i + 1) * 100]
        if how == "extra":
            return part.assign(z=1) if i == 1 else part
        if how == "twice":
            return pd.concat([part, part[["x"]]], axis=1) if i == 1 else part
        return part[["x", "k"]]  # every partition in another order than the meta

    for how, columns, more in [("extra", "['k', 'x', 'z']", "['z']"),
                               ("twice", "['k', 'x', 'x']", "['x']")]:
        odd = dd.from_map(made, range(4), how=how, meta=pdf.head(0))
        with pytest.raises(ValueError, match=re.escape(
                f"shuffle: input partition 1 has columns {columns} where the collection's "
                f"meta has ['k', 'x'] (more than in the meta: {more}; fewer: [])")):
            odd.shuffle("k", npartitions=3, shuffle_method="service").compute(
                scheduler="sync")
    # columns in another order are the same columns, in the meta's order as with tasks
    reordered = dd.from_map(made, range(4), how="reordered", meta=pdf.head(0))
    ours = partitions(reordered.shuffle("k", npartitions=3, shuffle_method="service"))
    ref = partitions(reordered.shuffle("k", npartitions=3, shuffle_method="tasks"))
    for a, b in zip(ours, ref, strict=True):
        assert list(a.columns) == ["k", "x"]
        pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("case", ["drop_duplicates", "every_other_row", "unsorted_input"])
def test_the_index_frequency_is_the_one_tasks_gives_not_the_metas(case):
    # outputs took the meta's frequency wherever their rows allowed it: a one-row
    # partition always did, and rows 2 s apart kept "s" where tasks gave "2s" or none,
    # so index.shift(1) gave other timestamps, or some where tasks raises
    index = pd.date_range("2001", periods=12, freq="s")
    pdf = pd.DataFrame({"k": [1, 1, 0, 1, 0, 1, 2, 2, 3, 1, 0, 3]}, index=index)
    ddf = dd.from_pandas(pdf, npartitions=2)
    if case == "drop_duplicates":  # one row per output, kept 2 s apart by the first step
        first = dd.from_pandas(pd.DataFrame({"k": [1, 1, 0, 1, 0, 1]}, index=index[:6]),
                               npartitions=1)

        def make(method):
            return first.drop_duplicates(split_out=4, shuffle_method=method)
    elif case == "every_other_row":
        def make(method):
            return ddf.map_partitions(lambda d: d.iloc[::2]).shuffle(
                "k", npartitions=3, shuffle_method=method)
    else:
        def make(method):
            return ddf.shuffle("k", npartitions=2, shuffle_method=method)

    ours, ref = partitions(make("service")), partitions(make("tasks"))
    for a, b in zip(ours, ref, strict=True):
        pd.testing.assert_frame_equal(a, b, check_freq=len(b) > 0)

    def next_stamps(part):
        try:
            return pd.Series(part.index.shift(1).astype(str), index=part.index)
        except Exception as e:  # tasks: NullFrequencyError where the rows have none
            return pd.Series(type(e).__name__, index=part.index, dtype=object)

    got, expected = (make(m).map_partitions(next_stamps, meta=(None, object))
                     .compute(scheduler="sync") for m in ("service", "tasks"))
    pd.testing.assert_series_equal(got, expected)


@service_cluster(nthreads=[("127.0.0.1", 1)] * 2)
async def test_a_wide_frame_shuffles_and_merges_as_pandas_does(c, s, a, b):
    """Frames wider than ``COLUMN_WAY_MAX_COLUMNS`` take pandas' way on every path (small
    pieces, into 7 partitions; pieces of more than ``SMALL_PIECE_ROWS`` rows, into 2; a
    merge), their dtypes interleaved; the result is what pandas gives."""
    rng = np.random.default_rng(5)
    n = 8_000  # 667 rows per input partition
    pdf = pd.DataFrame({"k": rng.integers(0, 40, n),
                        **{f"c{j}": (rng.random(n) if j % 3 else rng.integers(0, 9, n))
                           for j in range(300)}})
    ddf = dd.from_pandas(pdf, npartitions=12)
    for npartitions in (7, 2):
        ours = await c.compute(ddf.shuffle("k", npartitions=npartitions,
                                           shuffle_method="service"))
        pd.testing.assert_frame_equal(ours.sort_index(), pdf)
    right = dd.from_pandas(pd.DataFrame({"k": np.arange(40), "r": np.arange(40.0)}), 3)
    merged = await c.compute(ddf.merge(right, on="k", shuffle_method="service",
                                       broadcast=False))
    expected = pdf.merge(right.compute(scheduler="sync"), on="k")
    pd.testing.assert_frame_equal(merged.sort_values(["k", "c1"]).reset_index(drop=True),
                                  expected.sort_values(["k", "c1"]).reset_index(drop=True))
