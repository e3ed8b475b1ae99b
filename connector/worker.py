"""Worker side: vLLM's glue over the data mover (``datamover``), which does the copying. This
class is what vLLM's worker-side calls reach; its parts are beside it, each handed the state
they share (``worker_context.py``: the store, the movers, the stats, one lock): whole loads on
background threads (``whole_loads.py``), split loads within a step's forward pass
(``split_loads.py``), consume-mode claims before either reads (``load_claims.py``), each step's
saves and the commit records of finished requests (``save_writes.py``), probes of the store
(``probe_reads.py``), and forward passes timed for the load policy (``forward_timing.py``).

- Blocks are gathered and scattered along the block dimension of the *logical* per-layer view
  vLLM presents ([blocks, kv_heads, block_size, content]), so no backend's layout is assumed.
- A model with several KV-cache groups gets movers per group (its layers, its share of the
  staging budget); each group's block is its own value, and a group's null blocks (a sliding
  window's past) are never read or written. A failed load of such a model is reported for the
  whole request (``take_transfer_results``): vLLM cannot map block ids back across groups.
- Tensor parallelism: a block is stored as ``store_tp_size`` head slices (``layout``). Each
  group gets one mover per slice this rank reads, over the cache heads the slice covers; the
  slices within this rank's heads are also the ones it writes (none on a rank whose heads an
  earlier rank holds too) (``slice_movers.py``).
- Consume mode: a handed-off chain is deleted by the scheduler side once every rank has
  finished loading it (several ranks may read one slice), never by a worker.
- Measurements for the load policy (``figures.py``) are sent with the stats, each rank's
  tagged with it; what one block costs this rank to load is sent once.
- The compute fence (``BlockMover.compute_fence``) is recorded when vLLM binds the step's
  metadata, before the forward pass is launched: vLLM starts asynchronous loads after it, and a
  fence recorded then would hold the load's writes until that whole pass has run.
- vLLM sleep mode: the KV cache is set aside while it sleeps; loads in flight are reported,
  and nothing is read or written until it is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch

from connector.commits import StoredReport
from connector.config import RedisConnectorConfig
from connector.forward_timing import ForwardTimer
from connector.idle_probes import IdleProbes
from connector.layout import KVLayout
from connector.load_policy import LOAD_THREADS
from connector.metadata import RedisConnectorMetadata, SaveSpec
from connector.probe_reads import ProbeReads
from connector.save_writes import SaveWrites
from connector.slice_movers import build_slice_movers, log_slice_movers
from connector.split_loads import Split, SplitLoads
from connector.whole_loads import WholeLoads
from connector.worker_context import WorkerContext
from datamover import BlockMover
from kvstore import LookupBuffer
from kvstore.values.value_auth import UNAUTHENTICATED

logger = logging.getLogger("connector.worker")


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
        self.layout = layout
        self.tp_rank = tp_rank
        self.store = store
        self._ctx = ctx = WorkerContext(config, layout, store, tp_rank)
        self.stats = ctx.stats
        self._invalid_seen = (0, 0)  # the store's (invalid, unauthenticated) values reported
        self._kv: dict[str, torch.Tensor] = {}
        self._kv_asleep: dict[str, torch.Tensor] = {}  # vLLM sleep mode: set aside, not used
        self._shape_reported = False  # what a block costs to load, sent once with the stats
        # this step's compute fence and when vLLM bound it (``forward_started``)
        self._step_fence: Any = None
        self._step_started = time.perf_counter()
        self._load_io = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="redis-kv-load")
        # split loads never queue behind asynchronous ones: a forward pass waits for them
        self._layered_io = ThreadPoolExecutor(2, thread_name_prefix="redis-kv-layered")
        # probes run here, one at a time, never holding up a load
        self._probe_io = ThreadPoolExecutor(1, thread_name_prefix="redis-kv-probe")
        # each load receives its next chunk here while it copies the current one in
        self._prefetch_io = ThreadPoolExecutor(
            max(2, 2 * config.read_ahead_chunks), thread_name_prefix="redis-kv-prefetch"
        )
        self._save_io = ThreadPoolExecutor(
            max(1, config.io_threads), thread_name_prefix="redis-kv-save"
        )
        self._whole_loads = WholeLoads(ctx, self._load_io)
        self._split_loads = SplitLoads(ctx, self._layered_io)
        self._probes = ProbeReads(ctx, self._probe_io, self._split_loads)
        self.idle_probes = IdleProbes(self._probes.start, ctx.bug)  # while no step runs
        self._saves = SaveWrites(ctx, self._save_io, report_stored)
        self._timer = ForwardTimer(ctx)

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"RedisConnector: KV caches for layers {missing} were not registered")
        with self._ctx.lock:
            self._kv = {name: kv_caches[name] for name in self.layout.layer_names}
            self._kv_asleep, self._ctx.asleep = {}, False
        self._ctx.slices = build_slice_movers(
            self._kv, self.layout, self.store, self.config, self.tp_rank, self._prefetch_io
        )
        self._saves.registered()
        self._split_loads.registered()
        self._shape_reported = False
        log_slice_movers(self._ctx.slices, self.layout, self.tp_rank)

    @property
    def movers_by_group(self) -> list[list[BlockMover]]:
        """Each KV-cache group's data movers (the layout's group order), head slice by head
        slice (for tools and tests)."""
        return [[sm.mover for sm in movers] for movers in self._ctx.slices]

    @property
    def movers(self) -> list[BlockMover]:
        """Every data mover, group by group, head slice by head slice (for tools and tests)."""
        return self._ctx.movers

    @property
    def _splits(self) -> dict[str, Split]:
        """This step's split loads (for tests: a leak check)."""
        return self._split_loads.running

    def unregister_kv_caches(self) -> None:
        """vLLM sleep mode (0.33+), before the KV cache's memory is released: no thread may
        touch it afterwards. Loads in flight are reported now, their uncopied blocks failed
        (those requests recompute; a block copy in progress finishes first, so this waits at
        most one block). Saves need nothing: their blocks were copied to staging on the forward
        path. Idempotent."""
        with self._ctx.lock:
            if self._ctx.asleep:
                return
            self._ctx.asleep = True  # no new load starts
            jobs = list(self._whole_loads.jobs.values())
            splits = list(self._split_loads.running.values())
        for job in jobs:  # once reported, a load's thread writes nothing more
            self._whole_loads.report(job, cancelled=True)
        for split in splits:  # nor a split's (its step reports its blocks failed)
            split.load.cancel()
        with self._ctx.lock:
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
        with self._ctx.lock:
            if self._ctx.asleep:
                self._kv, self._kv_asleep = self._kv_asleep, {}
                self._ctx.asleep = False

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, meta: RedisConnectorMetadata) -> None:
        """Every step starts here, with or without a forward pass; ``wait_for_save`` runs only
        after a forward pass on vLLM 0.30. So finished requests' commits are taken
        here, and acted on after this step's saves are staged (or in ``get_finished``)."""
        self.idle_probes.step_began(meta.idle_probes)
        self._saves.commits_received(meta.commits)
        with self._ctx.lock:
            # blocks a failed split left wrong, which this step's requests would read: vLLM
            # recomputes them from this step's output on
            self._ctx.failed_block_ids.update(meta.reject_blocks)
        now = time.monotonic()
        # recorded when the step was bound, before its forward pass (``forward_started``);
        # the blocks these loads write may still have writes of an earlier step pending
        fence, self._step_fence = self._step_fence, None
        if fence is None and meta.loads and self.movers:
            fence = self.movers[0].compute_fence()
        for spec in meta.loads:
            if spec.layered:
                self._split_loads.start(spec, now, fence)
            else:
                self._whole_loads.start(spec, now, fence, self._step_started)
        for probe in meta.probes:
            self._probes.start(probe)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before an attention layer runs: wait for its band of this step's split loads (at
        most until each load's deadline; a load still missing it then ends, failed)."""
        self._split_loads.wait_for_layer(layer_name)

    # ------------------------------------------------------------------ forward timing
    def forward_started(self, meta: RedisConnectorMetadata) -> None:
        """vLLM bound this step's metadata, before launching its forward pass: the compute
        fence of the step's loads is recorded now (``start_load_kv`` may come after the pass
        was launched), and the pass is timed on rank 0 for the load policy's figures."""
        self._step_started = time.perf_counter()
        self._step_fence = None
        self.idle_probes.step_began(meta.idle_probes)
        movers = self.movers if meta.loads else []
        if movers:
            self._step_fence = movers[0].compute_fence()
        self._timer.started(meta.step)

    def forward_ended(self) -> None:
        """The forward pass was launched and ran (CPU) or is queued (CUDA): its time is a
        sample once known (``forward_timing.py``)."""
        self._timer.ended(self._split_loads)

    # ------------------------------------------------------------------ saves
    def wait_for_save(self, meta: RedisConnectorMetadata) -> None:
        """Start copying this step's new full blocks into staging and hand them to the writer
        threads; returns without waiting for the copy (CUDA) or for Redis. Then act on the
        commits this step brought."""
        self.forward_ended()
        if meta.saves:
            self._stage_and_submit(meta.saves)
        self._saves.take_commits()

    def _stage_and_submit(self, specs: list[SaveSpec]) -> None:
        # one call per step with saves: tests wrap it to see what each step staged
        self._saves.stage_and_submit(specs)

    def take_stored_reports(self) -> list[StoredReport]:
        """(request, leading blocks confirmed in Redis, loadable ends of a state model) of
        finished requests, for the scheduler side's KV events: those
        ``take_transfer_results`` took (vLLM asks both every step)."""
        return self._saves.take_stored_reports()

    # ------------------------------------------------------------------ completion
    def tracked_requests(self) -> set[str]:
        """Requests whose loads or saves this worker still tracks: none once every request has
        finished and its saves were acknowledged (anything else is a leak)."""
        return self._whole_loads.requests() | self._saves.requests()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished saves, finished loads): ``take_transfer_results`` without the failed."""
        saves, loads, _ = self.take_transfer_results()
        return saves, loads

    def take_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished saves, finished loads, loads failed as a whole -- among the finished),
        taken together so a load is never reported twice. Loads past their deadline are
        reported now, with every block not yet copied failed, even if their thread is still
        waiting on Redis."""
        # a step without a forward pass has no wait_for_save (vLLM < 0.32)
        self._saves.take_commits()
        self._split_loads.finish()  # the forward pass is over
        now = time.monotonic()
        self._whole_loads.expire(now)
        saves = self._saves.take_finished(now)
        loads, failed = self._whole_loads.take_finished()
        return saves, loads, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._ctx.lock:
            failed, self._ctx.failed_block_ids = self._ctx.failed_block_ids, set()
        return failed

    def take_stats(self) -> dict[str, Any]:
        """What this rank measured and counted since the last call: vLLM gathers it at the end
        of every step, which ends the step for the idle probes too."""
        self.idle_probes.step_ended()
        if not self._shape_reported and self._ctx.slices:
            # what one block costs this rank to load, and in how many bands a split reads it
            self._shape_reported = True
            block = sum(m.header_bytes + m.raw_bytes for m in self.movers)
            self.stats.sample("rank_block_bytes", block)
            if self._split_loads.bands:
                self.stats.sample("split_bands", len(self._split_loads.bands))
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
            pending = self._ctx.pending()
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return len(pending)
            wait(pending, timeout=left)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.idle_probes.stop()
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
