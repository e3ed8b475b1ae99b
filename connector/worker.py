"""Worker side: move blocks between vLLM's paged KV cache and Redis, off the forward path.

- Loads run on a background thread: fetch (``select`` or ``drop_select``), validate, and copy
  each block into its allocated slot (CUDA: through pinned staging on a side stream, synchronised
  before the request is reported loaded). vLLM keeps scheduling other requests meanwhile.
- Saves: after the forward pass, each new full block is copied once, straight from the KV cache
  into a reusable staging buffer in its final value format; a background thread then writes it
  with a pipelined ``SET``. When no staging buffer is free (Redis slower than the model), the
  block is shed and counted instead of growing memory.
- Blocks are gathered and scattered along the block dimension of the *logical* per-layer view
  vLLM presents ([blocks, kv_heads, block_size, content]), so no backend's layout is assumed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvstore import KVStoreError, LookupBuffer
from kvstore.staging import StagingPool

from .config import KVLayout, RedisConnectorConfig
from .metadata import LoadSpec, RedisConnectorMetadata, SaveSpec
from .stats import FailureCounts

logger = logging.getLogger("connector.worker")


@dataclass
class WorkerStats:
    """Counters since the last ``take()``: the interval vLLM's stats hooks report."""

    blocks_loaded: int = 0
    blocks_load_failed: int = 0
    blocks_saved: int = 0
    blocks_save_failed: int = 0
    blocks_shed: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    loads: int = 0
    saves: int = 0
    redis_errors: int = 0

    def take(self) -> dict[str, Any]:
        snap = asdict(self)
        for k in snap:
            setattr(self, k, type(snap[k])())
        return snap


class RedisConnectorWorker:
    def __init__(
        self,
        config: RedisConnectorConfig,
        layout: KVLayout,
        store: LookupBuffer,
        tp_rank: int = 0,
    ) -> None:
        self.config = config
        self.layout = layout
        self.tp_rank = tp_rank
        self.store = store
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._kv: dict[str, torch.Tensor] = {}
        self._block_shape: tuple[int, ...] = ()
        self._dtype: torch.dtype | None = None
        self._device = torch.device("cpu")
        self._load_io = ThreadPoolExecutor(2, thread_name_prefix="redis-kv-load")
        self._save_io = ThreadPoolExecutor(
            max(1, config.io_threads), thread_name_prefix="redis-kv-save"
        )
        self._save_pool: StagingPool | None = None
        self._load_pool: StagingPool | None = None  # CUDA only: pinned bounce buffers
        self._value_bytes = 0
        self._finished_loads: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._pending: set[Future[None]] = set()
        self._stream: Any = None
        self._failures = FailureCounts()  # never reset (stats are): drives sparse logging

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"RedisConnector: KV caches for layers {missing} were not registered")
        self._kv = {name: kv_caches[name] for name in self.layout.layer_names}
        first = next(iter(self._kv.values()))
        self._block_shape = tuple(first.shape[1:])
        self._dtype = first.dtype
        self._device = first.device
        for name, t in self._kv.items():
            if tuple(t.shape[1:]) != self._block_shape or t.dtype != self._dtype:
                raise ValueError(f"RedisConnector: layer {name} has a different KV block shape")
        if self._block_shape[:2] != (self.layout.num_kv_heads, self.layout.block_size):
            raise ValueError(
                f"RedisConnector: unexpected per-layer KV view {tuple(first.shape)}; expected "
                f"[blocks, {self.layout.num_kv_heads}, {self.layout.block_size}, content]"
            )
        # One dry-run encode learns the exact value size, then staging is allocated once.
        probe = {name: t[0] for name, t in self._kv.items()}
        self._value_bytes = len(self.store.encode("0" * 32, probe)) + 64
        count = max(2, self.config.max_inflight_bytes // self._value_bytes)
        pin = self._device.type == "cuda"
        self._save_pool = StagingPool(self._value_bytes, count, pin_memory=pin)
        if pin:
            block_bytes = first[0].numel() * first.element_size() * len(self._kv)
            self._load_pool = StagingPool(block_bytes, 4, pin_memory=True)
            self._stream = torch.cuda.Stream(device=self._device)
        logger.info(
            "RedisConnector worker (tp rank %d): %d layers, block %s %s on %s, value %d bytes, "
            "%d staging buffers (%d MiB), store %s key pattern %s",
            self.tp_rank,
            len(self._kv),
            list(self._block_shape),
            self._dtype,
            self._device,
            self._value_bytes,
            count,
            count * self._value_bytes >> 20,
            self.store.safe_url,
            self.store.key_pattern(),
        )

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, meta: RedisConnectorMetadata) -> None:
        for spec in meta.loads:
            self._track(self._load_io.submit(self._load, spec))

    def _load(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        failed: list[int] = []
        loaded = nbytes = errors = 0
        try:
            if spec.consume:
                values = self.store.drop_select(spec.hashes, copy=False)
            else:
                values = self.store.select(spec.hashes, copy=False)
        except KVStoreError as exc:
            total = self._failures.add("redis")
            if total:
                logger.warning(
                    "request %s: loading from Redis failed (%d Redis errors so far): %s; "
                    "recomputing",
                    spec.req_id,
                    total,
                    exc,
                )
            values = [None] * len(spec.hashes)
            errors = 1
        try:
            for block_id, value in zip(spec.block_ids, values, strict=True):
                if value is None or not self._fits(value):
                    failed.append(block_id)
                    continue
                self._copy_in(block_id, value)  # synchronous: done when it returns
                loaded += 1
                nbytes += sum(t.numel() * t.element_size() for t in value.values())
        except Exception:  # never leave the request waiting forever
            logger.exception("request %s: copying loaded blocks failed; recomputing", spec.req_id)
            failed = list(spec.block_ids)
            loaded = 0
        with self._lock:
            self.stats.loads += 1
            self.stats.blocks_loaded += loaded
            self.stats.blocks_load_failed += len(failed)
            self.stats.bytes_loaded += nbytes
            self.stats.load_seconds += time.perf_counter() - t0
            self.stats.redis_errors += errors
            self._failed_block_ids.update(failed)
            self._finished_loads.add(spec.req_id)

    def _fits(self, value: Mapping[str, torch.Tensor]) -> bool:
        ok = set(value) == set(self._kv) and all(
            tuple(t.shape) == self._block_shape and t.dtype == self._dtype for t in value.values()
        )
        if not ok:
            logger.warning("a stored block does not match this instance's KV layout; ignoring it")
        return ok

    def _copy_in(self, block_id: int, value: Mapping[str, torch.Tensor]) -> None:
        if self._stream is None or self._load_pool is None:
            for name, dst in self._kv.items():
                dst[block_id].copy_(value[name])
            return
        bounce = self._load_pool.acquire()
        assert bounce is not None
        try:
            offset = 0
            staged = []
            for name, src in value.items():
                n = src.numel() * src.element_size()
                view = bounce[offset : offset + n].view(src.dtype).view(src.shape)
                view.copy_(src)
                staged.append((name, view))
                offset += n
            with torch.cuda.stream(self._stream):
                for name, view in staged:
                    self._kv[name][block_id].copy_(view, non_blocking=True)
            self._stream.synchronize()  # the bounce buffer is reused right after
        finally:
            self._load_pool.release(bounce)

    # ------------------------------------------------------------------ saves
    def wait_for_save(self, meta: RedisConnectorMetadata) -> None:
        """Copy this step's new full blocks into staging (bounded, no Redis I/O) and hand them
        to the writer threads; the forward path never waits on Redis."""
        for spec in meta.saves:
            self._stage_and_submit(spec)

    def _stage_and_submit(self, spec: SaveSpec) -> None:
        assert self._save_pool is not None
        staged: list[tuple[str, memoryview, torch.Tensor]] = []
        shed = 0
        for block_id, block_hash in zip(spec.block_ids, spec.hashes, strict=True):
            buf = self._save_pool.try_acquire()
            if buf is None:
                shed += 1
                continue
            tensors = {name: kv[block_id] for name, kv in self._kv.items()}
            staged.append((block_hash, self.store.encode(block_hash, tensors, out=buf), buf))
        if shed:
            with self._lock:
                self.stats.blocks_shed += shed
            total = self._failures.add("shed", shed)
            if total:
                logger.warning(
                    "request %s: %d block(s) not saved, staging full (%d shed so far; Redis is "
                    "slower than the model: raise max_inflight_bytes or speed up Redis)",
                    spec.req_id,
                    shed,
                    total,
                )
        if staged:
            self._track(self._save_io.submit(self._write, spec.req_id, staged))

    def _write(self, req_id: str, staged: list[tuple[str, memoryview, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        ok = True
        try:
            self.store.insert_encoded([(h, v) for h, v, _ in staged])
        except KVStoreError as exc:
            ok = False
            total = self._failures.add("redis")
            if total:
                logger.warning(
                    "request %s: saving %d block(s) failed (%d Redis errors so far): %s",
                    req_id,
                    len(staged),
                    total,
                    exc,
                )
        finally:
            assert self._save_pool is not None
            for _, _, buf in staged:
                self._save_pool.release(buf)
        with self._lock:
            self.stats.saves += 1
            if ok:
                self.stats.blocks_saved += len(staged)
                self.stats.bytes_saved += sum(len(v) for _, v, _ in staged)
            else:
                self.stats.blocks_save_failed += len(staged)
                self.stats.redis_errors += 1
            self.stats.save_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ completion
    def _track(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.discard(fut)
        exc = fut.exception()
        if exc is not None:
            logger.error("RedisConnector background task failed: %r", exc)

    def get_finished(self) -> set[str]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_stats(self) -> dict[str, Any]:
        with self._lock:
            return self.stats.take()

    def shutdown_pending(self, timeout_s: float) -> int:
        """Wait (bounded) for running transfers; returns how many are still running."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = wait(pending, timeout=timeout_s)
        return len(not_done)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        still_running = self.shutdown_pending(timeout_s)
        if still_running:
            logger.warning(
                "RedisConnector: %d transfer(s) still running at shutdown", still_running
            )
        self._load_io.shutdown(wait=False, cancel_futures=True)
        self._save_io.shutdown(wait=False, cancel_futures=True)
        self.store.close()
