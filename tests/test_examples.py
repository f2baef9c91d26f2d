"""The example services against plain Python, on hypothesis-generated inputs."""

from __future__ import annotations

import functools
import operator

import dask
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_nothing_left, service_cluster

import dask_services
from dask_services.demo_services import Histogram
from dask_services.examples import AllReduce, SampleSort

pytestmark = pytest.mark.timeout(120)

numbers = st.one_of(st.integers(-10**6, 10**6), st.floats(-1e6, 1e6, allow_nan=False))
chunks = st.lists(st.lists(numbers, max_size=20), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=chunks, n_out=st.integers(1, 6), instances=st.integers(1, 4))
def test_sample_sort_matches_sorted(chunks, n_out, instances):
    xs = [dask.delayed(c) for c in chunks]
    with dask.config.set({"dask_services.local-instances": instances}):
        parts = dask.compute(*dask_services.service_task(SampleSort, xs, outputs=n_out,
                                                         samples_per_instance=4),
                             scheduler="sync")
    assert [v for p in parts for v in p] == sorted(v for c in chunks for v in c)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.integers(-1000, 1000), min_size=1, max_size=15),
       op=st.sampled_from(["sum", "max", "min"]), n_out=st.integers(1, 4))
def test_allreduce_matches_reduce(values, op, n_out):
    expected = functools.reduce({"sum": operator.add, "max": max, "min": min}[op], values)
    outs = dask_services.service_task(AllReduce, [dask.delayed(v) for v in values],
                                      outputs=n_out, op=op)
    assert list(dask.compute(*outs, scheduler="threads")) == [expected] * n_out


def test_allreduce_of_arrays_and_unknown_op():
    arrays = [np.full(3, i) for i in range(4)]
    (out,) = dask_services.service_task(AllReduce, [dask.delayed(a) for a in arrays], outputs=1)
    np.testing.assert_array_equal(out.compute(scheduler="sync"), np.full(3, 6))
    bad = dask_services.service_task(AllReduce, [dask.delayed(1)], outputs=1, op="median")
    with pytest.raises(ValueError, match="unknown op 'median'"):
        bad[0].compute(scheduler="sync")


@service_cluster(nthreads=[("127.0.0.1", 1)] * 3)
async def test_examples_on_a_cluster(c, s, a, b, w3):
    rng = np.random.default_rng(42)
    data = [rng.integers(0, 100, size=int(rng.integers(0, 50))).tolist() for _ in range(20)]
    futs = await c.scatter(data)
    parts, hist = await c.gather([
        dask_services.submit(SampleSort, futs, outputs=5, client=c),
        dask_services.submit(Histogram, futs, outputs=3, client=c, bins=10, high=100),
    ])
    flat = [v for ch in data for v in ch]
    assert [v for p in parts for v in p] == sorted(flat)
    merged = {k: v for h in hist for k, v in h.items()}
    expected, _ = np.histogram(flat, bins=10, range=(0, 100))
    assert [merged[i] for i in range(10)] == expected.tolist()
    del futs, parts, hist
    await assert_nothing_left(s, [a, b, w3])
