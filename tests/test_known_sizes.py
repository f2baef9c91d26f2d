"""Sizes given to ``produce_key(nbytes=)``: what dask's ``sizeof`` and the worker take."""

from __future__ import annotations

import gc

import dask
import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof
from hypothesis import given, settings
from hypothesis import strategies as st
from utils import assert_errs, assert_nothing_left, service_cluster

import dask_services
from dask_services import Service
from dask_services._known_sizes import (
    _wrapped,
    checked_nbytes,
    remember,
    remembered,
    remembered_count,
)
from dask_services.graph import OutputClaimSpec

pytestmark = pytest.mark.timeout(60)


def measured_by_dask(value) -> int:
    """What dask's sizeof measures, whether or not its type is wrapped."""
    return _wrapped.get(type(value), sizeof.dispatch(type(value)))(value)


def test_a_remembered_size_is_what_sizeof_returns_while_the_value_lives():
    before = remembered_count()
    value = np.zeros(100)
    other = np.zeros(100)
    assert remember(value, 7) is True
    assert sizeof(value) == 7 and remembered(value) == 7
    assert sizeof(other) == measured_by_dask(other) == sizeof(np.zeros(100))
    assert remembered(other) is None
    assert remembered_count() == before + 1
    del value
    gc.collect()
    assert remembered_count() == before


def test_values_without_weak_references_are_measured():
    before = remembered_count()
    for value in ([1, 2, 3], {"a": 1}, (1, 2), 12345):
        assert remember(value, 3) is False
        assert sizeof(value) != 3
    assert remembered_count() == before


def test_a_subclass_is_wrapped_on_its_own():
    class Tagged(np.ndarray):
        pass

    tagged = np.zeros(10).view(Tagged)
    plain = np.zeros(10)
    assert remember(tagged, 1)
    assert sizeof(tagged) == 1
    assert remembered(plain) is None and sizeof(plain) == measured_by_dask(plain)
    assert sizeof(np.zeros(10).view(Tagged)) == sizeof(plain)  # measured as before


frames = st.builds(
    lambda n, seed, kinds: pd.DataFrame({
        f"c{j}": (np.random.default_rng(seed + j).random(n) if kind == "float"
                  else pd.array([f"s{i % 7}" for i in range(n)], dtype=kind))
        for j, kind in enumerate(kinds)}),
    st.integers(0, 300), st.integers(0, 1000),
    st.lists(st.sampled_from(["float", "str", "string", "object"]), max_size=4))


@settings(max_examples=40, deadline=None)
@given(frames, st.integers(0, 10**9))
def test_frames_measure_as_dask_measures_them_unless_remembered(frame, nbytes):
    expected = measured_by_dask(frame)
    copy = frame.copy()
    remember(frame, nbytes)
    assert sizeof(frame) == nbytes
    # dask samples columns of Python objects at random: compare the others exactly
    if not any(dtype in (np.dtype(object), pd.StringDtype("python"))
               for dtype in frame.dtypes):
        assert sizeof(copy) == expected


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", [4], 2**63, 2**64, 10**30])
def test_a_size_that_is_not_a_byte_count_is_refused(bad):
    # 2**64 and above were taken: the worker's next message to the scheduler failed to
    # pack, and the scheduler dropped the worker
    with pytest.raises(ValueError, match="not a size in bytes"):
        checked_nbytes(bad)


def test_numpy_integers_are_sizes():
    assert checked_nbytes(np.int64(5)) == 5 and type(checked_nbytes(np.int64(5))) is int
    assert checked_nbytes(2**63 - 1) == 2**63 - 1  # the largest a message carries


class ProducesSized(Service):
    """Produces ``np.arange(10)`` (or, with ``as_int``, the int 7) for every output it
    owns, with ``nbytes=given``."""

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader,
                    given=None, as_int=False, **kwargs) -> None:
        self.given = given
        self.as_int = as_int

    async def add_key(self, key, data) -> None:
        pass

    async def all_inputs_done(self) -> None:
        for out in self.concierge.wanted_outputs:
            if self.concierge.owner(out) == self.id:
                value = 7 if self.as_int else np.arange(10)
                await self.concierge.produce_key(out, value, nbytes=self.given)


@service_cluster()
async def test_the_worker_and_scheduler_take_the_size_given(c, s, a, b):
    before = remembered_count()
    outs = c.compute(dask_services.service_task(ProducesSized, [], outputs=4, given=12345))
    results = await c.gather(outs)
    assert all((r == np.arange(10)).all() for r in results)
    for out in outs:
        assert s.tasks[out.key].nbytes == 12345
        (holder,) = [w for w in (a, b) if out.key in w.data]
        assert holder.state.tasks[out.key].nbytes == 12345
        assert remembered(holder.data[out.key]) == 12345
    # the memory manager weighs it so too
    assert sum(w.data.fast.total_weight for w in (a, b)) >= 4 * 12345
    s.validate_state()
    del outs, results, out
    await assert_nothing_left(s, [a, b])
    gc.collect()
    assert remembered_count() == before


@service_cluster()
async def test_a_value_without_weak_references_is_measured_by_the_worker(c, s, a, b):
    outs = c.compute(dask_services.service_task(ProducesSized, [], outputs=2, given=12345,
                                                as_int=True))
    assert await c.gather(outs) == [7, 7]
    assert [s.tasks[o.key].nbytes for o in outs] == [sizeof(7)] * 2
    del outs
    await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_a_size_that_is_not_a_byte_count_fails_the_task(c, s, a, b):
    (fut,) = c.compute(dask_services.service_task(ProducesSized, [], outputs=1, given=-3))
    await assert_errs(fut, ValueError, "nbytes=-3 is not a size in bytes")
    del fut
    await assert_nothing_left(s, [a, b])


def strings_frame() -> pd.DataFrame:
    return pd.DataFrame({"k": np.arange(400) % 37, "v": np.random.default_rng(0).random(400),
                         "t": pd.array([f"s{i}" for i in range(400)], dtype="str")})


def wide_numeric_frame() -> pd.DataFrame:
    """Measured from its dtypes (``_frame_size.py``), in pandas' way (> 128 columns)."""
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.random((400, 150)), columns=[f"c{i}" for i in range(150)])
    frame["k"] = np.arange(400) % 37
    frame["v"] = rng.random(400)
    frame["b"] = frame.v > 0.5
    return frame


@pytest.mark.parametrize("make", [strings_frame, wide_numeric_frame])
@service_cluster()
async def test_shuffle_outputs_are_measured_once_where_they_are_built(c, s, a, b, make):
    import dask.dataframe as dd

    before = remembered_count()
    pdf = make()
    df = dd.from_pandas(pdf, npartitions=8)
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        out = c.persist(df.shuffle("k", npartitions=6))
    parts = await c.gather(c.compute(out.to_delayed()))
    assert sorted(pd.concat(parts).v.tolist()) == sorted(pdf.v.tolist())
    outputs = [k for k in s.tasks if isinstance(s.tasks[k].run_spec, OutputClaimSpec)]
    assert len(outputs) == 6
    for key in outputs:
        (holder,) = [w for w in (a, b) if key in w.data]
        frame = holder.data[key]
        assert remembered(frame) is not None
        assert s.tasks[key].nbytes == remembered(frame) == measured_by_dask(frame)
    del out, parts, frame
    await assert_nothing_left(s, [a, b])
    gc.collect()
    assert remembered_count() == before
