"""Replica tables shared by the handles of a service that live in one process.

A handle travels pickled in every task that calls its service, so a worker unpickles a
handle per task, and each fetched its own replica table before its first call: 1,000
tasks calling a service were 1,000 ``replicated_table`` requests to the scheduler.  The
handles that reach the scheduler through the same ``Worker`` or ``Client`` (their
*owner*) share instead: a fetch under way for a service is joined rather than sent again,
and a handle with no table yet takes the one another handle got less than
``refresh-interval`` ago (as old as a busy handle's own table may be).  A handle that
needs the table as it is now (a call failed, a replica was woken, a fan-out, a scale)
joins only a fetch sent after it knew it needed one (or its own handle's under way, as a
handle's calls share theirs).  A table saying the service is gone
is never taken from here: a handle sees that itself.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any

from dask_services.replicated._background import consume

# services whose tables are kept per owner (the least recently fetched dropped first)
KEPT = 256

Key = tuple[str, "str | None"]  # service name, deployment uid


@dataclass
class _Entry:
    info: dict | None = None  # the scheduler's answer (None: no such service)
    fetched: float = -1.0  # time.monotonic() when the request it answers was sent
    fetching: asyncio.Future | None = None  # the fetch under way (the latest sent)
    sent: float = -1.0  # ... sent then


_BY_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _entries(owner: Any) -> collections.OrderedDict[Key, _Entry]:
    entries = _BY_OWNER.get(owner)
    if entries is None:
        entries = _BY_OWNER[owner] = collections.OrderedDict()
    return entries


async def fetch(owner: Any, scheduler: Any, name: str, uid: str | None,
                sent_after: float = -math.inf) -> tuple[dict | None, float]:
    """The table of service ``name`` (deployment ``uid``) as the scheduler gives it, and
    when it was asked for; joins a fetch of it under way through ``owner`` if that was
    sent at ``sent_after`` (``time.monotonic()``) or later."""
    entries = _entries(owner)
    key = (name, uid)
    entry = entries.get(key)
    if entry is None:
        entry = entries[key] = _Entry()
        while len(entries) > KEPT:
            entries.popitem(last=False)
    if entry.fetching is None or entry.fetching.done() or entry.sent <= sent_after:
        entry.sent = time.monotonic()
        entry.fetching = asyncio.ensure_future(
            _fetch(entry, scheduler, name, uid, entry.sent))
        # retrieved here too: every handle awaiting it may have been cancelled
        entry.fetching.add_done_callback(consume)
    entries.move_to_end(key)
    return await asyncio.shield(entry.fetching)


async def _fetch(entry: _Entry, scheduler: Any, name: str, uid: str | None, sent: float
                 ) -> tuple[dict | None, float]:
    info = await scheduler.replicated_table(name=name, uid=uid)
    if sent >= entry.fetched:  # not an answer older than one already kept
        entry.info, entry.fetched = info, sent
    return info, sent


def recent(owner: Any, name: str, uid: str | None, max_age: float
           ) -> tuple[dict, float] | None:
    """The table of the service another handle through ``owner`` fetched less than
    ``max_age`` seconds ago, and when; None if there is none that recent."""
    entries = _BY_OWNER.get(owner)
    entry = None if entries is None else entries.get((name, uid))
    if entry is None or entry.info is None or time.monotonic() - entry.fetched >= max_age:
        return None
    return entry.info, entry.fetched
