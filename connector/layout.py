"""The KV layout both sides agree on, from vLLM's config alone, and its fingerprint: exactly what
changes a stored block's bytes.

A model may have several KV-cache groups (vLLM's hybrid memory allocator): full attention and
sliding-window layers keep separate block tables. Each group's block at a chain position is its
own value, under the position's hash with the group appended (``<hash>.g1``), so a load reads
only the blocks vLLM allocated for it: a sliding-window group gets real blocks only for the
window before the hit's end (the rest are vLLM's null block, which is never read or written).
A model with one group keeps the keys and fingerprint it always had."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore import layout_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The stored bytes of a block: the logical per-layer block [num_kv_heads, block_size, content]
# of every layer, in layer order. Bump it only when that changes; never with vLLM's version, so
# instances on different vLLM releases with the same layout share blocks.
LAYOUT_VERSION = "logical-HNC/1"


# vLLM's null block: a placeholder in a group's block table for positions that group does not
# keep (a sliding window's past). Never read from, never written to.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: layers sharing one block table, stored as one value per block."""

    index: int  # its place in vLLM's ``kv_cache_groups``: block ids come in this order
    kind: str  # "full", "sliding_window=<tokens>", "chunked_local=<tokens>"
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: str

    def holds(self, block_id: int) -> bool:
        """Whether ``block_id`` is a block of this group's own: a windowed group's block table
        holds vLLM's null block where the window has passed (never read, never written; a
        full-attention group never holds it)."""
        return self.kind == "full" or block_id != NULL_BLOCK_ID

    def first_needed(self, blocks: int, block_size: int) -> int:
        """The first chain position a hit of ``blocks`` leading blocks needs from this group:
        vLLM gives the positions before it the null block (its ``get_num_skipped_tokens``;
        without speculative decoding's extra retained tokens, which only make a load fail
        and recompute)."""
        kind, _, size = self.kind.partition("=")
        tokens = blocks * block_size
        if kind == "sliding_window":
            return max(0, tokens - int(size) + 1) // block_size
        if kind == "chunked_local":
            return tokens // int(size) * int(size) // block_size
        return 0

    @property
    def windowed(self) -> bool:
        """Its block table holds the null block where tokens no longer count."""
        return self.kind.startswith(("sliding_window=", "chunked_local="))


class UnsupportedModelError(ValueError):
    """The model has a KV-cache group this connector cannot store (yet)."""


def _group_kind(spec: object) -> str | None:
    """What a group keeps, or None for a group the connector cannot store. A group's block at
    chain position p must hold the KV of tokens [p * block_size, (p + 1) * block_size)."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    if not isinstance(spec, AttentionSpec) or not getattr(spec, "prefix_cacheable", True):
        return None  # state (Mamba, GDN) or a ring buffer: blocks are not token positions
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window={int(spec.sliding_window)}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked_local={int(spec.attention_chunk_size)}"
    if isinstance(spec, FullAttentionSpec):
        return "full"  # (with the hybrid allocator off, window layers keep every block too)
    return type(spec).__name__


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
    # every KV-cache group; () means one group of all ``layer_names`` (what the fields above say)
    groups: tuple[KVGroup, ...] = ()
    # vLLM's KV-cache groups, stored or not (a group vLLM rebuilds after a load is not)
    engine_groups: int = 1

    def __post_init__(self) -> None:
        if not self.groups:
            only = KVGroup(
                0, "full", self.layer_names, self.num_kv_heads, self.head_size, self.dtype
            )
            object.__setattr__(self, "groups", (only,))

    @property
    def hybrid(self) -> bool:
        """Several KV-cache groups: keys carry the group, loads fail per request."""
        return len(self.groups) > 1

    def group_key(self, block_hash: str, group: KVGroup) -> str:
        """The name of ``group``'s block at the position ``block_hash`` names."""
        return f"{block_hash}.g{group.index}" if self.hybrid else block_hash

    @property
    def fails_per_request(self) -> bool:
        """A failed load fails its whole request: block ids are unique only within a group, and
        cutting a windowed group's hit short at a failed block would leave the window before
        it on null blocks."""
        return self.engine_groups > 1 or any(g.windowed for g in self.groups)

    def usable_prefix(self, present: Callable[[int, int], bool], start: int, end: int) -> int:
        """The longest hit (in leading blocks, ``start`` at least: those are vLLM's own) whose
        every needed block is present: ``present(g, p)`` says whether group ``g`` (an index
        into ``groups``) has position ``p``. A full group needs every position, a windowed
        group only the window before the hit's end."""
        for g, group in enumerate(self.groups):
            if not group.windowed:  # every position up to the hit's end
                p = start
                while p < end and present(g, p):
                    p += 1
                end = p
        windowed = [(g, group) for g, group in enumerate(self.groups) if group.windowed]
        for n in range(end, start, -1):
            if all(
                present(g, p)
                for g, group in windowed
                for p in range(max(start, group.first_needed(n, self.block_size)), n)
            ):
                return n
        return start

    def keys_of(self, hashes: list[str]) -> list[str]:
        """Every group's key at each position, position by position: a chain's leading keys
        present, divided by ``len(groups)``, are its leading positions present in every group."""
        return [self.group_key(h, g) for h in hashes for g in self.groups]

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None
    ) -> KVLayout:
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("RedisConnector does not support pipeline parallelism yet")
        groups = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(group, "enable_kv_transfer", True):
                continue  # vLLM rebuilds it from another group after a load
            spec: Any = group.kv_cache_spec  # an attention spec, once _group_kind says so
            kind = _group_kind(spec)
            if kind is None:
                raise UnsupportedModelError(
                    f"RedisConnector cannot store KV-cache group {index} "
                    f"({type(spec).__name__}, layers {list(group.layer_names)[:3]}...): "
                    "state (Mamba, gated delta-net) and other non-attention groups are not "
                    "supported yet. Serve this model without --kv-transfer-config."
                )
            groups.append(
                KVGroup(
                    index=index,
                    kind=kind,
                    layer_names=tuple(group.layer_names),
                    num_kv_heads=int(spec.num_kv_heads),
                    head_size=int(spec.head_size),
                    dtype=str(spec.dtype).replace("torch.", ""),
                )
            )
        if not groups:
            raise UnsupportedModelError("RedisConnector: this model has no KV cache to store")
        block_sizes = {
            int(kv_cache_config.kv_cache_groups[g.index].kv_cache_spec.block_size) for g in groups
        }
        if len(block_sizes) != 1:
            raise UnsupportedModelError(
                f"RedisConnector needs one block size for every KV-cache group, got "
                f"{sorted(block_sizes)}"
            )
        first = groups[0]
        model_config = vllm_config.model_config
        return cls(
            model_id=model_id or str(model_config.model),
            block_size=block_sizes.pop(),
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            layer_names=tuple(name for g in groups for name in g.layer_names),
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            revision=getattr(model_config, "revision", None) or None,
            quantization=getattr(model_config, "quantization", None) or None,
            kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
            hf_overrides=describe_overrides(getattr(model_config, "hf_overrides", None)),
            groups=tuple(groups),
            engine_groups=len(kv_cache_config.kv_cache_groups),
        )

    def fingerprint(self, tp_rank: int) -> str:
        fields: dict[str, object] = {
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
        if self.hybrid:  # a one-group model keeps the fingerprint it always had
            fields["groups"] = [
                [g.index, g.kind, list(g.layer_names), g.num_kv_heads, g.head_size, g.dtype]
                for g in self.groups
            ]
        return layout_fingerprint(fields)

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
