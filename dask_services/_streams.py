"""Control messages on distributed's batched streams, sent without waiting out the batch.

A ``BatchedSend`` (scheduler to worker every 5 ms, worker to scheduler every 2 ms) holds a
message back until its interval since the previous batch has passed.  The few control
messages of a run (start an instance, it started, all started, all inputs done) are each
on the run's critical path, one after the other, and so is an output produced (its claim
waits for it); :func:`flush` sends what the stream holds at the next turn of the event loop
instead.  An input handed off stays batched with the hand-off's own task-finished message.
"""

from __future__ import annotations

from typing import Any


def flush(stream: Any) -> None:
    """Send what ``stream`` (a ``distributed.batched.BatchedSend``) holds without delay."""
    if stream is None or not stream.buffer:
        return
    # ``_background_send`` sends once woken with no deadline pending
    stream.next_deadline = None
    stream.waker.set()
