"""The KV layout both sides agree on, from vLLM's config alone, and its fingerprint: exactly what
changes a stored block's bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore import layout_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The stored bytes of a block: the logical per-layer block [num_kv_heads, block_size, content]
# of every layer, in layer order. Bump it only when that changes; never with vLLM's version, so
# instances on different vLLM releases with the same layout share blocks.
LAYOUT_VERSION = "logical-HNC/1"


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
