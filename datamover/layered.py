"""A load that lands band of layers by band of layers while a forward pass runs: the forward
pass calls :meth:`LayeredLoad.wait` before each layer, which returns once that layer's band
of every block is in the cache, so loading the prefix and computing the rest of the prompt
overlap (a "split" load: ``connector.load_policy``).

- One loader thread runs :meth:`LayeredLoad.run`: each mover (one per stored head slice a rank
  reads) receives its band ``b`` of every block (``BlockMover.receive_bands``), then band
  ``b + 1``; each piece is written into the cache under the load's lock, unless the load has
  ended. A band has landed once every mover's last piece of it is written.
- :meth:`wait` never waits past the load's deadline: a band still missing then ends the load,
  failed. :meth:`finish` ends it at the end of the forward pass, whatever happened.
- Once ended -- by the deadline, an error, :meth:`finish` or :meth:`cancel` -- nothing more is
  written: the lock is held while a piece is written, so ending waits for a piece in progress
  (one staging buffer's worth) and no write follows.
- What failed: every block that did not land in every band, and every block at all when a
  layer ran without its wait having seen its band land (:meth:`finish` cannot tell that such
  a layer read the loaded bytes: a forward pass that skipped a wait, or an engine that starts
  loads after the pass).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from datamover.mover import BandPiece, BlockMover
from kvstore import DeadlinePassedError


class LayeredLoad:
    def __init__(
        self,
        movers: Sequence[BlockMover],
        block_ids: Sequence[int],
        hashes: Sequence[str],
        bands: Sequence[tuple[int, int]],
        deadline: float,
        *,
        after: Any = None,
        on_landed: Callable[[int], None] | None = None,
    ) -> None:
        """``deadline``: ``time.monotonic()`` past which no wait waits; ``after``: on CUDA,
        the compute fence the writes go after (``BlockMover.compute_fence``); ``on_landed``:
        told the bytes of each piece written."""
        if not movers:
            raise ValueError("a layered load needs a mover")
        self.movers = list(movers)
        self.block_ids = list(block_ids)
        self.hashes = list(hashes)
        self.bands = list(bands)
        self.deadline = deadline
        self.after = after
        self.on_landed = on_landed
        # called once, on the load's thread, when every band has landed
        self.on_all_landed: Callable[[], None] | None = None
        layers = len(self.movers[0].kv.names)
        # the band each layer's bytes come in
        self._band_of = [0] * layers
        for b, (first, end) in enumerate(self.bands):
            for layer in range(first, end):
                self._band_of[layer] = b
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._landed = 0  # bands landed, every block's that arrived
        self._ended = False
        self._layers_cleared: set[int] = set()
        self._layers_waited: set[int] = set()  # layers the forward pass waited for at all
        # per block id: bands written of it, per mover (a block is loaded once every mover
        # wrote every band of it)
        self._written: dict[int, int] = dict.fromkeys(self.block_ids, 0)
        self.error: BaseException | None = None
        self.nbytes = 0
        self.started = time.perf_counter()
        self.landed_s: float | None = None  # seconds from start until every band landed
        self.band_landed_s: list[float] = []  # seconds from start until each band landed
        self.stall_s = 0.0  # time waits spent waiting
        self.misfits = 0

    @property
    def ended(self) -> bool:
        return self._ended

    def band_bytes(self, band: int) -> int:
        """The bytes of every block's band ``band`` (one mover's)."""
        first, end = self.bands[band]
        return len(self.block_ids) * (end - first) * self.movers[0].layer_raw_bytes

    @property
    def skipped_waits(self) -> bool:
        """A layer ran without waiting for its band at all: the forward pass does not call
        the per-layer wait (a full CUDA graph replays no Python), so no split can land in it."""
        return len(self._layers_waited) < len(self._band_of)

    def band_timeline(self) -> tuple[int, float, float, int] | None:
        """(bytes of one band, every block's and every mover's; seconds until the first band
        landed; the median seconds between bands; bands) of a load whose every band landed,
        for the split figure (``connector.figures.SplitRate``); else None."""
        times = self.band_landed_s
        if self.landed_s is None or not times or not self.nbytes:
            return None
        between = statistics.median(b - a for a, b in pairwise(times)) if len(times) > 1 else 0.0
        layers, bands = len(self._band_of), len(self.bands)
        per_band = len(self.block_ids) * layers * self.movers[0].layer_raw_bytes // bands
        return per_band * len(self.movers), times[0], between, bands

    def transfer_sample(self) -> tuple[int, float] | None:
        """(bytes, seconds) this load says of the store's bandwidth: its bytes and the time
        every band took to land; for a load that ended first, what landed plus the band it
        was waiting for, over the time it ran -- an upper bound, so a store that got slower
        is noticed by failed loads too. None when it says nothing (an error, nothing asked)."""
        if self.landed_s is not None:
            return (self.nbytes, self.landed_s) if self.nbytes else None
        if self.error is not None or not self.block_ids:
            return None
        waiting = min(self._landed, len(self.bands) - 1)
        nbytes = self.nbytes + self.band_bytes(waiting) * len(self.movers)
        return nbytes, time.perf_counter() - self.started

    def run(self, before: Callable[[], bool] | None = None) -> None:
        """Receive and write band by band until every band landed or the load ended.
        ``before()`` runs first (consume mode: the handoff's claim); False fails the load.
        Never raises: an error ends the load (``error``)."""
        try:
            if self._ended:  # ended before its thread ran (its deadline, a cancel)
                return
            if before is not None and not before():
                self._end()
                return
            if self._ended:
                return
            pieces = [
                m.receive_bands(
                    self.block_ids,
                    self.hashes,
                    self.bands,
                    timeout_s=max(0.0, self.deadline - time.monotonic()),
                )
                for m in self.movers
            ]
            try:
                for band in range(len(self.bands)):
                    for generator in pieces:
                        while True:
                            if self._ended:  # nobody will read what comes: stop reading
                                return
                            piece = next(generator)
                            if not self._write(piece):
                                return
                            if piece.last_of_band:
                                break
                    with self._changed:
                        self._landed = band + 1
                        self.band_landed_s.append(time.perf_counter() - self.started)
                        if self._landed == len(self.bands):
                            self.landed_s = self.band_landed_s[-1]
                        self._changed.notify_all()
                    if self.landed_s is not None and self.on_all_landed is not None:
                        self.on_all_landed()  # (outside the lock: it may take the caller's)
            finally:
                for generator in pieces:
                    generator.close()  # staging back at once
        except DeadlinePassedError:
            # its deadline passed with bands still to come: ended as a wait past it ends it,
            # not an error (what landed by then still bounds the store: ``transfer_sample``)
            self._end()
        except BaseException as exc:  # reported by whoever waits, never lost
            self.error = exc
            self._end()

    def _write(self, piece: BandPiece) -> bool:
        """Write one piece into the cache unless the load has ended; False once it has."""
        with self._lock:
            if self._ended:
                return False
            written, nbytes = piece.copy_in(self.after)
            bands = len(self.bands) if piece.whole else 1  # a whole value: every band at once
            for block_id in written:
                self._written[block_id] += bands
            self.nbytes += nbytes
            self.misfits += piece.misfits
        if self.on_landed is not None:
            self.on_landed(nbytes)
        return True

    def wait(self, layer: int) -> bool:
        """Before ``layer`` runs: wait until its band landed (True), the load ended, or the
        deadline passed (the load then ends: False)."""
        band = self._band_of[layer]
        t0 = time.perf_counter()
        with self._changed:
            self._layers_waited.add(layer)
            while self._landed <= band and not self._ended:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._ended = True
                    break
                self._changed.wait(left)
            if self._landed > band:
                self._layers_cleared.add(layer)
                ok = True
            else:
                ok = False
        self.stall_s += time.perf_counter() - t0
        return ok

    def finish(self) -> list[int]:
        """End the load (the forward pass is over); the block ids that did not load."""
        self._end()
        with self._lock:
            every_layer = len(self._layers_cleared) == len(self._band_of)
            whole = len(self.bands) * len(self.movers)
            return [b for b in self.block_ids if not every_layer or self._written.get(b, 0) < whole]

    def cancel(self) -> None:
        """End the load now (the KV cache is going away): nothing more is written."""
        self._end()

    def _end(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()
