"""Masked chunks in a service task's rechunk, carried as one plain array of two planes.

A masked chunk (``numpy.ma.MaskedArray``) is turned, as it is handed off to an instance,
into a structured numpy array of two fields: its data and its mask (``as_planes``).  Every
path of the exchange (the pieces, packed buffers, the lane, receive buffers and their spill
files, in-place assembly) then slices, moves and writes it as any numpy array of one dtype,
and an output chunk made of such pieces becomes a masked array again when it is handed out
(``as_masked``), with the fill value its dtype carries (the first masked chunk's among its
pieces: numpy keeps a dtype's metadata through views, copies and pickles).  A piece of a
plain chunk written into an output with planes is unmasked there, as
``numpy.ma.concatenate`` of masked and plain arrays gives.  (Copies and merges, which
exchange nothing, assemble values and masks apart: ``_pieces.assembled_apart``.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

DATA = "dask_services:data"
MASK = "dask_services:mask"


def planes_dtype(data: np.dtype, fill_value: Any = None) -> np.dtype:
    """The dtype of a masked chunk of ``data`` values carried as planes (a structured
    ``data`` has a mask of one boolean per field, as numpy's masked arrays do), carrying
    the chunk's ``fill_value`` (``None``: numpy's default)."""
    return np.dtype([(DATA, data), (MASK, np.ma.make_mask_descr(data))],
                    metadata=None if fill_value is None else {"fill_value": fill_value})


def fill_value_of_masked(block: np.ma.MaskedArray) -> Any:
    """``block``'s fill value (numpy's default for float16, 1e20, overflows to ``inf``
    without a warning)."""
    with np.errstate(over="ignore"):
        return block.fill_value


def fill_value_of(dtype: np.dtype) -> Any:
    """The fill value a dtype with planes carries (``None``: numpy's default)."""
    return (dtype.metadata or {}).get("fill_value")


def has_planes(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is that of a masked chunk carried as planes."""
    return dtype.names == (DATA, MASK)


def data_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of the values of a chunk of ``dtype`` (planes or not)."""
    return dtype[DATA] if has_planes(dtype) else dtype


def as_planes(block: np.ma.MaskedArray) -> np.ndarray:
    """``block``'s data and mask (``False`` everywhere where it has none) in one new
    structured array."""
    data = np.ma.getdata(block)
    out = np.empty(data.shape, planes_dtype(data.dtype, fill_value_of_masked(block)))
    out[DATA] = data
    out[MASK] = np.ma.getmaskarray(block)
    return out


def as_masked(chunk: np.ndarray) -> np.ndarray:
    """An output chunk as it is handed out: a masked array (C-ordered data and mask of
    their own, the fill value its dtype carries) where it was assembled with planes, else
    ``chunk`` itself."""
    if not has_planes(chunk.dtype):
        return chunk
    return np.ma.MaskedArray(np.ascontiguousarray(chunk[DATA]),
                             mask=np.ascontiguousarray(chunk[MASK]),
                             fill_value=fill_value_of(chunk.dtype))


def write(out: np.ndarray, where: Any, piece: np.ndarray) -> None:
    """``piece`` written into ``out[where]``: as numpy assigns, but into an output with
    planes a plain piece is written as values with no mask (numpy would assign it to both
    fields) and a piece with planes of another value dtype plane by plane."""
    if out.dtype == piece.dtype or not has_planes(out.dtype):
        out[where] = piece
        return
    target = out[where]
    if has_planes(piece.dtype):
        target[DATA] = piece[DATA]
        target[MASK] = piece[MASK]
    else:
        target[DATA] = piece
        target[MASK] = False


def converted(chunk: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A copy of ``chunk`` in ``dtype`` (a plain chunk into planes: values, no mask)."""
    if has_planes(dtype) and chunk.dtype != dtype:
        out = np.empty(chunk.shape, dtype)
        write(out, ..., chunk)
        return out
    return chunk.astype(dtype)
