"""Worker status changes as scheduler plugins see them.

distributed calls no plugin hook when a worker's status changes (paused, running again,
being retired); it logs a ``worker-status-change`` event under the worker's address, and
every plugin's ``log_event`` sees it.  Both the service-task core (a participant being
retired restarts its run) and replicated services (a replica's worker being retired moves
it) read it here.
"""

from __future__ import annotations

from typing import Any


def status_change(topic: Any, msg: Any) -> tuple[str, str, str] | None:
    """``(worker, new status, stimulus_id)`` of a logged ``worker-status-change`` event;
    ``None`` for any other event (the stimulus id is ``""`` if the event has none)."""
    if (isinstance(msg, dict) and msg.get("action") == "worker-status-change"
            and isinstance(topic, str)):
        return topic, msg.get("status", ""), msg.get("stimulus_id") or ""
    return None
