"""How call arguments and results travel between callers and replicas.

distributed's serialization (``to_serialize``) handles large buffers well (numpy arrays
without copies, compression, splitting into frames), but costs tens of microseconds per
message even for a small value: a dispatch on the type, ``sizeof`` of the value, a
serialization header, a metrics context.  On a replicated call that is a large part of the
caller's cost.  So a value whose pickle is small and has no out-of-band buffers travels as
plain pickled bytes in the message (msgpack carries bytes as they are); anything else
still goes through ``to_serialize``.  The two use different keys, so nothing is guessed
on arrival.
"""

from __future__ import annotations

from typing import Any

from distributed.protocol import pickle
from distributed.protocol.serialize import serialize, to_serialize

from dask_services._messages import unwrap
from dask_services._quiet import quietly

SMALL = 64 * 1024  # bytes: larger pickles go through distributed's serialization


def pack(value: Any, key: str) -> dict[str, Any]:
    """``{key: to_serialize(value)}``, or ``{"pickled": bytes}`` for a small value.

    Raises ``TypeError`` for a value that neither pickle nor distributed's serializers can
    send, here rather than when the message is written, where the failure would look like
    a broken connection and take the calls sharing the message with it."""
    buffers: list[Any] = []
    try:
        data = quietly(pickle.dumps, value, buffer_callback=buffers.append)
    except Exception as e:
        try:  # a type that distributed serializes its own way (dask_serialize)
            quietly(serialize, value, on_error="raise")
        except Exception:
            raise TypeError(f"{type(e).__name__}: {e}") from e
        return {key: to_serialize(value)}
    if buffers or len(data) > SMALL:
        return {key: to_serialize(value)}
    return {"pickled": data}


def unpack(msg: dict[str, Any], key: str) -> Any:
    """The value that :func:`pack` put in ``msg``."""
    if "pickled" in msg:
        return pickle.loads(msg["pickled"])
    return unwrap(msg[key])
