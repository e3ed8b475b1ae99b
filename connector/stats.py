"""The connector's counters, carried to vLLM's logs and ``/metrics`` by its KV-connector hooks.

Workers return ``RedisConnectorStats`` each step (``get_kv_connector_stats``); vLLM aggregates
them in the frontend, logs ``reduce()`` periodically and feeds ``RedisPromMetrics.observe``,
which exports ``vllm:redis_kv_*`` Prometheus counters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# stats key -> (Prometheus name, help text)
COUNTERS: dict[str, tuple[str, str]] = {
    "blocks_loaded": ("vllm:redis_kv_blocks_loaded", "KV blocks loaded from Redis"),
    "blocks_load_failed": (
        "vllm:redis_kv_blocks_load_failed",
        "KV blocks that could not be loaded (missing, corrupt, Redis error) and were recomputed",
    ),
    "blocks_saved": ("vllm:redis_kv_blocks_saved", "KV blocks written to Redis"),
    "blocks_save_failed": ("vllm:redis_kv_blocks_save_failed", "KV block writes that failed"),
    "blocks_shed": (
        "vllm:redis_kv_blocks_shed",
        "KV blocks not saved because staging was full (Redis slower than the model)",
    ),
    "bytes_loaded": ("vllm:redis_kv_bytes_loaded", "Bytes of KV loaded from Redis"),
    "bytes_saved": ("vllm:redis_kv_bytes_saved", "Bytes of KV written to Redis"),
    "load_seconds": ("vllm:redis_kv_load_seconds", "Seconds spent loading KV from Redis"),
    "save_seconds": ("vllm:redis_kv_save_seconds", "Seconds spent writing KV to Redis"),
    "loads": ("vllm:redis_kv_loads", "Load jobs (one per request and step)"),
    "saves": ("vllm:redis_kv_saves", "Save jobs (one per request and step)"),
    "redis_errors": ("vllm:redis_kv_redis_errors", "Redis operations that raised an error"),
}


class FailureCounts:
    """Totals of failures by kind, and which of them to log: a line when a total reaches 1, 2,
    4, 8, ... so an outage logs a handful of lines instead of one per request or block."""

    def __init__(self) -> None:
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, kind: str, n: int = 1) -> int | None:
        """Count ``n`` more; returns the new total when it should be logged, else None."""
        with self._lock:
            old = self._totals.get(kind, 0)
            new = self._totals[kind] = old + n
        return new if new.bit_length() != old.bit_length() else None

    def __getitem__(self, kind: str) -> int:
        with self._lock:
            return self._totals.get(kind, 0)


@dataclass
class RedisConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if v}
        if self.data.get("loads"):
            out["avg_load_ms"] = round(1000 * self.data["load_seconds"] / self.data["loads"], 2)
        if self.data.get("saves"):
            out["avg_save_ms"] = round(1000 * self.data["save_seconds"] / self.data["saves"], 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class RedisPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, (name, doc) in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)  # type: ignore[union-attr]
