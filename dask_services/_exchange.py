"""The base of services that exchange data between peers: the shuffle and the rechunk.

An exchange receives into a :class:`SpillBuffer` and sends through a :class:`PeerStream`,
both sized from its config section (``dask_services.<section>.buffer-fraction`` and
``.bytes-in-flight``; a buffer fraction set where the graph was built travels with it,
``graph_settings``), answers the stream's ``done_sending`` barrier, reports its memory
and spilled bytes to the worker, spills when the worker asks, and clears both on ``stop``.
"""

from __future__ import annotations

from dask.utils import parse_bytes

from dask_services._sending import PeerStream, window_size
from dask_services._spill import SpillBuffer
from dask_services.config import packaged_default, setting
from dask_services.service import Concierge, Service, ServiceId, rpc


def graph_settings(section: str) -> dict[str, float]:
    """The settings of ``section`` that travel with a graph, as parameters of its service
    task: ``buffer-fraction`` where the process building the graph set it (to other than
    the packaged default), so that ``dask.config.set`` around ``compute()`` in a notebook
    reaches the workers, as ``distributed.p2p.disk`` does for p2p.  Otherwise the
    workers' own config decides."""
    name = f"{section}.buffer-fraction"
    value = float(setting(name))
    return {} if value == float(packaged_default(name)) else {"buffer_fraction": value}


class PeerExchange(Service):
    config_section: str  # "shuffle", "rechunk"
    trim_after_sends = True  # give freed memory back to the OS as sends complete

    def __init__(self) -> None:
        self.buffer: SpillBuffer | None = None
        self.stream: PeerStream | None = None
        self.sent_bytes = 0
        self.received_bytes = 0
        self.spilled_total = 0  # of buffers already cleared

    def open_exchange(self, concierge: Concierge) -> None:
        """Create the buffer and the stream (call from ``start``)."""
        section = self.config_section
        memory = concierge.memory_to_plan_on
        fraction = getattr(self, "params", {}).get("buffer_fraction")
        if fraction is None:  # not set where the graph was built: the worker's config
            fraction = float(setting(f"{section}.buffer-fraction"))
        self.buffer = SpillBuffer(concierge.local_directory, int(memory * fraction))
        configured = parse_bytes(setting(f"{section}.bytes-in-flight"))
        self.stream = PeerStream(self, window_size(configured, memory),
                                 trim=self.trim_after_sends)

    @rpc
    async def done_sending(self, sender: ServiceId) -> None:
        """``sender`` has delivered everything it had for this instance."""
        assert self.stream is not None
        self.stream.sender_done(sender)

    async def stop(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
        if self.buffer is not None:
            self.spilled_total += self.buffer.spilled_total
            self.buffer.clear()
            self.buffer = None

    def __sizeof__(self) -> int:
        in_flight = self.stream.in_flight if self.stream is not None else 0
        return in_flight + (self.buffer.held_bytes if self.buffer is not None else 0)

    def spilled_bytes(self) -> int:
        return self.buffer.disk_bytes if self.buffer is not None else 0

    def counters(self) -> dict[str, int]:
        # Bytes sent and received are the framework's count of the peer calls (serialized
        # sizes, _counters.py): the same figure on both sides, and pieces an instance keeps
        # for itself are not exchanged.  sent_bytes/received_bytes stay as the in-memory
        # sizes the exchange handed to and took from the stream.
        spilled = self.spilled_total + (self.buffer.spilled_total if self.buffer else 0)
        return {"bytes_spilled": spilled}

    async def please_evict(self, nbytes: int) -> None:
        if self.buffer is not None:
            await self.buffer.spill()
