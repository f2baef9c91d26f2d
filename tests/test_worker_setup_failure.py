"""A worker on which dask_services cannot set up (a config value given to that worker
alone is wrong): runs needing it fail with the setup's error instead of waiting for ever,
and the worker's other work goes on."""

from __future__ import annotations

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Nanny
from distributed.utils_test import gen_cluster

import dask_services

pytestmark = pytest.mark.timeout(120)


@gen_cluster(client=True, nthreads=[("", 1)], timeout=100)
async def test_runs_on_a_worker_that_could_not_set_up_fail_with_its_error(c, s, a):
    # a config given to this worker alone (as `dask worker` started with
    # DASK_DASK_SERVICES__THREADS=0 would have)
    async with Nanny(s.address, nthreads=1, config={"dask_services": {"threads": 0}}) as n:
        await c.wait_for_workers(2)
        await dask_services.install_async(c)
        bad = n.worker_address
        assert await c.run(lambda dask_worker: "dask_services" in dask_worker.extensions) \
            == {a.address: True, bad: False}

        pdf = pd.DataFrame({"k": np.arange(400) % 9, "v": np.arange(400.0)})
        parts = [c.submit(lambda i: pdf.iloc[i * 50:(i + 1) * 50], i, pure=False,
                          workers=[a.address if i % 2 else bad]) for i in range(8)]
        ddf = dd.from_delayed(parts, meta=pdf.iloc[:0])
        with pytest.raises(dask_services.WorkerSetupError,
                           match=rf"could not set up on worker {bad}.*dask_services.threads"):
            await c.compute(ddf.shuffle("k", shuffle_method="service"))

        x = da.ones((40, 40), chunks=(4, 40))
        with pytest.raises(dask_services.WorkerSetupError, match="dask_services.threads"):
            await c.compute(x.rechunk((40, 4), method="service"), workers=[bad])

        # the worker itself is fine: plain tasks run there, and the run on the other
        # worker alone works
        assert await c.submit(lambda: 1 + 1, workers=[bad]) == 2
        y = await c.compute((x + 1).rechunk((40, 4), method="service"), workers=[a.address])
        np.testing.assert_array_equal(y, np.full((40, 40), 2.0))
        s.validate_state()


@pytest.mark.parametrize("threads", ["2", 2.0])
@gen_cluster(client=True, timeout=60)
async def test_a_whole_number_of_threads_given_as_text_or_float_sets_up(c, s, a, b,
                                                                       threads):
    # the config check takes "2" and 2.0, as the other counts' readers do; the worker
    # refused them (WorkerSetupError on every run)
    import dask

    with dask.config.set({"dask_services.threads": threads}):
        await dask_services.install_async(c)
        x = da.ones((40, 40), chunks=(4, 40))
        total = await c.compute(x.rechunk((40, 4), method="service").sum())
    assert total == 1600
    assert all(w.extensions["dask_services"].threads.threads == 2 for w in (a, b))
