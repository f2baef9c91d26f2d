"""The bytes of inputs that hand-off tasks passed on without waiting for them to be taken.

A hand-off task on a worker returns as soon as its input is on its way into the local
instance, so that the worker runs its next task meanwhile; the instance's ``add_key`` then
runs in the background.  The inputs waiting so are held outside the worker's own memory
accounting, so their bytes are bounded: past the bound (or for an input larger than it), a
hand-off waits until the instance has taken its input, as it did before.
"""

from __future__ import annotations


class PendingInputs:
    """Admission of inputs up to ``limit`` bytes waiting at once (``limit`` 0: none)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.count = 0

    def admit(self, nbytes: int) -> bool:
        """Take ``nbytes`` more if they fit under the limit; whether they were taken."""
        if self.bytes + nbytes > self.limit:
            return False
        self.bytes += nbytes
        self.count += 1
        return True

    def release(self, nbytes: int) -> None:
        """An admitted input of ``nbytes`` was taken (or dropped)."""
        self.bytes -= nbytes
        self.count -= 1
        assert self.bytes >= 0 and self.count >= 0, (self.bytes, self.count)
