"""Split loads on the worker side (``LoadSpec.layered``, the load policy's ``split``):
synchronous, within one step.

``start_load_kv`` (which vLLM calls before a forward pass that has such loads) starts a
``datamover.LayeredLoad`` on a thread of its own; ``wait_for_layer_load`` (before each attention
layer) waits for that layer's band; the step's ``take_transfer_results`` ends it, and whatever
did not land is a failed block, reported with that step's output. Never reported finished:
vLLM holds nothing for it. Only a layout of one KV-cache group is split (the scheduler side
refuses splits for others). Each split's band timeline is a sample of the load policy's figures
(``figures.py``); one that failed is an upper bound.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from connector.load_claims import claim_handoff
from connector.metadata import LoadSpec
from connector.worker_context import WorkerContext
from datamover import LayeredLoad, StagingBusyError
from kvstore import KVStoreError


@dataclass
class Split:
    """A split load of this step: its spec, the layered load behind it, and this rank's bytes
    landed (every load's) when it started."""

    spec: LoadSpec
    load: LayeredLoad
    landed_before: int = 0
    landed_after: int | None = None  # this rank's bytes landed when its last band landed


class SplitLoads:
    def __init__(self, ctx: WorkerContext, io: ThreadPoolExecutor) -> None:
        self._ctx = ctx
        # split loads never queue behind asynchronous ones: a forward pass waits for them
        self._io = io
        self.running: dict[str, Split] = {}  # this step's
        self.bands: list[tuple[int, int]] = []  # bands of layers a split reads
        self._layer_index: dict[str, int] = {}  # layer name -> its index in the split's movers

    def registered(self) -> None:
        """The KV caches were (re)registered: what a split reads, band of layers by band, if
        the layout is one group's (the scheduler side refuses splits for other layouts)."""
        ctx = self._ctx
        if len(ctx.slices) == 1 and ctx.slices[0] and not ctx.layout.fails_per_request:
            first = ctx.slices[0][0].mover
            self.bands = first.layer_bands(ctx.config.split_band_bytes)
            self._layer_index = {name: i for i, name in enumerate(first.kv.names)}

    def start(self, spec: LoadSpec, now: float, fence: Any) -> None:
        """A split load of this step (see the module docstring): started now, on a thread of
        its own; this step's forward pass waits for its layers, its end ends it."""
        ctx = self._ctx
        with ctx.lock:
            if ctx.asleep or not self.bands:
                # no KV cache to write (asleep), or a layout the scheduler side never splits:
                # every block failed, reported with this step's output
                ctx.failed_block_ids.update(spec.block_ids[0])
                ctx.stats.add(split_loads_failed=1)
                return
            load = LayeredLoad(
                [sm.mover for sm in ctx.slices[0]],
                spec.block_ids[0],
                spec.names[0],
                self.bands,
                now + spec.timeout_s,
                after=fence,
                on_landed=ctx.count_landed,
            )
            split = Split(spec, load, ctx.landed)
            self.running[spec.req_id] = split

        def all_landed() -> None:
            # what the store gave this rank until then (loads landing later did not share
            # the link with its bands)
            split.landed_after = ctx.landed_since(0, 0)

        load.on_all_landed = all_landed

        def claim() -> bool:
            return claim_handoff(ctx, spec)

        ctx.track(self._io.submit(load.run, claim), "a split load")

    def stall_s(self) -> float:
        """How long this step's forward pass has waited for its split loads so far."""
        return sum(split.load.stall_s for split in self.running.values())

    def wait_for_layer(self, layer_name: str) -> None:
        """Before an attention layer runs: wait for its band of this step's split loads (at
        most until each load's deadline; a load still missing it then ends, failed)."""
        if not self.running:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:  # not a layer of ours (it reads another layer's cache)
            return
        for split in list(self.running.values()):
            split.load.wait(layer)

    def finish(self) -> None:
        """The forward pass is over: end this step's split loads; what did not land is
        reported failed with this step's output, and nothing more is written."""
        ctx = self._ctx
        with ctx.lock:
            splits, self.running = self.running, {}
        for req_id, split in splits.items():
            load = split.load
            bound = load.transfer_sample()  # (before finish: the time it ran)
            failed = load.finish()
            ctx.stats.add(bytes_loaded=load.nbytes)
            ctx.stats.observe("split_stall_seconds", load.stall_s)
            ctx.stats.observe("load_seconds", time.perf_counter() - load.started)
            timeline = load.band_timeline()
            if timeline is not None:
                # its bands shared the store with the loads beside it: what it gave the rank
                band_bytes, first, between, bands = timeline
                after = split.landed_after
                got = after - split.landed_before if after is not None else 0
                shared = max(got, load.nbytes) / max(1, load.nbytes)
                sample = (int(band_bytes * shared), first, between, bands)
                ctx.stats.timed_sample("split_samples", ctx.tp_rank, *sample)
            elif bound is not None and not load.skipped_waits:
                # a failed split too: a store that got slower shows
                ctx.stats.timed_sample("split_bounds", ctx.tp_rank, *bound)
            if load.skipped_waits:
                ctx.stats.add(split_loads_unwaited=1)
                ctx.stats.sample("split_unwaited", 1)  # (for the scheduler side's policy)
                ctx.warn(
                    "unwaited",
                    "request %(req)s: its forward pass ran layers without waiting for its split "
                    "load (a full CUDA graph?); recomputing (%(total)d so far; the scheduler "
                    "stops choosing splits)",
                    req=req_id,
                )
            if load.misfits:
                ctx.warn(
                    "layout",
                    "a stored block does not match this instance's KV layout; ignoring it "
                    "(%(total)d so far). Is another model writing to namespace %(ns)r?",
                    n=load.misfits,
                    ns=ctx.config.namespace,
                )
            if not failed:
                continue
            ctx.stats.add(split_loads_failed=1)
            with ctx.lock:
                ctx.failed_block_ids.update(failed)
            error = load.error
            if isinstance(error, KVStoreError):
                ctx.redis_error(
                    error,
                    "request %(req)s: its split load from Redis failed (%(total)d so far): "
                    "%(exc)s; recomputing",
                    req=req_id,
                )
            elif error is not None and not isinstance(error, StagingBusyError):
                ctx.bug("split", error, f"request {req_id}: its split load (recomputed)")
            else:
                ctx.warn(
                    "split",
                    "request %(req)s: %(n)d block(s) of its split load did not land in its "
                    "forward pass%(why)s; recomputing them (%(total)d so far)",
                    n=len(failed),
                    req=req_id,
                    why=f" ({error})" if error is not None else "",
                )
