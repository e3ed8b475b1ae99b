"""Probes on the worker side (planned by the scheduler side: ``probes.py``): background reads of
a few stored blocks into staging, as a whole load or a split of their kind would read them,
nothing written into the KV cache, one at a time on a thread of their own; their time is a
sample of that kind's figure (``figures.py``).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise

from connector.probes import ProbeKind, ProbeSpec
from connector.split_loads import SplitLoads
from connector.worker_context import WorkerContext
from datamover import StagingBusyError
from kvstore import KVStoreError

logger = logging.getLogger("connector.worker")


class ProbeReads:
    def __init__(self, ctx: WorkerContext, io: ThreadPoolExecutor, splits: SplitLoads) -> None:
        self._ctx = ctx
        self._io = io  # probes run here, one at a time, never holding up a load
        self._splits = splits  # a probe of splits reads their bands
        self._probing = False  # under ``ctx.lock``

    def start(self, spec: ProbeSpec, stop: threading.Event | None = None) -> Future[bool] | None:
        """A probe of the store (``probes.py``), unless one is still running or there is
        nothing to read with (asleep, a layout without one group's movers, shut down): None.
        The future says whether the blocks were there. Once ``stop`` is set the probe ends
        with no sample (an idle probe, when a step begins)."""
        ctx = self._ctx
        with ctx.lock:
            if self._probing or ctx.asleep or not ctx.slices or not ctx.slices[0]:
                return None
            if stop is not None and stop.is_set():
                return None
            self._probing = True
        try:
            fut = self._io.submit(self._probe, spec, stop)
        except RuntimeError:  # (the worker shuts down)
            with ctx.lock:
                self._probing = False
            return None
        ctx.stats.add(load_probes=1)
        ctx.track(fut, "a probe")
        return fut

    def _probe(self, spec: ProbeSpec, stop: threading.Event | None = None) -> bool:
        """Read ``spec``'s blocks into staging as a load of its kind would, writing nothing
        into the KV cache; the time is a sample of that kind's figure, an upper bound if it
        expired or failed. Values not there (evicted, or a handoff already deleted) are no
        sample, and False; nor is a probe ``stop`` ended."""
        ctx = self._ctx
        names = spec.names  # (the first group's: the one group a split loads)
        ids = list(range(len(names)))  # (nothing is written: no block ids are needed)
        movers = [sm.mover for sm in ctx.slices[0]]
        nbytes, missing, t0 = 0, 0, time.perf_counter()
        landed_before = ctx.landed_since(0, 0)
        deadline = time.monotonic() + spec.timeout_s
        kind = "load" if spec.kind is ProbeKind.WHOLE else "split"
        timeline: list[float] = []
        try:
            for mover in movers:
                if stop is not None and stop.is_set():
                    raise _Stopped  # (before its reads, not only between chunks)
                left = max(0.0, deadline - time.monotonic())
                if spec.kind is ProbeKind.WHOLE:
                    chunks = mover.receive(ids, names, timeout_s=left)
                    try:
                        for chunk in chunks:
                            got = [v for v in chunk.values if v is not None]
                            missing += len(chunk.values) - len(got)
                            nbytes += len(got) * (mover.header_bytes + mover.raw_bytes)
                            ctx.count_landed(len(got) * (mover.header_bytes + mover.raw_bytes))
                            if stop is not None and stop.is_set():
                                raise _Stopped
                            if time.monotonic() > deadline:
                                raise TimeoutError("the probe ran past its time")
                    finally:
                        chunks.close()
                    continue
                bands = self._splits.bands or [(0, len(mover.kv.names))]
                pieces = mover.receive_bands(ids, names, bands, timeout_s=left)
                try:
                    for piece in pieces:
                        good = sum(piece.ok)
                        missing += len(piece.ok) - good if piece.band == 0 else 0
                        layers = piece.layers[1] - piece.layers[0]
                        nbytes += good * layers * mover.layer_raw_bytes
                        ctx.count_landed(good * layers * mover.layer_raw_bytes)
                        if piece.last_of_band and mover is movers[-1]:
                            timeline.append(time.perf_counter() - t0)
                        if stop is not None and stop.is_set():
                            raise _Stopped
                        if time.monotonic() > deadline:
                            raise TimeoutError("the probe ran past its time")
                finally:
                    pieces.close()
        except _Stopped:
            return True
        except StagingBusyError:
            return True  # users' loads hold the staging: the worker's own congestion
        except (KVStoreError, TimeoutError) as exc:
            seconds = time.perf_counter() - t0
            logger.debug("probing the store ended early (%s): %s", kind, exc)
            ctx.stats.timed_sample(f"{kind}_bounds", ctx.tp_rank, nbytes, seconds)
            ctx.stats.sample("probe_done", spec.probe_id)
            return True
        finally:
            with ctx.lock:
                self._probing = False
        seconds = time.perf_counter() - t0
        if missing or not nbytes:
            # part of it was not there (evicted, or a handoff deleted): its time says little of
            # the store, and the scheduler side stops probing those blocks
            ctx.stats.sample("probe_missing", spec.probe_id)
            return False
        shared = ctx.landed_since(landed_before, nbytes)  # (what loads beside it got too)
        if spec.kind is ProbeKind.WHOLE:
            ctx.stats.timed_sample("load_samples", ctx.tp_rank, shared, seconds, -1.0)
        else:
            between = (
                statistics.median(b - a for a, b in pairwise(timeline)) if timeline[1:] else 0.0
            )
            per_band = shared // max(1, len(timeline))
            first = timeline[0] if timeline else seconds
            ctx.stats.timed_sample(
                "split_samples", ctx.tp_rank, per_band, first, between, len(timeline)
            )
        # after its sample: the report may let a held handoff go, and the sample must be in
        # the same stats by then
        ctx.stats.sample("probe_done", spec.probe_id)
        return True


class _Stopped(Exception):
    """An idle probe's step began: it ends, with no sample."""
