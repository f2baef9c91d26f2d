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
    assert SimpleShuffle._parameters[:6] == [
        "frame", "partitioning_index", "npartitions_out", "ignore_index", "options",
        "original_partitioning_index",
    ]
    # every hash shuffle goes through Shuffle(..., method) with a "_partitions" column
    src = inspect.getsource(RearrangeByColumn._lower)
    assert "Shuffle(" in src and '"_partitions"' in src
    assert "self.method or get_default_shuffle_method()" in inspect.getsource(_expr._dask_lower)


def test_unknown_methods_still_refused_by_dask():
    import dask.dataframe as dd
    import pandas as pd

    df = dd.from_pandas(pd.DataFrame({"a": [1, 2, 3]}), npartitions=2)
    with pytest.raises(ValueError, match="not supported"):
        df.shuffle("a", shuffle_method="nope").compute(scheduler="sync")
