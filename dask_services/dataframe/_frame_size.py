"""The size of a pandas DataFrame as dask's ``sizeof`` gives it, without its cost per column.

dask measures a frame column by column: it builds a Series for each one and asks it for its
memory (``DataFrame._series``, ``Series.memory_usage``), ~0.15 ms a column, so a frame of
2,000 columns took 305 ms to measure, longer than it took to assemble. For a frame whose
columns all hold a numpy dtype other than ``object`` each column's memory is its rows times
its itemsize, and the same figure comes from the dtypes alone. Any other frame (Python
objects, which dask samples; extension dtypes, whose memory their arrays report; repeated
column labels, which dask counts once) is measured by dask itself.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pandas as pd
from dask.sizeof import sizeof

# dask's fixed cost per run of columns of one dtype, and per frame at least
_PER_DTYPE_RUN = 1200
_AT_LEAST = 1200


def frame_sizeof(frame: Any) -> int:
    """dask's ``sizeof(frame)``, from the dtypes where every column holds a numpy dtype."""
    columns = getattr(frame, "columns", None)
    if columns is None or not columns.is_unique:
        return int(sizeof(frame))
    dtypes = frame.dtypes.tolist()
    if not all(isinstance(d, np.dtype) and d.kind != "O" for d in dtypes):
        return int(sizeof(frame))
    runs = sum(1 for i, d in enumerate(dtypes) if i == 0 or d != dtypes[i - 1])
    data = len(frame) * sum(d.itemsize for d in dtypes)
    total = sizeof(frame.index) + sizeof(columns) + _PER_DTYPE_RUN * runs + data
    return int(max(_AT_LEAST, total))


def holds_objects(dtype: Any) -> bool:
    """Whether a column of ``dtype`` holds Python objects (which dask's ``sizeof``
    samples)."""
    return dtype == np.dtype(object) or (isinstance(dtype, pd.StringDtype)
                                          and dtype.storage == "python")


def object_cell_bytes(frame: Any) -> tuple[np.ndarray, int] | None:
    """For a frame with columns of Python objects (``object``, python-backed strings):
    each row's bytes in those columns (``sys.getsizeof`` of each cell: exact for strings,
    bytes and arrays that own their data; a container's own size), and the size of the
    rest of the frame (its other columns and index, as dask measures them). None for a
    frame without such columns.

    dask samples 100 cells of such a column, so a partition of 2,000 small rows and one
    300 MB cell measured 1.9 MB or 6,002 MB depending on the draw; the shuffle's buffers,
    sized from it, held 500 MB received as a few MB and never spilled. Measuring each cell
    costs ~100 ns."""
    dtypes = list(getattr(frame, "dtypes", ()))
    objects = [i for i, d in enumerate(dtypes) if holds_objects(d)]
    if not objects:
        return None
    rows = np.zeros(len(frame), dtype=np.int64)
    for i in objects:
        cells = np.asarray(frame.iloc[:, i].array, dtype=object)
        rows += np.fromiter(map(sys.getsizeof, cells), dtype=np.int64, count=len(cells))
    others = set(range(len(dtypes))).difference(objects)
    rest = frame.iloc[:, sorted(others)]
    return rows, frame_sizeof(rest)
