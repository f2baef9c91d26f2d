"""Background sends within a byte budget, and how the shuffle groups its partitions."""

from __future__ import annotations

import asyncio
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof
from hypothesis import given, settings
from hypothesis import strategies as st
from utils import assembled_in_two_windows, suspended_in, until

from dask_services._sending import PeerStream, SendWindow
from dask_services.dataframe import _service
from dask_services.dataframe._service import group_partitions, split_by_destination
from dask_services.service import ServiceId

pytestmark = pytest.mark.timeout(30)


def test_window_bounds_bytes_in_flight_and_flush_waits_for_delivery():
    async def main():
        window = SendWindow(limit=100)
        gates = [asyncio.Event() for _ in range(4)]
        delivered = []
        peak = 0

        def start(i):
            async def send():
                nonlocal peak
                peak = max(peak, window.in_flight)
                await gates[i].wait()
                delivered.append(i)
            return send

        await window.send(60, start(0))
        await window.send(40, start(1))  # exactly full
        third = asyncio.create_task(window.send(30, start(2)))
        await until(lambda: suspended_in(third, "Event.wait", window._room))  # waits for room
        assert not third.done() and window.in_flight == 100
        gates[0].set()
        await third
        assert window.in_flight == 70
        flushing = asyncio.create_task(window.flush())
        # parked in flush, on the two sends still in flight
        await until(lambda: suspended_in(flushing, "SendWindow.flush", window))
        assert not flushing.done() and window.in_flight == 70
        gates[1].set()
        gates[2].set()
        await flushing
        assert sorted(delivered) == [0, 1, 2] and window.in_flight == 0 and peak <= 100

    asyncio.run(main())


def test_window_sends_an_oversized_message_alone():
    async def main():
        window = SendWindow(limit=10)
        done = asyncio.Event()

        async def big():
            await done.wait()

        await window.send(1000, big)  # nothing in flight: it goes
        waiting = asyncio.create_task(window.send(1, big))
        await until(lambda: suspended_in(waiting, "Event.wait", window._room))
        assert not waiting.done() and window.in_flight == 1000
        done.set()
        await waiting
        await window.flush()

    asyncio.run(main())


def test_window_raises_a_failed_send_from_flush_and_every_later_send():
    async def main():
        window = SendWindow(limit=100)

        async def fail():
            raise ConnectionError("peer gone")

        async def ok():
            pass

        await window.send(10, fail)
        with pytest.raises(ConnectionError, match="peer gone"):
            await window.flush()
        with pytest.raises(ConnectionError, match="peer gone"):
            await window.send(10, ok)
        assert window.in_flight == 0

    asyncio.run(main())


def test_window_cancel_stops_sends():
    async def main():
        window = SendWindow(limit=100)
        never = asyncio.Event()

        async def hang():
            await never.wait()

        await window.send(10, hang)
        window.cancel()
        with pytest.raises(asyncio.CancelledError):
            await window.flush()
        assert window.in_flight == 0

    asyncio.run(main())


class GatedPeer:
    """A peer handle whose ``take`` calls each wait for their own gate."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list] = []
        self.gates: list[asyncio.Event] = []
        self.fail = fail

    async def take(self, items: list) -> None:
        gate = asyncio.Event()
        self.gates.append(gate)
        self.calls.append(list(items))
        if self.fail and len(self.calls) > 1:  # gone by now
            raise ConnectionError("peer gone")
        await gate.wait()
        if self.fail:
            raise ConnectionError("peer gone")

    async def done_sending(self, sender) -> None:
        pass

    def open_all(self) -> None:
        for gate in self.gates:
            gate.set()


class TwoInstances:
    def __init__(self, fail: bool = False) -> None:
        self.id = ServiceId("me")
        self.peer = GatedPeer(fail)
        self.peers = {self.id: None, ServiceId("other"): self.peer}


def batched_stream(fail: bool = False, coalesce_bytes: int = 2**20, linger: float = 0,
                   limit: int = 10**9):
    service = TwoInstances(fail)
    stream = PeerStream(service, limit=limit, trim=False, coalesce_bytes=coalesce_bytes,
                        linger=linger)
    stream.sender_done(ServiceId("other"))  # the other side has nothing for us
    return stream, service.peer


def test_batched_sends_go_at_once_and_wait_only_while_one_is_in_flight():
    async def main():
        stream, peer = batched_stream()
        other = ServiceId("other")
        await stream.send_batched(other, 10, "take", "a")
        await until(lambda: len(peer.calls) == 1)
        assert peer.calls == [["a"]]  # nothing in flight: it went alone, at once
        for item in "bcd":
            await stream.send_batched(other, 10, "take", item)
        assert peer.calls == [["a"]] and stream.in_flight == 40  # waiting ones count
        peer.gates[0].set()  # "a" delivered: what waited goes as one call
        await until(lambda: len(peer.calls) == 2)
        assert peer.calls[1] == ["b", "c", "d"]
        await stream.send_batched(other, 10, "take", "e")
        finishing = asyncio.create_task(stream.finish())
        await until(lambda: len(peer.gates) == 2)
        peer.open_all()
        await until(lambda: len(peer.calls) == 3)
        peer.open_all()
        await finishing  # delivers what waited, then the barrier
        assert [x for call in peer.calls for x in call] == list("abcde")
        assert stream.in_flight == 0

    asyncio.run(main())


def stream_to_two_peers(limit: int) -> tuple[PeerStream, GatedPeer, GatedPeer]:
    """A stream to peers ``"1"`` and ``"2"``, which have nothing for it."""
    first, second = GatedPeer(), GatedPeer()
    service = TwoInstances()
    service.peers = {service.id: None, ServiceId("1"): first, ServiceId("2"): second}
    stream = PeerStream(service, limit=limit, trim=False, linger=0)
    for sid in ("1", "2"):
        stream.sender_done(ServiceId(sid))
    return stream, first, second


def test_memory_several_sends_keep_alive_is_counted_until_the_last_is_delivered():
    """Views of one chunk go to several peers and keep the whole chunk until the last
    of them is delivered: a hold counts the chunk once, for that long, and its sends
    count only what they hold of their own."""
    async def main():
        stream, fast, slow = stream_to_two_peers(limit=100)
        hold = await stream.window.hold(60, parts=2)
        for sid in ("1", "2"):
            await stream.send_batched(ServiceId(sid), 30, "take", sid, held=0, hold=hold)
        await until(lambda: len(fast.calls) == len(slow.calls) == 1)
        assert stream.in_flight == 60
        fast.open_all()
        await until(lambda: not stream._busy[ServiceId("1")])
        assert stream.in_flight == 60  # the slow peer's views still hold the chunk
        second = asyncio.create_task(stream.window.hold(60, parts=1))
        await asyncio.sleep(0)
        assert not second.done()  # 60 + 60 > 100: waits for room
        slow.open_all()
        (await second).part_done()
        await stream.finish()
        assert stream.in_flight == 0

    asyncio.run(main())


def test_sends_never_wait_for_a_hold_that_their_delivery_lets_go():
    """A chunk larger than the window held it alone, and its own batch (a packed piece
    of a few bytes) waited for room that only its delivery would make: a 2 GB rechunk
    through 0.5 GB workers hung.  Sends wait for sends only; holds for both."""
    async def main():
        stream, peer = batched_stream(limit=100)
        hold = await stream.window.hold(150, parts=1)  # alone: larger than the window
        await asyncio.wait_for(
            stream.send_batched(ServiceId("other"), 60, "take", "a", held=10, hold=hold), 5)
        await until(lambda: len(peer.calls) == 1)
        # another send goes beside it, as sends did before holds existed
        await asyncio.wait_for(stream.send_batched(ServiceId("other"), 80, "take", "b"), 5)
        later = asyncio.create_task(stream.window.hold(1, parts=1))
        await asyncio.sleep(0)  # (the task runs until it waits: a hold with room would end)
        assert not later.done()  # a hold waits for the sends and the other holds
        peer.open_all()
        await until(lambda: len(peer.calls) == 2)
        peer.open_all()
        (await asyncio.wait_for(later, 5)).part_done()
        await stream.finish()
        assert stream.in_flight == 0

    asyncio.run(main())


def test_a_batch_that_cannot_be_made_fails_the_stream_and_lets_its_holds_go():
    """An error making a batch's call (its encoding) was swallowed: its holds were never
    let go and the next hold waited for ever.  Now it is the stream's error."""
    async def main():
        stream, _ = batched_stream(limit=100)

        def encode(items):
            raise ValueError("cannot encode")

        stream.encode = encode
        hold = await stream.window.hold(80, parts=1)
        with pytest.raises(ValueError, match="cannot encode"):
            await stream.send_batched(ServiceId("other"), 10, "take", "a", held=0,
                                      hold=hold)
        assert stream.window.held == 0 and not stream._busy[ServiceId("other")]
        with pytest.raises(ValueError, match="cannot encode"):
            await asyncio.wait_for(stream.window.hold(80, parts=1), 5)

    asyncio.run(main())


def test_a_hold_that_must_wait_sends_what_lingers_first():
    """Chunks larger than the window go one at a time, each batch lingering 50 ms behind
    the hold of the next chunk: a hold that must wait sends the lingering batches."""
    async def main():
        stream, peer = batched_stream(limit=100, linger=3600)
        first = await stream.hold(150, parts=1)
        await stream.send_batched(ServiceId("other"), 60, "take", "a", held=0, hold=first)
        assert peer.calls == []  # lingering
        second = asyncio.create_task(stream.hold(150, parts=1))
        await until(lambda: peer.calls == [["a"]])  # sent for the hold
        peer.open_all()
        (await asyncio.wait_for(second, 5)).part_done()
        await stream.finish()
        assert stream.in_flight == 0

    asyncio.run(main())


def test_a_batch_waiting_for_room_in_the_window_is_counted():
    async def main():
        stream, first, second = stream_to_two_peers(limit=100)
        await stream.send_batched(ServiceId("1"), 80, "take", "a")
        waiting = asyncio.create_task(stream.send_batched(ServiceId("2"), 50, "take", "b"))
        await until(lambda: stream.in_flight == 130)  # 80 in the window, 50 waiting
        assert not waiting.done() and second.calls == []
        first.open_all()
        await waiting
        await until(lambda: len(second.calls) == 1)
        second.open_all()
        await stream.finish()
        assert stream.in_flight == 0

    asyncio.run(main())


def test_a_batched_send_lingers_so_that_the_next_ones_go_with_it():
    async def main():
        stream, peer = batched_stream(linger=0.01)
        other = ServiceId("other")
        for item in "abc":  # nothing in flight, but "a" lingers: "b" and "c" join it
            await stream.send_batched(other, 10, "take", item)
        assert peer.calls == []
        await until(lambda: len(peer.calls) == 1)
        assert peer.calls == [["a", "b", "c"]]
        peer.open_all()
        await stream.finish()
        assert stream.in_flight == 0

    asyncio.run(main())


def test_finish_sends_lingering_messages_at_once():
    async def main():
        stream, peer = batched_stream(linger=3600)  # the timer would never fire in time
        other = ServiceId("other")
        await stream.send_batched(other, 10, "take", "a")
        finishing = asyncio.create_task(stream.finish())
        await until(lambda: len(peer.calls) == 1)
        peer.open_all()
        await asyncio.wait_for(finishing, 5)
        assert peer.calls == [["a"]] and not stream._lingering

    asyncio.run(main())


def test_cancel_drops_lingering_messages():
    async def main():
        stream, peer = batched_stream(linger=3600)
        await stream.send_batched(ServiceId("other"), 10, "take", "a")
        stream.cancel()
        assert not stream._lingering and stream.in_flight == 0 and peer.calls == []

    asyncio.run(main())


def test_batched_sends_go_once_they_add_up_to_the_coalescing_size():
    async def main():
        stream, peer = batched_stream(coalesce_bytes=25)
        other = ServiceId("other")
        await stream.send_batched(other, 10, "take", "a")
        await until(lambda: len(peer.calls) == 1)
        await stream.send_batched(other, 10, "take", "b")
        assert len(peer.calls) == 1  # "b" waits for "a"
        await stream.send_batched(other, 20, "take", "c")  # 30 bytes waiting: go
        await until(lambda: len(peer.calls) == 2)
        assert peer.calls[1] == ["b", "c"]
        peer.open_all()
        await stream.finish()

    asyncio.run(main())


def test_a_failed_batched_send_is_raised_from_finish():
    async def main():
        stream, peer = batched_stream(fail=True)
        other = ServiceId("other")
        await stream.send_batched(other, 10, "take", "a")
        await stream.send_batched(other, 10, "take", "b")
        await until(lambda: len(peer.calls) == 1)
        peer.open_all()  # "a" fails
        with pytest.raises(ConnectionError, match="peer gone"):
            await stream.finish()

    asyncio.run(main())


def test_cancel_drops_waiting_batched_sends():
    async def main():
        stream, peer = batched_stream()
        other = ServiceId("other")
        await stream.send_batched(other, 10, "take", "a")
        await stream.send_batched(other, 10, "take", "b")
        stream.cancel()
        peer.open_all()
        with pytest.raises(asyncio.CancelledError):
            await stream.finish()
        assert ["b"] not in peer.calls and stream.in_flight == 0

    asyncio.run(main())


@given(
    owner=st.dictionaries(st.integers(0, 200), st.sampled_from(["a", "b", "c"]), max_size=60),
    groups=st.integers(1, 10),
)
def test_groups_are_contiguous_runs_of_each_owners_partitions(owner, groups):
    assigned = group_partitions({p: ServiceId(s) for p, s in owner.items()}, groups)
    assert {p: sid for p, (sid, _) in assigned.items()} == owner
    for sid in set(owner.values()):
        mine = sorted(p for p in owner if owner[p] == sid)
        numbers = [assigned[p][1] for p in mine]
        assert numbers == sorted(numbers)  # in partition order
        assert len(set(numbers)) <= groups


@given(rows=st.integers(0, 300), groups=st.integers(1, 5), seed=st.integers(0, 2**16),
       min_group_bytes=st.sampled_from([0, 200, 2**20]), wide_keys=st.booleans(),
       own=st.sampled_from([None, "a", "b"]), all_wanted=st.booleans(),
       parts_dtype=st.sampled_from(["int64", "int8", "uint16"]), as_arrays=st.booleans())
def test_split_puts_every_row_in_its_partition_in_order(rows, groups, seed, min_group_bytes,
                                                         wide_keys, own, all_wanted,
                                                         parts_dtype, as_arrays):
    """Every row in its partition's group, in order; the caller's own groups share no
    memory with each other or with the groups sent, also where an input is split as
    arrays (``as_arrays``, the column way)."""
    from dask_services.dataframe._rows import ColumnWay, FrameRows

    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"x": rng.integers(0, 1000, rows),
                       "_p": rng.integers(0, 10 if all_wanted else 12, rows).astype(parts_dtype)})
    arrays = (ColumnWay(df.drop(columns="_p").iloc[:0]).values_of(df, "_p", dropping=True)
              if as_arrays else None)
    owner = {p: ServiceId("a" if p % 3 else "b") for p in range(10)}  # 10, 11 unwanted
    destination = group_partitions(owner, groups)
    routing = _service.Routing(destination)
    if wide_keys:  # the sort keys of more than 65,536 partitions
        routing.rank_dtype = np.int64
        routing.every_rank = routing.every_rank.astype(np.int64)
    with mock.patch.object(_service, "MIN_GROUP_BYTES", min_group_bytes), \
            mock.patch.object(_service, "EXACT_SIZE_ROWS", 0):  # sizes measured, not estimated
        out = split_by_destination(df.drop(columns="_p"), df["_p"].to_numpy(), destination,
                                   nbytes=rows * 16, routing=routing,
                                   own=None if own is None else ServiceId(own),
                                   arrays=arrays)
    seen = {}
    for sid, batch in out.items():
        if min_group_bytes == 0:
            assert len(batch) == len({destination[p][1] for p in batch_partitions(batch)})
        for k, (frame, partitions, bounds, nbytes) in enumerate(batch):
            assert isinstance(frame, FrameRows) == as_arrays
            if isinstance(frame, FrameRows):
                if own is not None and sid == ServiceId(own):  # its own rows' arrays only
                    assert all(c.base is None for c in frame.source.columns())
                frame = frame.frame(df.drop(columns="_p").iloc[:0])
                batch[k] = (frame, partitions, bounds, nbytes)
                # measured from its arrays: its columns' and its (taken) index's bytes
                assert nbytes == frame.memory_usage(index=True, deep=True).sum()
            else:
                assert nbytes == sizeof(frame)
            for j, p in enumerate(partitions):
                assert owner[p] == sid
                seen[p] = frame.iloc[bounds[j]:bounds[j + 1]]
    for p in range(12):
        expected = df[df._p == p].drop(columns="_p")
        if p >= 10 or not len(expected):
            assert p not in seen
        else:
            pd.testing.assert_frame_equal(seen[p], expected)
    if own is not None:  # the caller's own groups are copies of their own
        mine = [frame.x.to_numpy() for frame, *_ in out.get(ServiceId(own), [])]
        assert not any(np.shares_memory(x, y) for i, x in enumerate(mine) for y in mine[i + 1:])
        others = [frame.x.to_numpy() for sid, batch in out.items() if sid != ServiceId(own)
                  for frame, *_ in batch]
        assert not any(np.shares_memory(x, y) for x in mine for y in others)


def batch_partitions(batch) -> list[int]:
    return [p for _, partitions, _, _ in batch for p in partitions]


@given(st.lists(st.integers(0, 100)), st.integers(1, 150))
def test_size_batches_keep_order_and_stay_within_the_limit(sizes, limit):
    items = list(enumerate(sizes))
    batches = _service.size_batches(items, lambda item: item[1], limit)
    assert [item for batch in batches for item in batch] == items
    assert all(batch for batch in batches)
    for batch in batches:
        assert len(batch) == 1 or sum(n for _, n in batch) <= limit
    # greedy: a batch is only closed when the next item would not fit
    for batch, following in zip(batches, batches[1:], strict=False):
        assert sum(n for _, n in batch) + following[0][1] > limit


def test_assemble_many_assembles_each_output_in_input_partition_order():
    frames = [pd.DataFrame({"x": np.arange(n)}) for n in (5, 7, 3)]
    pieces = [[(1, f.iloc[2:]), (0, f.iloc[:2])] for f in frames]
    out = _service.assemble_many(pieces, frames[0].iloc[:0], ignore_index=False)
    for got, f in zip(out, frames, strict=True):
        pd.testing.assert_frame_equal(got, f)


@given(inputs=st.integers(1, 6), rows=st.integers(0, 40), nparts=st.integers(1, 9),
       seed=st.integers(0, 2**16), small=st.booleans(), ignore_index=st.booleans(),
       groups=st.integers(1, 4), last=st.integers(-1, 4))
@settings(deadline=None)
def test_assemble_group_gives_each_partition_its_rows_in_input_order(
        inputs, rows, nparts, seed, small, ignore_index, groups, last):
    """Both ways of assembling (one concatenation per output, or one concatenation and sort
    for the window) give what a concatenation of each partition's pieces gives, also for
    frames cut at a window's edge (``cut_at``: the groups up to ``last``, then the rest)."""
    rng = np.random.default_rng(seed)
    frames = [pd.DataFrame({"x": rng.integers(0, 100, rows), "s": pd.array(
        rng.integers(0, 9, rows).astype(str), dtype="str"), "_p": rng.integers(0, nparts, rows)},
        index=rng.integers(0, 1000, rows)) for _ in range(inputs)]
    owner = {p: ServiceId("a") for p in range(nparts)}
    destination = group_partitions(owner, groups)
    received = []
    for i in rng.permutation(inputs).tolist():  # arrival order is not input order
        df = frames[i]
        for _, batch in split_by_destination(df.drop(columns="_p"), df["_p"].to_numpy(),
                                             destination, nbytes=rows * 16).items():
            received += [(i, frame, parts, bounds) for frame, parts, bounds, _ in batch]
    meta = frames[0].drop(columns="_p").iloc[:0]
    for p, got in assembled_in_two_windows(received, destination, nparts, last, meta,
                                           ignore_index, small):
        pieces = [f[f._p == p].drop(columns="_p") for f in frames]
        expected = (pd.concat([f for f in pieces if len(f)]) if any(map(len, pieces))
                    else meta)
        if ignore_index:
            expected = expected.reset_index(drop=True)
        pd.testing.assert_frame_equal(got, expected)


@given(rows=st.integers(1, 60), nparts=st.integers(1, 12), groups=st.integers(1, 5),
       last=st.integers(-1, 5), seed=st.integers(0, 2**16))
def test_cut_at_splits_received_frames_at_a_group_boundary(rows, nparts, groups, last, seed):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"x": np.arange(rows), "_p": rng.integers(0, nparts, rows)})
    destination = group_partitions({p: ServiceId("a") for p in range(nparts)}, groups)
    received = [(7, frame, parts, bounds) for frame, parts, bounds, _ in split_by_destination(
        df.drop(columns="_p"), df["_p"].to_numpy(), destination, nbytes=rows,
    ).get(ServiceId("a"), [])]
    now, later = _service.cut_at(received, last, destination)

    def rows_of(items):
        out = {}
        for index, frame, parts, bounds in items:
            assert index == 7 and len(bounds) == len(parts) + 1
            for j, p in enumerate(parts):
                out[p] = list(frame.x.iloc[bounds[j]:bounds[j + 1]])
        return out

    got_now, got_later = rows_of(now), rows_of(later)
    # frames are shared, not sliced: a slice per frame and window is what cut_at avoids
    frames = {id(frame) for _, frame, _, _ in received}
    assert {id(frame) for _, frame, _, _ in now + later} <= frames
    assert all(destination[p][1] <= last for p in got_now)
    assert all(destination[p][1] > last for p in got_later)
    assert {**got_now, **got_later} == rows_of(received)


def test_service_graphs_are_ordered_without_a_walk_per_input_output_pair():
    """The scheduler's ``dask.order.order`` orders a service task's graph as if its outputs
    did not depend on it: every key still gets a priority, hand-offs before the service
    task, and graphs without a service task are ordered as dask orders them."""
    import dask.order

    from dask_services import graph

    graph.install_order()
    assert dask.order.order is graph.order
    outs = service_graph_for_order(200)
    ordered = dask.order.order(outs)
    assert set(ordered) == set(outs)
    service = next(k for k, v in outs.items() if isinstance(v, graph.ServiceTaskSpec))
    handoffs = [k for k, v in outs.items() if isinstance(v, graph.HandOffSpec)]
    assert max(ordered[h] for h in handoffs) < ordered[service]
    plain = {"a": 1, "b": (sum, ["a"])}
    assert dask.order.order(plain) == graph.order.original(plain)


def service_graph_for_order(n: int) -> dict:
    import dask

    from dask_services.client import service_task
    from dask_services.examples import AllReduce

    xs = [dask.delayed(i, name=f"x-{i}") for i in range(n)]
    outs = service_task(AllReduce, xs, outputs=n)
    return dict(dask.base.collections_to_expr(outs).__dask_graph__())


def test_peer_call_arguments_are_measured_unless_their_caller_knows_their_size():
    from dask_services._host import known_or_size_of
    from dask_services._payload import arguments_of_size

    frame = pd.DataFrame({"x": np.arange(1000)})
    measured = known_or_size_of((frame,), {})
    assert measured >= 8000
    with arguments_of_size(123):  # what PeerStream does around each delivery
        assert known_or_size_of((frame,), {}) == 123
    assert known_or_size_of((frame,), {}) == measured
