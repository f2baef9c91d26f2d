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

A share written to disk (``_spill.py`` pickles it) takes only its own rows with it, as
bare arrays where its frame takes the column way: a share read back is then its columns'
and index's values, with no frame to build or take apart (for 2,600-row shares, writing
and reading back took half the time of a pickled frame, and finding a read-back frame's
columns and dtypes again cost another ~0.5 ms each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.extensions import ExtensionArray

from dask_services.dataframe._frame_size import holds_objects


class RowSource:
    """A received frame, and its columns and index as arrays once an assembly asks for them.

    A source read back from disk has no frame, only its columns' and index's values
    (:meth:`of_arrays`), which is all :func:`concat_rows` needs; its frame is built only
    if a pandas concatenation asks for it (:meth:`frame_like`).
    """

    __slots__ = ("_frame", "_columns", "_index", "_column_way")

    def __init__(self, frame: pd.DataFrame, column_way: bool | None = None) -> None:
        """``column_way``: :func:`takes_column_way` of ``frame``, if known."""
        self._frame: pd.DataFrame | None = frame
        self._columns: list[Any] | None = None
        # (values, name), set at once: the spill thread may read it while an assembly
        # in a service thread finds it
        self._index: tuple[Any, Any] | None = None
        self._column_way = column_way

    @classmethod
    def of_arrays(cls, columns: list[Any], index: Any, index_name: Any) -> RowSource:
        """The source of a frame that takes the column way, from its columns' values and
        its index's values and name."""
        source = cls.__new__(cls)
        source._frame = None
        source._columns = columns
        source._index = (index, index_name)
        source._column_way = True
        return source

    def takes_column_way(self, meta: pd.DataFrame) -> bool:
        """:func:`takes_column_way` of the frame (found once)."""
        if self._column_way is None:
            assert self._frame is not None
            self._column_way = takes_column_way(self._frame, meta)
        return self._column_way

    def columns(self) -> list[Any]:
        """Each column's values: a numpy array, or the extension array itself."""
        if self._columns is None:
            assert self._frame is not None
            frame = self._frame
            self._columns = [_values(column) for _, column in frame.items()]
        return self._columns

    def index(self) -> tuple[Any, Any]:
        """The index's values (as :meth:`columns` gives a column's) and its name."""
        if self._index is None:
            assert self._frame is not None
            self._index = (_values(self._frame.index), self._frame.index.name)
        return self._index

    def index_slice(self, start: int, stop: int) -> pd.Index:
        """Rows ``start:stop`` of the index."""
        if self._frame is not None:
            return self._frame.index[start:stop]
        values, name = self.index()
        return pd.Index(values[start:stop], dtype=values.dtype, name=name, copy=False)

    def frame_like(self, meta: pd.DataFrame) -> pd.DataFrame:
        """The frame; one read back from disk is rebuilt with the meta's column labels
        (a source that takes the column way has the meta's columns)."""
        if self._frame is None:
            index = self.index_slice(0, len(self.index()[0]))
            self._frame = _frame_of(self.columns(), index, meta)
        return self._frame


class FrameRows:
    """Rows ``start:stop`` of a :class:`RowSource`'s frame."""

    __slots__ = ("source", "start", "stop")

    def __init__(self, source: RowSource, start: int, stop: int) -> None:
        self.source = source
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def frame(self, meta: pd.DataFrame) -> pd.DataFrame:
        """These rows as a pandas slice."""
        return self.source.frame_like(meta).iloc[self.start:self.stop]

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (spilled): these rows only, not the whole frame they are part of; as
        # bare arrays where the frame takes the column way
        source, a, b = self.source, self.start, self.stop
        if source._column_way:
            values, name = source.index()
            return (_rows_of_arrays, ([c[a:b] for c in source.columns()], values[a:b], name))
        assert source._frame is not None
        return (_rows_of, (source._frame.iloc[a:b],))


class ColumnWay:
    """Whether frames take the column way for one meta (:func:`takes_column_way`), found
    for a small frame for the price of reading its columns: the meta's side is found once.
    """

    def __init__(self, meta: pd.DataFrame) -> None:
        self.possible = meta_allows_column_way(meta)
        self.labels = meta.columns.tolist() if meta.ndim == 2 else []
        self.dtypes = meta.dtypes.tolist() if meta.ndim == 2 else []
        self.index_dtype = meta.index.dtype

    def values_of(self, frame: pd.DataFrame, drop: Any = None, dropping: bool = False
                  ) -> tuple[list[Any], Any, Any] | None:
        """``frame``'s columns' values in order (without the columns labelled ``drop``
        when ``dropping``), its index's values and its index's name, if ``frame`` so
        takes the column way; else None."""
        if (not self.possible or isinstance(frame.index, pd.MultiIndex)
                or frame.index.dtype != self.index_dtype):
            return None
        labels = frame.columns.tolist()
        try:
            kept = [not (dropping and (label is drop or label == drop)) for label in labels]
            if [label for label, keep in zip(labels, kept, strict=True) if keep] != self.labels:
                return None
        except (TypeError, ValueError):  # labels that do not compare (``pd.NA``): pandas' way
            return None
        # ``items`` (a Series per column by position): half of ``iloc[:, j]``'s cost
        values = [_values(column) for (_, column), keep
                  in zip(frame.items(), kept, strict=True) if keep]
        if [v.dtype for v in values] != self.dtypes:
            return None
        return values, _values(frame.index), frame.index.name


def rows_of_arrays(columns: list[Any], index: Any, index_name: Any) -> FrameRows:
    """All rows of a frame that takes the column way, given as its columns' values and
    its index's values and name (as a spilled share is read back)."""
    return FrameRows(RowSource.of_arrays(columns, index, index_name), 0, len(index))


def sliced(rows: pd.DataFrame | FrameRows, start: int, stop: int) -> pd.DataFrame | FrameRows:
    """Rows ``start:stop`` of a frame (a pandas slice), or of all rows of a frame taken as
    arrays (a :class:`FrameRows` of slices of its arrays)."""
    if not isinstance(rows, FrameRows):
        return rows.iloc[start:stop]
    source = rows.source
    index, name = source.index()
    return rows_of_arrays([c[start:stop] for c in source.columns()], index[start:stop], name)


def rows_nbytes(rows: FrameRows) -> int:
    """The bytes of the rows of a :class:`FrameRows` whose source takes the column way, as
    dask's ``sizeof`` of their frame counts its columns and index (without its fixed
    overheads); a few microseconds where ``sizeof`` of a frame takes ~0.5 ms."""
    source, a, b = rows.source, rows.start, rows.stop
    index, _ = source.index()
    return sum(_values_nbytes(c[a:b]) for c in source.columns()) + _values_nbytes(index[a:b])


def _values_nbytes(values: Any) -> int:
    dtype = values.dtype
    if holds_objects(dtype):
        # Python objects: dask samples them (its sizeof of the column, without the
        # column's fixed overheads)
        from dask.sizeof import sizeof

        series = pd.Series(values, dtype=dtype, copy=False)
        return sizeof(series) - sizeof(series.iloc[:0])
    return int(values.nbytes)


def take_rows(pieces: list[FrameRows], order: np.ndarray, meta: pd.DataFrame,
              ignore_index: bool) -> pd.DataFrame:
    """Rows ``order`` of the concatenation of ``pieces`` (whose sources take the column
    way), as one frame: what ``pd.concat`` of their slices, then ``take(order)``, gives."""
    columns = [_concat_values([p.source.columns()[j][p.start:p.stop] for p in pieces])
               .take(order) for j in range(meta.shape[1])]
    if ignore_index:
        index: pd.Index = pd.RangeIndex(len(order))
    else:
        names = {p.source.index()[1] for p in pieces}
        values = _concat_values([p.source.index()[0][p.start:p.stop] for p in pieces])
        index = pd.Index(values.take(order), dtype=values.dtype,
                         name=names.pop() if len(names) == 1 else None, copy=False)
    return _frame_of(columns, index, meta)


def _rows_of(frame: pd.DataFrame) -> FrameRows:
    return FrameRows(RowSource(frame), 0, len(frame))


def _rows_of_arrays(columns: list[Any], index: Any, index_name: Any) -> FrameRows:
    return rows_of_arrays(columns, index, index_name)


def _values(column: pd.Series | pd.Index) -> Any:
    values = column.array
    if type(values) is pd.arrays.NumpyExtensionArray:  # not its subclasses (StringArray)
        return values.to_numpy()  # no copy
    return values


# Frames wider than this take pandas' way: the column way costs per column and piece (a
# slice, a concatenation, a Series to build the output from), pandas' per block.  A 1.6 GB
# shuffle then a sum per partition, 2 workers, 100 partitions of 2,000 columns: 172 s the
# column way, 81-91 s pandas' (p2p 368 s); of 200 columns 12.0-20.8 s against
# 8.3-16.9 s; of 64 columns level (3.2-5.9 s either way); design/dataframe-shuffle.md.
COLUMN_WAY_MAX_COLUMNS = 128


def meta_allows_column_way(meta: pd.DataFrame) -> bool:
    """Whether frames of ``meta`` may take the column way at all: a frame (not a series)
    of at most ``COLUMN_WAY_MAX_COLUMNS`` columns, a flat index, nothing categorical."""
    return (meta.ndim == 2 and meta.shape[1] <= COLUMN_WAY_MAX_COLUMNS
            and not isinstance(meta.index, pd.MultiIndex)
            and not isinstance(meta.index.dtype, pd.CategoricalDtype)
            and not any(isinstance(d, pd.CategoricalDtype) for d in meta.dtypes.tolist()))


def takes_column_way(frame: pd.DataFrame, meta: pd.DataFrame) -> bool:
    """Whether the rows of ``frame`` can be concatenated by :func:`concat_rows`: the same
    columns and dtypes as ``meta``, nothing categorical, a flat index of the meta's type."""
    if not meta_allows_column_way(meta):
        return False
    return (frame.dtypes.tolist() == meta.dtypes.tolist()
            and frame.columns.equals(meta.columns)
            and frame.index.dtype == meta.index.dtype
            and not isinstance(frame.index, pd.MultiIndex))


def concat_rows(pieces: list[FrameRows], meta: pd.DataFrame,
                ignore_index: bool) -> pd.DataFrame:
    """The rows of ``pieces``, in order, as one frame: what ``pd.concat`` of their slices
    gives, for pieces whose frames take the column way (:func:`takes_column_way`)."""
    columns = [_concat_values([piece.source.columns()[j][piece.start:piece.stop]
                               for piece in pieces])
               for j in range(meta.shape[1])]
    if ignore_index:
        index: pd.Index = pd.RangeIndex(sum(len(p) for p in pieces))
    else:
        indexes = [piece.source.index_slice(piece.start, piece.stop) for piece in pieces]
        index = indexes[0].append(indexes[1:]) if len(indexes) > 1 else indexes[0]
    return _frame_of(columns, index, meta)


def concat_frames(frames: list[pd.DataFrame], ignore_index: bool = False,
                  concat: Callable[..., pd.DataFrame] | None = None) -> pd.DataFrame:
    """``concat(frames, ignore_index=...)`` (dask's concatenation by default: pandas' way),
    with the columns of wide frames grouped by dtype first and put back in their order
    after.

    pandas concatenates frames whose blocks interleave (an integer column among float
    ones, say) column by column: for 100 pieces of 2,000 such columns 0.43 s, against
    0.05 s for the same pieces with their columns grouped (one block per dtype), the
    grouping and the reordering of the result included; from about 100 columns on it
    costs less than it saves.  A permutation of the columns taken alike in every frame
    changes nothing but their order, whatever each frame's dtypes, as long as the frames
    have the same columns."""
    if concat is None:
        from dask.dataframe.core import _concat as concat
    first = frames[0] if frames else None
    if (first is None or getattr(first, "ndim", 1) != 2
            or first.shape[1] <= COLUMN_WAY_MAX_COLUMNS
            or any(not f.columns.equals(first.columns) for f in frames[1:])):
        return concat(frames, ignore_index=ignore_index)
    codes: dict[Any, int] = {}
    order = np.argsort([codes.setdefault(d, len(codes)) for d in first.dtypes.tolist()],
                       kind="stable")
    if len(codes) == 1 or bool((order[1:] > order[:-1]).all()):
        return concat(frames, ignore_index=ignore_index)  # already grouped
    result = concat([f.iloc[:, order] for f in frames], ignore_index=ignore_index)
    return result.iloc[:, np.argsort(order)]


def _concat_values(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)  # a copy even of one part: never a view into a frame
    extension: type[ExtensionArray] = type(parts[0])
    return extension._concat_same_type(parts)


def _frame_of(columns: list[Any], index: pd.Index, meta: pd.DataFrame) -> pd.DataFrame:
    # as Series of their own dtype: a frame made from bare arrays would infer another
    # dtype for object columns (strings, datetimes)
    out = pd.DataFrame({j: pd.Series(values, index=index, dtype=values.dtype, copy=False)
                        for j, values in enumerate(columns)}, copy=False)
    if not columns:  # a frame of its index alone: made of no column, it would have no rows
        out = pd.DataFrame(index=index)
    out.columns = meta.columns
    return out
