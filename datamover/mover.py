"""BlockMover: a paged KV cache <-> staging memory <-> the store, in chunks, bounded.

Saves (``stage_saves`` on the forward path, ``write`` on a writer thread):
- A step's new blocks -- every request's together -- are cut into chunks of ``chunk_blocks``.
  Each chunk takes a staging buffer or is shed (counted by the caller): saves never wait.
- CUDA: each chunk is gathered on a *gather stream* (which first waits for the forward pass)
  into device scratch, one ``index_select`` per layer, then copied device-to-host on a *copy
  stream* into pinned staging; an event marks the copy done. The compute stream waits (on the
  GPU, not the host) for the gathers -- of every chunk staged, a shed tail or an error
  notwithstanding -- so the next forward pass may reuse the blocks at once, a preempted
  request's blocks included. The copies to the host overlap it, except that device scratch
  holds ``device_chunks`` chunks: a later chunk's gather waits for the copy that frees its
  scratch, so a step staging more chunks than that makes the next forward pass wait for all
  but the last ``device_chunks`` copies (on an H200: 2 ms after a 256-block step with 2,
  nothing measurable with 8; ``bench_gpu``'s ``compute_held_ms``). ``stage_saves`` only
  enqueues work: it never waits for a copy or for Redis.
- CPU: the gather writes straight into staging (there is nothing to overlap with).
- The writer waits for the chunk's event, frames each block (header + the layer pieces where
  they lie; the checksum streams over them) and ``SET``s the chunk over several connections
  with ``sendmsg``: the bytes are not copied again on the host.

Loads (``receive`` then ``LoadChunk.copy_in``, on a loader thread):
- Blocks are fetched a chunk at a time with ``select_into``: each value is received from the
  socket into its row of a (pinned) staging buffer, verified in place. Given a ``prefetch``
  executor, the next ``read_ahead`` chunks are received while the current one is copied in.
- Nothing is received into the cache itself, even on the CPU where it could be: a load may
  pass its deadline mid-receive, and its blocks then belong to vLLM again. Only ``copy_in``
  writes the cache, and the caller runs it under its own check that the load is still on.
- The chunk is scattered into the cache with one ``index_copy_`` per layer: on CUDA after one
  host-to-device copy of the whole chunk on the loader thread's own stream, and one
  synchronisation per chunk. The scatter waits for the load's ``compute_fence``: the writes
  still pending on the compute stream when the load started (the blocks' previous owner's,
  vLLM zeroing them) land before the loaded KV, not on top of it.
- A long prompt streams through the fixed pool: staging never grows with the prompt.

Memory: saves and loads each get half of ``max_inflight_bytes`` of host staging (at least two
chunks of one block each way); CUDA adds ``device_chunks`` chunks of device scratch per side.

A stored value may hold more rows of the block's first dimension than the cache does
(``value_rows``: e.g. all the KV heads of a slice, of which this cache holds some): loads then
receive the whole value and scatter only the cache's rows. Such a mover only loads. A cache
whose blocks are split into kernel blocks (``[rows, r, tokens / r, content]`` per block) stores
and loads them as ``[rows, tokens, content]``: the same bytes, so it shares values with an
unsplit cache.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from datamover.paged import PagedKV
from datamover.staging import StagingPool
from kvstore import DeadlinePassedError, LookupBuffer, ValueHeader
from kvstore.net.shards import result_by
from kvstore.values.codec import frame_parts, plan_entries
from kvstore.values.tensor_reads import HeadMiss

logger = logging.getLogger("datamover")

T = TypeVar("T")
# Header room per value beyond the probe's: the caller's metadata, longer numbers.
_HEADER_SLACK = 512
DEFAULT_CHUNK_BYTES = 32 << 20


class StagingBusyError(Exception):
    """No load staging buffer came free before the load's deadline."""


@dataclass(frozen=True)
class SaveItem:
    block_id: int
    block_name: str  # the store's name for it (a model with several KV-cache groups: its group's)
    position: int  # the block's index in its chain (sets its TTL)
    owner: str  # e.g. the request id: whose outcome this block counts towards


@dataclass
class SaveChunk:
    items: list[SaveItem]
    host: torch.Tensor  # staging: [layers, n, layer_bytes] uint8, filled once ``ready`` fires
    ready: Any = None  # torch.cuda.Event (None on CPU: filled already)

    @property
    def owners(self) -> set[str]:
        return {item.owner for item in self.items}


@dataclass
class LoadChunk:
    """One chunk's values, received into ``rows`` of a staging buffer (views, or None)."""

    mover: BlockMover
    block_ids: list[int]
    values: list[dict[str, torch.Tensor] | None]
    rows: torch.Tensor  # [n, slot_bytes] uint8
    buffer: torch.Tensor  # the staging buffer ``rows`` lie in
    misfits: int = field(default=0)

    def copy_in(self, after: Any = None) -> tuple[list[int], int]:
        """Write the chunk's valid blocks into the cache; returns (block ids written, bytes).
        Synchronous: done when it returns. Values that do not fit this cache's layout are
        skipped and counted in ``misfits``. ``after``: on CUDA, the load's
        :meth:`BlockMover.compute_fence`; the blocks are written only after the work it
        fences."""
        return self.mover._copy_in(self, after)


@dataclass
class BandPiece:
    """Some blocks' layers ``layers`` (a band) received into ``rows`` of a staging buffer, from
    ``offset`` in each row; ``ok[i]``: block ``block_ids[i]``'s arrived intact. Band 0's rows
    begin with the value's header. ``whole``: band 0 only, values that could not be read by
    ranges (written by an older version, compressed), received whole; their every layer is
    written with this piece (``misfits``: how many of them do not fit this cache)."""

    mover: BlockMover
    band: int
    layers: tuple[int, int]
    block_ids: list[int]
    ok: list[bool]
    rows: torch.Tensor
    offset: int
    buffer: torch.Tensor
    last_of_band: bool
    whole: list[LoadChunk] = field(default_factory=list)

    def copy_in(self, after: Any = None) -> tuple[list[int], int]:
        """Write the piece's intact blocks' layers -- or, for a piece of whole values, every
        layer of them -- into the cache; returns (block ids written, bytes). Synchronous: done
        when it returns."""
        keep = [i for i, good in enumerate(self.ok) if good]
        written = [self.block_ids[i] for i in keep]
        nbytes = len(keep) * (self.layers[1] - self.layers[0]) * self.mover.layer_raw_bytes
        if keep:
            ids = torch.tensor(written, dtype=torch.long, pin_memory=self.mover.kv.on_cuda)
            self.mover._scatter_rows(self.rows, keep, self.offset, ids, after, self.layers)
        for chunk in self.whole:
            ids_written, chunk_bytes = chunk.copy_in(after)
            written += ids_written
            nbytes += chunk_bytes
        return written, nbytes

    @property
    def misfits(self) -> int:
        return sum(chunk.misfits for chunk in self.whole)


class BlockMover:
    def __init__(
        self,
        caches: Mapping[str, torch.Tensor],
        store: LookupBuffer,
        *,
        max_inflight_bytes: int,
        connections: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        device_chunks: int = 2,
        value_rows: tuple[int, int, int] | None = None,
        prefetch: Executor | None = None,
        read_ahead: int = 1,
    ) -> None:
        """``value_rows`` = (rows, first, end): a stored value's block has ``rows`` rows in
        its first dimension, of which this cache holds ``[first, end)`` (default: all).
        ``prefetch``: threads (the caller's) on which loads receive their next chunk while
        the current one is copied in; None receives one chunk after the other. ``read_ahead``:
        how many chunks a load keeps in flight on it beyond the one being copied in (more keep
        several masters and connections busy across chunk boundaries; each holds a staging
        buffer, taken only while no load waits for one)."""
        self.kv = PagedKV(caches)
        self.store = store
        self.connections = max(1, connections)
        self.prefetch = prefetch
        self.read_ahead = max(1, read_ahead)
        rows = self.kv.block_shape[0]
        self.value_rows = value_rows or (rows, 0, rows)
        if (
            self.value_rows[2] - self.value_rows[1] != rows
            or self.value_rows[2] > self.value_rows[0]
        ):
            raise ValueError(f"value_rows {value_rows} do not fit a cache block of {rows} rows")
        # a block split into kernel blocks ([rows, r, tokens / r, content]) is stored as the
        # block it is: [rows, tokens, content] (the same bytes, in the same order)
        inner = self.kv.block_shape[1:]
        if len(inner) > 2:
            inner = (math.prod(inner[:-1]), inner[-1])
        self.value_shape = (self.value_rows[0], *inner)
        self._cache_rows_shape = (rows, *inner)
        self.entries, self.raw_bytes = plan_entries(self.kv.names, self.kv.dtype, self.value_shape)
        self.layer_raw_bytes = self.raw_bytes // len(self.kv.names)  # one layer of one value
        probe = frame_parts(
            self.entries,
            [bytes(self.raw_bytes)],
            fingerprint=store.fingerprint,
            block_hash="0" * 32,
            value_key=store.value_key,
        )
        header_bytes = memoryview(probe[0]).nbytes
        # a value this mover writes has a header of exactly this length: where a layer-by-layer
        # load expects each layer (``receive_bands``)
        self.header_bytes = header_bytes
        # a row holds one received value; 8-aligned so every row's payload can be viewed as
        # the cache's dtype (safetensors aligns the payload to 8 within the value)
        # room for lz4's worst case too: another instance may compress, and KV data often
        # does not compress
        lz4_bound = self.raw_bytes + self.raw_bytes // 255 + 16
        self.slot_bytes = -(-(header_bytes + _HEADER_SLACK + lz4_bound) // 8) * 8
        budget = max(1, max_inflight_bytes // 2)
        self.chunk_blocks = max(1, min(chunk_bytes, budget // 2) // self.slot_bytes)
        save_chunk = self.chunk_blocks * self.raw_bytes
        load_chunk = self.chunk_blocks * self.slot_bytes
        pin = self.kv.on_cuda
        self._save_pool = StagingPool(save_chunk, max(2, budget // save_chunk), pin_memory=pin)
        self._load_pool = StagingPool(load_chunk, max(2, budget // load_chunk), pin_memory=pin)
        if self.kv.on_cuda:
            dev = self.kv.device
            self._gather_stream = torch.cuda.Stream(device=dev)
            self._copy_stream = torch.cuda.Stream(device=dev)
            self._load_streams = threading.local()  # a stream per loader thread
            # (scratch, event after which it may be overwritten), used in turn
            self._save_scratch: list[tuple[torch.Tensor, Any]] = [
                (torch.empty(save_chunk, dtype=torch.uint8, device=dev), None)
                for _ in range(max(1, device_chunks))
            ]
            self._next_scratch = 0
            self._load_scratch = StagingPool(load_chunk, max(1, device_chunks), device=dev)

    @property
    def whole_values(self) -> bool:
        """A stored value is exactly a cache block's bytes (so this mover may save too)."""
        return self.value_shape == self._cache_rows_shape

    @property
    def staging_bytes(self) -> int:
        """Host staging allocated, loads and saves together."""
        return (
            self._save_pool.buffer_bytes * self._save_pool.count
            + self._load_pool.buffer_bytes * self._load_pool.count
        )

    # ------------------------------------------------------------------ saves
    def stage_saves(self, items: Sequence[SaveItem]) -> tuple[list[SaveChunk], list[SaveItem]]:
        """Start copying ``items``' blocks out of the cache; returns the chunks to ``write``
        and the items shed for want of staging (the tail: later positions go first). Never
        waits for a copy or for Redis. If a gather fails, every staging buffer this call took
        is released (after the copies already queued into them) and the error is raised."""
        if not self.whole_values:
            raise ValueError("this mover holds part of each stored value: it cannot save")
        chunks: list[SaveChunk] = []
        shed: list[SaveItem] = []
        n = self.chunk_blocks
        try:
            for start in range(0, len(items), n):
                host = self._save_pool.try_acquire()
                if host is None:
                    shed = list(items[start:])
                    break
                try:
                    chunks.append(self._gather(list(items[start : start + n]), host))
                except BaseException:
                    self._save_pool.release(host)
                    for chunk in chunks:
                        if chunk.ready is not None:
                            chunk.ready.synchronize()
                        self._save_pool.release(chunk.host)
                    raise
        finally:
            if self.kv.on_cuda:
                # the next forward pass may overwrite these blocks only after they were
                # gathered -- whatever ended the loop: a shed tail, an error, the last chunk
                torch.cuda.current_stream(self.kv.device).wait_stream(self._gather_stream)
        return chunks, shed

    def _gather(self, items: list[SaveItem], host: torch.Tensor) -> SaveChunk:
        n = len(items)
        shape = (len(self.kv.names), n, *self.kv.block_shape)
        # pinned on CUDA, so its copy to the device never makes the host wait for the stream
        ids = torch.tensor(
            [it.block_id for it in items], dtype=torch.long, pin_memory=self.kv.on_cuda
        )
        staged = host[: n * self.raw_bytes].view(self.kv.dtype).view(shape)
        if not self.kv.on_cuda:
            self.kv.gather(ids, staged)
            return SaveChunk(items, host)
        scratch, free = self._save_scratch[self._next_scratch]
        gather, copy = self._gather_stream, self._copy_stream
        gather.wait_stream(torch.cuda.current_stream(self.kv.device))  # the forward pass
        with torch.cuda.stream(gather):
            if free is not None:  # its previous chunk's copy to the host is done
                gather.wait_event(free)
            on_device = scratch[: n * self.raw_bytes].view(self.kv.dtype).view(shape)
            self.kv.gather(ids.to(self.kv.device, non_blocking=True), on_device)
            gathered = gather.record_event()
        copy.wait_event(gathered)
        with torch.cuda.stream(copy):
            staged.copy_(on_device, non_blocking=True)
            # blocking: the writer thread waiting on it sleeps instead of spinning a core
            done = copy.record_event(torch.cuda.Event(blocking=True))
        self._save_scratch[self._next_scratch] = (scratch, done)
        self._next_scratch = (self._next_scratch + 1) % len(self._save_scratch)
        return SaveChunk(items, host, done)

    def write(self, chunk: SaveChunk) -> int:
        """On a writer thread: wait for the chunk's copy, frame and ``SET`` its blocks; returns
        the bytes written. Raises the store's typed errors. The staging buffer is released
        whatever happens."""
        try:
            if chunk.ready is not None:
                chunk.ready.synchronize()
            n = len(chunk.items)
            layers = len(self.kv.names)
            pieces = chunk.host[: n * self.raw_bytes].numpy().reshape(layers, n, -1)
            values = [
                (
                    item.block_name,
                    self.store.frame_parts(
                        self.entries,
                        [pieces[layer, i] for layer in range(layers)],
                        item.block_name,
                    ),
                )
                for i, item in enumerate(chunk.items)
            ]
            self.store.insert_parts(
                values,
                positions=[item.position for item in chunk.items],
                connections=self.connections,
            )
            return sum(memoryview(p).nbytes for _, parts in values for p in parts)
        finally:
            self._save_pool.release(chunk.host)

    # ------------------------------------------------------------------ loads
    def receive(
        self, block_ids: Sequence[int], hashes: Sequence[str], *, timeout_s: float | None = None
    ) -> Generator[LoadChunk, None, None]:
        """Fetch blocks a chunk at a time into staging; each chunk's buffer is released when
        the caller asks for the next (or closes the generator). Raises
        :class:`StagingBusyError` when no buffer comes free within ``timeout_s``, and the
        store's typed errors: ``DeadlinePassedError`` where a chunk's replies are still coming
        when ``timeout_s`` has passed (no reply holds the load past it).

        With a ``prefetch`` executor, the next ``read_ahead`` chunks are received on it while the
        caller copies the current one in, each when a staging buffer is free and no load is
        waiting for one (measured on the 2-core VM: loads 12-32% faster with one; see
        docs/benchmarks.md). A prefetch
        writes only into staging: the cache is written by ``copy_in`` alone, on the caller's
        thread. A prefetch the caller no longer wants (it closed the generator, or the
        executor cancelled it) gives its buffer back when it ends."""
        # (the deadline runs from this call, not from the generator's first step)
        return self._chunks(block_ids, hashes, _deadline(timeout_s))

    def _chunks(
        self, block_ids: Sequence[int], hashes: Sequence[str], deadline: float
    ) -> Generator[LoadChunk, None, None]:
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        n = self.chunk_blocks
        starts = list(range(0, len(hashes), n))
        # chunks received while the caller uses this one (each with the buffer it fills), in
        # order: chunks i + 1, i + 2, ... once chunk i is taken
        ahead: collections.deque[tuple[Future[LoadChunk], torch.Tensor]] = collections.deque()
        try:
            for i, start in enumerate(starts):
                ids, part = list(block_ids[start : start + n]), hashes[start : start + n]
                read = ahead.popleft() if ahead else None
                chunk = self._read_ahead_or_now(
                    read, deadline, functools.partial(self._fetch, ids, part, deadline)
                )
                try:
                    while (
                        self.prefetch is not None
                        and len(ahead) < self.read_ahead
                        and (following := i + 1 + len(ahead)) < len(starts)
                    ):
                        more = self._read_ahead(starts[following], block_ids, hashes, deadline)
                        if more is None:
                            break
                        ahead.append(more)
                    yield chunk
                finally:
                    self._load_pool.release(chunk.buffer)
        finally:
            for fetched, spare in ahead:
                # a chunk not yet started is never fetched (a load past its deadline, on a busy
                # store, must not keep reading); one under way gives its buffer back when done
                fetched.cancel()
                fetched.add_done_callback(functools.partial(self._abandoned, spare))

    def _read_ahead_or_now(
        self,
        ahead: tuple[Future[T], torch.Tensor] | None,
        deadline: float,
        fetch: Callable[[torch.Tensor], T],
    ) -> T:
        """What was read ahead (raising what it raised; one still queued for the prefetch
        threads at ``deadline`` never runs: ``DeadlinePassedError``); or, with nothing read
        ahead (or its executor shut down before it ran), ``fetch`` now into a staging buffer
        that comes free by ``deadline`` (:class:`StagingBusyError` when none does)."""
        if ahead is not None:
            fetched, spare = ahead
            try:
                # (the prefetch threads are every load's: a load must not wait past its own
                # deadline for another's reads to end -- a review)
                return result_by(fetched, deadline)
            except CancelledError:
                self._load_pool.release(spare)
            except DeadlinePassedError:
                if fetched.cancelled():  # (never ran: its staging is still ours)
                    self._load_pool.release(spare)
                raise
        timeout_s = _left(deadline)
        buf = self._load_pool.acquire(timeout_s)
        if buf is None:
            raise StagingBusyError(
                f"no load staging buffer came free in {timeout_s:.2f}s; raise "
                "max_inflight_bytes if loads often wait"
            )
        return fetch(buf)

    def _read_ahead(
        self, start: int, block_ids: Sequence[int], hashes: Sequence[str], deadline: float
    ) -> tuple[Future[LoadChunk], torch.Tensor] | None:
        """Start receiving the chunk at ``start`` on the prefetch executor, if a staging
        buffer is free and no load is waiting for one (reading ahead never delays a load)."""
        assert self.prefetch is not None
        spare = self._load_pool.try_acquire_spare()
        if spare is None:
            return None
        end = start + self.chunk_blocks
        try:
            fetched = self.prefetch.submit(
                self._fetch, list(block_ids[start:end]), hashes[start:end], deadline, spare
            )
        except RuntimeError:  # the executor was shut down: no reading ahead
            self._load_pool.release(spare)
            return None
        return fetched, spare

    # ------------------------------------------------------------------ layer-by-layer loads
    def layer_bands(self, min_band_bytes: int) -> list[tuple[int, int]]:
        """The value's layers cut into bands (``layer_bands``)."""
        return layer_bands(len(self.kv.names), self.layer_raw_bytes, min_band_bytes)

    def value_header_bytes(self, block_hash: str) -> int:
        """How long the header of a value this mover writes under ``block_hash`` is."""
        if len(block_hash) == 32:
            return self.header_bytes
        probe = frame_parts(
            self.entries,
            [bytes(self.raw_bytes)],
            fingerprint=self.store.fingerprint,
            block_hash=block_hash,
            value_key=self.store.value_key,
        )
        return memoryview(probe[0]).nbytes

    def receive_bands(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[str],
        bands: Sequence[tuple[int, int]],
        *,
        timeout_s: float | None = None,
    ) -> Generator[BandPiece, None, None]:
        """Fetch blocks band by band -- every block's first band before any block's second --
        a staging buffer's worth of blocks at a time: the order a forward pass that waits for
        each band of layers before running them needs. Band 0 reads each value's header too
        (``select_head_into``); a value that cannot be read by ranges is read whole then. A
        block that failed a band is not read again. With a ``prefetch`` executor the next
        piece is received while the caller copies this one in (as :meth:`receive` does). Each
        piece's buffer is released when the caller asks for the next one (or closes the
        generator). Raises :class:`StagingBusyError` when no buffer comes free within
        ``timeout_s``, and the store's typed errors (``DeadlinePassedError`` as
        :meth:`receive`)."""
        return self._band_pieces(block_ids, hashes, bands, _deadline(timeout_s))

    def _band_pieces(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[str],
        bands: Sequence[tuple[int, int]],
        deadline: float,
    ) -> Generator[BandPiece, None, None]:
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        if not bands or bands[0][0] != 0 or bands[-1][1] != len(self.kv.names):
            raise ValueError(f"bands {list(bands)} do not cover the {len(self.kv.names)} layers")
        plan = _BandPlan(self, list(block_ids), list(hashes), list(bands), deadline)
        spec = plan.next()
        ahead: tuple[Future[BandPiece], torch.Tensor] | None = None
        try:
            while spec is not None:
                if not spec.part:  # every block failed an earlier band: it lands, empty
                    yield BandPiece(self, spec.band, spec.layers, [], [], _EMPTY, 0, _EMPTY, True)
                    spec = plan.next()
                    continue
                read, ahead = ahead, None
                piece = self._read_ahead_or_now(
                    read, deadline, functools.partial(self._fetch_piece, plan, spec)
                )
                whole = plan.whole
                plan.whole = []
                following = plan.next()  # (what it reads depends on what this one found)
                if following is not None and following.part and not whole:
                    ahead = self._read_piece_ahead(plan, following)
                try:
                    yield piece
                finally:
                    self._load_pool.release(piece.buffer)
                if whole:  # read whole, after this piece's buffer went back
                    yield from self._whole_pieces(whole, spec, _left(deadline))
                spec = following
        finally:
            if ahead is not None:
                fetched, spare = ahead
                fetched.cancel()  # (not started: never read; under way: ends by the deadline)
                fetched.add_done_callback(functools.partial(self._abandoned, spare))

    def _fetch_piece(self, plan: _BandPlan, spec: _PieceSpec, buf: torch.Tensor) -> BandPiece:
        """Receive one piece into ``buf``; on an error ``buf`` is released and it is raised."""
        try:
            part = spec.part
            rows = buf[: len(part) * spec.row_bytes].view(len(part), spec.row_bytes)
            hashes = [plan.hashes[i] for i in part]
            first, end = spec.layers
            if spec.band == 0:
                ok, offset = self._read_heads(plan, part, hashes, rows, end)
            else:
                offset = 0
                ok = self.store.select_tensors_into(
                    hashes,
                    [plan.headers[i] for i in part],  # type: ignore[misc]
                    list(rows),
                    first,
                    end,
                    connections=self.connections,
                    deadline=plan.deadline,
                )
                for i, good in zip(part, ok, strict=True):
                    if not good:
                        plan.headers[i] = None
            return BandPiece(
                self,
                spec.band,
                spec.layers,
                [plan.block_ids[i] for i in part],
                ok,
                rows,
                offset,
                buf,
                last_of_band=spec.last_of_band and not plan.whole,
            )
        except BaseException:
            self._load_pool.release(buf)
            raise

    def _read_piece_ahead(
        self, plan: _BandPlan, spec: _PieceSpec
    ) -> tuple[Future[BandPiece], torch.Tensor] | None:
        """Start receiving ``spec`` on the prefetch executor, if there is one, a staging
        buffer is free and no load waits for one (reading ahead never delays a load)."""
        if self.prefetch is None:
            return None
        spare = self._load_pool.try_acquire_spare()
        if spare is None:
            return None
        try:
            return self.prefetch.submit(self._fetch_piece, plan, spec, spare), spare
        except RuntimeError:  # the executor was shut down: no reading ahead
            self._load_pool.release(spare)
            return None

    def _whole_pieces(
        self, whole: list[int], spec: _PieceSpec, timeout_s: float | None
    ) -> Generator[BandPiece, None, None]:
        """Band 0's values that could not be read by ranges, received whole a chunk at a time
        (each chunk's buffer is held until the caller asks for the next)."""
        plan_ids = spec.plan.block_ids
        chunks = self.receive(
            [plan_ids[i] for i in whole], [spec.plan.hashes[i] for i in whole], timeout_s=timeout_s
        )
        try:
            last = -(-len(whole) // self.chunk_blocks) - 1
            for c, chunk in enumerate(chunks):
                yield BandPiece(
                    self, spec.band, spec.layers, [], [], chunk.rows[:0], 0, chunk.buffer,
                    spec.last_of_band and c == last, [chunk],
                )  # fmt: skip
        finally:
            chunks.close()

    def _read_heads(
        self, plan: _BandPlan, part: list[int], hashes: list[str], rows: torch.Tensor, end: int
    ) -> tuple[list[bool], int]:
        """Band 0 of blocks ``part``: each header and its first layers. Fills the plan's
        ``headers`` for the blocks whose later bands can be read by ranges, its ``whole`` with
        those to read whole; returns which blocks' first band arrived and where it lies in
        their rows."""
        heads, headers, whole = plan.heads, plan.headers, plan.whole
        header_bytes = heads[part[0]]
        same = [i for i, p in enumerate(part) if heads[p] == header_bytes]
        got: list[ValueHeader | HeadMiss] = [HeadMiss.WHOLE] * len(part)
        if same:
            read = self.store.select_head_into(
                [hashes[i] for i in same],
                [rows[i] for i in same],
                header_bytes=header_bytes,
                entries=self.entries,
                tensors=end,
                connections=self.connections,
                deadline=plan.deadline,
            )
            for i, r in zip(same, read, strict=True):
                got[i] = r
        ok = []
        for p, r in zip(part, got, strict=True):
            if isinstance(r, ValueHeader):
                headers[p] = r
            elif r is HeadMiss.WHOLE:
                whole.append(p)
            ok.append(isinstance(r, ValueHeader))
        return ok, header_bytes

    def _fetch(
        self, ids: list[int], hashes: Sequence[str], deadline: float, buf: torch.Tensor
    ) -> LoadChunk:
        """Receive one chunk into ``buf`` by ``deadline``; on an error ``buf`` is released and
        the error raised."""
        try:
            rows = buf[: len(ids) * self.slot_bytes].view(len(ids), self.slot_bytes)
            values = self.store.select_into(
                hashes, list(rows), connections=self.connections, deadline=deadline
            )
            return LoadChunk(self, ids, values, rows, buf)
        except BaseException:
            self._load_pool.release(buf)
            raise

    def _abandoned(self, spare: torch.Tensor, fetched: Future[Any]) -> None:
        """A prefetched chunk nobody will copy in: its buffer goes back (a failed fetch gave it
        back itself); its error is logged (the load it belonged to has ended, and said how)."""
        if fetched.cancelled() or fetched.exception() is None:
            self._load_pool.release(spare)
        else:
            logger.debug("a prefetched chunk of an abandoned load failed: %r", fetched.exception())

    def _fits(self, value: Mapping[str, torch.Tensor]) -> bool:
        return tuple(value) == self.kv.names and all(
            tuple(t.shape) == self.value_shape and t.dtype == self.kv.dtype for t in value.values()
        )

    def _payload_offset(self, row: torch.Tensor, value: Mapping[str, torch.Tensor]) -> int | None:
        """Where the value's layers start in ``row`` when they lie there back to back (the
        value was received in place, uncompressed) at an offset the cache's dtype can be
        viewed at; else None (the layers are then stacked: a valid value whose header was
        not padded puts its payload at any byte)."""
        base = row.data_ptr()
        first = next(iter(value.values())).data_ptr() - base
        if first % self.kv.dtype.itemsize:
            return None
        layer_bytes = self.raw_bytes // len(self.kv.names)
        for layer, t in enumerate(value.values()):
            at = first + layer * layer_bytes
            if t.data_ptr() - base != at or not t.is_contiguous():
                return None
        return first if first >= 0 and first + self.raw_bytes <= row.numel() else None

    def compute_fence(self) -> Any:
        """On CUDA, an event recorded on the current (compute) stream: given to ``copy_in``, it
        orders the load's writes after everything queued there so far. A block handed to a
        load may still have writes pending from the step before -- its previous owner's last
        token, vLLM zeroing it for reuse -- and with asynchronous scheduling the host runs
        ahead of them. Record it on the thread that launches the forward passes, when the load
        starts. None on the CPU, where every write is done when its call returns."""
        if not self.kv.on_cuda:
            return None
        # blocking: a thread waiting on it (synchronize) sleeps instead of spinning a core
        fence = torch.cuda.Event(blocking=True)
        return torch.cuda.current_stream(self.kv.device).record_event(fence)

    def _copy_in(self, chunk: LoadChunk, after: Any = None) -> tuple[list[int], int]:
        rows: list[int] = []
        for i, value in enumerate(chunk.values):
            if value is None:
                continue
            if self._fits(value):
                rows.append(i)
            else:
                chunk.misfits += 1
        if not rows:
            return [], 0
        offsets = {self._payload_offset(chunk.rows[i], chunk.values[i]) for i in rows}  # type: ignore[arg-type]
        ids = torch.tensor(
            [chunk.block_ids[i] for i in rows], dtype=torch.long, pin_memory=self.kv.on_cuda
        )
        if len(offsets) == 1 and None not in offsets:
            self._scatter_rows(chunk.rows, rows, offsets.pop(), ids, after)  # type: ignore[arg-type]
        else:  # compressed, or headers of different lengths: stack the blocks first
            stacked = torch.stack(
                [torch.stack(list(chunk.values[i].values())) for i in rows]  # type: ignore[union-attr]
            )
            self._scatter(ids, stacked, after)
        return [chunk.block_ids[i] for i in rows], len(rows) * self.raw_bytes

    def _scatter_rows(
        self,
        rows: torch.Tensor,
        keep: list[int],
        offset: int,
        ids: torch.Tensor,
        after: Any,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Scatter rows ``keep`` of a staging buffer whose payloads all start at ``offset``:
        every layer, or the ``layers`` range the rows hold (a band of a layer-by-layer load)."""
        first, end = layers or (0, len(self.kv.names))
        n = rows.shape[0]
        shape = (n, end - first, *self.value_shape)
        nbytes = (end - first) * self.layer_raw_bytes
        if not self.kv.on_cuda:
            src = rows[:, offset : offset + nbytes].view(self.kv.dtype).view(shape)
            src = self._cached_rows(src if len(keep) == n else src[torch.tensor(keep)])
            self.kv.scatter(ids, src, first)
            return
        scratch = self._load_scratch.acquire()
        assert scratch is not None  # acquire() without a timeout waits
        try:
            stream = self._load_stream()
            try:
                with torch.cuda.stream(stream):
                    flat = scratch[: rows.numel()]
                    flat.copy_(rows.reshape(-1), non_blocking=True)  # one copy per chunk
                    on_device = flat.view(n, rows.shape[1])[:, offset : offset + nbytes]
                    src = on_device.view(self.kv.dtype).view(shape)
                    if len(keep) != n:
                        src = src[torch.tensor(keep, device=self.kv.device)]
                    if after is not None:  # the blocks' pending writes first (compute_fence)
                        stream.wait_event(after)
                    rows_of_cache = self._cached_rows(src)
                    self.kv.scatter(ids.to(self.kv.device, non_blocking=True), rows_of_cache, first)
            finally:
                # one synchronisation per chunk; after an error too, before the scratch (and
                # the host rows the copy reads) can be handed out again
                _wait(stream)
        finally:
            self._load_scratch.release(scratch)  # whatever happened: loads never hang on it

    def _cached_rows(self, src: torch.Tensor) -> torch.Tensor:
        """``[n, layers, *value_shape]`` narrowed to the rows this cache holds, in the cache's
        block shape (a view: narrowing rows, splitting the token axis into kernel blocks)."""
        _, first, end = self.value_rows
        if not self.whole_values:
            src = src.narrow(2, first, end - first)
        if len(self.kv.block_shape) > len(self.value_shape):
            src = src.unflatten(3, self.kv.block_shape[1:-1])
        return src

    def _scatter(self, ids: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        if not self.kv.on_cuda:
            self.kv.scatter(ids, self._cached_rows(src))
            return
        stream = self._load_stream()
        try:
            with torch.cuda.stream(stream):
                on_device = src.to(self.kv.device, non_blocking=True)
                if after is not None:
                    stream.wait_event(after)
                rows = self._cached_rows(on_device)
                self.kv.scatter(ids.to(self.kv.device, non_blocking=True), rows)
        finally:
            _wait(stream)

    def _load_stream(self) -> Any:
        """This thread's stream for loads: a loader waits for its own chunk's copies only,
        not for another loader's on a shared stream."""
        stream = getattr(self._load_streams, "stream", None)
        if stream is None:
            stream = self._load_streams.stream = torch.cuda.Stream(device=self.kv.device)
        return stream


@dataclass
class _PieceSpec:
    """One piece of a band load: which blocks (indices into the load's), into rows how wide."""

    plan: _BandPlan
    band: int
    layers: tuple[int, int]
    part: list[int]
    row_bytes: int
    last_of_band: bool


def _deadline(timeout_s: float | None) -> float:
    """The ``time.monotonic()`` a load's replies are waited for until (none: ``inf``)."""
    return math.inf if timeout_s is None else time.monotonic() + timeout_s


def _left(deadline: float) -> float | None:
    """The time left to ``deadline`` as a timeout (None: no deadline): what a wait for
    staging may take of it, not a fresh ``timeout_s`` for every chunk."""
    return None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())


class _BandPlan:
    """What a band load reads next, from what it found so far: band 0 of every block, then
    each later band of the blocks whose head was read by ranges and whose bands all arrived."""

    def __init__(
        self,
        mover: BlockMover,
        block_ids: list[int],
        hashes: list[str],
        bands: list[tuple[int, int]],
        deadline: float,
    ) -> None:
        self.block_ids, self.hashes, self.bands = block_ids, hashes, bands
        self.deadline = deadline  # (time.monotonic()) no reply is waited for past it
        self.heads = [mover.value_header_bytes(h) for h in hashes]  # expected header lengths
        # per block: the header later bands are read by (None: failed, or read whole)
        self.headers: list[ValueHeader | None] = [None] * len(hashes)
        self.whole: list[int] = []  # band 0's blocks to read whole, found by the last piece
        self._mover = mover
        self._pieces = self._specs()

    def next(self) -> _PieceSpec | None:
        return next(self._pieces, None)

    def _specs(self) -> Generator[_PieceSpec, None, None]:
        buffer_bytes = self._mover._load_pool.buffer_bytes
        for band, (first, end) in enumerate(self.bands):
            span = (end - first) * self._mover.layer_raw_bytes
            if band == 0:
                todo = list(range(len(self.hashes)))
                row_bytes = _aligned(max(self.heads, default=0) + span)
            else:  # decided now: the band before has been received in full
                todo = [i for i, h in enumerate(self.headers) if h is not None]
                row_bytes = _aligned(span)
            per_buffer = max(1, buffer_bytes // row_bytes)
            starts = list(range(0, len(todo), per_buffer)) or [0]
            for n, start in enumerate(starts):
                part = todo[start : start + per_buffer]
                yield _PieceSpec(self, band, (first, end), part, row_bytes, n == len(starts) - 1)


_EMPTY = torch.empty(0, 0, dtype=torch.uint8)


def layer_bands(layers: int, layer_bytes: int, min_band_bytes: int) -> list[tuple[int, int]]:
    """``layers`` layers of ``layer_bytes`` each per value, cut into bands: consecutive layer
    ranges, each read as one range per block -- single layers where a layer's bytes reach
    ``min_band_bytes`` (a shorter range costs a command for too few bytes:
    ``scripts/bench_layer_reads.py``), else as few layers together as reach it."""
    per = max(1, -(-min_band_bytes // max(1, layer_bytes)))
    return [(first, min(layers, first + per)) for first in range(0, layers, per)]


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 8: every row of a staging buffer can be viewed as the cache's
    dtype."""
    return -(-nbytes // 8) * 8


def _wait(stream: Any) -> None:
    """Wait for the work queued on ``stream`` so far, sleeping rather than spinning a core."""
    done = torch.cuda.Event(blocking=True)
    stream.record_event(done)
    done.synchronize()
