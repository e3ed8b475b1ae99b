"""Worker side: vLLM's glue over the data mover (``datamover``), which does the copying.

- Loads run on background threads: the mover receives a request's blocks a chunk at a time
  straight into staging (``select_into``) and scatters each chunk into the allocated blocks.
  vLLM keeps scheduling other requests meanwhile. Every load is reported finished -- with its
  failed blocks -- whatever happens: an exception of any type, or its deadline passing while a
  thread is still stuck in a socket read (the late thread then writes nothing). In consume
  mode the handed-off chain is deleted after the copy, so a dropped connection mid-fetch loses
  nothing.
- Saves: ``wait_for_save`` hands the step's new full blocks, every request's together, to the
  mover, which starts copying them into staging (CUDA: gathered and copied device-to-host on
  side streams; it never waits) and returns; writer threads wait for the copy, then frame and
  ``SET`` them. When no staging is free (Redis slower than the model) or the store is
  unavailable, blocks are shed and counted. When a request has finished and its writes are
  acknowledged, its commit record says how many leading blocks really made it. Its blocks go
  back to vLLM (finished sending) as soon as it has finished: the compute stream waits for the
  gathers, so nothing reads them after the next forward pass starts.
- Blocks are gathered and scattered along the block dimension of the *logical* per-layer view
  vLLM presents ([blocks, kv_heads, block_size, content]), so no backend's layout is assumed.
- A model with several KV-cache groups gets movers per group (its layers, its share of the
  staging budget); each group's block is its own value, and a group's null blocks (a sliding
  window's past) are never read or written. A failed load of such a model is reported for the
  whole request (``take_transfer_results``): vLLM cannot map block ids back across groups.
- Tensor parallelism: a block is stored as ``store_tp_size`` head slices (``layout``). Each
  group gets one mover per slice this rank reads, over the cache heads the slice covers; the
  slices within this rank's heads are also the ones it writes (none on a rank whose heads an
  earlier rank holds too) (``slice_movers.py``). A block counts as loaded when every slice
  covering it arrived; a commit record is published per slice written, saying what
  ``commits.py``'s ledger confirmed.
- Consume mode: a handed-off chain is deleted by the scheduler side once every rank has
  finished loading it (several ranks may read one slice), never by a worker.
- Split loads (``LoadSpec.layered``, the load policy's ``split``): synchronous, within one
  step. ``start_load_kv`` (which vLLM calls before a forward pass that has such loads) starts
  a ``datamover.LayeredLoad`` on a thread of its own; ``wait_for_layer_load`` (before each
  attention layer) waits for that layer's band; the step's ``take_transfer_results`` ends it,
  and whatever did not land is a failed block, reported with that step's output. Never
  reported finished: vLLM holds nothing for it.
- Measurements for the load policy (``figures.py``), sent with the stats, each rank's tagged
  with it: each whole load's bytes and seconds from its first request to Redis (a wait for the
  compute fence does not count) and how long after its step began that was; each split's band
  timeline; an upper bound from each load or split that expired or failed; and (rank 0) each
  forward pass's shape and seconds from ``bind_connector_metadata`` to ``wait_for_save`` --
  less what it waited for split loads on the CPU; a CUDA pass that waited for bands gives no
  sample (the GPU idled while the host waited, and its events cannot tell).
- Probes (``probes.py``): background reads of a few stored blocks into staging, nothing written
  into the KV cache, one at a time on a thread of their own; their time is a figure's sample.
- The compute fence (``BlockMover.compute_fence``) is recorded when vLLM binds the step's
  metadata, before the forward pass is launched: vLLM starts asynchronous loads after it, and a
  fence recorded then would hold the load's writes until that whole pass has run.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from connector.commits import SaveLedger, StoredReport
from connector.config import RedisConnectorConfig
from connector.figures import StepShape
from connector.layout import KVLayout
from connector.load_policy import LOAD_THREADS
from connector.logs import FailureCounts
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.probes import ProbeKind, ProbeSpec
from connector.slice_movers import (
    SliceMover,
    build_slice_movers,
    log_slice_movers,
    slices_written,
)
from connector.stats import StatsBuffer
from datamover import BlockMover, LayeredLoad, LoadChunk, SaveChunk, SaveItem, StagingBusyError
from kvstore import (
    Claim,
    KVStoreError,
    LookupBuffer,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvstore.values.keys import BlockName
from kvstore.values.value_auth import UNAUTHENTICATED

logger = logging.getLogger("connector.worker")

# A retry of a failed fetch is only worth it with this much of the deadline left.
_RETRY_MIN_LEFT_S = 0.1
# forward passes timed on CUDA whose events have not completed yet, kept at most
_PENDING_TIMINGS = 64


@dataclass
class _Split:
    """A split load of this step: its spec, the layered load behind it, and this rank's bytes
    landed (every load's) when it started."""

    spec: LoadSpec
    load: LayeredLoad
    landed_before: int = 0
    landed_after: int | None = None  # this rank's bytes landed when its last band landed


@dataclass
class _ForwardTiming:
    """One forward pass being timed: what it computes, and from when."""

    step: StepShape
    started: Any  # perf_counter seconds, or a CUDA event on the compute stream
    ended: Any = None


@dataclass
class _LoadJob:
    spec: LoadSpec
    deadline: float
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (group, slice, block id) written into the KV cache (block ids are unique only within a
    # group; a block is loaded once every slice covering it is)
    copied: set[tuple[int, int, int]] = field(default_factory=set)
    nbytes: int = 0
    reported: bool = False  # once True, nothing touches this request's blocks any more
    # CUDA: the compute stream's work queued when the step began; the load's writes go
    # after it (``BlockMover.compute_fence``)
    after: Any = None
    step_started: float = 0.0  # perf_counter when vLLM bound the load's step
    first_byte: float | None = None  # perf_counter when its first request to Redis went out
    fenced_s: float = 0.0  # time it waited for the compute fence (not the store's)
    landed_before: int = 0  # this rank's bytes landed (every load's) at its first byte


class RedisConnectorWorker:
    def __init__(
        self,
        config: RedisConnectorConfig,
        layout: KVLayout,
        store: LookupBuffer,
        tp_rank: int = 0,
        report_stored: bool = False,
    ) -> None:
        self.config = config
        # each request's saves and what its commit record will say (and, KV events, report)
        self._ledger = SaveLedger(layout, report_stored)
        self._reports_out: list[StoredReport] = []  # taken with the finished saves
        self.layout = layout
        self.tp_rank = tp_rank
        self.store = store
        self._invalid_seen = (0, 0)  # the store's (invalid, unauthenticated) values reported
        self.stats = StatsBuffer()
        self._lock = threading.Lock()
        self._kv: dict[str, torch.Tensor] = {}
        self._kv_asleep: dict[str, torch.Tensor] = {}  # vLLM sleep mode: set aside, not used
        self._asleep = False
        self._load_io = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="redis-kv-load")
        # split loads never queue behind asynchronous ones: a forward pass waits for them
        self._layered_io = ThreadPoolExecutor(2, thread_name_prefix="redis-kv-layered")
        self._splits: dict[str, _Split] = {}  # this step's
        self._split_bands: list[tuple[int, int]] = []  # bands of layers a split reads
        self._layer_index: dict[str, int] = {}  # layer name -> its index in the split's movers
        self._shape_reported = False  # what a block costs to load, sent once with the stats
        self._timing: _ForwardTiming | None = None  # this step's forward pass
        self._timings: list[_ForwardTiming] = []  # CUDA: passes whose events are not done
        # this step's compute fence and when vLLM bound it (``forward_started``)
        self._step_fence: Any = None
        self._step_started = time.perf_counter()
        # probes run here, one at a time, never holding up a load
        self._probe_io = ThreadPoolExecutor(1, thread_name_prefix="redis-kv-probe")
        self._probing = False
        # bytes every load, split and probe of this rank received so far: over one load's
        # time, what the store gave the rank (loads side by side share it), not that load
        self._landed = 0
        # each load receives its next chunk here while it copies the current one in
        self._prefetch_io = ThreadPoolExecutor(
            max(2, 2 * config.read_ahead_chunks), thread_name_prefix="redis-kv-prefetch"
        )
        self._save_io = ThreadPoolExecutor(
            max(1, config.io_threads), thread_name_prefix="redis-kv-save"
        )
        # per KV-cache group (the layout's order), the head slices this rank reads
        self._slices: list[list[SliceMover]] = []
        self._jobs: dict[str, _LoadJob] = {}
        self._commits_received: list[CommitSpec] = []
        self._finished_loads: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._failed_loads: set[str] = set()  # loads failed as a whole (fails_per_request)
        self._pending: set[Future[Any]] = set()
        self._failures = FailureCounts()  # never reset (stats are): drives sparse logging

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"RedisConnector: KV caches for layers {missing} were not registered")
        with self._lock:
            self._kv = {name: kv_caches[name] for name in self.layout.layer_names}
            self._kv_asleep, self._asleep = {}, False
        self._slices = build_slice_movers(
            self._kv, self.layout, self.store, self.config, self.tp_rank, self._prefetch_io
        )
        self._ledger.slices_written = slices_written(self._slices)
        if len(self._slices) == 1 and self._slices[0] and not self.layout.fails_per_request:
            # one group: what a split load reads, band of layers by band (the scheduler side
            # refuses splits for other layouts)
            first = self._slices[0][0].mover
            self._split_bands = first.layer_bands(self.config.split_band_bytes)
            self._layer_index = {name: i for i, name in enumerate(first.kv.names)}
        self._shape_reported = False
        log_slice_movers(self._slices, self.layout, self.tp_rank)

    @property
    def movers_by_group(self) -> list[list[BlockMover]]:
        """Each KV-cache group's data movers (the layout's group order), head slice by head
        slice (for tools and tests)."""
        return [[sm.mover for sm in movers] for movers in self._slices]

    @property
    def movers(self) -> list[BlockMover]:
        """Every data mover, group by group, head slice by head slice (for tools and tests)."""
        return [sm.mover for movers in self._slices for sm in movers]

    def unregister_kv_caches(self) -> None:
        """vLLM sleep mode (0.33+), before the KV cache's memory is released: no thread may
        touch it afterwards. Loads in flight are reported now, their uncopied blocks failed
        (those requests recompute; a block copy in progress finishes first, so this waits at
        most one block). Saves need nothing: their blocks were copied to staging on the forward
        path. Idempotent."""
        with self._lock:
            if self._asleep:
                return
            self._asleep = True  # no new load starts
            jobs = list(self._jobs.values())
            splits = list(self._splits.values())
        for job in jobs:  # once reported, a load's thread writes nothing more
            self._report_load(job, cancelled=True)
        for split in splits:  # nor a split's (its step reports its blocks failed)
            split.load.cancel()
        with self._lock:
            self._kv_asleep, self._kv = self._kv, {}
        logger.info(
            "RedisConnector worker: KV cache released for sleep; %d load(s) in flight "
            "cancelled, their requests recompute",
            len(jobs),
        )

    def restore_kv_caches(self) -> None:
        """vLLM sleep mode, after wake-up: the KV cache is back at the same addresses (vLLM's
        sleep allocator remaps them), so the tensors set aside are valid again. A
        ``register_kv_caches`` with new tensors replaces them. Idempotent."""
        with self._lock:
            if self._asleep:
                self._kv, self._kv_asleep = self._kv_asleep, {}
                self._asleep = False

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, meta: RedisConnectorMetadata) -> None:
        """Every step starts here, with or without a forward pass; ``wait_for_save`` runs only
        after a forward pass on vLLM 0.30. So finished requests' commits are taken
        here, and acted on after this step's saves are staged (or in ``get_finished``)."""
        with self._lock:
            self._commits_received.extend(meta.commits)
            # blocks a failed split left wrong, which this step's requests would read: vLLM
            # recomputes them from this step's output on
            self._failed_block_ids.update(meta.reject_blocks)
        now = time.monotonic()
        # recorded when the step was bound, before its forward pass (``forward_started``);
        # the blocks these loads write may still have writes of an earlier step pending
        fence, self._step_fence = self._step_fence, None
        if fence is None and meta.loads and self.movers:
            fence = self.movers[0].compute_fence()
        for spec in meta.loads:
            if spec.layered:
                self._start_split(spec, now, fence)
                continue
            job = _LoadJob(
                spec,
                deadline=now + spec.timeout_s,
                started=time.perf_counter(),
                after=fence,
                step_started=self._step_started,
            )
            with self._lock:
                asleep = self._asleep
                if not asleep:
                    self._jobs[spec.req_id] = job
            if asleep:  # no KV cache to write into: the request recomputes (a handoff is
                self._report_load(job, cancelled=True)  # deleted by the scheduler side)
                continue
            self._track(self._load_io.submit(self._load, job))
        for probe in meta.probes:
            self._start_probe(probe)

    def _count_landed(self, nbytes: int) -> None:
        with self._lock:
            self._landed += nbytes

    def _landed_since(self, before: int, own: int) -> int:
        """What the store gave this rank since it had given ``before`` (at least ``own``)."""
        with self._lock:
            return max(own, self._landed - before)

    def _start_probe(self, spec: ProbeSpec) -> None:
        """A probe of the store (``probes.py``), unless one is still running or there is
        nothing to read with (asleep, or a layout without one group's movers)."""
        with self._lock:
            if self._probing or self._asleep or not self._slices or not self._slices[0]:
                return
            self._probing = True
        self.stats.add(load_probes=1)
        self._track(self._probe_io.submit(self._probe, spec), "a probe")

    def _probe(self, spec: ProbeSpec) -> None:
        """Read ``spec``'s blocks into staging as a load of its kind would, writing nothing
        into the KV cache; the time is a sample of that kind's figure, an upper bound if it
        expired or failed. Values not there (evicted, or a handoff already deleted) are no
        sample."""
        names = spec.names  # (the first group's: the one group a split loads)
        ids = list(range(len(names)))  # (nothing is written: no block ids are needed)
        movers = [sm.mover for sm in self._slices[0]]
        nbytes, missing, t0 = 0, 0, time.perf_counter()
        landed_before = self._landed_since(0, 0)
        deadline = time.monotonic() + spec.timeout_s
        kind = "load" if spec.kind is ProbeKind.WHOLE else "split"
        timeline: list[float] = []
        try:
            for mover in movers:
                left = max(0.0, deadline - time.monotonic())
                if spec.kind is ProbeKind.WHOLE:
                    chunks = mover.receive(ids, names, timeout_s=left)
                    try:
                        for chunk in chunks:
                            got = [v for v in chunk.values if v is not None]
                            missing += len(chunk.values) - len(got)
                            nbytes += len(got) * (mover.header_bytes + mover.raw_bytes)
                            self._count_landed(len(got) * (mover.header_bytes + mover.raw_bytes))
                            if time.monotonic() > deadline:
                                raise TimeoutError("the probe ran past its time")
                    finally:
                        chunks.close()
                    continue
                bands = self._split_bands or [(0, len(mover.kv.names))]
                pieces = mover.receive_bands(ids, names, bands, timeout_s=left)
                try:
                    for piece in pieces:
                        good = sum(piece.ok)
                        missing += len(piece.ok) - good if piece.band == 0 else 0
                        layers = piece.layers[1] - piece.layers[0]
                        nbytes += good * layers * mover.layer_raw_bytes
                        self._count_landed(good * layers * mover.layer_raw_bytes)
                        if piece.last_of_band and mover is movers[-1]:
                            timeline.append(time.perf_counter() - t0)
                        if time.monotonic() > deadline:
                            raise TimeoutError("the probe ran past its time")
                finally:
                    pieces.close()
        except StagingBusyError:
            return  # users' loads hold the staging: the worker's own congestion, not the store's
        except (KVStoreError, TimeoutError) as exc:
            seconds = time.perf_counter() - t0
            logger.debug("probing the store ended early (%s): %s", kind, exc)
            self.stats.sample(f"{kind}_bounds", self.tp_rank, nbytes, seconds)
            return
        finally:
            with self._lock:
                self._probing = False
        seconds = time.perf_counter() - t0
        if missing or not nbytes:
            # part of it was not there (evicted, or a handoff deleted): its time says little of
            # the store, and the scheduler side stops probing those blocks
            self.stats.sample("probe_missing", 1)
            return
        shared = self._landed_since(landed_before, nbytes)  # (what loads beside it got too)
        if spec.kind is ProbeKind.WHOLE:
            self.stats.sample("load_samples", self.tp_rank, shared, seconds, -1.0)
            return
        between = statistics.median(b - a for a, b in pairwise(timeline)) if timeline[1:] else 0.0
        per_band = shared // max(1, len(timeline))
        first = timeline[0] if timeline else seconds
        self.stats.sample("split_samples", self.tp_rank, per_band, first, between, len(timeline))

    def _start_split(self, spec: LoadSpec, now: float, fence: Any) -> None:
        """A split load of this step (see the module docstring): started now, on a thread of
        its own; this step's forward pass waits for its layers, its end ends it."""
        with self._lock:
            if self._asleep or not self._split_bands:
                # no KV cache to write (asleep), or a layout the scheduler side never splits:
                # every block failed, reported with this step's output
                self._failed_block_ids.update(spec.block_ids[0])
                self.stats.add(split_loads_failed=1)
                return
            load = LayeredLoad(
                [sm.mover for sm in self._slices[0]],
                spec.block_ids[0],
                spec.names[0],
                self._split_bands,
                now + spec.timeout_s,
                after=fence,
                on_landed=self._count_landed,
            )
            split = _Split(spec, load, self._landed)
            self._splits[spec.req_id] = split

        def all_landed() -> None:
            # what the store gave this rank until then (loads landing later did not share
            # the link with its bands)
            split.landed_after = self._landed_since(0, 0)

        load.on_all_landed = all_landed

        def claim() -> bool:
            return self._claim(spec)

        self._track(self._layered_io.submit(load.run, claim), "a split load")

    def _claim(self, spec: LoadSpec) -> bool:
        """Consume mode: claim the load's handoff for it (exactly one request loads one); False
        when another request took it first. Raises the store's errors."""
        if spec.claim is None:
            return True
        claim = self.store.claim_handoff(
            spec.claim, self.layout.all_fingerprints(), owner=spec.owner
        )
        if claim is Claim.TAKEN:  # another request took it first: not ours to touch
            self.stats.add(handoffs_lost=1)
            self._warn(
                "claim",
                "request %(req)s: its handoff was taken by another request (a retried "
                "request?); recomputing (%(total)d so far)",
                req=spec.req_id,
            )
            return False
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before an attention layer runs: wait for its band of this step's split loads (at
        most until each load's deadline; a load still missing it then ends, failed)."""
        if not self._splits:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:  # not a layer of ours (it reads another layer's cache)
            return
        for split in list(self._splits.values()):
            split.load.wait(layer)

    def _finish_splits(self) -> None:
        """The forward pass is over: end this step's split loads; what did not land is
        reported failed with this step's output, and nothing more is written."""
        with self._lock:
            splits, self._splits = self._splits, {}
        for req_id, split in splits.items():
            load = split.load
            bound = load.transfer_sample()  # (before finish: the time it ran)
            failed = load.finish()
            self.stats.add(bytes_loaded=load.nbytes)
            self.stats.observe("split_stall_seconds", load.stall_s)
            self.stats.observe("load_seconds", time.perf_counter() - load.started)
            timeline = load.band_timeline()
            if timeline is not None:
                # its bands shared the store with the loads beside it: what it gave the rank
                band_bytes, first, between, bands = timeline
                after = split.landed_after
                got = after - split.landed_before if after is not None else 0
                shared = max(got, load.nbytes) / max(1, load.nbytes)
                sample = (int(band_bytes * shared), first, between, bands)
                self.stats.sample("split_samples", self.tp_rank, *sample)
            elif bound is not None and not load.skipped_waits:
                # a failed split too: a store that got slower shows
                self.stats.sample("split_bounds", self.tp_rank, *bound)
            if load.skipped_waits:
                self.stats.add(split_loads_unwaited=1)
                self.stats.sample("split_unwaited", 1)  # (for the scheduler side's policy)
                self._warn(
                    "unwaited",
                    "request %(req)s: its forward pass ran layers without waiting for its split "
                    "load (a full CUDA graph?); recomputing (%(total)d so far; the scheduler "
                    "stops choosing splits)",
                    req=req_id,
                )
            if load.misfits:
                self._warn(
                    "layout",
                    "a stored block does not match this instance's KV layout; ignoring it "
                    "(%(total)d so far). Is another model writing to namespace %(ns)r?",
                    n=load.misfits,
                    ns=self.config.namespace,
                )
            if not failed:
                continue
            self.stats.add(split_loads_failed=1)
            with self._lock:
                self._failed_block_ids.update(failed)
            error = load.error
            if isinstance(error, KVStoreError):
                self._redis_error(
                    error,
                    "request %(req)s: its split load from Redis failed (%(total)d so far): "
                    "%(exc)s; recomputing",
                    req=req_id,
                )
            elif error is not None and not isinstance(error, StagingBusyError):
                logger.error("request %s: its split load failed: %r; recomputing", req_id, error)
            else:
                self._warn(
                    "split",
                    "request %(req)s: %(n)d block(s) of its split load did not land in its "
                    "forward pass%(why)s; recomputing them (%(total)d so far)",
                    n=len(failed),
                    req=req_id,
                    why=f" ({error})" if error is not None else "",
                )

    # ------------------------------------------------------------------ forward timing
    def forward_started(self, meta: RedisConnectorMetadata) -> None:
        """vLLM bound this step's metadata, before launching its forward pass: the compute
        fence of the step's loads is recorded now (``start_load_kv`` may come after the pass
        was launched), and the pass is timed on rank 0 for the load policy's figures."""
        self._step_started = time.perf_counter()
        self._step_fence = None
        movers = self.movers if meta.loads else []
        if movers:
            self._step_fence = movers[0].compute_fence()
        self._timing = None
        if self.tp_rank != 0 or meta.step.empty:
            return
        self._timing = _ForwardTiming(meta.step, self._clock())

    def forward_ended(self) -> None:
        """The forward pass was launched and ran (CPU) or is queued (CUDA): its time, less
        what it waited for split loads (CPU), is a sample once known. A CUDA pass that waited
        for split loads gives none: the GPU idled while the host waited, which its events
        cannot tell from compute."""
        timing, self._timing = self._timing, None
        if timing is None:
            return
        stall = sum(split.load.stall_s for split in self._splits.values())
        timing.ended = self._clock()
        if isinstance(timing.started, float):
            seconds = timing.ended - timing.started - stall
            self._compute_sample(timing.step, seconds)
            return
        if not self._splits:
            self._timings.append(timing)  # CUDA: read once its events completed
            self._timings = self._timings[-_PENDING_TIMINGS:]
        while self._timings and self._timings[0].ended.query():
            done = self._timings.pop(0)
            self._compute_sample(done.step, done.started.elapsed_time(done.ended) / 1000)

    def _compute_sample(self, step: StepShape, seconds: float) -> None:
        self.stats.sample(
            "compute_samples",
            step.prefill_tokens,
            step.prefill_attention,
            step.decode_rows,
            step.decode_context,
            seconds,
        )

    def _clock(self) -> Any:
        """Now: perf_counter seconds, or on CUDA an event recorded on the compute stream."""
        movers = self.movers
        if not movers or not movers[0].kv.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(movers[0].kv.device))
        return event

    def _load(self, job: _LoadJob) -> None:
        spec = job.spec
        expired = store_failed = False
        try:
            job.first_byte = time.perf_counter()
            job.landed_before = self._landed_since(0, 0)
            if not self._claim(spec):
                return
            if job.reported:
                return  # cancelled (sleep), or found past its deadline: reported already
            if time.monotonic() >= job.deadline:
                # its thread started (or its claim ended) too late: an expiry all the same
                expired = True
                return
            try:
                self._receive(job)
            except (StoreUnavailableError, StoreTimeoutError):
                # once more for what is not copied yet, if the connection dropped and time is
                # left (the values are only deleted after they were copied: still there)
                if job.deadline - time.monotonic() < _RETRY_MIN_LEFT_S or not self.store.available:
                    raise
                self._receive(job)
        except KVStoreError as exc:
            store_failed = True
            self._redis_error(
                exc,
                "request %(req)s: loading from Redis failed (%(total)d so far): %(exc)s; "
                "recomputing",
                req=spec.req_id,
            )
        except StagingBusyError as exc:
            self._warn(
                "staging", "request %(req)s: %(exc)s (%(total)d so far)", req=spec.req_id, exc=exc
            )
        except Exception:  # never leave the request waiting, whatever went wrong
            logger.exception("request %s: loading blocks failed; recomputing", spec.req_id)
        finally:
            self._report_load(job, expired=expired, store_failed=store_failed)

    def _uncopied(self, job: _LoadJob) -> list[tuple[int, int, list[int], list[BlockName]]]:
        """(group, slice, block ids, the store's block names) of each group's slices not copied
        yet; null blocks (a sliding window's past) are neither read nor written."""
        out = []
        spec = job.spec
        for g, (group, ids, names) in enumerate(
            zip(self.layout.groups, spec.block_ids, spec.names, strict=True)
        ):
            for k in range(len(self._slices[g]) if self._slices else 1):
                pairs = [
                    (b, name)
                    for b, name in zip(ids, names, strict=True)
                    if group.holds(b) and (g, k, b) not in job.copied
                ]
                if pairs:
                    out.append((g, k, [b for b, _ in pairs], [n for _, n in pairs]))
        return out

    def _receive(self, job: _LoadJob) -> None:
        """Receive and copy in chunk by chunk, slice by slice, what is not copied yet; stops as
        soon as the load was reported."""
        for g, k, block_ids, names in self._uncopied(job):
            chunks = self._slices[g][k].mover.receive(
                block_ids, names, timeout_s=max(0.0, job.deadline - time.monotonic())
            )
            try:
                for chunk in chunks:
                    if not self._copy_in(job, g, k, chunk):
                        return
            finally:
                chunks.close()  # releases the staging buffer at once

    def _copy_in(self, job: _LoadJob, group: int, head_slice: int, chunk: LoadChunk) -> bool:
        if job.after is not None:
            # the GPU work the load is ordered after (what was queued when its step began) is
            # waited for here, not under the lock: the model-runner thread takes the lock to
            # report a load whose deadline passed, and must not wait a step for it
            t0 = time.perf_counter()
            job.after.synchronize()
            job.fenced_s += time.perf_counter() - t0
        with job.lock:
            if job.reported:  # the deadline passed: these blocks are no longer ours
                return False
            copied, nbytes = chunk.copy_in(job.after)  # synchronous: done when it returns
            job.copied.update((group, head_slice, b) for b in copied)
            job.nbytes += nbytes
        self._count_landed(nbytes)
        if chunk.misfits:
            self._warn(
                "layout",
                "a stored block does not match this instance's KV layout; ignoring it "
                "(%(total)d so far). Is another model writing to namespace %(ns)r?",
                n=chunk.misfits,
                ns=self.config.namespace,
            )
        return True

    def _report_load(
        self,
        job: _LoadJob,
        expired: bool = False,
        cancelled: bool = False,
        store_failed: bool = False,
    ) -> None:
        """Report a load finished, exactly once; blocks not copied by now are failed."""
        spec = job.spec
        with job.lock:
            if job.reported:
                return
            job.reported = True
            failed = self._uncopied(job)
            # in the same critical section: once ``reported`` is set, the next get_finished
            # must see the load finished (it may be the call that found the deadline passed)
            with self._lock:
                if self._jobs.get(spec.req_id) is job:
                    del self._jobs[spec.req_id]
                if failed and self.layout.fails_per_request:
                    # block ids are unique only within a group (and a windowed group's hit
                    # cannot be cut short at a failed block): vLLM takes these
                    # failure per request (and recomputes all of it)
                    self._failed_loads.add(spec.req_id)
                else:
                    self._failed_block_ids.update(b for _, _, ids, _ in failed for b in ids)
                self._finished_loads.add(spec.req_id)
        # what the request got is counted by the scheduler side, once vLLM has heard from
        # every rank; a rank counts its own bytes and its own load's fate
        self.stats.add(
            loads_expired=int(expired), loads_cancelled=int(cancelled), bytes_loaded=job.nbytes
        )
        now = time.perf_counter()
        self.stats.observe("load_seconds", now - job.started)
        if job.first_byte is not None and not cancelled:
            # timed from its first request to Redis: queued behind other loads, or waiting
            # for the GPU, is not the store's time
            seconds = now - job.first_byte - job.fenced_s
            if (expired or store_failed) and seconds > 0:
                # the store gave at most this: the policy trusts no more until measured again
                self.stats.sample("load_bounds", self.tp_rank, job.nbytes, seconds)
            elif not failed and job.nbytes:  # a whole load: a sample of the load bandwidth
                # from the step's start to its first byte: vLLM's late call and the queue
                # behind other loads. The model adds the queue of the loads ahead too, but
                # underestimates it under many loads; without the queue here (a review's
                # suggestion) the simulator's busy cells ran 2-5x the best fixed way
                lag = job.first_byte - job.step_started
                shared = self._landed_since(job.landed_before, job.nbytes)
                self.stats.sample("load_samples", self.tp_rank, shared, seconds, lag)
        if expired:
            self._warn(
                "deadline",
                "request %(req)s: its deadline passed while loading from Redis (%(total)d so "
                "far); recomputing what was not loaded",
                req=spec.req_id,
            )

    # ------------------------------------------------------------------ saves
    def wait_for_save(self, meta: RedisConnectorMetadata) -> None:
        """Start copying this step's new full blocks into staging and hand them to the writer
        threads; returns without waiting for the copy (CUDA) or for Redis. Then act on the
        commits this step brought."""
        self.forward_ended()
        if meta.saves:
            self._stage_and_submit(meta.saves)
        self._take_commits()

    def _take_commits(self) -> None:
        """Finished requests: publish each one's commit record once its writes are done. (A
        finished request is never scheduled again, so its last saves were staged in an
        earlier step's ``wait_for_save``.)"""
        with self._lock:
            commits, self._commits_received = self._commits_received, []
        self._ledger.committed(commits)
        for commit in commits:
            self._maybe_publish(commit.req_id)

    def _save_items(self, specs: list[SaveSpec]) -> list[list[SaveItem]]:
        """Each group's blocks to save (null blocks skipped), in the layout's group order."""
        return [
            [
                SaveItem(block_id, name, spec.first_position + i, spec.req_id)
                for spec in specs
                for i, (block_id, name) in enumerate(
                    zip(spec.block_ids[g], spec.names[g], strict=True)
                )
                if group.holds(block_id)
            ]
            for g, group in enumerate(self.layout.groups)
        ]

    def _stage_and_submit(self, specs: list[SaveSpec]) -> None:
        self._ledger.opened(spec.req_id for spec in specs)
        for g, items in enumerate(self._save_items(specs)):
            if items:
                self._stage_group(g, items)

    def _stage_group(self, group: int, items: list[SaveItem]) -> None:
        """Stage ``items`` of every head slice this rank writes of ``group`` (none: another
        rank holding the same heads writes them)."""
        for k, sm in enumerate(self._slices[group]):
            if sm.writes:
                self._stage_slice(group, k, items)

    def _stage_slice(self, group: int, head_slice: int, items: list[SaveItem]) -> None:
        chunks: list[SaveChunk] = []
        shed = items  # Redis is down or hung (or the KV cache asleep): do not even copy
        if self.store.available and not self._asleep:
            try:
                chunks, shed = self._slices[group][head_slice].mover.stage_saves(items)
            except Exception:  # the step goes on; these blocks are not saved (and counted)
                logger.exception("copying %d block(s) out for saving failed", len(items))
        if shed:
            self.stats.add(blocks_shed=len(shed))
            self._warn(
                "shed",
                "%(n)d block(s) of request(s) %(req)s not saved: staging full or Redis "
                "unavailable (%(total)d shed so far; if Redis is up it is slower than the model: "
                "raise max_inflight_bytes)",
                n=len(shed),
                req=", ".join(sorted({item.owner for item in shed})),
            )
        for chunk in chunks:
            self._ledger.writing(chunk.owners)
            # the mover that staged it writes it: a register_kv_caches meanwhile (sleep mode)
            # replaces the movers, and the chunk's buffer belongs to this one's staging
            mover = self._slices[group][head_slice].mover
            self._track(
                self._save_io.submit(self._write, group, head_slice, mover, chunk), "a save"
            )

    def _write(self, group: int, head_slice: int, mover: BlockMover, chunk: SaveChunk) -> None:
        t0 = time.perf_counter()
        ok = False
        nbytes = 0
        try:
            nbytes = mover.write(chunk)
            ok = True
        except KVStoreError as exc:
            self._redis_error(
                exc,
                "request(s) %(req)s: saving %(blocks)d block(s) failed (%(total)d Redis errors "
                "so far): %(exc)s",
                req=", ".join(sorted(chunk.owners)),
                blocks=len(chunk.items),
            )
        except Exception:
            logger.exception(
                "request(s) %s: saving %d block(s) failed", sorted(chunk.owners), len(chunk.items)
            )
        finally:
            acked = [(i.owner, group, head_slice, i.position) for i in chunk.items] if ok else []
            self._ledger.written(chunk.owners, acked)
            self.stats.add(
                saves=1,
                blocks_saved=len(chunk.items) if ok else 0,
                bytes_saved=nbytes if ok else 0,
                blocks_save_failed=0 if ok else len(chunk.items),
            )
            self.stats.observe("save_seconds", time.perf_counter() - t0)
            for owner in chunk.owners:
                self._maybe_publish(owner)

    def _maybe_publish(self, req_id: str) -> None:
        """Once a finished request has no write in flight, publish its commit record."""
        ready = self._ledger.ready(req_id)
        if ready is not None:
            self._track(
                self._save_io.submit(self._publish, req_id, ready.commit, ready.blocks),
                "a commit record",
            )

    def _publish(self, req_id: str, commit: CommitSpec, n: int) -> None:
        stores = [sm.store for sm in self._slices[0] if sm.writes] if self._slices else []
        try:
            for store in stores:  # (none: another rank holding these heads writes them)
                store.publish_handoff(commit.handoff, n)
                self.stats.add(handoffs_published=1)
        except KVStoreError as exc:
            self._redis_error(
                exc,
                "request %(req)s: publishing its commit record failed (%(total)d Redis errors "
                "so far): %(exc)s; its consumer recomputes by its deadline",
                req=req_id,
            )
        finally:
            self._ledger.published(req_id)

    def take_stored_reports(self) -> list[tuple[str, int, list[int]]]:
        """(request, leading blocks confirmed in Redis, loadable ends of a state model) of
        finished requests, for the scheduler side's KV events: those
        ``take_transfer_results`` took (vLLM asks both every step)."""
        with self._lock:
            reports, self._reports_out = self._reports_out, []
        return reports

    # ------------------------------------------------------------------ completion
    def _warn(self, cause: str, msg: str, n: int = 1, **fields: Any) -> None:
        """A warning at 1, 2, 4, 8, ... occurrences of a cause, not one per block or request;
        ``msg`` uses ``%(total)d`` for the running total and ``%(name)s`` for ``fields``."""
        total = self._failures.add(cause, n)
        if total:
            logger.warning(msg, {**fields, "n": n, "total": total})

    def _redis_error(self, exc: KVStoreError, msg: str, **fields: Any) -> None:
        """Count a failed Redis call and warn sparsely, per error type."""
        self.stats.add(redis_errors=1)
        self._warn(f"redis:{type(exc).__name__}", msg, exc=exc, **fields)

    def _track(self, fut: Future[Any], what: str = "a load") -> None:
        with self._lock:
            self._pending.add(fut)

        def done(f: Future[Any]) -> None:
            with self._lock:
                self._pending.discard(f)
            if f.cancelled():  # cancelled at shutdown
                return
            exc = f.exception()
            if exc is not None:  # the tasks catch what they can; anything else is said here
                logger.error("RedisConnector background task (%s) failed: %r", what, exc)

        fut.add_done_callback(done)

    def tracked_requests(self) -> set[str]:
        """Requests whose loads or saves this worker still tracks: none once every request has
        finished and its saves were acknowledged (anything else is a leak)."""
        with self._lock:
            jobs = set(self._jobs)
        return jobs | self._ledger.requests()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished saves, finished loads): ``take_transfer_results`` without the failed."""
        saves, loads, _ = self.take_transfer_results()
        return saves, loads

    def take_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished saves, finished loads, loads failed as a whole -- among the finished),
        taken together so a load is never reported twice. Loads past their deadline are
        reported now, with every block not yet copied failed, even if their thread is still
        waiting on Redis."""
        self._take_commits()  # a step without a forward pass has no wait_for_save (vLLM < 0.32)
        self._finish_splits()  # the forward pass is over
        now = time.monotonic()
        with self._lock:
            expired = [job for job in self._jobs.values() if now >= job.deadline]
        for job in expired:
            self._report_load(job, expired=True)
        # taken with the finished saves: a request is freed in the step carrying its report
        saves, reports = self._ledger.take_finished(now)
        with self._lock:
            self._reports_out += reports
            loads, self._finished_loads = self._finished_loads, set()
            failed, self._failed_loads = self._failed_loads, set()
        return saves, loads, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_stats(self) -> dict[str, Any]:
        if not self._shape_reported and self._slices:
            # what one block costs this rank to load, and in how many bands a split reads it
            self._shape_reported = True
            block = sum(m.header_bytes + m.raw_bytes for m in self.movers)
            self.stats.sample("rank_block_bytes", block)
            if self._split_bands:
                self.stats.sample("split_bands", len(self._split_bands))
        # the store's invalid values since the last report (its counters are cumulative)
        snap = self.store.stats()
        invalid = snap.corrupt
        unauthenticated = sum(snap.corrupt_by_reason.get(r, 0) for r in UNAUTHENTICATED)
        seen_invalid, seen_unauthenticated = self._invalid_seen
        if invalid > seen_invalid:
            self._invalid_seen = (invalid, unauthenticated)
            self.stats.add(
                values_invalid=invalid - seen_invalid,
                values_unauthenticated=unauthenticated - seen_unauthenticated,
            )
        return self.stats.take()

    def shutdown_pending(self, timeout_s: float) -> int:
        """Wait (bounded) for running transfers; returns how many are still running."""
        deadline = time.monotonic() + timeout_s
        while True:  # a finished write may start a commit record: wait for those too
            with self._lock:
                pending = list(self._pending)
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return len(pending)
            wait(pending, timeout=left)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        still_running = self.shutdown_pending(timeout_s)
        if still_running:
            logger.warning(
                "RedisConnector: %d transfer(s) still running at shutdown", still_running
            )
        for pool in (
            self._load_io,
            self._layered_io,
            self._prefetch_io,
            self._save_io,
            self._probe_io,
        ):
            pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
