"""Rows of a received frame, sliced only when an output partition is assembled.

A received frame of large pieces holds the rows of many output partitions.  Cutting it
into one pandas slice per partition as it arrives cost ~50 us per slice on the event loop
(a ``DataFrame`` and its blocks per slice), and concatenating an output's slices cost as
much again per slice.  Here the frame is kept whole: each partition's share is a
:class:`FrameRows` (the frame and a row range), and :func:`concat_rows` builds an output
from its shares column by column, slicing the frames' arrays (a fraction of a
microsecond for a numpy column) instead of the frames.  Shares that cannot take that way
(frames whose dtypes or columns differ from the meta's, categoricals, a ``MultiIndex``)
are sliced and concatenated by pandas, as before.

A share written to disk (``_spill.py`` pickles it) takes only its own rows with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from pandas.api.extensions import ExtensionArray


class RowSource:
    """A received frame, and its columns as arrays once an assembly asks for them."""

    __slots__ = ("frame", "_columns", "_column_way")

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame
        self._columns: list[Any] | None = None
        self._column_way: bool | None = None

    def takes_column_way(self, meta: pd.DataFrame) -> bool:
        """:func:`takes_column_way` of the frame (found once)."""
        if self._column_way is None:
            self._column_way = takes_column_way(self.frame, meta)
        return self._column_way

    def columns(self) -> list[Any]:
        """Each column's values: a numpy array, or the extension array itself."""
        if self._columns is None:
            self._columns = [_values(self.frame.iloc[:, j]) for j in range(self.frame.shape[1])]
        return self._columns


class FrameRows:
    """Rows ``start:stop`` of a :class:`RowSource`'s frame."""

    __slots__ = ("source", "start", "stop")

    def __init__(self, source: RowSource, start: int, stop: int) -> None:
        self.source = source
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def frame(self) -> pd.DataFrame:
        """These rows as a pandas slice."""
        return self.source.frame.iloc[self.start:self.stop]

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (spilled): these rows only, not the whole frame they are part of
        return (_rows_of, (self.frame(),))


def _rows_of(frame: pd.DataFrame) -> FrameRows:
    return FrameRows(RowSource(frame), 0, len(frame))


def _values(column: pd.Series) -> Any:
    values = column.array
    if type(values) is pd.arrays.NumpyExtensionArray:  # not its subclasses (StringArray)
        return values.to_numpy()  # no copy
    return values


def takes_column_way(frame: pd.DataFrame, meta: pd.DataFrame) -> bool:
    """Whether the rows of ``frame`` can be concatenated by :func:`concat_rows`: the same
    columns and dtypes as ``meta``, nothing categorical, a flat index of the meta's type."""
    if meta.ndim != 2 or isinstance(meta.index, pd.MultiIndex):
        return False
    if isinstance(meta.index.dtype, pd.CategoricalDtype):
        return False
    dtypes = meta.dtypes.tolist()
    if any(isinstance(d, pd.CategoricalDtype) for d in dtypes):
        return False
    return (frame.dtypes.tolist() == dtypes and frame.columns.equals(meta.columns)
            and frame.index.dtype == meta.index.dtype
            and not isinstance(frame.index, pd.MultiIndex))


def concat_rows(pieces: list[FrameRows], meta: pd.DataFrame,
                ignore_index: bool) -> pd.DataFrame:
    """The rows of ``pieces``, in order, as one frame: what ``pd.concat`` of their slices
    gives, for pieces whose frames take the column way (:func:`takes_column_way`)."""
    columns = []
    for j in range(meta.shape[1]):
        parts = [piece.source.columns()[j][piece.start:piece.stop] for piece in pieces]
        if isinstance(parts[0], np.ndarray):
            columns.append(np.concatenate(parts))
        else:
            extension: type[ExtensionArray] = type(parts[0])
            columns.append(extension._concat_same_type(parts))
    if ignore_index:
        index: pd.Index = pd.RangeIndex(sum(len(p) for p in pieces))
    else:
        indexes = [piece.source.frame.index[piece.start:piece.stop] for piece in pieces]
        index = indexes[0].append(indexes[1:]) if len(indexes) > 1 else indexes[0]
    # as Series of their own dtype: a frame made from bare arrays would infer another
    # dtype for object columns (strings, datetimes)
    out = pd.DataFrame({j: pd.Series(values, index=index, dtype=values.dtype, copy=False)
                        for j, values in enumerate(columns)}, copy=False)
    out.columns = meta.columns
    return out
