"""A handle's watch over a replica it awaits answers from: re-sent if it was replaced.

A worker that freezes (a long native call holding the GIL, a stopped process) breaks no
connection, so a caller would wait for it while the scheduler, its health probe failing,
relaunches the replica elsewhere.  :class:`ReplacementWatch` asks the scheduler (through
the handle's replica table) now and then, and aborts the connection once the replica's slot
has a new incarnation: the calls or the stream on it are then lost in flight and re-sent
(or, a stream past its first item, fail).  Used by ``_handle.py`` and ``_streaming.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from dask_services.replicated._background import consume

if TYPE_CHECKING:
    from dask_services.replicated._handle import ReplicatedService, _Replica


class ReplacementWatch:
    """While a handle awaits answers from ``target`` on ``comm``, asks the scheduler now
    and then whether ``target`` was replaced, and if so aborts ``comm`` (its calls are then
    lost in flight and re-sent).  A worker that froze (a long native call holding the GIL,
    a stopped process) keeps its connections open, so its calls would wait for it, while
    the scheduler, its health probe failing, relaunched the replica elsewhere; the frozen
    one may still run them when it wakes, as a killed worker may have.  A replica stopped,
    not replaced (scale down, shutdown), drains its calls: they wait; so do the calls of
    one replaced because its worker is retired, which drains too (the table's
    ``draining``).  Costs a timer per
    delivery until the first check is due."""

    def __init__(self, handle: ReplicatedService, target: _Replica, comm: Any) -> None:
        self.handle, self.target, self.comm = handle, target, comm
        self.replaced: str | None = None  # why the comm was aborted
        self._check: asyncio.Future | None = None
        self._timer = asyncio.get_running_loop().call_later(handle._watch_period(),
                                                            self._due)

    def _due(self) -> None:
        self._check = asyncio.ensure_future(self._look())
        self._check.add_done_callback(consume)

    async def _look(self) -> None:
        with contextlib.suppress(Exception):
            await self.handle._refresh()
        target = self.target
        base = str(target.id).rsplit(".", 1)[0]
        successor = next((r for r in self.handle._table if r.id != target.id
                          and str(r.id).rsplit(".", 1)[0] == base), None)
        if successor is None or str(target.id) in self.handle._draining:
            # not replaced, or replaced but draining (its worker was retired): it answers
            self._timer = asyncio.get_running_loop().call_later(
                self.handle._watch_period(), self._due)
            return
        self.replaced = (f"replica {target.id} on {target.worker} was replaced by "
                         f"{successor.id} while it had the call (its health probe failed: "
                         "the worker froze?)")
        self.comm.abort()

    def cancel(self) -> None:
        self._timer.cancel()
        if self._check is not None and not self._check.done():
            self._check.cancel()
