"""dask_services where the dask config lost its ``dask_services`` section after import.

distributed's test utilities (``gen_cluster``) reset the config around every test to a copy
taken when ``distributed.utils_test`` was first imported; a test module importing it
before ``dask_services`` (or ``dask.config.refresh()``) leaves the section out.  Every
read then falls back to the packaged defaults, on the client, the scheduler and the
workers."""

from __future__ import annotations

import copy

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed.utils_test import gen_cluster
from replicated_services import Adder
from utils import assert_nothing_left

from dask_services.config import packaged_default, setting

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def snapshot_without_section(monkeypatch):
    """The copy ``gen_cluster`` resets the config to, as taken before the import."""
    import distributed.utils_test

    snapshot = copy.deepcopy(distributed.utils_test.original_config)
    snapshot.pop("dask_services", None)
    monkeypatch.setattr(distributed.utils_test, "original_config", snapshot)


def test_setting_falls_back_to_the_packaged_default(monkeypatch):
    monkeypatch.delitem(dask.config.config, "dask_services")
    assert setting("restarts") == 3
    assert setting("rechunk.merge-region-max") == "16 MiB"
    assert setting("rechunk.pairs-per-task") == 400
    assert setting("threads") is None
    with dask.config.set({"dask_services.shuffle.groups": 4}):
        assert setting("shuffle.groups") == 4  # a value set still wins
        assert setting("shuffle.buffer-fraction") == 0.25  # its neighbours: defaults
    with pytest.raises(KeyError, match="dask_services.no-such-key"):
        setting("no-such-key")


def test_every_checked_key_has_a_packaged_default():
    from dask_services._config_check import KEYS

    for key in KEYS:
        packaged_default(key)  # raises KeyError for a key the yaml lacks


def test_graphs_services_and_replicas_without_the_section(snapshot_without_section):
    @gen_cluster(client=True, nthreads=[("", 1)] * 2, timeout=90)
    async def run(c, s, a, b):
        assert "dask_services" not in dask.config.config
        assert all(w.extensions.get("dask_services") is None for w in (a, b))

        x = np.arange(200 * 200, dtype="f8").reshape(200, 200)
        y = da.from_array(x, chunks=(10, 200)).rechunk((200, 10), method="service")
        assert any(str(k).startswith("rechunk-service-task") for k in y.__dask_graph__())
        np.testing.assert_array_equal(await c.compute(y), x)

        pdf = pd.DataFrame({"k": np.arange(300) % 7, "v": np.arange(300.0)})
        ddf = dd.from_pandas(pdf, npartitions=6)
        out = await c.compute(ddf.shuffle("k", shuffle_method="service")
                              .groupby("k").v.sum())
        pd.testing.assert_series_equal(out.sort_index(), pdf.groupby("k").v.sum())

        svc = await Adder.options(replicas=2).as_service(5, client=c)
        assert await svc.add.route(1) == 6
        await svc.shutdown()

        assert "dask_services" not in dask.config.config
        s.validate_state()
        for w in (a, b):
            w.validate_state()
        await assert_nothing_left(s, [a, b])

    run()
