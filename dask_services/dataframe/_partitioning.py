"""Which output partition each row goes to: dask's hash partitioning, computed cheaply.

dask-expr puts the target partition of every row into a ``_partitions`` column with
``AssignPartitioningIndex.operation``: it selects the partitioning columns (or the index),
casts numeric ones to float64 (so that ``1`` and ``1.0`` meet) and hashes them with
``dask.dataframe.shuffle.partitioning_index``.  Selecting columns by a list of names builds
a new column index each time, and pandas' hashing of a frame builds a Series per column
and one for the result: for a 200-row partition 1.5 ms, where hashing the column's array
takes 14 us.  :func:`target_partitions` gives the same numbers for the common case (every
partitioning key is a column of a frame with unique column names, of a dtype whose hashed
values are known) by hashing the columns' arrays with ``pandas.util.hash_array`` and
combining them as pandas does, and calls dask's own function for everything else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex, _is_numeric_cast_type

# (partitioning_index, index_name, npartitions_out, meta, index_shuffle): the operands of
# AssignPartitioningIndex after its frame
Assign = tuple[Any, str, int, Any, bool]


def target_partitions(df: pd.DataFrame | pd.Series, assign: Assign) -> np.ndarray:
    """The output partition of every row of ``df``, as ``AssignPartitioningIndex`` gives it."""
    index, name, npartitions, meta, index_shuffle = assign
    if not _plain_columns(df, meta, index, index_shuffle):
        return AssignPartitioningIndex.operation(df, *assign)[name].to_numpy()
    hashes = []
    for column in index:
        values = _hashed_values(df[column], _is_numeric_cast_type(meta[column].dtype))
        if values is None:
            return AssignPartitioningIndex.operation(df, *assign)[name].to_numpy()
        hashes.append(pd.util.hash_array(values))
    partitions = _combine_hashes(hashes) % np.uint64(npartitions)
    return partitions.astype(np.min_scalar_type(-npartitions - 1))  # as dask's


def _hashed_values(column: pd.Series, cast: bool) -> Any:
    """The values pandas' ``hash_pandas_object`` hashes for ``column`` (after dask's cast
    of numeric keys to float64), or None where only dask's own path is known to agree."""
    dtype = column.dtype
    if isinstance(dtype, np.dtype):
        if cast:
            return column.to_numpy(np.float64) if dtype.kind in "biuf" else None
        if dtype.kind in "mM":
            return column.array  # what pandas hashes for datetimes: its datetime array
        return column.to_numpy() if dtype.kind in "biufcOSU" else None
    if cast:
        return None  # a nullable or categorical numeric: the cast may or may not apply
    return column.array


def _combine_hashes(hashes: list[np.ndarray]) -> np.ndarray:
    """The row hashes of several columns, combined as ``hash_pandas_object`` combines a
    frame's (``tests/test_partitioning.py`` checks the two agree)."""
    mult = np.uint64(1000003)
    out = np.zeros_like(hashes[0]) + np.uint64(0x345678)
    for i, h in enumerate(hashes):
        remaining = len(hashes) - i
        out ^= h
        out *= mult
        mult += np.uint64(82520 + remaining + remaining)
    out += np.uint64(97531)
    return out


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
