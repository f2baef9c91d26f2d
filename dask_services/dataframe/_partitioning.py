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
        hashes.append(_hash_numbers(values) if _eight_byte_numbers(values)
                      else pd.util.hash_array(values))
    partitions = _combine_hashes(hashes)
    np.remainder(partitions, np.uint64(npartitions), out=partitions)
    return partitions.astype(np.min_scalar_type(-npartitions - 1))  # as dask's


def _eight_byte_numbers(values: Any) -> bool:
    return (isinstance(values, np.ndarray) and values.dtype.kind in "iuf"
            and values.dtype.itemsize == 8)


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_NEGATIVE_ZERO = np.array(-0.0).view(np.uint64)
_NAN = np.array(np.nan).view(np.uint64)


def _hashes_alike(a: float, b: float) -> bool:
    hashed = pd.util.hash_array(np.array([a, b], dtype=np.float64))
    return bool(hashed[0] == hashed[1])


# Whether pandas hashes every NaN as NaN, and -0.0 as 0.0 (pandas 3 does; pandas 2 hashes
# the bit patterns as they are): dask's partitions follow the installed pandas, and so
# must ours
_CANONICAL_NAN = _hashes_alike(np.nan, -np.nan)
_CANONICAL_ZERO = _hashes_alike(0.0, -0.0)


def _hash_numbers(values: np.ndarray) -> np.ndarray:
    """``pd.util.hash_array(values)`` of 8-byte numbers, computed in one copy of them and
    one scratch array: pandas makes a new array at every step (on a 517,000-row key that
    was ~10 arrays of 4 MB, each new one faulting its pages in)."""
    out = values.view(np.uint64).copy()
    if values.dtype.kind == "f":  # as the installed pandas: NaNs and -0.0 perhaps alike
        if _CANONICAL_NAN:
            nan = np.isnan(values)
            if nan.any():
                out[nan] = _NAN
        if _CANONICAL_ZERO:
            out[out == _NEGATIVE_ZERO] = 0
    scratch = np.empty_like(out)
    for shift, mix in ((30, _MIX[0]), (27, _MIX[1])):
        np.right_shift(out, np.uint64(shift), out=scratch)
        out ^= scratch
        out *= mix
    np.right_shift(out, np.uint64(31), out=scratch)
    out ^= scratch
    return out


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
    frame's (``tests/test_partitioning.py`` checks the two agree), in place in the first
    (every hash is an array of its own)."""
    mult = np.uint64(1000003)
    out = hashes[0]
    out ^= np.uint64(0x345678)  # pandas starts from 0x345678 and xors the first hash in
    for i, h in enumerate(hashes):
        remaining = len(hashes) - i
        if i:
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
