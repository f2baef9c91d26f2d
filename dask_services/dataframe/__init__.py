"""P2P DataFrame shuffle as a service task.

Importing ``dask_services`` registers the shuffle method name ``"service"``::

    df.shuffle("key", shuffle_method="service")
    dd.merge(a, b, on="key", shuffle_method="service")
    with dask.config.set({"dataframe.shuffle.method": "service"}):
        df.set_index("key"); df.sort_values("x"); df.groupby("k").apply(f)
"""

from __future__ import annotations

from typing import Any

import dask.dataframe as dd

from dask_services.dataframe._expr import (
    METHOD,
    ServiceShuffle,
    refuse_multiindex_columns,
    register,
)
from dask_services.dataframe._service import DataFrameShuffle

register()

__all__ = ["METHOD", "DataFrameShuffle", "ServiceShuffle", "shuffle"]


def shuffle(df: Any, on: Any, npartitions: int | None = None, **kwargs: Any) -> Any:
    """Shuffle ``df`` so that rows with equal ``on`` share a partition, peer to peer.

    Same rows per output partition as ``df.shuffle(on, shuffle_method="tasks")``.
    """
    if not isinstance(df, (dd.DataFrame, dd.Series)):
        raise TypeError(
            f"dask_services.dataframe.shuffle takes a dask DataFrame or Series, got "
            f"{type(df).__module__}.{type(df).__qualname__}; make one with "
            f"dask.dataframe.from_pandas(df, npartitions=...)"
        )
    method = kwargs.pop("shuffle_method", None) or METHOD  # None: this function's own
    if method != METHOD:
        raise TypeError(
            f"dask_services.dataframe.shuffle always shuffles with {METHOD!r}, got "
            f"shuffle_method={method!r}; for another method call "
            f"df.shuffle(on, shuffle_method={method!r})"
        )
    refuse_multiindex_columns(df._meta)
    return df.shuffle(on, npartitions=npartitions, shuffle_method=METHOD, **kwargs)
