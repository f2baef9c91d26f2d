"""The array rechunk as a service: ``rechunk(x, chunks)`` and the ``"service"`` method.

Importing ``dask_services`` registers the rechunk method name ``"service"``::

    x.rechunk((1000, -1), method="service")
    with dask.config.set({"array.rechunk.method": "service"}):
        y = x.rechunk("auto")
"""

from __future__ import annotations

from typing import Any

from dask_services.array._rechunk import METHOD, register, service_rechunk


def rechunk(x: Any, chunks: Any = "auto", *, block_size_limit: Any = None,
            balance: bool = False) -> Any:
    """Rechunk the dask array ``x`` with the ``"service"`` method.

    ``chunks`` is anything ``Array.rechunk`` takes (a tuple, a dict by axis, ``-1``,
    ``None``, ``"auto"``); ``balance=True`` evens out chunk sizes as dask does.  Results
    equal ``x.rechunk(chunks, method="tasks")``; every result chunk is a new, writeable,
    C-ordered numpy array.
    """
    import dask.array as da

    from dask_services.client import _maybe_install_default_client

    if not isinstance(x, da.Array):
        raise TypeError(
            f"dask_services.array.rechunk takes a dask Array, got "
            f"{type(x).__module__}.{type(x).__qualname__}; make one with "
            f"dask.array.from_array(x, chunks=...)"
        )
    _maybe_install_default_client()
    return service_rechunk(x, chunks, block_size_limit=block_size_limit, balance=balance)


register()

__all__ = ["METHOD", "rechunk", "register"]
