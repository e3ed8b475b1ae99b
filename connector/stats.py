"""The connector's metrics, carried to vLLM's logs and ``/metrics`` by its KV-connector hooks.

Both sides return ``RedisConnectorStats`` (workers each step from ``get_kv_connector_stats``,
the scheduler side after each step); vLLM aggregates them in the frontend, logs ``reduce()``
periodically and feeds ``RedisPromMetrics.observe``, which exports ``vllm:redis_kv_*``.

Latencies are histograms (one observation per load, save or lookup), never float counters:
vLLM's offline metrics reader truncates counter values to integers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# stats key -> (Prometheus name, help text)
COUNTERS: dict[str, tuple[str, str]] = {
    "blocks_loaded": (
        "vllm:redis_kv_blocks_loaded",
        "KV blocks loaded from Redis and used (a load's blocks before its first failed one; "
        "once per request, whatever the TP size)",
    ),
    "tokens_loaded": (
        "vllm:redis_kv_tokens_loaded",
        "Prompt tokens whose KV was loaded from Redis (external hits actually delivered)",
    ),
    "blocks_load_failed": (
        "vllm:redis_kv_blocks_load_failed",
        "KV blocks announced as hits that were recomputed: those that could not be loaded "
        "(missing, corrupt, Redis error, deadline) and every block after them",
    ),
    "tokens_load_failed": (
        "vllm:redis_kv_tokens_load_failed",
        "Prompt tokens counted by vLLM as external hits whose load then failed (recomputed)",
    ),
    "blocks_saved": (
        "vllm:redis_kv_blocks_saved",
        "KV block values written to Redis: one per block and slice of the KV heads",
    ),
    "blocks_save_failed": (
        "vllm:redis_kv_blocks_save_failed",
        "KV block values whose write failed (one per block and slice of the KV heads)",
    ),
    "blocks_shed": (
        "vllm:redis_kv_blocks_shed",
        "KV block values not saved because staging was full or Redis was unavailable",
    ),
    "blocks_save_skipped": (
        "vllm:redis_kv_blocks_save_skipped",
        "Prompt blocks the save policy did not write (save_policy: second_sight writes a "
        "prompt's head until the prompt is seen again; marked only marked requests)",
    ),
    "bytes_loaded": (
        "vllm:redis_kv_bytes_loaded",
        "Bytes of KV loaded from Redis (every TP rank's)",
    ),
    "bytes_saved": ("vllm:redis_kv_bytes_saved", "Bytes of KV written to Redis"),
    "loads": (
        "vllm:redis_kv_loads",
        "Loads (one per request, counted once every TP rank has finished it)",
    ),
    "loads_expired": (
        "vllm:redis_kv_loads_expired",
        "Loads cut off by the request's deadline, per TP rank (their blocks were recomputed)",
    ),
    "loads_cancelled": (
        "vllm:redis_kv_loads_cancelled",
        "Loads cancelled because vLLM put the KV cache to sleep, per TP rank (recomputed)",
    ),
    "saves": (
        "vllm:redis_kv_saves",
        "Save jobs (one per request, step and slice of the KV heads written)",
    ),
    "handoffs_published": (
        "vllm:redis_kv_handoffs_published",
        "Producer commit records written (one per request and slice of the KV heads)",
    ),
    "handoffs_lost": (
        "vllm:redis_kv_handoffs_lost",
        "Loads of a handoff that another request had claimed first (a retried request); recomputed",
    ),
    "lookups": ("vllm:redis_kv_lookups", "Lookups of a prompt's blocks in Redis"),
    "requests_given_up": (
        "vllm:redis_kv_requests_given_up",
        "Requests that stopped waiting for Redis (deadline, breaker open, handoff taken) and "
        "recomputed",
    ),
    "transfer_params_ignored": (
        "vllm:redis_kv_transfer_params_ignored",
        "Producer kv_transfer_params that did not match this instance (namespace, block size, "
        "prompt) and were ignored",
    ),
    "redis_errors": ("vllm:redis_kv_redis_errors", "Redis operations that raised an error"),
    "internal_errors": (
        "vllm:redis_kv_internal_errors",
        "Unexpected exceptions in the connector's own code (bugs; logged with a traceback): "
        "the request it hit recomputed",
    ),
    "values_invalid": (
        "vllm:redis_kv_values_invalid",
        "Values read from Redis that were not a valid block of this layout (corrupt, truncated, "
        "oversize, another layout, unauthenticated): counted misses, recomputed",
    ),
    "values_unauthenticated": (
        "vllm:redis_kv_values_unauthenticated",
        "Of those, values that failed the namespace secret's MAC check (forged, unsigned, or "
        "signed while this instance has no secret): someone without the secret wrote them",
    ),
    "resets": (
        "vllm:redis_kv_resets",
        "Namespace resets this instance made (reset_prefix_cache with the connector): every "
        "block saved before is never loaded again",
    ),
    "breaker_opens": (
        "vllm:redis_kv_breaker_opens",
        "Times the circuit breaker stopped traffic to an unavailable Redis",
    ),
    # the load policy's decisions (load_policy.py), one per request with a hit in Redis
    "chose_async": (
        "vllm:redis_kv_chose_async",
        "Hits served by loading every block before the request runs (the load policy's choice, "
        "or pinned)",
    ),
    "chose_split": (
        "vllm:redis_kv_chose_split",
        "Hits served by loading their first blocks layer by layer while the forward pass "
        "computes the rest",
    ),
    "chose_recompute": (
        "vllm:redis_kv_chose_recompute",
        "Hits not loaded at all: predicted slower than computing them (or pinned)",
    ),
    "splits_for_the_queue": (
        "vllm:redis_kv_splits_for_the_queue",
        "Of the splits chosen, those taken for the requests queued behind them: recomputing "
        "looked as soon, counting only the requests the engine holds",
    ),
    "splits_after_a_pass": (
        "vllm:redis_kv_splits_after_a_pass",
        "Hits whose split waited one step for a pass free of another split (one split a "
        "pass), predicted sooner than loading or recomputing now; decided again then",
    ),
    "tokens_recompute_chosen": (
        "vllm:redis_kv_tokens_recompute_chosen",
        "Prompt tokens found in Redis that the load policy chose to compute instead",
    ),
    "tainted_blocks_rejected": (
        "vllm:redis_kv_tainted_blocks_rejected",
        "Blocks a failed split left wrong in vLLM's prefix cache (its request gone before "
        "computing them again) that another request was about to run on: recomputed instead",
    ),
    "split_loads_failed": (
        "vllm:redis_kv_split_loads_failed",
        "Split loads whose bands did not all land in their forward pass (their blocks were "
        "recomputed), per TP rank",
    ),
    "split_loads_unwaited": (
        "vllm:redis_kv_split_loads_unwaited",
        "Split loads whose forward pass ran layers without waiting for their bands (a full "
        "CUDA graph?): recomputed; after 2, the engine chooses no more splits",
    ),
    "load_probes": (
        "vllm:redis_kv_load_probes",
        "Background reads of a few stored blocks that measure the store for the load policy "
        "(nothing is written into the KV cache), per TP rank",
    ),
}
# stats key -> (Prometheus name, help text, buckets in seconds)
_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
HISTOGRAMS: dict[str, tuple[str, str, list[float]]] = {
    "load_seconds": (
        "vllm:redis_kv_load_seconds",
        "Time to load one request's blocks (fetch, verify, copy into the KV cache)",
        _LATENCY_BUCKETS,
    ),
    "save_seconds": (
        "vllm:redis_kv_save_seconds",
        "Time to write one save job's blocks (hash, compress, SET)",
        _LATENCY_BUCKETS,
    ),
    "lookup_seconds": (
        "vllm:redis_kv_lookup_seconds",
        "Time of one lookup round trip (present blocks, producer commit record)",
        _LATENCY_BUCKETS,
    ),
    "handoff_wait_seconds": (
        "vllm:redis_kv_handoff_wait_seconds",
        "Time a consumer waited for the producer's commit record",
        _LATENCY_BUCKETS,
    ),
    "split_stall_seconds": (
        "vllm:redis_kv_split_stall_seconds",
        "Time a forward pass waited for a split load's layers (one observation per split)",
        _LATENCY_BUCKETS,
    ),
    "predicted_gain_seconds": (
        "vllm:redis_kv_predicted_gain_seconds",
        "Time to first token the load policy predicted its choice saves against recomputing "
        "the hit (one observation per measured choice; 0 when it recomputes)",
        _LATENCY_BUCKETS,
    ),
}
GAUGES: dict[str, tuple[str, str]] = {
    "breaker_open": (
        "vllm:redis_kv_breaker_open",
        "1 while the scheduler's circuit breaker is open (Redis skipped, requests recompute)",
    ),
    # the figures the load policy decides from (figures.py), as last measured
    "policy_load_bytes_per_second": (
        "vllm:redis_kv_policy_load_bytes_per_second",
        "Load bandwidth one rank gets from Redis into its KV cache, fitted over recent loads",
    ),
    "policy_load_overhead_seconds": (
        "vllm:redis_kv_policy_load_overhead_seconds",
        "A load's fixed cost (round trips, claims), fitted over recent loads",
    ),
    "policy_split_bytes_per_second": (
        "vllm:redis_kv_policy_split_bytes_per_second",
        "Bandwidth one rank gets from Redis reading split loads band by band, fitted over "
        "recent splits and band probes (reported only where auto may split)",
    ),
    "policy_step_seconds": (
        "vllm:redis_kv_policy_step_seconds",
        "A forward pass's fixed cost, fitted over recent forward passes",
    ),
    "policy_token_seconds": (
        "vllm:redis_kv_policy_token_seconds",
        "Forward time per token computed, fitted over recent forward passes",
    ),
    "policy_attention_seconds": (
        "vllm:redis_kv_policy_attention_seconds",
        "Forward time per token and context token it attends to, fitted over recent passes",
    ),
}
# samples the worker sends the scheduler side's load policy (figures.py) with its stats:
# lists, concatenated over TP ranks, never exported
SAMPLES = (
    "load_samples",
    "load_bounds",
    "split_samples",
    "split_bounds",
    "split_unwaited",
    "probe_missing",
    "probe_done",
    "compute_samples",
    "rank_block_bytes",
    "split_bands",
)


class StatsBuffer:
    """Counters and latency observations since the last ``take()``, safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        self._timed: set[str] = set()  # keys of ``timed_sample``

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                if v:
                    self._data[k] = self._data.get(k, 0) + v

    def observe(self, key: str, seconds: float) -> None:
        with self._lock:
            self._data.setdefault(key, []).append(seconds)

    def sample(self, key: str, *values: float) -> None:
        """One sample for the load policy's figures (a key of ``SAMPLES``)."""
        with self._lock:
            self._data.setdefault(key, []).append(list(values))

    def timed_sample(self, key: str, *values: float) -> None:
        """One sample of a figure that ages (a key of ``SAMPLES``): ``take`` adds how long ago
        it was recorded, so samples and upper bounds keep their order and age however long
        they waited here (an idle engine's probes wait until its next step)."""
        with self._lock:
            self._data.setdefault(key, []).append([*values, -time.monotonic()])
            self._timed.add(key)

    def set(self, key: str, value: float) -> None:
        with self._lock:
            self._data[key] = value

    def take(self) -> dict[str, Any]:
        with self._lock:
            data, self._data = self._data, {}
            timed, self._timed = self._timed, set()
        now = time.monotonic()
        for key in timed:
            for entry in data.get(key, ()):
                entry[-1] = max(0.0, now + entry[-1])  # (recorded as minus the time)
        return data


@dataclass
class RedisConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if k in HISTOGRAMS or k in SAMPLES:
                self.data[k] = list(self.data.get(k, [])) + list(v)
            elif k in GAUGES:
                self.data[k] = v  # the latest value (one side sets each)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if k in SAMPLES:
                continue
            if k in HISTOGRAMS:
                if v:
                    out[f"avg_{k.removesuffix('_seconds')}_ms"] = round(1000 * sum(v) / len(v), 2)
            elif v or k in GAUGES:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not self.data


class RedisPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = per_engine_labelvalues
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per_engine
            )
            for key, (name, doc) in COUNTERS.items()
        }
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(  # type: ignore[call-arg]  # vLLM types the classes loosely
                    name=name, documentation=doc, labelnames=labelnames, buckets=buckets
                ),
                per_engine,
            )
            for key, (name, doc, buckets) in HISTOGRAMS.items()
        }
        self._gauges = {
            key: create_metric_per_engine(
                self._gauge_cls(  # type: ignore[call-arg]  # vLLM types the classes loosely
                    name=name,
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine,
            )
            for key, (name, doc) in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)  # type: ignore[union-attr]
            elif key in self._histograms:
                hist = self._histograms[key][engine_idx]
                for seconds in value:
                    hist.observe(seconds)  # type: ignore[union-attr]
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)  # type: ignore[union-attr]
