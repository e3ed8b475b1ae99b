"""Recycled receive buffers for reads that return new memory (``select``, ``drop_select``).

A fresh 2 MiB buffer costs 512 page faults the first time it is written: receiving into new
memory ran at 1.4 GB/s on the test VM against 8 to 12 GB/s into memory used before, so
``select`` was bound by the kernel zero-filling pages, not by the network. LMCache avoids this
with an allocator its callers release by hand. Here the caller releases nothing: each buffer
handed out is a numpy view of a pooled block, and the block goes back to the pool when the
last tensor that views it is garbage-collected (``weakref.finalize`` on the view; torch's
``frombuffer`` keeps the view alive). A block is never reused while anything can still read it.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import numpy as np

# Smaller buffers are not pooled: malloc serves them from memory already mapped (glibc maps
# fresh pages only from 128 KiB up), and a pooled block would outlive a small result's need.
# (At 64 << 10 a 64 KiB block's value -- just over it, with its header -- was pooled, and the
# finalizer each lease registers cost select 7-15% at that size: measured, docs/benchmarks.md.)
MIN_POOLED_BYTES = 128 << 10


def size_class(nbytes: int) -> int:
    """The block size a request of ``nbytes`` is served from: rounded up to a multiple of
    between 1/32 and 1/16 of itself, so one model's blocks (all the same size) share a class
    and a kept result wastes at most 1/16 of its size."""
    granule = max(4096, 1 << (nbytes.bit_length() - 5))
    return -(-nbytes // granule) * granule


class BufferPool:
    """Writable byte buffers. Returned blocks are kept for reuse up to as many bytes as the last
    batch had in use at once -- 16 values of 8 MiB are 128 MiB, and keeping only half of them
    sent the other half to fresh pages on every read -- but at least ``max_idle_bytes`` and at
    most ``max_idle_ceiling_bytes``; the rest are freed. A batch ends when nothing is in use;
    a returned block that does not fit displaces idle blocks of other sizes first (the size in
    use now is the one the next read needs)."""

    def __init__(self, max_idle_bytes: int, max_idle_ceiling_bytes: int | None = None) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.max_idle_ceiling_bytes = max(max_idle_bytes, max_idle_ceiling_bytes or 0)
        self._idle: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._idle_bytes = 0
        self._in_use_bytes = 0  # pooled blocks leased and not yet returned
        self._batch_peak = 0  # the most in use since nothing was
        self._last_batch_peak = 0  # the same, for the batch before
        # re-entrant: a finalizer may return a block on a thread that is inside take()
        self._lock = threading.RLock()
        self._closed = False
        self.reused = 0  # buffers served from the pool (for tests and counters)

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes``, not zero-filled."""
        if nbytes < MIN_POOLED_BYTES:
            return memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]
        capacity = size_class(nbytes)
        block: np.ndarray | None = None
        with self._lock:
            free = self._idle.get(capacity)
            if free:
                block = free.pop()
                self._idle_bytes -= capacity
                self.reused += 1
        if block is None:
            block = np.empty(capacity, dtype=np.uint8)  # may raise: nothing is counted yet
        with self._lock:
            self._in_use_bytes += capacity
            self._batch_peak = max(self._batch_peak, self._in_use_bytes)
        lease = block[:nbytes]
        done = weakref.finalize(lease, self._give_back, block)
        done.atexit = False
        return memoryview(lease).cast("B")  # type: ignore[arg-type]

    def _give_back(self, block: np.ndarray) -> None:
        size = block.nbytes
        with self._lock:
            self._in_use_bytes -= size
            if self._in_use_bytes == 0:  # a batch ended: its peak is what the next one needs
                self._last_batch_peak, self._batch_peak = self._batch_peak, 0
            if self._closed:
                return
            limit = self.idle_limit
            self._free_idle(self._idle_bytes - limit, keep=None)  # the limit may have fallen
            if size > limit:
                return
            self._free_idle(self._idle_bytes + size - limit, keep=size)
            if self._idle_bytes + size <= limit:
                self._idle[size].append(block)
                self._idle_bytes += size

    def _free_idle(self, nbytes: int, *, keep: int | None) -> None:
        """Free at least ``nbytes`` of idle blocks, those of other sizes than ``keep`` first;
        with ``keep`` set, blocks of that size stay."""
        for size in sorted(self._idle, key=lambda s: s == keep):
            if nbytes <= 0 or size == keep:
                break
            blocks = self._idle[size]
            while blocks and nbytes > 0:
                blocks.pop()
                self._idle_bytes -= size
                nbytes -= size
            if not blocks:
                del self._idle[size]

    @property
    def idle_limit(self) -> int:
        """The most idle bytes kept now: the last batch's peak in use (or the current one's, if
        higher), between the floor and the ceiling."""
        peak = max(self._last_batch_peak, self._batch_peak)
        return min(self.max_idle_ceiling_bytes, max(self.max_idle_bytes, peak))

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of pooled blocks leased and not yet returned."""
        with self._lock:
            return self._in_use_bytes

    def close(self) -> None:
        """Free the idle blocks; blocks still in use are freed when their tensors are."""
        with self._lock:
            self._closed = True
            self._idle.clear()
            self._idle_bytes = 0
