"""Arrays between peers: ``Buffers`` out, ``IncomingBuffers`` in, the lane between workers."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any
from unittest import mock

import dask
import numpy as np
import pytest
from distributed.utils_test import captured_logger
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from utils import assert_nothing_left, service_cluster

from dask_services import Buffers, IncomingBuffers, Service, _bulk, rpc, service_task
from dask_services._buffers import ArraysInMemory, as_incoming, buffers_of
from dask_services._bulk import BulkLane, LaneUnreachable, parts

pytestmark = pytest.mark.timeout(120)

DTYPES = ["f8", "f4", "i2", "u1", "c16", "M8[ns]", "?", [("a", "<i4"), ("b", "<f8")]]


@st.composite
def layouts(draw: Any) -> np.ndarray:
    """Arrays of every layout a sender may hold: views with steps, offsets into a larger
    array, reversed and swapped axes."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9))
    room = tuple(2 * n + 1 for n in shape)
    raw = (np.arange(int(np.prod(room)) * dtype.itemsize) % 251).astype(np.uint8)
    base = raw.view(dtype).reshape(room)
    index = []
    for n, r in zip(shape, room, strict=True):
        step = draw(st.sampled_from([1, 2]))
        start = draw(st.integers(0, r - 1 - max(0, n - 1) * step))
        index.append(slice(start, start + n * step, step))
    view = base[tuple(index)]
    if draw(st.booleans()):
        view = view[::-1]
    if view.ndim > 1 and draw(st.booleans()):
        view = view.swapaxes(0, -1)
    return view


def assert_same(received: np.ndarray, sent: np.ndarray) -> None:
    """Same dtype, shape and bytes (NaN and NaT patterns included)."""
    assert received.dtype == sent.dtype and received.shape == sent.shape
    assert np.ascontiguousarray(received).tobytes() == np.ascontiguousarray(sent).tobytes()


@settings(max_examples=200, deadline=None)
@given(layouts(), st.sampled_from([8, 64, 1 << 20]))
def test_parts_cover_an_array_in_c_order(array, limit):
    covered = list(parts(array, limit))
    assert all(p.flags.c_contiguous or p.nbytes <= limit for p in covered)
    flat = b"".join(p.tobytes() for p in covered)
    assert flat == np.ascontiguousarray(array).tobytes()
    assert all(np.shares_memory(p, array) for p in covered if p.size)


async def _lanes(handler: Any) -> tuple[BulkLane, BulkLane]:
    receiver = BulkLane("127.0.0.1", handler, _no_endpoint)
    endpoint = receiver.endpoint()

    async def endpoint_of(address: str) -> dict | None:
        return endpoint

    return receiver, BulkLane("127.0.0.1", _no_handler, endpoint_of)


async def _no_endpoint(address: str) -> dict | None:
    raise AssertionError("the receiver sends nothing")


async def _no_handler(request: dict, incoming: IncomingBuffers) -> Any:
    raise AssertionError("the sender receives nothing")


def _round_trip(arrays: list[np.ndarray], strided_destinations: bool) -> list[np.ndarray]:
    """``arrays`` sent on a lane to a handler that reads them into views of larger arrays
    (or into new ones); what it read."""
    got: list[np.ndarray] = []

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        assert request["note"] == "hello"
        if strided_destinations:
            homes = [np.zeros(tuple(2 * s + 1 for s in shape), dtype)
                     for shape, dtype in zip(incoming.shapes, incoming.dtypes, strict=True)]
            views = [h[tuple(slice(1, None, 2) for _ in h.shape)] for h in homes]
            await incoming.read_into(views)
            got.extend(views)
        else:
            got.extend(await incoming.arrays())
        return {"ok": len(got)}

    async def main() -> Any:
        receiver, sender = await _lanes(handler)
        try:
            reply = await sender.call("tcp://peer:1", {"note": "hello"}, arrays)
            again = await sender.call("tcp://peer:1", {"note": "hello"}, arrays[:1])
            assert again == {"ok": len(arrays) + (1 if arrays else 0)}
            return reply
        finally:
            await sender.close()
            await receiver.close()
            assert sender.connections == receiver.connections == 0

    assert asyncio.run(main()) == {"ok": len(arrays)}
    return got[: len(arrays)]


@settings(max_examples=60, deadline=None)
@given(st.lists(layouts(), min_size=0, max_size=4), st.booleans(),
       st.sampled_from([_bulk.SCRATCH_BYTES, 4096, 100]))
def test_arrays_arrive_as_they_were_sent(arrays, strided_destinations, scratch):
    """Whatever the layouts on both sides, and scratch buffers smaller than the arrays,
    than a run written directly, or than an item."""
    with mock.patch.object(_bulk, "SCRATCH_BYTES", scratch):
        got = _round_trip(arrays, strided_destinations)
    assert len(got) == len(arrays)
    for sent, received in zip(arrays, got, strict=True):
        assert_same(received, sent)


def test_large_strided_arrays_go_through_the_scratch_buffers():
    rng = np.random.default_rng(0)
    big = rng.random((1500, 1200))  # 14 MB: many scratch buffers' worth
    arrays = [big[:, 7:900], big.T[3:], big[::3, ::-1], np.ascontiguousarray(big[:800])]
    got = _round_trip(arrays, strided_destinations=True)
    for sent, received in zip(arrays, got, strict=True):
        assert_same(received, sent)


def test_what_a_method_leaves_unread_is_skipped_and_the_connection_goes_on():
    calls = []

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        calls.append(request["n"])
        if request["n"] == 1:
            (first,) = await incoming.arrays()
            return float(first.sum())
        return None  # reads nothing

    async def main() -> None:
        receiver, sender = await _lanes(handler)
        try:
            data = np.arange(300_000.0)
            assert await sender.call("tcp://peer:1", {"n": 0}, [data]) is None
            assert await sender.call("tcp://peer:1", {"n": 1}, [data]) == data.sum()
            assert sender.connections == 1  # one connection, reused
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())
    assert calls == [0, 1]


@pytest.mark.parametrize("how", ["given up", "left running"])
def test_a_read_stopped_half_way_is_skipped_and_the_connection_goes_on(how):
    """A method that gives up its read (``asyncio.wait_for`` timing out) or returns while a
    read of its own runs on: the rest of the payload is skipped and the connection serves
    the next call (the reader's count missed the bytes of the read stopped half-way: the
    skip waited for bytes that never came, and the caller for ever)."""
    seen: dict[str, Any] = {}

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        if request["n"] == 1:
            (small,) = await incoming.arrays()
            return float(small.sum())
        dst = np.zeros(incoming.shapes[0], incoming.dtypes[0])
        reading = asyncio.ensure_future(incoming.read_into([dst]))
        while dst[0] == 0:  # until its first bytes have arrived
            await asyncio.sleep(0)
        seen["half-way"] = bool(dst[-1] == 0)
        if how == "given up":
            reading.cancel()  # as asyncio.wait_for does on its timeout
            with pytest.raises(asyncio.CancelledError):
                await reading
        incoming.method_returned()  # as the host does once the method returned
        if how == "left running":
            with pytest.raises(RuntimeError, match="returned before the read was over"):
                await reading
        return "stopped"

    async def main() -> None:
        receiver, sender = await _lanes(handler)
        try:
            big = np.ones(6_000_000)  # 48 MB: many receives
            assert await sender.call("tcp://peer:1", {"n": 0}, [big]) == "stopped"
            assert await sender.call("tcp://peer:1", {"n": 1}, [np.arange(10.0)]) == 45.0
            assert sender.connections == 1
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert seen["half-way"]


def test_a_read_stopped_as_its_bytes_arrive_loses_none_of_the_count():
    """The method returns in the very turn of the loop in which bytes arrived for its
    read: whatever the read had taken is counted, so the skip reads exactly the rest of
    the payload and leaves the next request's bytes alone (through
    ``loop.sock_recv_into`` the bytes were taken and the count lost with the cancelled
    result: the skip swallowed the next request and waited for ever)."""
    from dask_services._bulk import ScratchPool, _SocketReader

    async def main() -> bytes:
        mine, peer = socket.socketpair()
        mine.setblocking(False)
        peer.setblocking(False)
        loop = asyncio.get_running_loop()
        payload = 1 << 20
        reader = _SocketReader(mine, [(payload,)], [np.dtype(np.uint8)], payload,
                               ScratchPool())
        reading = asyncio.ensure_future(reader.read_into([np.empty(payload, np.uint8)]))
        while reader._reading is None or reader._reading._fut_waiter is None:
            await asyncio.sleep(0)  # until the read waits for bytes
        inner = reader._reading

        def return_once_bytes_came() -> None:
            waiter = inner._fut_waiter
            if waiter is not None and waiter.done():
                reader.method_returned()  # in the turn the bytes came
            else:
                loop.call_soon(return_once_bytes_came)

        loop.call_soon(return_once_bytes_came)
        peer.send(b"x" * 1000)
        with pytest.raises(RuntimeError, match="returned before the read was over"):
            await reading
        sending = asyncio.ensure_future(
            loop.sock_sendall(peer, b"y" * (payload - 1000) + b"NEXT"))
        await asyncio.wait_for(reader.discard(), 10)
        await sending
        following = await asyncio.wait_for(loop.sock_recv(mine, 4), 10)
        reader.release()
        mine.close()
        peer.close()
        return following

    assert asyncio.run(main()) == b"NEXT"


def test_a_connection_without_the_token_is_closed_unheard():
    heard = []

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        heard.append(request)

    async def main() -> bytes:
        receiver = BulkLane("127.0.0.1", handler, _no_endpoint)
        endpoint = receiver.endpoint()
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (endpoint["host"], endpoint["port"]))
            await loop.sock_sendall(sock, struct.pack("<16sQQ", b"x" * 16, 5, 0) + b"hello")
            try:
                return await asyncio.wait_for(loop.sock_recv(sock, 10), 10)
            except ConnectionResetError:  # closed with "hello" unread
                return b""
        finally:
            sock.close()
            await receiver.close()

    assert asyncio.run(main()) == b""  # closed
    assert heard == []


def test_a_lane_that_cannot_be_reached_says_so():
    async def main() -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]  # nothing listens there

        async def endpoint_of(address: str) -> dict | None:
            return {"host": "127.0.0.1", "port": port, "token": b"t" * 16}

        sender = BulkLane("127.0.0.1", _no_handler, endpoint_of)
        with pytest.raises(LaneUnreachable, match="bulk lane of tcp://peer:1"):
            await sender.call("tcp://peer:1", {}, [np.zeros(3)])
        assert sender.connections == 0
        sender.refuse("tcp://peer:1")
        assert not await sender.available("tcp://peer:1")

    asyncio.run(main())


def test_buffers_and_their_reading_name_what_is_wrong():
    with pytest.raises(TypeError, match="item 1 is a list"):
        Buffers([np.zeros(2), [1, 2]])
    with pytest.raises(TypeError, match="dtype object"):
        Buffers([np.array(["a"], dtype=object)])
    with pytest.raises(TypeError, match="at most one Buffers"):
        buffers_of((Buffers([]),), {"more": Buffers([])})

    async def main() -> None:
        (incoming,), _ = as_incoming((Buffers([np.arange(6).reshape(2, 3)]),), {})
        assert isinstance(incoming, ArraysInMemory) and incoming.nbytes == 48
        with pytest.raises(ValueError, match=r"shape \(2, 3\) and dtype int64.*got shape "
                                             r"\(3, 2\)"):
            await incoming.read_into([np.empty((3, 2), np.int64)])
        with pytest.raises(ValueError, match="needs 1 destinations"):
            await incoming.read_into([])
        with pytest.raises(ValueError, match="read-only"):
            ro = np.empty((2, 3), np.int64)
            ro.flags.writeable = False
            await incoming.read_into([ro])
        out = np.zeros((2, 3), np.int64)
        await incoming.read_into([out])
        np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))
        with pytest.raises(RuntimeError, match="read already"):
            await incoming.arrays()

    asyncio.run(main())


class Scatter(Service):
    """Every instance sends each peer (itself included) a strided view of every input, as
    ``Buffers``; a receiver writes each into its row of a preallocated array
    (``read_into``).  The output: the array of the output's owner, and the kinds of
    ``IncomingBuffers`` it was given."""

    async def start(self, *args: Any, **kwargs: Any) -> None:
        self.rows = {k: i for i, k in enumerate(self.input_keys)}
        self.got = np.full((len(self.input_keys), 50, 20), -1.0)
        self.kinds: set[str] = set()

    async def add_key(self, key, data) -> None:
        view = data[::2, :20]  # strided: 50 x 20 of a 100 x 40 block
        for sid in self.peers:
            await self.peers[sid].take(self.rows[key], Buffers([view]))

    @rpc
    async def take(self, row: int, incoming: IncomingBuffers) -> None:
        self.kinds.add(type(incoming).__name__)
        await incoming.read_into([self.got[row]])

    async def all_inputs_done(self) -> None:
        for key in self.concierge.wanted_outputs:
            if self.concierge.owner(key) == self.id:
                await self.concierge.produce_key(key, (self.got, sorted(self.kinds)))


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).random((100, 40))


@pytest.mark.parametrize("lane", [True, False])
@service_cluster()
async def test_a_service_reads_its_peers_arrays_where_it_wants_them(c, s, a, b, lane):
    with dask.config.set({"dask_services.bulk-lane": lane}):
        inputs = [dask.delayed(block)(i) for i in range(8)]
        (out,) = service_task(Scatter, inputs, outputs=1)
        got, kinds = await c.compute(out)
        for i in range(8):
            np.testing.assert_array_equal(got[i], block(i)[::2, :20])
        # an instance's own arrays come in memory; its peer's on the lane, if on
        assert ("_SocketReader" in kinds) == lane and "ArraysInMemory" in kinds, kinds
        lanes = [w.extensions["dask_services"].lane for w in (a, b)]
        assert all((lane_._listener is not None) == lane for lane_ in lanes)
        del out
        await assert_nothing_left(s, [a, b])


@service_cluster()
async def test_a_lane_that_cannot_be_reached_falls_back_to_the_comms(c, s, a, b):
    """A firewall may let the workers' own ports through and not the lane's: the calls go
    through distributed's comms instead, and the run is not restarted."""
    for w in (a, b):
        w.extensions["dask_services"].lane.endpoint = lambda: {
            "host": "127.0.0.1", "port": 1, "token": b"t" * 16}
    with captured_logger("dask_services") as log:
        (out,) = service_task(Scatter, [dask.delayed(block)(i) for i in range(8)],
                              outputs=1)
        got, kinds = await c.compute(out)
    for i in range(8):
        np.testing.assert_array_equal(got[i], block(i)[::2, :20])
    assert kinds == ["ArraysInMemory"]
    assert "sending to that worker through distributed's comms" in log.getvalue()
    assert "restart" not in log.getvalue()
    del out
    await assert_nothing_left(s, [a, b])


def test_the_lane_is_configurable():
    assert dask.config.get("dask_services.bulk-lane") is True


def test_scratch_buffers_are_lent_and_a_few_kept_until_no_run_is_left():
    pool = _bulk.ScratchPool()
    lent = [pool.take() for _ in range(_bulk.SCRATCH_KEPT + 2)]
    assert all(s.nbytes == _bulk.SCRATCH_BYTES for s in lent)
    for s in lent:
        pool.give(s)
    again = [pool.take() for _ in range(_bulk.SCRATCH_KEPT)]
    assert all(any(a is s for s in lent) for a in again)  # reused: no fresh pages
    for a in again:
        pool.give(a)
    lane = BulkLane("127.0.0.1", _no_handler, _no_endpoint)
    lane.scratch = pool
    lane.close_idle()
    assert pool.take() is not lent[0] and not any(pool.take() is s for s in lent)


def test_calls_to_one_worker_share_a_few_connections_and_keep_their_order():
    """Every concurrent call opening a connection of its own ran workers out of file
    descriptors (many runs at once): at most CONNECTIONS_PER_PEER are open to a peer, and
    the calls waiting for one start in the order they were made."""
    started: list[int] = []
    release = asyncio.Event()
    open_at_once: list[int] = []

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        started.append(request["n"])
        open_at_once.append(len(receiver._serving))
        if len(started) == _bulk.CONNECTIONS_PER_PEER:
            release.set()
        await release.wait()
        return request["n"]

    async def main() -> list[Any]:
        nonlocal receiver
        receiver, sender = await _lanes(handler)
        try:
            calls = [sender.call("tcp://peer:1", {"n": n}, [np.arange(n, dtype="f8")])
                     for n in range(40)]
            return await asyncio.gather(*calls)
        finally:
            await sender.close()
            await receiver.close()

    receiver: Any = None
    assert asyncio.run(main()) == list(range(40))
    assert max(open_at_once) == _bulk.CONNECTIONS_PER_PEER
    assert started == list(range(40))


class Careless(Service):
    """Makes the mistakes the rules refuse: a call with two ``Buffers``; and keeping the
    ``IncomingBuffers`` to read after the method returned.  Its output: what each
    mistake raised, and the arrays of the calls that followed them."""

    async def start(self, *args: Any, **kwargs: Any) -> None:
        self.kept: list[IncomingBuffers] = []
        self.got: list[np.ndarray] = []
        self.raised: list[str] = []

    async def add_key(self, key, data) -> None:
        for sid in sorted(self.peers):
            try:
                await self.peers[sid].take(Buffers([data]), more=Buffers([data]))
            except TypeError as exc:
                self.raised.append(str(exc))
            await self.peers[sid].keep(Buffers([data]))
            await self.peers[sid].take(Buffers([data[::2]]))

    @rpc
    async def take(self, incoming: IncomingBuffers, more: Any = None) -> None:
        self.got.extend(await incoming.arrays())

    @rpc
    async def keep(self, incoming: IncomingBuffers) -> None:
        self.kept.append(incoming)  # read later: refused

    async def all_inputs_done(self) -> None:
        for incoming in self.kept:
            try:
                await incoming.arrays()
            except RuntimeError as exc:
                self.raised.append(str(exc))
        for key in self.concierge.wanted_outputs:
            await self.concierge.produce_key(key, (self.id, self.raised, self.got))


@pytest.mark.parametrize("lane", [True, False])
@service_cluster()
async def test_mistakes_with_buffers_fail_alone_and_later_calls_go_on(c, s, a, b, lane):
    """Two Buffers in one call are refused before the call takes its turn (it left a gap
    in the channel's order, and every later call waited for ever); buffers read after
    their method returned are refused (on the lane that read took the next call's
    bytes)."""
    with dask.config.set({"dask_services.bulk-lane": lane}):
        outs = service_task(Careless, [dask.delayed(block)(i) for i in range(4)], outputs=2)
        results = await c.gather(c.compute(outs))
    raised = [m for _, r, _ in results for m in r]
    got = [g for *_, gs in results for g in gs]
    assert sum("at most one Buffers" in m for m in raised) == 4 * 2  # per input and peer
    assert sum("the method they were sent to has returned" in m for m in raised) == 4 * 2
    expected = sorted(block(i)[::2].sum() for i in range(4) for _ in range(2))
    assert sorted(g.sum() for g in got) == pytest.approx(expected)
    del outs
    await assert_nothing_left(s, [a, b])


def block_of_objects(i: int) -> np.ndarray:
    out = np.empty((100, 40), dtype=object)
    out[:] = block(i)
    return out


@service_cluster()
async def test_chunks_of_objects_in_an_array_of_numbers_travel_pickled(c, s, a, b):
    import dask.array as da

    x = da.concatenate([da.from_delayed(dask.delayed(block_of_objects)(i), (100, 40),
                                        dtype="f8") for i in range(4)])
    with dask.config.set({"dask_services.rechunk.copy-max-inputs": 0,
                          "dask_services.rechunk.merge-region-max": 0}):
        got = await c.compute(x.rechunk((400, 4), method="service"))
    np.testing.assert_array_equal(got, np.concatenate([block(i) for i in range(4)]))
    await assert_nothing_left(s, [a, b])


def test_the_lane_keeps_accepting_after_running_out_of_file_descriptors():
    import errno

    calls = 0

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        return "ok"

    async def main() -> Any:
        receiver, sender = await _lanes(handler)
        loop = asyncio.get_running_loop()
        accept = type(loop).sock_accept

        async def first_fails(self: Any, sock: socket.socket) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise OSError(errno.EMFILE, "Too many open files")
            return await accept(self, sock)

        try:
            with mock.patch.object(type(loop), "sock_accept", first_fails), \
                    mock.patch.object(_bulk, "ACCEPT_RETRY_DELAY", 0.01):
                receiver._accepting.cancel()  # started before the patch: start again
                receiver._accepting = asyncio.ensure_future(receiver._accept())
                return await asyncio.wait_for(
                    sender.call("tcp://peer:1", {}, [np.zeros(3)]), 10)
        finally:
            await sender.close()
            await receiver.close()

    assert asyncio.run(main()) == "ok"
    assert calls >= 2


def test_turns_on_the_connections_follow_the_tickets_not_the_order_of_waiting():
    """The receiver starts a channel's calls in the order of their sequence numbers; a
    call that held one of the few connections while an earlier one waited for a turn
    hung the rechunk (the earlier call had been slower to come to wait: it was still
    asking for the peer's lane).  Turns go by tickets, taken in the calls' order."""
    turn = 0
    changed = asyncio.Condition()

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        nonlocal turn
        async with changed:  # as ServiceHost.deliver: in the order of the calls
            await changed.wait_for(lambda: turn == request["n"])
            turn += 1
            changed.notify_all()
        return request["n"]

    async def main() -> list[Any]:
        receiver, sender = await _lanes(handler)
        try:
            tickets = [sender.ticket("tcp://peer:1") for _ in range(12)]

            async def call(n: int) -> Any:
                try:
                    return await sender.call("tcp://peer:1", {"n": n}, [np.zeros(n)],
                                             tickets[n])
                finally:
                    sender.done_with("tcp://peer:1", tickets[n])

            # coming to wait in reverse order
            calls = [call(n) for n in reversed(range(12))]
            return await asyncio.wait_for(asyncio.gather(*calls), 20)
        finally:
            await sender.close()
            await receiver.close()

    assert asyncio.run(main()) == list(reversed(range(12)))


def test_slots_give_turns_in_ticket_order_and_skip_abandoned_tickets():
    async def main() -> list[int]:
        slots = _bulk.Slots(2)
        tickets = [slots.ticket() for _ in range(5)]
        assert [t.done() for t in tickets] == [True, True, False, False, False]
        slots.done_with(tickets[3])  # abandoned while in line: skipped
        slots.done_with(tickets[1])
        assert tickets[2].done() and not tickets[4].done()
        slots.done_with(tickets[0])
        assert tickets[4].done()
        slots.done_with(tickets[2])
        slots.done_with(tickets[4])
        return [slots.free, len(slots.line)]

    assert asyncio.run(main()) == [2, 0]


def test_calls_to_many_workers_share_a_bounded_number_of_connections():
    """A worker with hundreds of peers opened up to CONNECTIONS_PER_PEER connections to
    each and kept them all: calls in use over all peers are bounded, in ticket order, and
    of the idle ones only the most recently used are kept."""
    started: list[tuple[str, int]] = []
    in_use: list[int] = []
    release = asyncio.Event()

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        started.append((request["peer"], request["n"]))
        in_use.append(len(started) - len(answered))
        if len(started) == 3:
            release.set()
        await release.wait()
        answered.append(request["n"])
        return request["peer"], request["n"]

    answered: list[int] = []

    receivers: list[BulkLane] = []

    async def main() -> tuple[list[Any], int, list[int]]:
        peers = [f"tcp://peer:{i}" for i in range(6)]
        endpoints = {}
        for peer in peers:
            receivers.append(BulkLane("127.0.0.1", handler, _no_endpoint))
            endpoints[peer] = receivers[-1].endpoint()

        async def endpoint_of(address: str) -> dict | None:
            return endpoints[address]

        sender = BulkLane("127.0.0.1", _no_handler, endpoint_of)
        try:
            calls = [sender.call(peer, {"peer": peer, "n": n}, [np.zeros(4)])
                     for n in range(3) for peer in peers]
            got = await asyncio.wait_for(asyncio.gather(*calls), 20)
            idle = sender.connections
            kept = sorted(int(p.rsplit(":", 1)[1]) for p, socks in sender._idle.items()
                          for _ in socks)
            return got, idle, kept
        finally:
            await sender.close()
            for receiver in receivers:
                await receiver.close()

    with mock.patch.object(_bulk, "CONNECTIONS_TOTAL", 3), \
            mock.patch.object(_bulk, "IDLE_KEPT", 2):
        got, idle, kept = asyncio.run(main())
    order = [(f"tcp://peer:{i}", n) for n in range(3) for i in range(6)]
    assert got == order
    assert max(in_use) == 3  # never more in use than CONNECTIONS_TOTAL
    assert started == order  # turns in the order the calls were made
    assert idle == 2
    assert len(kept) == 2 and set(kept) <= set(range(6))


def test_calls_waiting_for_a_busy_peer_do_not_hold_up_the_others():
    """A call waiting for one of its peer's connections held a place among all calls: ten
    calls to a peer whose handler was slow took every place, and a call to another peer
    waited for them."""
    release_a = asyncio.Event()

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        if request["peer"] == "a":
            await release_a.wait()
        return request["peer"]

    async def main() -> bool:
        receivers = {peer: BulkLane("127.0.0.1", handler, _no_endpoint) for peer in "ab"}
        endpoints = {f"tcp://{peer}:1": r.endpoint() for peer, r in receivers.items()}

        async def endpoint_of(address: str) -> dict | None:
            return endpoints[address]

        sender = BulkLane("127.0.0.1", _no_handler, endpoint_of)
        try:
            to_a = [asyncio.ensure_future(sender.call("tcp://a:1", {"peer": "a"},
                                                      [np.zeros(2)])) for _ in range(10)]
            to_b = await asyncio.wait_for(
                sender.call("tcp://b:1", {"peer": "b"}, [np.zeros(2)]), 10)
            a_waiting = not any(c.done() for c in to_a)
            release_a.set()
            assert await asyncio.wait_for(asyncio.gather(*to_a), 10) == ["a"] * 10
            return to_b == "b" and a_waiting
        finally:
            await sender.close()
            for receiver in receivers.values():
                await receiver.close()

    with mock.patch.object(_bulk, "CONNECTIONS_TOTAL", 8), \
            mock.patch.object(_bulk, "CONNECTIONS_PER_PEER", 2):
        assert asyncio.run(main())


def test_a_call_taken_by_the_receiver_gives_its_place_in_line_to_the_next():
    """A method that waits for a later call before reading its arrays (all the pieces
    announced, then each read at its offset): the calls beyond CONNECTIONS_PER_PEER waited
    for a place that the waiting methods held until they returned, for ever.  A call
    holds its place until the receiver has taken it (``call_started``)."""
    n = _bulk.CONNECTIONS_PER_PEER + 3
    announced: dict[int, tuple[int, ...]] = {}
    everyone = asyncio.Event()
    out: list[np.ndarray] = []

    async def handler(request: dict, incoming: IncomingBuffers) -> Any:
        await incoming.call_started()  # as the worker does once the call took its turn
        announced[request["i"]] = incoming.shapes[0]
        if len(announced) == n:
            out.append(np.zeros(sum(s[0] for s in announced.values())))
            everyone.set()
        await everyone.wait()
        offset = sum(announced[j][0] for j in range(request["i"]))
        await incoming.read_into([out[0][offset:offset + announced[request["i"]][0]]])
        return request["i"]

    async def main() -> list[Any]:
        receiver, sender = await _lanes(handler)
        try:
            # large enough that a piece cannot wait in the sockets' buffers: its sender
            # is still writing when the receiver says it took the call
            pieces = [np.full(1_000_000 + i, float(i)) for i in range(n)]
            calls = [sender.call("tcp://peer:1", {"i": i}, [p]) for i, p in enumerate(pieces)]
            return await asyncio.wait_for(asyncio.gather(*calls), 30)
        finally:
            await sender.close()
            await receiver.close()

    assert asyncio.run(main()) == list(range(n))
    expected = np.concatenate([np.full(1_000_000 + i, float(i)) for i in range(n)])
    np.testing.assert_array_equal(out[0], expected)


def test_a_copy_given_up_on_stops_writing_its_destination():
    """Arrays in memory (the same worker, or no lane) are copied in a thread, which went
    on writing the destination after the read was given up on (a timeout) and after the
    method returned; and read the sender's arrays, which the sender may change once its
    call is answered.  It stops at its next step, and ``stopped()`` waits for that."""

    async def main() -> tuple[bool, int, int]:
        source = np.ones(50_000_000, dtype="u1")  # 50 MB: steps of COPY_STEP_BYTES
        incoming = ArraysInMemory([source])
        dst = np.zeros_like(source)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(incoming.read_into([dst]), 0.0001)
        incoming.method_returned()
        await incoming.stopped()  # as the host does before answering the call
        written = int(dst.sum())
        source[:] = 7  # the sender reuses its array once answered
        copying = incoming._copying
        return copying is not None and copying.done(), written, int((dst == 7).sum())

    thread_over, written, after = asyncio.run(main())
    assert thread_over
    assert written < 50_000_000  # stopped part-way
    assert after == 0  # nothing written once stopped


class Announced(Service):
    """Each instance sends the leader's instance its pieces as ``Buffers``, more calls at
    once than the lane lets wait; the receiving method reads only once every piece is
    announced, at the piece's offset in one array (the output)."""

    async def start(self, *args: Any, pieces: int = 6, **kwargs: Any) -> None:
        self.n = pieces * len(self.peers)
        self.shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        self.everyone = asyncio.Event()
        self.read = 0
        self.all_read = asyncio.Event()  # every piece is in ``out``
        self.out: np.ndarray | None = None

    async def add_key(self, key, data) -> None:
        pass

    async def all_inputs_done(self) -> None:
        pieces = [np.full(200_000 + i, float(i)) for i in range(self.n // len(self.peers))]
        await asyncio.gather(*(self.peers[self.leader].piece(str(self.id), i, Buffers([p]))
                               for i, p in enumerate(pieces)))
        if self.id == self.leader:
            # its own calls returned, not necessarily the other senders': their reads
            # may still be under way (produced then, their pieces read as zeros)
            await self.all_read.wait()
            await self.concierge.produce_key(self.output_keys[0], self.out)

    @rpc
    async def piece(self, sender: str, i: int, incoming: IncomingBuffers) -> None:
        self.shapes[sender, i] = incoming.shapes[0]
        if len(self.shapes) == self.n:
            self.out = np.zeros(sum(s[0] for s in self.shapes.values()))
            self.everyone.set()
        await self.everyone.wait()
        order = sorted(self.shapes)
        offset = sum(self.shapes[k][0] for k in order[:order.index((sender, i))])
        await incoming.read_into([self.out[offset:offset + self.shapes[sender, i][0]]])
        self.read += 1
        if self.read == self.n:
            self.all_read.set()


@pytest.mark.parametrize("lane", [True, False])
@service_cluster()
async def test_a_method_may_wait_for_later_calls_before_reading(c, s, a, b, lane):
    """Written once for the lane and the comms, as the README says: with the lane, calls
    beyond CONNECTIONS_PER_PEER to one worker waited for ever behind methods that waited
    for them."""
    with dask.config.set({"dask_services.bulk-lane": lane}):
        (out,) = service_task(Announced, [dask.delayed(abs)(i) for i in range(2)],
                              outputs=1, pieces=_bulk.CONNECTIONS_PER_PEER + 2)
        got = await asyncio.wait_for(c.compute(out), 60)
    per = _bulk.CONNECTIONS_PER_PEER + 2
    # pieces in (sender id, i) order: each sender's pieces 0..per-1
    expected = np.concatenate([np.full(200_000 + i, float(i))
                               for _ in range(2) for i in range(per)])
    np.testing.assert_array_equal(got, expected)
    del out
    await assert_nothing_left(s, [a, b])
