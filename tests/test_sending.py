"""Background sends within a byte budget, and how the shuffle groups its partitions."""

from __future__ import annotations

import asyncio
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof
from hypothesis import given
from hypothesis import strategies as st
from utils import suspended_in, until

from dask_services._sending import SendWindow
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
       min_group_bytes=st.sampled_from([0, 200, 2**20]))
def test_split_puts_every_row_in_its_partition_in_order(rows, groups, seed, min_group_bytes):
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"x": rng.integers(0, 1000, rows), "_p": rng.integers(0, 12, rows)})
    owner = {p: ServiceId("a" if p % 3 else "b") for p in range(10)}  # 10, 11 unwanted
    destination = group_partitions(owner, groups)
    with mock.patch.object(_service, "MIN_GROUP_BYTES", min_group_bytes):
        out = split_by_destination(df.drop(columns="_p"), df["_p"].to_numpy(), destination,
                                   nbytes=rows * 16)
    seen = {}
    for sid, batch in out.items():
        if min_group_bytes == 0:
            assert len(batch) == len({destination[p][1] for p in batch_partitions(batch)})
        for frame, partitions, bounds, nbytes in batch:
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
