"""Peer-call payloads that the receiver deserializes itself, after the call took its turn.

A peer call carries a sequence number so that calls from one instance to another start in
order.  If the worker's comm deserialized the arguments while reading the message, a payload
that fails to deserialize would fail the read itself: the handler would never run, the
receiver would never learn the call's sequence number, and every later call on that channel
would wait forever.  So arguments (and results) travel as :class:`Packed` frames: distributed
is asked to write frames that were serialized before the call took its turn (:func:`pack`,
in a thread when large, as distributed's comms do), and on reading it hands the handler the
frames untouched; :func:`unpack` turns them into the value where a failure can be answered
like any other error of the call.
Frames are passed through as they are, so numpy, pandas and arrow buffers are not copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from dask.sizeof import sizeof
from distributed.comm.utils import OFFLOAD_THRESHOLD
from distributed.protocol.serialize import (
    dask_deserialize,
    dask_serialize,
    deserialize,
    serialize,
)
from distributed.utils import offload

from dask_services._counters import size_of
from dask_services._quiet import quietly
from dask_services.service import PeerCallError

_SERIALIZERS = ("dask", "pickle")

# The bytes of the arguments of the peer calls made in this context, when the caller knows
# them (``arguments_of_size``): measuring them again with ``sizeof`` costs a call per piece.
_arguments_nbytes: ContextVar[int | None] = ContextVar("arguments_nbytes", default=None)


@contextlib.contextmanager
def arguments_of_size(nbytes: int) -> Iterator[None]:
    """Peer calls made inside carry arguments of about ``nbytes`` bytes."""
    token = _arguments_nbytes.set(nbytes)
    try:
        yield
    finally:
        _arguments_nbytes.reset(token)


def known_arguments_nbytes() -> int | None:
    """The bytes of the arguments of a peer call made here, as its caller said them
    (``arguments_of_size``), or None."""
    return _arguments_nbytes.get()


class Packed:
    """A value serialized for a peer: distributed's header and frames, passed through."""

    __slots__ = ("header", "frames")

    def __init__(self, header: dict, frames: list) -> None:
        self.header = header
        self.frames = frames

    @property
    def nbytes(self) -> int:
        return sum(memoryview(f).nbytes for f in self.frames)


@dask_serialize.register(Packed)
def _serialize_packed(packed: Packed) -> tuple[dict, list]:
    return {"inner": packed.header}, list(packed.frames)


@dask_deserialize.register(Packed)
def _deserialize_packed(header: dict, frames: list) -> Packed:
    return Packed(header["inner"], list(frames))


@sizeof.register(Packed)
def _sizeof_packed(packed: Packed) -> int:
    # Already serialized: writing it only passes its frames on, no work worth a thread.
    return 64


def _serialize(value: Any) -> Packed:
    header, frames = quietly(serialize, value, serializers=_SERIALIZERS, on_error="raise")
    return Packed(header, frames)


def _deserialize(packed: Packed) -> Any:
    return deserialize(packed.header, packed.frames)


def _large(nbytes: int) -> bool:
    return bool(OFFLOAD_THRESHOLD) and nbytes > OFFLOAD_THRESHOLD


async def pack(value: Any, what: str, nbytes: int | None = None) -> Packed:
    """Serialize ``value`` (in a thread when it is large, as distributed's comms do; its
    size is ``nbytes`` if given, else measured); :class:`PeerCallError` naming ``what`` if
    it cannot be."""
    try:
        if _large(size_of(value) if nbytes is None else nbytes):
            # (0 where sizeof raises: serialized here, as distributed takes such a value
            # to be small, rather than refused as one that "could not be serialized")
            return await offload(_serialize, value)
        return _serialize(value)
    except Exception as exc:
        raise PeerCallError(
            f"{what} could not be serialized: {type(exc).__name__}: {exc}"
        ) from exc


async def unpack(packed: Any, what: str) -> Any:
    """The value ``packed`` carries; :class:`PeerCallError` naming ``what`` if it cannot be
    deserialized here."""
    if not isinstance(packed, Packed):
        return packed
    try:
        if _large(packed.nbytes):
            return await offload(_deserialize, packed)
        return _deserialize(packed)
    except Exception as exc:
        raise PeerCallError(
            f"{what} could not be deserialized: {type(exc).__name__}: {exc}. Every worker "
            "must be able to import the types it carries (same packages and versions)"
        ) from exc
