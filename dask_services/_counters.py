"""Worker side of the run figures: each instance's counters, sent with the heartbeat.

The framework carries every peer call, so it counts the bytes of every call for every
service: :class:`Traffic` (one per instance) adds up the serialized size of the arguments
and results of remote calls (``_payload.Packed.nbytes``) and, for calls between instances
on the same worker, which are not serialized, their ``sizeof``.  The arguments of a call
count as sent by the caller when it sends them (taken back if the call never reached the
callee's instance) and as received by the callee when the call takes its turn; a result
other than ``None`` counts as sent by the callee and received by the caller.  So, summed
over a run's instances, ``bytes_sent`` equals ``bytes_received``: both are the data
exchanged with peers.  A call on the wire when its instance stops is waited for (the host's
``stop``), so it is counted on both sides or on neither; only one whose peer did not answer
within the grace given is counted by one side alone.

``Service.counters()`` returns what a service knows beyond that; its values *override*
the framework's figures of the same name (a service that counts its own data, say before
compression, reports that), and missing names keep the framework's.  ``bytes_spilled`` is
only ever the service's own.

The worker extension's ``heartbeat()`` sends the record of each live instance to the
scheduler plugin, plus, exactly once, the final record of every instance stopped since the
previous heartbeat; so a run shorter than a heartbeat still reports its figures, and
nothing stays on the worker after that.  A record also carries gauges of the moment, for
the dashboard's live plots: the bytes the instance holds in memory (``__sizeof__``), has in
flight to peers and keeps on disk, and the inputs it was handed and the outputs it produced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dask.sizeof import sizeof

if TYPE_CHECKING:
    from dask_services._host import Instance

COUNTERS = ("bytes_sent", "bytes_received", "bytes_spilled")
# figures of the moment, zero once the instance has stopped
GAUGES = ("memory_bytes", "in_flight_bytes", "disk_bytes", "inputs", "outputs")


class Traffic:
    """Bytes of the peer calls of one instance, counted by the framework."""

    __slots__ = ("bytes_sent", "bytes_received", "in_flight")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.in_flight = 0  # arguments of remote calls sent and not answered yet

    def counters(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}


def size_of(value: Any) -> int:
    """``sizeof`` of a value passed without serialization; 0 if it cannot be measured."""
    try:
        return int(sizeof(value))
    except Exception:
        return 0


def instance_counters(inst: Instance, final: bool = False) -> dict[str, Any]:
    """One heartbeat record: the instance, its run, its counters (the framework's, then the
    service's own on top) and, unless ``final``, its gauges."""
    record: dict[str, Any] = {"id": str(inst.spec.id), "run_id": inst.spec.run_id}
    values: dict[str, Any] = dict(inst.traffic.counters())
    with contextlib.suppress(Exception):  # a service's own code: never break the heartbeat
        values.update(inst.service.counters() or {})
    for name in COUNTERS:
        try:
            record[name] = int(values.get(name, 0))
        except Exception:  # not a number, infinite (OverflowError), a failing __int__...
            record[name] = int(inst.traffic.counters().get(name, 0))
    gauges = dict.fromkeys(GAUGES, 0)
    if not final:
        with contextlib.suppress(Exception):
            gauges["memory_bytes"] = int(inst.service.__sizeof__())
        with contextlib.suppress(Exception):
            gauges["disk_bytes"] = int(inst.service.spilled_bytes())
        gauges["in_flight_bytes"] = inst.traffic.in_flight
        gauges["inputs"] = len(inst.inputs)
        gauges["outputs"] = len(inst.produced)
    record.update(gauges)
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
