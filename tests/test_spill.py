"""The partitioned spill buffer shared by the shuffle and the rechunk."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from distributed.utils_test import gen_cluster
from utils import held_up_spill_writes, suspended_in, until

from dask_services import _spill
from dask_services._spill import OutOfDiskError, SpillBuffer

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(coro)


def test_memory_then_disk_then_take(tmp_path):
    async def main():
        buf = SpillBuffer(str(tmp_path), limit=1000)
        df = pd.DataFrame({"a": np.arange(100)})
        await buf.add_batch([("p0", (0, df.iloc[:50]), 400), ("p1", (0, df.iloc[50:]), 400)])
        assert buf.memory_bytes == 800 and not os.listdir(tmp_path)
        await buf.add_batch([("p0", (1, df.iloc[:10]), 300)])  # over the limit: all to disk
        assert buf.memory_bytes == 0 and buf.disk_bytes > 0 and len(os.listdir(tmp_path)) == 2
        await buf.add_batch([("p0", (2, df.iloc[10:20]), 100)])
        p0 = await buf.take("p0")
        assert sorted(i for i, _ in p0) == [0, 1, 2]
        assert sum(len(d) for _, d in p0) == 70
        assert len(os.listdir(tmp_path)) == 1  # p0's file is gone
        buf.clear()
        assert not os.listdir(tmp_path) and buf.disk_bytes == 0

    run(main())


def test_spilled_pieces_come_back_as_they_were(tmp_path):
    """numpy pickles a non-contiguous array of non-native byte order as a native one: a
    rechunk's ``>f8`` chunks that spilled came out ``float64`` (5 of 5 runs). And plain
    pickle refused objects of classes defined in a client's ``__main__`` (or locally),
    which distributed had sent with cloudpickle: a rechunk of such an object array that
    spilled failed with a ``PicklingError``."""

    class Point:  # pickled by value, as a class of a script's __main__ is
        def __init__(self, v):
            self.v = v

    async def main():
        buf = SpillBuffer(str(tmp_path), limit=1)
        big_endian = np.arange(64.0).astype(">f8").reshape(8, 8)[:, 1:5]
        assert not big_endian.flags.c_contiguous and not big_endian.dtype.isnative
        points = np.empty(3, object)
        points[:] = [Point(i) for i in range(3)]
        await buf.add_batch([("p", ((0, 0), big_endian), 256), ("q", ((0,), points), 24)])
        assert buf.disk_bytes > 0 and buf.memory_bytes == 0
        ((offset, back),) = await buf.take("p")
        assert offset == (0, 0) and back.dtype == np.dtype(">f8")
        np.testing.assert_array_equal(back, big_endian)
        ((_, objects),) = await buf.take("q")
        assert [p.v for p in objects] == [0, 1, 2]
        buf.clear()

    run(main())


def test_out_of_disk_is_a_clear_error(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_spill, "open", full, raising=False)

    async def main():
        buf = SpillBuffer(str(tmp_path), limit=0)
        with pytest.raises(OutOfDiskError, match="out of disk space while spilling to"):
            await buf.add_batch([("p", b"x" * 10, 10)])
        buf.clear()

    run(main())


def test_a_write_under_way_holds_back_batches_over_the_limit(tmp_path):
    """Pieces being written still take memory: a batch that brings what is held over the
    limit waits for the write (the receiver's senders with it); one that fits does not."""

    async def main():
        with held_up_spill_writes() as release:
            buf = SpillBuffer(str(tmp_path), limit=1000)
            await buf.add_batch([("p0", b"x" * 10, 600)])
            spilling = asyncio.create_task(buf.spill())
            await until(lambda: buf.writing_bytes == 600)
            assert buf.memory_bytes == 0 and buf.held_bytes == 600
            await asyncio.wait_for(buf.add_batch([("p1", b"y", 300)]), 5)  # 900 held: fits
            over = asyncio.create_task(buf.add_batch([("p1", b"z", 200)]))  # 1100 held
            # it has added its piece, and waits for the write under way
            await until(lambda: suspended_in(over, "Event.wait", buf._written))
            assert buf.memory_bytes == 500 and not over.done()
            release.set()
            await asyncio.wait_for(asyncio.gather(spilling, over), 10)
            assert buf.writing_bytes == 0 and buf.held_bytes == 500
            assert await buf.take("p0") == [b"x" * 10]
            buf.clear()

    run(main())


def test_a_partition_being_written_is_still_held(tmp_path):
    """While a spill writes a partition's pieces, the buffer still holds them: its
    ``nbytes`` counts them and ``holds`` says so.  The shuffle's assembly reads the
    sizes to find the partitions with pieces of their own: one that read 0 then (a spill
    asked for by the worker's memory check, under way as a window was assembled) made
    its output without those pieces, losing rows silently."""

    async def main():
        with held_up_spill_writes() as release:
            buf = SpillBuffer(str(tmp_path), limit=10**9)
            await buf.add_batch([("p0", b"x" * 10, 600), ("p1", b"y", 50)])
            spilling = asyncio.create_task(buf.spill())
            await until(lambda: buf.writing_bytes == 650)
            assert buf.nbytes("p0") == 600 and buf.nbytes("p1") == 50
            assert buf.holds("p0") and buf.holds("p1") and not buf.holds("p2")
            taking = asyncio.create_task(buf.take("p1"))  # read after the write
            await until(lambda: not buf.holds("p1"))  # forgotten at once
            assert buf.nbytes("p1") == 0
            release.set()
            assert await asyncio.wait_for(taking, 10) == [b"y"]
            await asyncio.wait_for(spilling, 10)
            # what was taken while it was written is not counted again once written
            assert buf.nbytes("p1") == 0 and not buf.holds("p1")
            assert buf.nbytes("p0") > 0 and buf.holds("p0")
            assert await buf.take("p0") == [b"x" * 10]
            assert buf.nbytes("p0") == 0 and buf.disk_bytes == 0 and not buf._writing
            buf.clear()

    run(main())


def test_a_spill_cancelled_while_writing_still_counts_what_it_writes(tmp_path):
    """A spill whose caller is cancelled (the memory check's eviction, say) while its
    write runs in the I/O thread: the write goes on, so its partitions stay counted as
    being written, and once it ends their sizes on disk are counted; the pieces come back
    from the file.  Counted as ended at the cancellation, the partitions read 0 bytes
    while still being written and ever after, which the shuffle's assembly took for
    partitions with no pieces of their own."""
    import pickle

    async def main():
        with held_up_spill_writes() as release:
            buf = SpillBuffer(str(tmp_path), limit=10**9)
            await buf.add_batch([("p", b"a" * 100, 100)])
            spilling = asyncio.create_task(buf.spill())
            await until(lambda: buf.writing_bytes == 100)
            spilling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await spilling
            assert buf.writing_bytes == 100 and buf.nbytes("p") == 100
            assert buf.holds("p")
            release.set()
            await until(lambda: not buf.writing_bytes)
            size = len(pickle.dumps(b"a" * 100, protocol=5))
            assert buf.nbytes("p") == buf.disk_bytes == buf.spilled_total == size
            assert not buf._writing and buf._written.is_set()
            assert await buf.take("p") == [b"a" * 100]
            assert buf.disk_bytes == 0 and not os.listdir(tmp_path)
            buf.clear()

    run(main())


def test_a_partition_taken_while_written_then_spilled_again(tmp_path):
    """Taken during a write that appends to its file, then spilled again into a new file:
    the pieces come back once each, sizes and bytes spilled count each byte once."""
    import pickle

    def written(*pieces):
        return sum(len(pickle.dumps(p, protocol=5)) for p in pieces)

    async def main():
        with held_up_spill_writes() as release:
            buf = SpillBuffer(str(tmp_path), limit=10**9)
            await buf.add_batch([("p", b"a" * 100, 100)])
            release.set()
            await buf.spill()  # the partition has a file
            assert buf.disk_bytes == written(b"a" * 100)
            release.clear()
            await buf.add_batch([("p", b"b" * 200, 200)])
            first = asyncio.create_task(buf.spill())  # appends to the file, held up
            await until(lambda: buf.writing_bytes == 200)
            taking = asyncio.create_task(buf.take("p"))
            await until(lambda: not buf.holds("p"))
            await buf.add_batch([("p", b"c" * 300, 300)])
            second = asyncio.create_task(buf.spill())  # a new file
            await until(lambda: buf.writing_bytes == 500)
            assert buf.nbytes("p") == 300
            release.set()
            assert await asyncio.wait_for(taking, 10) == [b"a" * 100, b"b" * 200]
            await asyncio.wait_for(asyncio.gather(first, second), 10)
            assert buf.nbytes("p") == buf.disk_bytes == written(b"c" * 300)
            assert not buf._writing and buf.writing_bytes == 0
            assert buf.spilled_total == written(b"a" * 100, b"b" * 200, b"c" * 300)
            assert await buf.take("p") == [b"c" * 300]
            assert not os.listdir(tmp_path)
            buf.clear()

    run(main())


def test_huge_page_advice_is_off_while_any_thread_is_inside_and_restored_after():
    """Overlapping ``without_huge_page_advice`` blocks in two threads: the advice stays off
    until the last one leaves, then is what it was before the first entered."""
    import threading

    from dask_services._memory import (
        _get_madvise_hugepage,
        _set_madvise_hugepage,
        without_huge_page_advice,
    )

    before = _get_madvise_hugepage()
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with without_huge_page_advice():
            entered.set()
            leave.wait(10)

    try:
        for setting in (True, False):
            _set_madvise_hugepage(setting)
            entered.clear()
            leave.clear()
            thread = threading.Thread(target=other)
            with without_huge_page_advice():
                thread.start()
                assert entered.wait(10)
                assert _get_madvise_hugepage() is False
            assert _get_madvise_hugepage() is False  # the other thread is still inside
            leave.set()
            thread.join(10)
            assert _get_madvise_hugepage() is setting
    finally:
        _set_madvise_hugepage(before)


def test_produced_outputs_spilled_are_read_back_once(tmp_path):
    from dask_services._produced import ProducedOutputs

    produced = ProducedOutputs(str(tmp_path))
    frame = pd.DataFrame({"a": np.arange(1000)})
    produced.put("o0", frame)
    produced.put("o1", np.arange(10))
    produced.put("o2", "small")
    assert produced.in_memory() == 3 and not os.listdir(tmp_path)
    count, nbytes = produced.spill()
    assert count == 3 and nbytes > 8000
    assert produced.in_memory() == 0 and len(os.listdir(tmp_path)) == 3
    pd.testing.assert_frame_equal(produced.take("o0", keep=True), frame)  # still held
    pd.testing.assert_frame_equal(produced.take("o0"), frame)
    assert "o0" not in produced and len(os.listdir(tmp_path)) == 2
    np.testing.assert_array_equal(produced.take("o1"), np.arange(10))
    with pytest.raises(KeyError):
        produced.take("o1")
    produced.put("o3", 3)  # produced after the spill: in memory
    assert produced.in_memory() == 1
    lock = threading.Lock()
    produced.put("o4", lock)  # cannot be written: stays, and is taken as it is
    assert produced.spill()[0] == 1 and produced.in_memory() == 1  # o3 written, o4 not
    assert produced.take("o4") is lock
    produced.drop("o2")
    produced.clear()
    assert len(produced) == 0 and not tmp_path.exists()  # gone with its last file
    produced.put("o5", np.arange(3))
    assert produced.spill()[0] == 1 and len(os.listdir(tmp_path)) == 1  # made again
    np.testing.assert_array_equal(produced.take("o5"), np.arange(3))
    assert not tmp_path.exists()


def test_produced_outputs_on_a_full_disk_leave_no_file(tmp_path, monkeypatch):
    # a write that failed left its file, one more at every memory check of a paused
    # worker, and the directory stayed after the run
    import errno
    import io

    from dask_services import OutOfDiskError, _produced
    from dask_services._produced import ProducedOutputs

    class Full(io.FileIO):
        def writelines(self, frames):
            super().write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_produced, "open", lambda path, mode: Full(path, mode), raising=False)
    produced = ProducedOutputs(str(tmp_path / "dir"))
    produced.put("o0", np.arange(1000))
    for _ in range(3):
        with pytest.raises(OutOfDiskError, match="out of disk space.*local-directory") as e:
            produced.spill()
        assert e.value.spilled == (0, 0)  # none written before it
    assert produced.in_memory() == 1 and not (tmp_path / "dir").exists()
    np.testing.assert_array_equal(produced.take("o0"), np.arange(1000))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_paused_worker_that_cannot_write_outputs_says_so_once(c, s, a, caplog):
    # every memory check (500 ms) of a paused worker on a full disk logged a traceback
    import dask_services

    await dask_services.install_async(c)
    ext = a.extensions["dask_services"]
    ext.produced.put("o0", np.arange(10))
    full = OutOfDiskError(errno.ENOSPC, "out of disk space writing produced outputs")
    with mock.patch.object(ext.produced, "spill", side_effect=full), \
            caplog.at_level("WARNING", logger="dask_services"):
        assert await ext.spill_produced() == 0
        assert await ext.spill_produced() == 0
    said = [r for r in caplog.records if "cannot write produced outputs" in r.getMessage()]
    assert len(said) == 1 and "kept in memory" in said[0].getMessage()
    assert ext.produced.in_memory() == 1
    ext.produced.clear()


@pytest.mark.parametrize("spill", [False, True])
@gen_cluster(client=True, timeout=60)
async def test_a_workers_local_directory_is_as_it_was_after_a_run(c, s, a, b, spill):
    """No ``dask-services`` directory stays behind on a worker once its runs are over,
    whether or not their pieces were spilled to disk (as p2p leaves a worker's directory;
    the directory was made when dask_services was installed, and stayed)."""
    import dask
    import dask.dataframe as dd

    before = {w.address: list(os.walk(w.local_directory)) for w in (a, b)}
    frame = pd.DataFrame({"a": np.arange(2000) % 37, "b": np.arange(2000.0)})
    config = {"dask_services.shuffle.buffer-fraction": 1e-9} if spill else {}
    buffers = []
    made = SpillBuffer.__init__

    def keep(buffer, *args, **kwargs):
        made(buffer, *args, **kwargs)
        buffers.append(buffer)

    with dask.config.set(config), mock.patch.object(SpillBuffer, "__init__", keep):
        out = dd.from_pandas(frame, npartitions=8).shuffle("a", shuffle_method="service")
        head = await c.compute(out.partitions[0])
        total = await c.compute(out.b.sum())
    assert total == frame.b.sum() and set(head.a) <= set(frame.a)
    assert any(buffer.spilled_total for buffer in buffers) == spill
    await until(lambda: all(not w.extensions["dask_services"].host.instances
                            for w in (a, b)))
    assert {w.address: list(os.walk(w.local_directory)) for w in (a, b)} == before


def blobs(i: int) -> pd.DataFrame:
    """2,000 rows of 100 bytes, and one of 8 MB: dask's sample of 100 cells misses it."""
    rng = np.random.default_rng(i)
    cells = np.empty(2_001, dtype=object)
    cells[:] = [rng.bytes(100) for _ in range(2_001)]
    cells[777] = rng.bytes(8 * 2**20)
    return pd.DataFrame({"key": rng.integers(0, 50, 2_001), "blob": cells})


# a limit far above the test process's memory: in-process workers measure the whole
# process, which a long test session grows to a small limit's pause threshold
@gen_cluster(client=True, timeout=60, worker_kwargs={"memory_limit": 2**36})
async def test_large_cells_among_small_rows_count_toward_the_buffer(c, s, a, b):
    """The buffers took their pieces' sizes from dask's ``sizeof``, which samples a column
    of objects: 4 partitions holding 32 MB in hidden cells fit, as far as they knew, in a
    budget of 10 MB, and nothing was spilled (0 of 500 MB with a 43 MB budget on 2 GiB
    workers). Their cells are now measured one by one."""
    import dask
    import dask.dataframe as dd

    buffers = []
    made = SpillBuffer.__init__

    def keep(buffer, *args, **kwargs):
        made(buffer, *args, **kwargs)
        buffers.append(buffer)

    config = {"dask_services.shuffle.buffer-fraction": 10e6 / 2**36,  # 10 MB a worker
              "dataframe.convert-string": False}
    with dask.config.set(config), mock.patch.object(SpillBuffer, "__init__", keep):
        df = dd.from_map(blobs, range(4), meta=blobs(0).iloc[:0])
        out = df.shuffle("key", shuffle_method="service", npartitions=4)
        sizes = out.map_partitions(
            lambda p: p.assign(n=p.blob.map(len)).groupby("key").n.sum(),
            meta=("n", "i8"))
        got = await c.compute(sizes)
    frames = [blobs(i) for i in range(4)]
    expected = pd.concat(frames).assign(n=lambda f: f.blob.map(len)).groupby("key").n.sum()
    pd.testing.assert_series_equal(got.groupby(level=0).sum().sort_index(),
                                   expected.sort_index(), check_names=False)
    assert sum(buffer.spilled_total for buffer in buffers) > 8 * 2**20
