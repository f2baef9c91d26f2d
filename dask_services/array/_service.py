"""The array rechunk as a service.

Every instance slices the chunks handed to it into the pieces each wanted output chunk
needs and sends them, batched per destination instance, through a byte-bounded window.
Receivers count the pieces of each of their output chunks and produce a chunk as soon as
its last piece has arrived, before ``all_inputs_done`` whenever its inputs were handed off
early.  Where the old and new chunkings leave independent regions, the first outputs are
therefore in memory long before the last inputs are handed off.

Where an instance's output chunks fit its buffer budget together, each piece is written
into its output chunk as it arrives (in place), so that a chunk is ready the moment its last
piece is, and the copying overlaps the exchange instead of following it.  Otherwise pieces
are buffered (spilling to disk past the budget, as the shuffle does) and a chunk is
assembled, one at a time, once complete; an instance whose outputs are a box keeps each
slab as its parts for bands of the box instead, and assembles a band at a time
(``_bands.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from dask_services._buffers import ArraysInMemory, IncomingBuffers
from dask_services._exchange import PeerExchange
from dask_services._memory import TrimAfter, release_freed_memory
from dask_services.array._bands import Band, BandPart, Bands, assemble_band, band_parts
from dask_services.array._masks import as_masked, has_planes, write
from dask_services.array._pieces import (
    BoxCount,
    Chunks,
    Index,
    PackedPieces,
    Piece,
    Slab,
    TiledBox,
    TileLayout,
    as_buffers,
    assembles_in_place,
    batch_bytes,
    check_block_shape,
    fill,
    fits,
    from_buffers,
    is_view,
    new_array,
    output_indices,
    output_shape,
    own_bytes,
    piece_bytes,
    pieces_by_destination,
    pieces_dtype,
    plain_numpy,
    promoted,
    region,
    unpacked,
    write_into,
)
from dask_services.array._plan import (
    AFFINITY_MAX_INPUTS,
    axis_overlaps,
    chunk_starts,
    output_blocks,
    owned_boxes,
    pieces_per_output,
)
from dask_services.service import ServiceId, rpc

# a batch of at most this many bytes is written into its outputs on the event loop; a larger
# one in a worker thread (a thread hand-over costs about as much as copying this much)
WRITE_ON_LOOP_MAX = 1 << 20
# ... and of at most this many pieces (each write costs a few microseconds of Python)
WRITE_ON_LOOP_PIECES = 64
# a box is held as tiles of at most this many arrays per axis (chunks of this many sizes
# along it: a regular grid's and its last, smaller chunk's); past it, pieces are sent
MAX_BOX_PARTS = 2
# a buffering instance assembles its box in bands of at most this many bytes (and at most
# a quarter of its buffer budget; one chunk at least)
MAX_BAND_BYTES = 64 << 20
# ... and writes the first bands in place, as long as they fit this share of its budget
IN_PLACE_BANDS_SHARE = 0.75


class ArrayRechunk(PeerExchange):
    """Peer-to-peer rechunk of a numpy-backed (masked or not) dask array; see module
    docstring."""

    config_section = "rechunk"
    # output_keys come in the order of their chunk indices (C order); the names are not read
    outputs_by_position = True
    # the pieces sent are mostly views into input chunks, which stay in memory until every
    # piece of theirs is sent: trimming after sends would give back little, at a cost
    trim_after_sends = False

    @classmethod
    def output_owners(cls, params: dict[str, Any], outputs: int, workers: int
                      ) -> list[int] | None:
        """A box of neighbouring output chunks per worker (``output_blocks``), so that an
        input chunk's share for each is one ``Slab``."""
        blocks = output_blocks(params["old_chunks"], params["new_chunks"], workers)
        return blocks if blocks is not None and len(blocks) == outputs else None

    async def start(self, id, key, peers, input_keys, output_keys, concierge, leader, *,
                    old_chunks: Chunks, new_chunks: Chunks, dtype: np.dtype,
                    old_offset: Index | None = None, new_offset: Index | None = None,
                    masked: bool = False, **kwargs: Any) -> None:
        # the chunks of this service task's region of the array, whose first input chunk
        # has the index ``old_offset``; ``output_keys`` are its output chunks in C order
        # (``new_offset``, the first one's index in the array, is not needed here);
        # ``masked``: the array's meta is a masked array
        self.new_chunks = new_chunks
        self.old_chunks = old_chunks
        self.dtype = dtype
        self.masked = masked
        self.overlaps = [axis_overlaps(o, n) for o, n in zip(old_chunks, new_chunks,
                                                             strict=True)]
        counts = pieces_per_output(self.overlaps, new_chunks)
        offset = old_offset or (0,) * len(new_chunks)
        self.index_of = {k: tuple(a - o for a, o in zip(k[1:], offset, strict=True))
                         for k in input_keys}
        # by position: an output fused with its consumer has the consumer's key
        output_index = dict(zip(output_keys, itertools.product(*map(range, map(
            len, new_chunks))), strict=True))
        self.key_of = {j: k for k, j in output_index.items()}
        self.owner = {output_index[k]: concierge.owner(k) for k in concierge.wanted_outputs}
        self.expected = {j: math.prod(counts[d][jd] for d, jd in enumerate(j))
                         for j, sid in self.owner.items() if sid == id}
        # instances whose outputs are a box (``output_owners``) take one slab of each input
        # chunk; only where outputs need many inputs each (the placement's condition: with
        # few, outputs are placed next to their inputs and complete early, and a box's
        # outputs, views of one array, would keep its memory until the last is let go of)
        boxes: dict[ServiceId, tuple[range, ...]] = {}
        known = not any(math.isnan(c) for axis in (*old_chunks, *new_chunks) for c in axis)
        if known and not np.dtype(dtype).hasobject and math.prod(
                max(c, default=0) for c in counts) > AFFINITY_MAX_INPUTS:
            boxes = owned_boxes(self.owner)
        # where each output (input) chunk starts along each axis, with the end of the last
        new_starts = [chunk_starts(axis) for axis in new_chunks] if boxes else []
        self.old_starts = [chunk_starts(axis) for axis in old_chunks] if boxes else []
        # how each boxed instance holds its box; not where its chunks come in many sizes
        # (slabs then cut into pieces of a frame each again)
        self.layouts = {sid: layout for sid, layout in (
            (sid, TileLayout(box, new_starts)) for sid, box in boxes.items())
            if len(layout.parts()) <= MAX_BOX_PARTS ** len(new_chunks)}
        self.unboxed = any(sid not in self.layouts for sid in set(self.owner.values()))
        # this instance's box: its output chunks as tiles of a few arrays (allocated with
        # its first piece), its pieces counted a slab at a time, and how many of its chunks
        # are still to be produced
        self.box: TiledBox | None = None
        self.layout: TileLayout | None = self.layouts.get(id)
        self.box_count = BoxCount(boxes[id], counts) if id in self.layouts else None
        self.box_left = len(self.expected) if id in self.layouts else 0
        self.received: dict[Index, int] = ({} if self.box_count is not None
                                           else dict.fromkeys(self.expected, 0))
        self.assembling: set[asyncio.Task] = set()
        # one chunk at a time takes its pieces (perhaps from disk) and is written out, so
        # that many chunks completing together do not all come into memory at once
        self.one_at_a_time = asyncio.Semaphore(1)
        self.trim = TrimAfter()
        self.open_exchange(concierge)
        assert self.buffer is not None and self.stream is not None
        # numbers travel as Buffers (read where they belong), objects pickled
        self.batch_method = "receive_many" if np.dtype(dtype).hasobject else "receive_pieces"
        if self.batch_method == "receive_pieces":
            self.stream.encode = as_buffers
        # in place: the output chunks being written, and the bytes written into each
        self.outputs: dict[Index, np.ndarray] | None = (
            {} if assembles_in_place(new_chunks, self.expected, np.dtype(dtype),
                                     self.buffer.limit) else None
        )
        # buffered, a box is kept as the parts of its slabs for bands of it, each
        # assembled once complete (``_bands.py``)
        self.bands: Bands | None = (
            Bands(self.layout, np.dtype(dtype).itemsize,
                  min(MAX_BAND_BYTES, max(1, self.buffer.limit // 4)))
            if self.outputs is None and self.layout is not None else None)
        # ... of which the first that fit a share of the budget are written in place as
        # their parts arrive (a box larger than the budget by a little is mostly written
        # in place), the others kept in what is left of the buffer
        self.band_boxes: dict[Band, TiledBox] = {}
        self.in_place_bands: set[Band] = set()
        if self.bands is not None:
            fitting = self.bands.fitting(int(self.buffer.limit * IN_PLACE_BANDS_SHARE))
            self.in_place_bands = set(fitting)
            self.buffer.limit -= sum(map(self.bands.nbytes, fitting))
        self.written: dict[Index, int] = {}
        self.box_written = 0  # bytes written into the box for chunks not yet produced
        # pieces of output chunks written in place whose dtype did not fit the chunk's
        self.aside: dict[Index, list[tuple[tuple[int, ...], np.ndarray]]] = {}

    async def all_started(self) -> None:
        for j, n in self.expected.items():
            if n == 0:  # an empty output chunk: nothing will arrive for it
                self._complete(j)

    async def add_key(self, key, block: np.ndarray) -> None:
        assert self.stream is not None
        # a memmap or other plain subclass: its data; a masked array: data and mask, as
        # planes (a copy of the chunk: in a worker thread, not on the event loop)
        block = (await self.concierge.run_in_executor(plain_numpy, block, key)
                 if isinstance(block, np.ma.MaskedArray) else plain_numpy(block, key))
        index = self.index_of[key]
        check_block_shape(block, tuple(self.old_chunks[d][i] for d, i in enumerate(index)),
                          key)
        by_destination = await self.concierge.run_in_executor(
            pieces_by_destination, block, index, self.overlaps, self.owner, self.id,
            self.layouts, tuple(self.old_starts[d][i] for d, i in enumerate(index))
            if self.layouts else (), self.unboxed
        )
        chunk_bytes = int(block.nbytes)
        del block
        # views keep the whole chunk until the last of them is delivered: it is counted
        # in the send window once, for that long (copies count their own bytes)
        with_views = {sid for sid, batch in by_destination.items()
                      if sid != self.id and any(map(is_view, batch))}
        hold = (await self.stream.hold(chunk_bytes, len(with_views))
                if with_views else None)
        for sid, batch in by_destination.items():
            if sid == self.id:
                await self.receive([batch])
                continue
            nbytes = batch_bytes(batch)
            self.sent_bytes += nbytes
            await self.stream.send_batched(sid, nbytes, self.batch_method, batch,
                                           held=own_bytes(batch),
                                           hold=hold if sid in with_views else None)

    @rpc
    async def receive_many(self, batches: list[list[Piece | PackedPieces]]) -> None:
        """Peer RPC: the pieces of several input chunks for this instance.  Pieces for one
        peer go together while an earlier call to it is in flight (``send_batched``): with
        many workers or small chunks, an input's share for each peer is small, and a call
        per input and peer cost more than the pieces it carried."""
        await self.receive(batches)

    @rpc
    async def receive_pieces(self, meta: list[tuple], incoming: IncomingBuffers | list
                             ) -> None:
        """Peer RPC: the pieces of several input chunks for this instance, as ``Buffers``
        (``as_buffers``): written straight into their output chunks where those are
        assembled in place, with no buffer of their own; else received as arrays."""
        if isinstance(incoming, list):  # objects, pickled
            incoming = ArraysInMemory(incoming)
        if self.outputs is None:
            arrays = await incoming.arrays()
            await self.receive([from_buffers(meta, arrays)])
            return
        destinations: list[np.ndarray] = []
        direct: list[tuple[Index, int]] = []
        # a chunk takes the dtype of its first piece (the graph's meta may say another); a
        # later piece of another dtype (chunks of the array that differ) is read into an
        # array of its own and cast on writing where that loses nothing, else set aside
        # until the chunk is complete and promoted
        casts: list[tuple[np.ndarray, np.ndarray]] = []
        aside: list[Piece] = []
        whole: list[Slab] = []  # slabs read straight into this instance's box
        for m, shape, dtype in zip(meta, incoming.shapes, incoming.dtypes, strict=True):
            box = self._box(dtype) if m[0] == "slab" else None
            if box is not None and box.dtype == dtype:
                assert self.layout is not None
                destination = box.destination(m[1], shape)
                whole.append(Slab(m[1], destination).placed(self.layout, whole=True))
            elif m[0] == "piece":
                destination = self._output(m[1], dtype)[region(m[2], shape)]
                if destination.dtype != dtype:
                    piece = np.empty(shape, dtype)
                    if fits(dtype, destination.dtype):
                        casts.append((destination, piece))
                    else:
                        aside.append((m[1], m[2], piece))
                    destination = piece
                direct.append((m[1], int(destination.nbytes)))
            else:
                destination = np.empty(shape, dtype)
            destinations.append(destination)
        await incoming.read_into(destinations)
        for chunk_region, piece in casts:
            write(chunk_region, ..., piece)
        self._set_aside(aside)
        # packed pieces, and slabs not read straight into this instance's box (another
        # dtype): written from here
        packed: list[PackedPieces | Slab] = [
            PackedPieces(m[2], m[1], a) if m[0] == "packed" else Slab(m[1], a)
            for m, a in zip(meta, destinations, strict=True)
            if m[0] == "packed" or (m[0] == "slab" and a.base is None)]
        del destinations, casts
        received = direct
        if packed:
            more, slabs = await self._write([packed], sum(len(p) for p in packed),
                                            sum(p.nbytes for p in packed))
            received = received + more
            whole += slabs
        self._received(received, incoming.nbytes, whole)

    async def _write(self, batches: list[list[Piece | PackedPieces | Slab]], count: int,
                     nbytes: int) -> tuple[list[tuple[Index, int]], list[Slab]]:
        """``batches`` written into their outputs (in place), on the event loop if small:
        each piece's output and bytes, and the slabs written whole into the box."""
        for batch in batches:
            for item in batch:
                if type(item) is Slab:
                    assert self.layout is not None
                    box = self._box(item.dtype)
                    item.placed(self.layout, whole=box is not None and fits(item.dtype,
                                                                            box.dtype))
        outputs = {j: self._output(j, dtype) for j, dtype in output_indices(batches).items()}
        if count <= WRITE_ON_LOOP_PIECES and nbytes <= WRITE_ON_LOOP_MAX:
            written, aside, whole = write_into(outputs, batches, self.box)
        else:
            written, aside, whole = await self.concierge.run_in_executor(
                write_into, outputs, batches, self.box)
        self._set_aside(aside)
        return written, whole

    def _set_aside(self, aside: list[Piece]) -> None:
        """Pieces whose dtype does not fit their output chunk's, kept until it is complete
        (``promoted``)."""
        for j, offset, piece in aside:
            self.aside.setdefault(j, []).append((offset, piece))

    async def receive(self, batches: list[list[Piece | PackedPieces]]) -> None:
        """Pieces of this instance's output chunks, some of them packed (``PackedPieces``).

        Written into the outputs in place, from views of the packed buffers, or else
        copied out of them (a kept view would hold the whole buffer) into the receive
        buffer.  A batch of many pieces is unpacked and written in a worker thread: at
        1,000 pieces per input chunk, writing on the event loop kept it busy most of the
        run."""
        assert self.buffer is not None
        count = sum(1 if type(item) is tuple else len(item)
                    for batch in batches for item in batch)
        nbytes = sum(map(batch_bytes, batches))
        if self.outputs is None:
            slabs: list[Slab] = []
            for batch in batches:
                for item in batch:
                    if type(item) is Slab:
                        assert self.layout is not None
                        slabs.append(item.placed(self.layout, whole=False))
            if self.bands is not None and slabs:  # kept as parts for bands, not pieces
                batches = [[item for item in batch if type(item) is not Slab]
                           for batch in batches]
                count -= sum(map(len, slabs))
                self._allocate_bands(slabs)
            if count <= WRITE_ON_LOOP_PIECES and nbytes <= WRITE_ON_LOOP_MAX:
                pieces, parts, aside = self._buffered(batches, slabs)
            else:
                pieces, parts, aside = await self.concierge.run_in_executor(
                    self._buffered, batches, slabs)
            self._set_aside(aside)
            del aside
            received = [(j, piece_bytes(piece)) for j, _, piece in pieces]
            await self.buffer.add_batch(
                [(j, (offset, piece), n)
                 for (j, offset, piece), (_, n) in zip(pieces, received, strict=True)]
                + [(("band", band), part, n) for band, part, n in parts])
            del pieces, parts
            del batches
            self.received_bytes += nbytes
            self._count(received)
            if self.bands is not None:
                assert self.box_count is not None
                for slab in slabs:
                    for j in self.box_count.add(slab):
                        self._complete(j)
            return
        received, whole = await self._write(batches, count, nbytes)
        del batches
        self._received(received, nbytes, whole)

    def _allocate_bands(self, slabs: list[Slab]) -> None:
        """The boxes of the bands held in place that ``slabs`` reach and that have none
        yet, of the dtype of the first slab to reach them (allocated here, on the event
        loop, so that the threads writing parts into them only write)."""
        assert self.bands is not None
        for slab in slabs:
            for band in self.bands.reached(slab):
                if band in self.in_place_bands and band not in self.band_boxes:
                    self.band_boxes[band] = TiledBox(self.bands.layout_of(band),
                                                     slab.dtype)

    def _buffered(self, batches: list[list[Piece | PackedPieces | Slab]], slabs: list[Slab]
                  ) -> tuple[list[Piece], list[tuple[Band, BandPart, int]], list[Piece]]:
        """What a buffering instance keeps of ``batches``: their pieces, copied, and
        (with bands: ``slabs`` not in ``batches`` then) the parts of ``slabs`` for bands
        not held in place, those for the others written into their boxes (pieces whose
        dtype does not fit returned to be set aside)."""
        if self.bands is None:
            return unpacked(batches, copy=True), [], []
        return (unpacked(batches, copy=True),
                *band_parts(self.bands, slabs, self.band_boxes))

    def _received(self, received: list[tuple[Index, int]], nbytes: int,
                  whole: Iterable[Slab] = ()) -> None:
        """Pieces written in place: ``received`` gives each one's output and bytes;
        ``whole``: slabs written whole into this instance's box."""
        for j, n in received:
            self.written[j] = self.written.get(j, 0) + n
        self.received_bytes += nbytes
        self._count(received)
        for slab in whole:
            assert self.box_count is not None
            self.box_written += slab.nbytes
            for j in self.box_count.add(slab):
                self._complete(j)

    def _count(self, received: list[tuple[Index, int]]) -> None:
        for j, _ in received:
            if self.box_count is not None:
                if self.box_count.add_one(j):
                    self._complete(j)
                continue
            self.received[j] += 1
            if self.received[j] == self.expected[j]:
                self._complete(j)

    def _complete(self, j: Index) -> None:
        if self.bands is not None:
            band = self.bands.completes(j)
            if band is None:  # (produced with the last of its band)
                return
            task = asyncio.create_task(self._produce_band(band))
        else:
            task = asyncio.create_task(self._produce(j))
        self.assembling.add(task)
        task.add_done_callback(self._assembled)

    def _assembled(self, task: asyncio.Task) -> None:
        self.assembling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.concierge.error(task.exception())

    def _output(self, j: Index, dtype: np.dtype | None = None) -> np.ndarray:
        """Output chunk ``j`` being written in place, allocated with its first piece (of
        ``dtype``: the chunks', which a graph's meta may misstate) or, with none, when
        produced empty."""
        assert self.outputs is not None
        chunk = self.outputs.get(j)
        if chunk is None:
            if self._box(dtype) is not None:
                return self.outputs[j]
            shape = tuple(int(self.new_chunks[d][jd]) for d, jd in enumerate(j))
            chunk = self.outputs[j] = new_array(shape, self.dtype if dtype is None else dtype)
        return chunk

    def _box(self, dtype: np.dtype | None = None) -> TiledBox | None:
        """This instance's box, where its outputs are one (``output_owners``) and written
        in place: a few arrays, allocated with the first piece to arrive (of ``dtype``, as
        ``_output`` allocates a chunk), whose tiles are its output chunks; ``None``
        otherwise."""
        if self.box is None and self.box_left and self.outputs is not None:
            assert self.layout is not None
            self.box = TiledBox(self.layout, np.dtype(self.dtype if dtype is None else dtype))
            for j in itertools.product(*self.layout.box):
                self.outputs[j] = self.box.chunk(j)
        return self.box

    async def _produce(self, j: Index) -> None:
        if self.outputs is not None:
            chunk = self._output(j)  # allocated here if it has no piece (an empty chunk)
            del self.outputs[j]
            in_pieces = self.written.pop(j, 0)
            if self.box_count is not None:  # (its other bytes came in slabs)
                self.box_written -= int(chunk.nbytes) - in_pieces
                self.box_left -= 1
                if not self.box_left:  # (its outputs, views of it, hold it from here on)
                    self.box = None
            await self._promoted_and_produced(j, chunk, self.aside.pop(j, []))
            return
        async with self.one_at_a_time:
            assert self.buffer is not None
            held = self.buffer.memory_bytes
            pieces = await self.buffer.take(j)
            shape = tuple(self.new_chunks[d][jd] for d, jd in enumerate(j))
            # allocated here, written in a worker thread: the received pieces were freed by
            # the event loop's thread, whose allocator arena can hand their memory out again
            # without page faults (measured together with ``new_array``'s change, not apart)
            chunk = new_array(output_shape(shape, pieces), pieces_dtype(self.dtype, pieces))
            chunk = await self.concierge.run_in_executor(fill, chunk, pieces)
            del pieces
            # Freed pieces go back to the OS only under memory pressure (once the buffer has
            # spilled): trimming costs the assembly page faults on the memory it gives back
            # (a 2 GB all-to-all took ~10% longer), and otherwise did not lower the peak.
            if self.trim.freed_bytes(held - self.buffer.memory_bytes) \
                    and self.buffer.spilled_total:
                await self.concierge.run_in_executor(release_freed_memory)
            await self.concierge.produce_key(self.key_of[j], await self._handed_out(j, chunk))

    async def _produce_band(self, band: Band) -> None:
        """Every output chunk of ``band`` (all complete), assembled from the parts of
        slabs kept for it and any pieces of its chunks, one band at a time."""
        assert self.bands is not None and self.buffer is not None
        box = self.band_boxes.pop(band, None)
        if box is not None:  # held in place
            await self._produce_in_place(box)
            return
        async with self.one_at_a_time:
            held = self.buffer.memory_bytes
            parts = await self.buffer.take(("band", band))
            layout = self.bands.layout_of(band)
            loose = {j: await self.buffer.take(j)
                     for j in itertools.product(*layout.box) if self.buffer.holds(j)}
            chunks = await self.concierge.run_in_executor(
                assemble_band, layout, parts, np.dtype(self.dtype), loose)
            del parts, loose
            if self.trim.freed_bytes(held - self.buffer.memory_bytes) \
                    and self.buffer.spilled_total:
                await self.concierge.run_in_executor(release_freed_memory)
            for j, chunk in chunks.items():
                await self.concierge.produce_key(self.key_of[j],
                                                 await self._handed_out(j, chunk))

    async def _produce_in_place(self, box: TiledBox) -> None:
        """Every output chunk of a band held in place: the tiles of ``box``, each
        promoted where pieces of it were set aside (another dtype; pieces that came as
        pieces and were buffered)."""
        assert self.buffer is not None
        for j in itertools.product(*box.layout.box):
            chunk = box.chunk(j)
            if not chunk.size:  # (no piece: the declared dtype, as buffered)
                chunk = np.empty(chunk.shape, np.dtype(self.dtype))
            await self._promoted_and_produced(j, chunk, self.aside.pop(j, []) + (
                await self.buffer.take(j) if self.buffer.holds(j) else []))

    async def _promoted_and_produced(self, j: Index, chunk: np.ndarray,
                                     aside: list[tuple[tuple[int, ...], np.ndarray]]) -> None:
        """Output chunk ``j``, written in place, produced: promoted first where pieces of
        it were set aside (``aside``: the chunk, those pieces and its promoted copy, one
        chunk at a time)."""
        if aside:
            async with self.one_at_a_time:
                chunk = await self.concierge.run_in_executor(
                    promoted, chunk, aside, np.dtype(self.dtype), j)
        del aside
        await self.concierge.produce_key(self.key_of[j], await self._handed_out(j, chunk))

    async def _handed_out(self, j: Index, chunk: np.ndarray) -> np.ndarray:
        """Output chunk ``j`` as it is produced: a masked array where it was assembled with
        planes (``_masks.py``: values and mask copied out of them, in a worker thread), or
        where it has no piece and the array's meta is masked (as ``tasks`` gives it)."""
        if self.masked and not self.expected[j]:
            return np.ma.masked_array(chunk)
        if has_planes(chunk.dtype):
            return await self.concierge.run_in_executor(as_masked, chunk)
        return chunk

    async def all_inputs_done(self) -> None:
        assert self.stream is not None
        await self.stream.finish()
        while self.assembling:
            await asyncio.wait(set(self.assembling))
        missing = [j for j, n in self.received.items() if n != self.expected[j]]
        if self.box_count is not None:
            missing += self.box_count.missing()
        if missing:
            raise RuntimeError(
                f"rechunk instance {self.id}: output chunks {missing[:5]} did not receive "
                "all their pieces although every input was handed off"
            )

    def __sizeof__(self) -> int:
        return (super().__sizeof__() + sum(getattr(self, "written", {}).values())
                + getattr(self, "box_written", 0)
                + sum(a.nbytes for box in getattr(self, "band_boxes", {}).values()
                      for a in box.parts.values()))

    async def stop(self) -> None:
        for task in list(getattr(self, "assembling", ())):
            task.cancel()
        if getattr(self, "outputs", None) is not None:
            self.outputs, self.written, self.aside = {}, {}, {}
            self.box, self.box_left = None, 0
        self.band_boxes, self.aside = {}, {}
        await super().stop()

