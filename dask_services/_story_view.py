"""The story of a selected run on the dashboard's ``/services`` page.

A run picker (the runs whose stories the scheduler keeps, newest first) and a table of what
the run's state machine received, decided and sent (``dask_services.story()``), refreshed
with the rest of the page.  Kept apart from ``dashboard.py``, which adds it under the page.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

COLUMNS = ("time", "kind", "what", "detail", "stimulus_id")
MAX_RUNS = 200  # runs offered in the picker


def known_runs(scheduler: Scheduler) -> list[tuple[int, str]]:
    """``(run id, service task key)`` of every run with a story, newest first."""
    from dask_services.worker import EXTENSION

    core = scheduler.extensions.get(EXTENSION)
    if core is None:
        return []
    books = [(k, m.stories) for k, m in core.machines.items()] + list(core.archive.items())
    runs = {rid: str(key) for key, book in books for rid in book if rid is not None}
    return sorted(runs.items(), reverse=True)[:MAX_RUNS]


class StoryView:
    """The widgets of the story panel of one browser session."""

    def __init__(self, scheduler: Scheduler) -> None:
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, DataTable, Div, Select, TableColumn

        self.scheduler = scheduler
        self.select = Select(title="Run", options=[], value="", name="dask-services-story-run")
        self.source = ColumnDataSource({c: [] for c in COLUMNS})
        self.table = DataTable(
            source=self.source, name="dask-services-story",
            columns=[TableColumn(field=c, title=c.replace("_", " ")) for c in COLUMNS],
            sizing_mode="stretch_width", height=300, index_position=None,
        )
        self.root = column([
            Div(text="<h3>Story of a run</h3><p>What the run's state machine received, "
                     "decided and sent, in order (<code>dask_services.story()</code>).</p>"),
            self.select, self.table,
        ], sizing_mode="stretch_width")
        self.select.on_change("value", lambda attr, old, new: self.update())
        self.update()

    def update(self) -> None:
        from dask_services.worker import EXTENSION

        options = [(str(rid), f"run {rid}: {key}") for rid, key in known_runs(self.scheduler)]
        if self.select.options != options:
            self.select.options = options
        if not self.select.value and options:
            self.select.value = options[0][0]
        core = self.scheduler.extensions.get(EXTENSION)
        entries: list[dict[str, Any]] = []
        if core is not None and self.select.value:
            entries = core.story(run_id=int(self.select.value))
        data = {c: [_cell(c, e.get(c)) for e in entries] for c in COLUMNS}
        if data != dict(self.source.data):
            self.source.data = data


def _cell(column: str, value: Any) -> Any:
    if column == "time" and isinstance(value, float):
        return time.strftime("%H:%M:%S", time.localtime(value)) + f"{value % 1:.3f}"[1:]
    return value if isinstance(value, (int, float, str)) else str(value)
