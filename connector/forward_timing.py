"""Forward passes timed on the worker side (rank 0), for the load policy's figures
(``figures.py``): each pass's shape and seconds from ``bind_connector_metadata`` to
``wait_for_save``, less what it waited for split loads on the CPU. A CUDA pass is timed by
events on the compute stream, read once they completed; one that waited for bands gives no
sample (the GPU idled while the host waited, and its events cannot tell).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from connector.figures import StepShape
from connector.split_loads import SplitLoads
from connector.worker_context import WorkerContext

# forward passes timed on CUDA whose events have not completed yet, kept at most
_PENDING_TIMINGS = 64


@dataclass
class ForwardTiming:
    """One forward pass being timed: what it computes, and from when."""

    step: StepShape
    started: Any  # perf_counter seconds, or a CUDA event on the compute stream
    ended: Any = None


class ForwardTimer:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._timing: ForwardTiming | None = None  # this step's forward pass
        self._timings: list[ForwardTiming] = []  # CUDA: passes whose events are not done

    def started(self, step: StepShape) -> None:
        """vLLM bound this step's metadata, before launching its forward pass: timed on rank 0,
        unless it computes nothing."""
        self._timing = None
        if self._ctx.tp_rank != 0 or step.empty:
            return
        self._timing = ForwardTiming(step, self._clock())

    def ended(self, splits: SplitLoads) -> None:
        """The forward pass was launched and ran (CPU) or is queued (CUDA): its time, less
        what it waited for ``splits`` (CPU), is a sample once known. A CUDA pass that waited
        for split loads gives none: the GPU idled while the host waited, which its events
        cannot tell from compute."""
        timing, self._timing = self._timing, None
        if timing is None:
            return
        stall = splits.stall_s()
        timing.ended = self._clock()
        if isinstance(timing.started, float):
            seconds = timing.ended - timing.started - stall
            self._compute_sample(timing.step, seconds)
            return
        if not splits.running:
            self._timings.append(timing)  # CUDA: read once its events completed
            self._timings = self._timings[-_PENDING_TIMINGS:]
        while self._timings and self._timings[0].ended.query():
            done = self._timings.pop(0)
            self._compute_sample(done.step, done.started.elapsed_time(done.ended) / 1000)

    def _compute_sample(self, step: StepShape, seconds: float) -> None:
        self._ctx.stats.sample(
            "compute_samples",
            step.prefill_tokens,
            step.prefill_attention,
            step.decode_rows,
            step.decode_context,
            seconds,
        )

    def _clock(self) -> Any:
        """Now: perf_counter seconds, or on CUDA an event recorded on the compute stream."""
        movers = self._ctx.movers
        if not movers or not movers[0].kv.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(movers[0].kv.device))
        return event
