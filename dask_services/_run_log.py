"""What the scheduler plugin tells about runs: the interface observers of the core implement
(:class:`RunObserver`, the entries it is given), the log filter for the warning a cut
output's edge would raise, and the lookup of run stories behind ``dask_services.story()``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_services import _run_model as run_model
from dask_services import _run_story as run_story

if TYPE_CHECKING:
    from dask_services._run_state import ServiceTaskMachine
    from dask_services.scheduler import ServiceSchedulerPlugin


@dataclass(frozen=True)
class RunLogEntry:
    """A run started, finished, failed, was restarted or cancelled (``_run_events.Log``)."""

    service: str  # the service class's name
    key: Key  # the service task
    action: str
    run_id: int
    detail: str
    run: run_model.RunSnapshot | None  # the service task's current run, if any
    inputs: int
    restarts: int


class RunObserver:
    """What an observer of the core (the diagnostics: status tables, dashboard, metrics)
    is told; the only way the core talks to them.  Add one with
    ``scheduler.extensions["dask_services"].observers.append(observer)``.  Every method is
    called on the scheduler's event loop and must be cheap; an exception is logged and
    otherwise ignored."""

    def run_logged(self, entry: RunLogEntry) -> None:
        """A run started or ended (also sent to the scheduler's event log)."""

    def counters_reported(self, worker: str, records: Sequence[Mapping[str, Any]]) -> None:
        """``Service.counters()`` of instances on ``worker``, from its heartbeat
        (``_counters.py``)."""

    def run_progressed(self, key: Key, run: run_model.RunSnapshot) -> None:
        """The current run of service task ``key`` changed (an event was handled)."""


class OwnEdgeCollisions(logging.Filter):
    """Drops distributed's warning of a key collision ("Detected different `run_spec`")
    for an output whose claim runs: the plugin cut its edge to its service task, so the
    same graph submitted again (the same collection computed twice at once) differs from
    the claim in that edge alone.  distributed keeps the running claim, which is right;
    its warning that this "can cause failures and deadlocks" would be noise.  Any other
    difference is logged as distributed logs it."""

    PREFIX = "Detected different `run_spec` for key "

    def __init__(self, plugin: ServiceSchedulerPlugin) -> None:
        super().__init__()
        self.plugin = plugin

    def filter(self, record: logging.LogRecord) -> bool:
        cut = self.plugin.cut
        if not cut or not isinstance(record.msg, str) or not record.msg.startswith(
                self.PREFIX):
            return True
        message = record.getMessage()
        shown = message[len(self.PREFIX):].split(" between two consecutive", 1)[0]
        for key in cut:
            if repr(key) == shown:
                edge = frozenset({self.plugin.output_of.get(key)})
                return not ("old dependencies: set()" in message
                            and any(f"new dependencies: {deps!r}" in message
                                    for deps in (edge, set(edge))))
        return True


def keep_archive_within(archive: OrderedDict[Key, OrderedDict[int | None,
                                                                run_story.RunStory]],
                        runs: int) -> None:
    """Drop the oldest stories of forgotten service tasks until ``archive`` keeps at most
    ``runs`` runs in all (``dask_services.story.runs``): the oldest forgotten task's oldest
    run first.  Bounded per task alone, a notebook computing the same graph again and again
    (one key, a run each time) and many tasks would keep ``runs`` x ``runs`` stories on the
    scheduler, tens of MB per task for runs of a few hundred inputs."""
    kept = sum(len(book) for book in archive.values())
    while archive and kept > runs:
        key, book = next(iter(archive.items()))
        if book:
            book.popitem(last=False)
            kept -= 1
        if not book:
            del archive[key]


def story_entries(machines: Mapping[Key, ServiceTaskMachine],
                  archive: OrderedDict[Key, OrderedDict[int | None, run_story.RunStory]],
                  output_of: Mapping[Key, Key], key: Key | None = None,
                  run_id: int | None = None) -> list[dict[str, Any]]:
    """The story of service task ``key`` (or of the service task of output ``key``: every
    run kept of it, live in ``machines`` or forgotten in ``archive``), or of run ``run_id``
    of any service task, as dicts in the order things happened."""
    books: list[Mapping[int | None, run_story.RunStory]] = []
    if key is not None:
        if isinstance(key, list):  # tuple keys arrive as lists
            key = _as_tuple(key)
        machine = machines.get(key)
        if machine is None and key not in archive and key in output_of:
            key = output_of[key]  # an output: the story of its service task
            machine = machines.get(key)
        if machine is not None:
            books.append(machine.stories)
        elif key in archive:
            books.append(archive[key])
    else:
        books += [m.stories for m in machines.values()]
        books += list(archive.values())
    entries = []
    for book in books:
        if key is None:
            story = book.get(run_id)
            if story is not None:
                entries += story.entries()
        else:
            for rid, story in book.items():
                if run_id is None or rid == run_id:
                    entries += story.entries()
    entries.sort(key=lambda e: e.seq)
    return [e.as_dict() for e in entries]


def _as_tuple(key: Any) -> Any:
    """A tuple key that travelled as a (nested) list."""
    return tuple(_as_tuple(k) for k in key) if isinstance(key, list) else key
