"""Which output partition each row goes to: dask's hash partitioning, computed cheaply.

dask-expr puts the target partition of every row into a ``_partitions`` column with
``AssignPartitioningIndex.operation``: it selects the partitioning columns (or the index),
casts numeric ones to float64 (so that ``1`` and ``1.0`` meet) and hashes them with
``dask.dataframe.shuffle.partitioning_index``.  Selecting columns by a list of names builds
a new column index each time, which for a few thousand rows costs more than the hashing.
:func:`target_partitions` gives the same numbers for the common case (every partitioning
key is a column of a frame with unique column names) from the columns themselves, and
calls dask's own function for everything else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex, _is_numeric_cast_type
from dask.dataframe.shuffle import partitioning_index

# (partitioning_index, index_name, npartitions_out, meta, index_shuffle): the operands of
# AssignPartitioningIndex after its frame
Assign = tuple[Any, str, int, Any, bool]


def target_partitions(df: pd.DataFrame | pd.Series, assign: Assign) -> np.ndarray:
    """The output partition of every row of ``df``, as ``AssignPartitioningIndex`` gives it."""
    index, name, npartitions, meta, index_shuffle = assign
    if not _plain_columns(df, meta, index, index_shuffle):
        return AssignPartitioningIndex.operation(df, *assign)[name].to_numpy()
    keys = {}
    for i, column in enumerate(index):
        values = df[column]
        if _is_numeric_cast_type(meta[column].dtype):
            values = values.astype(np.float64, errors="ignore")
        keys[i] = values
    # the hash combines the columns' hashes in order; their names play no part in it
    return np.asarray(partitioning_index(pd.DataFrame(keys, copy=False), npartitions))


def _plain_columns(df: Any, meta: Any, index: Any, index_shuffle: bool) -> bool:
    """Whether every partitioning key is a column, named once, of both ``df`` and ``meta``."""
    if index_shuffle or not isinstance(index, list) or not index:
        return False
    if getattr(df, "ndim", 0) != 2 or getattr(meta, "ndim", 0) != 2:
        return False
    if not (df.columns.is_unique and meta.columns.is_unique):
        return False
    return all(
        (np.isscalar(c) or pd.api.types.is_scalar(c) or isinstance(c, tuple))
        and c in df.columns and c in meta.columns
        for c in index
    )
