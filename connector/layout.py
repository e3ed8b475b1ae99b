"""The KV layout both sides agree on, from vLLM's config alone, and its fingerprint: exactly what
changes a stored block's bytes.

A model may have several KV-cache groups (vLLM's hybrid memory allocator): full attention and
sliding-window layers keep separate block tables. Each group's block at a chain position is its
own value, under the position's name with the group appended (``<hash>.g1``, built by
``kvstore.values.keys.block_name``; ``ChainNames`` holds a chain's), so a load reads
only the blocks vLLM allocated for it: a sliding-window group gets real blocks only for the
window before the hit's end (the rest are vLLM's null block, which is never read or written).
A model with one group keeps the keys and fingerprint it always had.

State groups (Mamba, gated delta-net; vLLM's "align" cache mode): a state group's block at
position ``p`` is the layer's recurrent state after exactly ``(p + 1) * block_size`` tokens, and
only the states vLLM commits at chunk ends exist. Such a block is saved only when vLLM offers it
(``boundary_state_offloads``, never read from the block table by position), and a hit of ``n``
blocks needs every full-attention block before ``n`` and each state group's block at ``n - 1``
alone -- a windowed group whose window is one block. A state is cut by TP rank, not by KV head,
so a model with state groups stores every group rank by rank (``store_tp_size`` = TP size).

Tensor parallelism: the stored unit is a *head slice*. The model's KV heads are cut into
``store_tp_size`` equal slices (default: this instance's TP size, at most the number of KV
heads), and slice ``j`` of every block is one value under its own fingerprint (the fingerprint a
rank of a TP ``store_tp_size`` instance always had). A rank writes the slices that lie within its
heads (several when ``store_tp_size`` is a multiple of its TP size) and reads the slices that
cover its heads, taking only its part of a larger one. So instances of different TP sizes that
set the same ``store_tp_size`` share blocks, and KV heads that several ranks hold -- GQA with
more ranks than KV heads, and MLA's one latent -- are stored once, by the first of those ranks.
Left unset, ``store_tp_size`` shares nothing across TP sizes (``tp_scope``): KV computed at
another TP size is not bit-identical. Set, it shares only with instances that set it too (a
``tp_shared`` field in the fingerprint and the handoff params): an instance at TP
``store_tp_size`` that left it unset keeps its own keys and never loads another size's KV.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.group_kinds import FULL, Family, GroupKind, names_carry_groups
from connector.presence import usable_prefix
from connector.versions import SUPPORTED_VLLM_WORDS
from kvstore import layout_fingerprint
from kvstore.values.keys import BlockName, block_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The stored bytes of a block: the logical per-layer block [num_kv_heads, block_size, content]
# of every layer, in layer order. Bump it only when that changes; never with vLLM's version, so
# instances on different vLLM releases with the same layout share blocks.
LAYOUT_VERSION = "logical-HNC/1"


# vLLM's null block: a placeholder in a group's block table for positions that group does not
# keep (a sliding window's past, a state group's skipped states). Never read from, never written
# to.
NULL_BLOCK_ID = 0
# A position a save or load names no block of a group at (a state saved alone, or the
# attention blocks of a step in a state group's place): skipped like the null block.
NO_BLOCK = -1


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: layers sharing one block table, stored as one value per block."""

    index: int  # its place in vLLM's ``kv_cache_groups``: block ids come in this order
    kind: GroupKind
    layer_names: tuple[str, ...]
    # the per-layer block vLLM presents, [num_kv_heads, block_size, head_size] of ``dtype``;
    # a state group's is [1, 1, state bytes] of int8
    num_kv_heads: int
    head_size: int
    dtype: str
    # a state group's states, what changes their bytes: shapes and dtypes, in the order the
    # layer packs them into its page (a conv state's orientation is in its shape)
    state: str = ""

    def holds(self, block_id: int) -> bool:
        """Whether ``block_id`` is a block of this group's own: a windowed or state group's
        block table holds vLLM's null block where the window has passed or no state is kept
        (never read, never written; a full-attention group never holds it), and a spec may
        name no block of a group at a position (``NO_BLOCK``)."""
        if block_id == NO_BLOCK:
            return False
        return self.kind.is_full or block_id != NULL_BLOCK_ID

    @property
    def is_state(self) -> bool:
        """A Mamba / gated delta-net group: one recurrent state per block, not tokens' KV."""
        return self.kind.is_state

    @property
    def block_tokens(self) -> int | None:
        """The second dimension of its per-layer block: None for the layout's block size, 1
        for a state group (one state per block)."""
        return 1 if self.is_state else None

    def first_needed(self, blocks: int, block_size: int) -> int:
        """The first chain position a hit of ``blocks`` leading blocks needs from this group
        (``GroupKind.first_needed``; without speculative decoding's extra retained tokens,
        which only make a load fail and recompute)."""
        return self.kind.first_needed(blocks, block_size)

    @property
    def windowed(self) -> bool:
        """Its block table holds the null block where tokens no longer count (a state group:
        every block but the hit's last)."""
        return self.kind.windowed


@dataclass(frozen=True)
class HeadSlice:
    """One stored head slice as a worker rank sees it: slice ``index`` holds ``value_heads``
    KV heads of each group's layers; this rank's cache holds heads ``cache_heads`` (a range of
    its own) of them, and its rows ``value_range`` of the slice go there."""

    index: int
    value_heads: int
    value_range: tuple[int, int]  # which of the slice's heads this rank holds
    cache_heads: tuple[int, int]  # where they are among this rank's heads

    @property
    def whole(self) -> bool:
        """The value is exactly these cache heads (a slice this rank could write)."""
        return self.value_range == (0, self.value_heads)


@dataclass(frozen=True)
class ChainNames:
    """A chain as the store names its blocks (``KVLayout.chain_names``): the chain hashes, the
    namespace's generation they are named in, and each stored KV-cache group's block name at
    every position -- made once per request, read by its lookups, loads and saves."""

    chain: list[str]
    generation: int
    names: list[list[BlockName]]  # per group (the layout's order), per position

    def __len__(self) -> int:
        return len(self.chain)

    def span(self, start: int, end: int) -> list[list[BlockName]]:
        """Each group's names of positions ``[start, end)``: what a load or save spec carries,
        aligned with its block ids."""
        return [group[start:end] for group in self.names]

    def first_group(self, start: int, end: int) -> list[BlockName]:
        """The first group's names of positions ``[start, end)``: one name per position, where
        one stands for it (the loads under way, a probe's reads, the save policy's heads)."""
        return self.names[0][start:end]

    def by_position(self, start: int = 0, end: int | None = None) -> list[BlockName]:
        """The names of positions ``[start, end)``, position by position, every group's at
        each: what a lookup asks (its answer's leading names, divided by the groups, are
        leading positions)."""
        end = len(self.chain) if end is None else end
        return [group[p] for p in range(start, end) for group in self.names]


class UnsupportedModelError(ValueError):
    """The model has a KV-cache group this connector cannot store (yet)."""


def _group_kind(spec: object) -> GroupKind | None:
    """What a group keeps, or None for a group the connector cannot store. An attention
    group's block at chain position p must hold the KV of tokens [p * block_size, (p + 1) *
    block_size); a state group's, the state after (p + 1) * block_size tokens."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        return GroupKind(Family.STATE, detail=_mamba_type(spec))
    if not isinstance(spec, AttentionSpec) or not getattr(spec, "prefix_cacheable", True):
        return None  # a ring buffer or another kind of state: blocks are not token positions
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind(Family.SLIDING_WINDOW, tokens=int(spec.sliding_window))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind(Family.CHUNKED_LOCAL, tokens=int(spec.attention_chunk_size))
    if isinstance(spec, FullAttentionSpec):
        return FULL  # (with the hybrid allocator off, window layers keep every block too)
    return GroupKind(Family.OTHER, detail=type(spec).__name__)


def _mamba_type(spec: Any) -> str:
    """The state's kind by vLLM's enum name ("GDN_ATTN", "MAMBA2", ...), not its value (a class
    path that may move between releases)."""
    kind = getattr(spec, "mamba_type", "MAMBA2")
    return str(getattr(kind, "name", kind))


def _state_group(index: int, names: tuple[str, ...], spec: Any) -> KVGroup:
    """A Mamba / gated delta-net group, or UnsupportedModelError saying what to change: its
    states must be vLLM's align-mode snapshots (one per block boundary), with no speculative
    scratch states in its pages."""
    where = f"KV-cache group {index} ({_mamba_type(spec)} state, layers {list(names)[:3]}...)"
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedModelError(
            f"RedisConnector stores {where} only in vLLM's 'align' Mamba cache mode (states at "
            f"block boundaries), not {mode!r}: keep prefix caching on (the default) or set "
            "--mamba-cache-mode align, or serve without --kv-transfer-config."
        )
    from vllm.v1.core.sched.output import SchedulerOutput

    if "kv_connector_block_state" not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
        raise UnsupportedModelError(
            f"RedisConnector cannot store {where}: this vLLM does not tell a connector which "
            "block holds each committed state (SchedulerOutput.kv_connector_block_state). "
            f"Serve it without --kv-transfer-config, or on vLLM {SUPPORTED_VLLM_WORDS}."
        )
    if int(getattr(spec, "num_speculative_blocks", 0)):
        raise UnsupportedModelError(
            f"RedisConnector cannot store {where} with speculative decoding (its pages hold "
            "scratch states that move in place): serve without --speculative-config, or "
            "without --kv-transfer-config."
        )
    shapes = [list(map(int, shape)) for shape in spec.shapes]
    dtypes = [str(d).replace("torch.", "") for d in spec.dtypes]
    return KVGroup(
        index=index,
        kind=GroupKind(Family.STATE, detail=_mamba_type(spec)),
        layer_names=names,
        num_kv_heads=1,
        head_size=int(spec.state_content_size_bytes),
        dtype="int8",
        state=json.dumps({"shapes": shapes, "dtypes": dtypes}, sort_keys=True),
    )


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
    # the model's KV heads over every rank (MLA: its one latent); 0: num_kv_heads * tp_size
    total_kv_heads: int = 0
    # how many head slices a block is stored as (see the module docstring); 0: the default,
    # min(tp_size, total_kv_heads)
    store_tp_size: int = 0
    # store_tp_size was set (not the default): instances of other TP sizes that set it too
    # read these blocks, and only they (the fingerprint says so). Left unset, an instance's
    # blocks are its own TP size's: KV computed at another TP size differs in the last bits
    # (other partial sums), so loading it would not answer as a connector-less server of this
    # size does.
    # (None: whether store_tp_size was given; an init field, so dataclasses.replace keeps it)
    tp_shared: bool | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            only = KVGroup(0, FULL, self.layer_names, self.num_kv_heads, self.head_size, self.dtype)
            object.__setattr__(self, "groups", (only,))
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads * self.tp_size)
        if self.tp_shared is None:
            object.__setattr__(self, "tp_shared", bool(self.store_tp_size))
        if not self.store_tp_size:
            object.__setattr__(self, "store_tp_size", min(self.tp_size, self.total_kv_heads))
        self._check_slices()

    @property
    def tp_scope(self) -> int | None:
        """The TP size this instance's blocks are kept apart for (in the fingerprint and the
        handoff params), or None when the slices alone say so: ``store_tp_size`` was set, or
        it is this TP size (the keys a rank always had)."""
        return None if self.tp_shared or self.tp_size == self.store_tp_size else self.tp_size

    def _check_slices(self) -> None:
        h, t, s = self.total_kv_heads, self.tp_size, self.store_tp_size
        if h % min(t, h) or (t > h and t % h):
            raise UnsupportedModelError(
                f"{h} KV heads cannot be spread over {t} tensor-parallel ranks evenly"
            )
        if self.num_kv_heads * self.ranks_with_distinct_heads != h:
            raise UnsupportedModelError(
                f"each rank holds {self.num_kv_heads} of {h} KV heads at TP {t}: expected "
                f"{h // min(t, h)}"
            )
        if h % s:
            raise UnsupportedModelError(
                f"store_tp_size {s} must divide the model's {h} KV heads"
                + (" (an MLA model's latent is one: use 1)" if h == 1 else "")
            )
        unit = math.lcm(s, self.ranks_with_distinct_heads)
        for g in self.groups:
            if g.num_kv_heads * self.ranks_with_distinct_heads % unit:
                raise UnsupportedModelError(
                    f"KV-cache group {g.index} has {g.num_kv_heads} KV heads per rank: they "
                    f"cannot be cut into {s} slices at TP {t}"
                )

    @property
    def ranks_with_distinct_heads(self) -> int:
        """How many ranks hold different heads: TP size, or the KV heads when ranks outnumber
        them (vLLM then gives consecutive ranks the same head)."""
        return min(self.tp_size, self.total_kv_heads)

    @property
    def can_write_slices(self) -> bool:
        """Every stored slice lies within one rank's heads, so some rank can write it."""
        return self.store_tp_size % self.ranks_with_distinct_heads == 0

    def _rank_slot(self, tp_rank: int) -> int:
        """Which of the ``ranks_with_distinct_heads`` head ranges ``tp_rank`` holds."""
        return tp_rank // (self.tp_size // self.ranks_with_distinct_heads)

    def slices_read(self, tp_rank: int, rank_heads: int | None = None) -> list[HeadSlice]:
        """The slices covering ``tp_rank``'s heads, with which part of each it holds, in heads
        of a group whose ranks hold ``rank_heads`` each (default: ``num_kv_heads``)."""
        s, d = self.store_tp_size, self.ranks_with_distinct_heads
        per_unit = (rank_heads or self.num_kv_heads) * d // math.lcm(s, d)
        width, own = (math.lcm(s, d) // n * per_unit for n in (s, d))  # in heads
        first = self._rank_slot(tp_rank) * own
        out = []
        for j in range(s):
            lo = j * width
            a, b = max(lo, first), min(lo + width, first + own)
            if a < b:
                out.append(HeadSlice(j, width, (a - lo, b - lo), (a - first, b - first)))
        return out

    def slices_written(self, tp_rank: int, rank_heads: int | None = None) -> list[HeadSlice]:
        """The slices ``tp_rank`` writes: those within its heads, and only on the first of
        the ranks holding the same heads (replicated KV heads, MLA's latent)."""
        if not self.can_write_slices or tp_rank % (self.tp_size // self.ranks_with_distinct_heads):
            return []
        return [sl for sl in self.slices_read(tp_rank, rank_heads) if sl.whole]

    @property
    def hybrid(self) -> bool:
        """Several KV-cache groups, or a state group: block names and the fingerprint name the
        groups (a model with one attention group keeps the names and fingerprint it always
        had)."""
        return names_carry_groups([g.kind for g in self.groups])

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
        group only the window before the hit's end (``connector.presence.usable_prefix``, which
        routers' presence questions use too)."""
        kinds = [g.kind for g in self.groups]
        return usable_prefix(kinds, self.block_size, present, start, end)

    def chain_names(self, chain: Sequence[str], generation: int) -> ChainNames:
        """The store's names of every group's block at each position of ``chain`` (chain
        hashes), in ``generation``."""
        groups = [g.index if self.hybrid else None for g in self.groups]
        names = [[block_name(h, generation, group) for h in chain] for group in groups]
        return ChainNames(list(chain), generation, names)

    @classmethod
    def from_vllm(
        cls,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        model_id: str | None,
        store_tp_size: int | None = None,
    ) -> KVLayout:
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("RedisConnector does not support pipeline parallelism yet")
        groups = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(group, "enable_kv_transfer", True):
                continue  # vLLM rebuilds it from another group after a load
            spec: Any = group.kv_cache_spec  # an attention or state spec, once kind says so
            kind = _group_kind(spec)
            names = tuple(group.layer_names)
            if kind is None:
                raise UnsupportedModelError(
                    f"RedisConnector cannot store KV-cache group {index} "
                    f"({type(spec).__name__}, layers {list(names)[:3]}...): its blocks are "
                    "neither tokens' KV nor block-boundary states. Serve this model without "
                    "--kv-transfer-config."
                )
            if kind.is_state:
                groups.append(_state_group(index, names, spec))
                continue
            groups.append(
                KVGroup(
                    index=index,
                    kind=kind,
                    layer_names=names,
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
        # the fields a one-group model's fingerprint always had: its first attention group's
        first = next((g for g in groups if not g.is_state), groups[0])
        model_config = vllm_config.model_config
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        total_heads = total_kv_heads(vllm_config, first.num_kv_heads, tp_size)
        if any(g.is_state for g in groups):
            # a state is cut by rank, not by KV head: every rank stores its own slice
            if store_tp_size not in (None, tp_size):
                raise UnsupportedModelError(
                    f"store_tp_size {store_tp_size}: a model with Mamba / gated delta-net "
                    f"state groups is stored rank by rank (TP {tp_size}); leave store_tp_size "
                    "unset"
                )
            # (so shared with no other TP size: set to this one, it is the default)
            total_heads, store_tp_size = first.num_kv_heads * tp_size, None
        return cls(
            model_id=model_id or str(model_config.model),
            block_size=block_sizes.pop(),
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            layer_names=tuple(name for g in groups for name in g.layer_names),
            tp_size=tp_size,
            revision=getattr(model_config, "revision", None) or None,
            quantization=getattr(model_config, "quantization", None) or None,
            kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
            hf_overrides=describe_overrides(getattr(model_config, "hf_overrides", None)),
            groups=tuple(groups),
            engine_groups=len(kv_cache_config.kv_cache_groups),
            total_kv_heads=total_heads,
            store_tp_size=store_tp_size or 0,
        )

    def fingerprint(self, head_slice: int) -> str:
        """The fingerprint of head slice ``head_slice`` of ``store_tp_size``: what a rank of
        an instance at TP ``store_tp_size`` always wrote under (same field names), so such an
        instance keeps its keys."""
        s = self.store_tp_size
        fields: dict[str, object] = {
            "layout": LAYOUT_VERSION,
            "model": self.model_id,
            "revision": self.revision,
            "quantization": self.quantization,
            "hf_overrides": self.hf_overrides,
            "block_size": self.block_size,
            "num_kv_heads": self.slice_heads(self.num_kv_heads),
            "head_size": self.head_size,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "layers": list(self.layer_names),
            "tp_rank": head_slice,
            "tp_size": s,
        }
        if self.tp_scope is not None:  # replicated heads (GQA at TP > heads, MLA) at TP t
            fields["instance_tp_size"] = self.tp_scope
        if self.tp_shared:
            # opted into sharing across TP sizes: apart from an instance at TP store_tp_size
            # that did not opt in, whose keys these slices would otherwise be
            fields["tp_shared"] = True
        if self.hybrid:  # a one-group model keeps the fingerprint it always had
            fields["groups"] = [
                [
                    g.index,
                    str(g.kind),
                    list(g.layer_names),
                    self.slice_heads(g.num_kv_heads),
                    g.head_size,
                    g.dtype,
                    *([g.state] if g.is_state else []),  # attention groups keep their fields
                ]
                for g in self.groups
            ]
        return layout_fingerprint(fields)

    def slice_heads(self, rank_heads: int) -> int:
        """The KV heads in one stored slice of a group whose ranks hold ``rank_heads`` each."""
        return rank_heads * self.ranks_with_distinct_heads // self.store_tp_size

    def all_fingerprints(self) -> list[str]:
        """Every head slice's fingerprint: a block is present when all of them have it."""
        return [self.fingerprint(j) for j in range(self.store_tp_size)]


def describe_overrides(overrides: object) -> str | None:
    """A stable text for ``--hf-overrides``: canonical JSON for a dict, the qualified name of
    a function (its effect cannot be inspected; name it to keep instances apart)."""
    if not overrides:
        return None
    if callable(overrides):
        module = getattr(overrides, "__module__", "?")
        return f"callable:{module}.{getattr(overrides, '__qualname__', repr(overrides))}"
    return json.dumps(overrides, sort_keys=True, default=str)


def total_kv_heads(vllm_config: VllmConfig, rank_heads: int, tp_size: int) -> int:
    """The model's KV heads over every rank: MLA's latent is one (every rank holds it); else
    the model config's count, when the ranks' share agrees with it (vLLM gives each rank
    ``total // tp`` heads, or one replicated head when ranks outnumber them). A model whose
    layers disagree with its config is treated as one whose ranks all hold different heads:
    each rank stores its own, as before slices."""
    model_config = vllm_config.model_config
    if getattr(model_config, "use_mla", False):
        return 1
    try:
        total = int(model_config.get_total_num_kv_heads())
    except Exception:  # a config vLLM cannot count heads for
        return rank_heads * tp_size
    if total > 0 and rank_heads * min(tp_size, total) == total:
        return total
    return rank_heads * tp_size
