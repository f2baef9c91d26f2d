"""The bounded story of each run: what the machine received, decided and sent."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from dask.typing import Key

from dask_services._run_model import RunSnapshot
from dask_services.config import setting

_sequence = itertools.count()


def next_seq() -> int:
    """The next number in the global order of story entries."""
    return next(_sequence)


@dataclass(frozen=True)
class StoryEntry:
    """One line of a run's story."""

    seq: int  # global order
    time: float
    key: Key
    run_id: int | None  # None: before any run, or about none
    stimulus_id: str
    kind: str  # "received" (an event), "decided" (a change of state), "sent" (an action)
    what: Any  # the event or action, or the decision's text

    def as_dict(self) -> dict[str, Any]:
        what = self.what
        return {
            "time": self.time, "key": self.key, "run_id": self.run_id,
            "stimulus_id": self.stimulus_id, "kind": self.kind,
            "what": what if isinstance(what, str) else type(what).__name__,
            "detail": "" if isinstance(what, str) else describe(what),
        }


def describe(obj: Any) -> str:
    """The fields of an event or action, briefly (a snapshot as its run id)."""
    parts = []
    for f in fields(obj):
        if f.name == "stimulus_id":
            continue
        value = getattr(obj, f.name)
        if isinstance(value, RunSnapshot):
            parts.append(f"run={value.run_id}")
        elif isinstance(value, (list, tuple)) and len(value) > 8:
            parts.append(f"{f.name}=<{len(value)} items>")
        else:
            parts.append(f"{f.name}={value!r}")
    return ", ".join(parts)


class RunStory:
    """The story of one run: its milestones and its per-key routine, each bounded."""

    __slots__ = ("milestones", "routine")

    def __init__(self, entries: int) -> None:
        self.milestones: deque[StoryEntry] = deque(maxlen=entries)
        self.routine: deque[StoryEntry] = deque(maxlen=entries)

    def entries(self) -> list[StoryEntry]:
        return sorted([*self.milestones, *self.routine], key=lambda e: e.seq)


def story_limits() -> tuple[int, int]:
    """``(entries per run, runs)`` from ``dask_services.story``."""
    return (max(1, int(setting("story.entries"))),
            max(1, int(setting("story.runs"))))
