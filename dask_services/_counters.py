"""Worker side of the run figures: each instance's counters, sent with the heartbeat.

``Service.counters()`` returns cumulative figures of one instance (``bytes_sent``,
``bytes_received``, ``bytes_spilled``).  The worker extension's ``heartbeat()`` sends those
of its live instances to the scheduler plugin, plus, exactly once, the final counters of
every instance stopped since the previous heartbeat; so a run shorter than a heartbeat
still reports its figures, and nothing stays on the worker after that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from dask_services._host import Instance

COUNTERS = ("bytes_sent", "bytes_received", "bytes_spilled")


def instance_counters(inst: Instance) -> dict[str, Any]:
    """One heartbeat record: the instance, its run and its counters (missing ones are 0)."""
    record: dict[str, Any] = {"id": str(inst.spec.id), "run_id": inst.spec.run_id}
    values: Any = {}
    with contextlib.suppress(Exception):  # a service's own code: never break the heartbeat
        values = inst.service.counters() or {}
    for name in COUNTERS:
        try:
            record[name] = int(values.get(name, 0))
        except (TypeError, ValueError):
            record[name] = 0
    return record


class CounterReports:
    """Final counters of stopped instances, kept until the next heartbeat takes them."""

    def __init__(self) -> None:
        self.final: list[dict[str, Any]] = []

    def stopped(self, record: dict[str, Any]) -> None:
        self.final.append(record)

    def heartbeat(self, live: Iterable[Instance]) -> dict[str, Any]:
        records = [instance_counters(inst) for inst in live]
        final, self.final = self.final, []
        return {"instances": final + records}

    def clear(self) -> None:
        self.final.clear()
