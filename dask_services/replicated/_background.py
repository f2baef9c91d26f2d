"""Helpers for the tasks a handle runs in the background and shares between its calls
(a table refresh, a wake, a delivery)."""

from __future__ import annotations

import asyncio


def consume(fut: asyncio.Future) -> None:
    """A done callback: the task's exception counts as retrieved (no "never retrieved"
    log for a task nobody awaits any more)."""
    if not fut.cancelled():
        fut.exception()


def idle(task: asyncio.Future | None) -> bool:
    """Whether a handle's shared task (a refresh, a wake) must be started anew: none, or
    done, or left on another event loop (one stopped without cancelling its tasks: the
    handle now talks through another client)."""
    return task is None or task.done() or task.get_loop() is not asyncio.get_running_loop()
