"""KV events for cache-aware routers: vLLM's own ``BlockStored`` for blocks confirmed in Redis and
``AllBlocksCleared`` on a reset, published by vLLM's ``--kv-events-config`` publisher next to
the events of its GPU cache, so subscribers written for vLLM understand them unchanged.

How a block gets announced: each worker rank reports, per finished request, how many leading
blocks of its chain it has confirmed written (SETs acknowledged; ``StoredPrefixReports``, carried
in vLLM's ``KVConnectorOutput.kv_cache_events`` and combined over ranks by vLLM's
``KVOutputAggregator``). The scheduler side (``KVEventsEmitter``) waits for every rank, takes
the least, and announces the blocks from the first one that was not in Redis already up to it.
So an event means "a load of this prefix finds it", never "a save was planned".

What the events carry: vLLM's block hashes (``Request.block_hashes``, as its GPU events have
them, at the connector's block size), the token ids, LoRA and extra keys, ``medium="CPU"``,
``locality="REMOTE"`` and ``ownership="redis:<namespace>"`` where the vLLM release has those
fields. Every instance of a namespace can load what any of them announced. A model with Mamba /
gated delta-net state groups can load a prefix only where a state was saved, so its events
name groups as vLLM's own events of such a model do (``group_idx``, ``kv_cache_spec_kind``):
the blocks once per attention group, and each state group's block only at the hit lengths a
load can end at (the ranks report those); a release without ``group_idx`` publishes none.

What they cannot carry: Redis evicting a block (maxmemory) or its TTL expiring happen inside
Redis, unseen by any connector, so no ``BlockRemoved`` follows them; a router should treat these
events as hints that age (the TTL) and ask the presence API (``connector.presence``, the proxy's
``POST /kv/presence``) for an exact answer. Share mode only: a consume-mode handoff chain is
private to the one request it was made for, so it is never announced (nor its deletion).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import Request

from connector.layout import KVLayout

logger = logging.getLogger(__name__)

# a request whose ranks have not all reported by then is forgotten (a rank died mid-write)
_FORGET_AFTER_S = 600.0
_BLOCK_STORED_FIELDS = frozenset(BlockStored.__struct_fields__)


class StoredPrefixReports(KVConnectorKVEvents):
    """One worker rank's reports, ``(request id, leading blocks confirmed in Redis[, the hit
    lengths a load can end at])`` per finished request (the third for a model with state
    groups); vLLM's aggregator appends the other ranks' to the first rank's."""

    def __init__(self, reports: list[Any] | None = None) -> None:
        self._reports: list[Any] = list(reports or [])
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._reports.extend(events)

    def aggregate(self) -> StoredPrefixReports:
        return self  # the scheduler side takes the least per request over every rank

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._reports)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._reports.clear()

    def __repr__(self) -> str:
        return f"<StoredPrefixReports {self._reports}>"


@dataclass(frozen=True)
class EventGroup:
    """One KV-cache group the connector stores, as its events name it: vLLM's group index, the
    kind and sliding window vLLM's own events carry for it, and whether it is a state group
    (Mamba / gated delta-net: a hit may end only where it has a state)."""

    index: int
    kind: str | None = None
    sliding_window: int | None = None
    is_state: bool = False


@dataclass
class _Watched:
    request: Request
    first_block: int  # blocks before it were in Redis already (found, not saved)
    since: float
    generation: int  # the namespace's when the request finished
    confirmed: list[int] = field(default_factory=list)  # one per rank that reported
    ends: list[set[int]] = field(default_factory=list)  # state models: loadable ends, per rank


class KVEventsEmitter:
    """Scheduler side: turns the ranks' reports into vLLM events, handed to vLLM's
    publisher by ``take``."""

    def __init__(
        self,
        block_size: int,
        hash_block_size: int,
        ranks: int,
        namespace: str,
        generation: Callable[[], int] = lambda: 0,
        groups: tuple[EventGroup, ...] = (),
    ) -> None:
        self.block_size = block_size
        # a model with state groups announces per group (vLLM's ``group_idx``), each state
        # group only at the hit lengths a load can end at: one block chain would tell a router
        # every prefix of it loads, and most do not
        self.groups = groups if any(g.is_state for g in groups) else ()
        self.generation = generation  # the namespace's, as this instance last read it
        self.ranks = ranks
        self.namespace = namespace
        # vLLM hashes every hash_block_size tokens; one of our blocks ends at every ratio-th
        self._ratio = (
            block_size // hash_block_size
            if hash_block_size > 0 and block_size % hash_block_size == 0
            else 0
        )
        if not self._ratio:
            logger.warning(
                "RedisConnector: vLLM hashes blocks of %d tokens, which do not divide the "
                "connector's %d, so its blocks cannot be named by vLLM's hashes: no KV events "
                "are published for them",
                hash_block_size,
                block_size,
            )
        if self.groups and "group_idx" not in _BLOCK_STORED_FIELDS:
            logger.warning(
                "RedisConnector: this vLLM release's BlockStored has no group_idx, so a router "
                "could not tell which prefixes of a model with Mamba / gated delta-net state "
                "groups load: no KV events are published for its blocks"
            )
            self._ratio = 0
        self._watched: dict[str, _Watched] = {}
        self._events: list[KVCacheEvent] = []
        self.forgotten = 0

    def watch(self, request: Request, first_block: int, num_blocks: int) -> None:
        """``request`` finished with blocks [first_block, num_blocks) of its chain to save:
        announce them once every rank confirms them."""
        if getattr(request, "mm_features", None):
            # our chain is salted with every image of the prompt, vLLM's hashes of the blocks
            # before an image are not: its hashes would name blocks a load may not find
            return
        if self._ratio and num_blocks > first_block:
            self._watched[request.request_id] = _Watched(
                request, first_block, time.monotonic(), self.generation()
            )

    def reported(self, reports: object) -> None:
        """The ranks' reports this step brought (``KVConnectorOutput.kv_cache_events``)."""
        if not isinstance(reports, StoredPrefixReports):
            return
        for req_id, confirmed, *ends in reports.get_all_events():
            watched = self._watched.get(req_id)
            if watched is None:
                continue  # nothing new to announce, or reset since
            watched.confirmed.append(confirmed)
            watched.ends.append(set(ends[0]) if ends else set())
            if len(watched.confirmed) >= self.ranks:
                del self._watched[req_id]
                if watched.generation != self.generation():  # reset since: never loaded
                    continue
                end = min(watched.confirmed)
                if self.groups:  # (only where every rank confirmed it)
                    loadable = sorted(e for e in set.intersection(*watched.ends) if e <= end)
                    self._announce_groups(watched.request, watched.first_block, end, loadable)
                else:
                    self._announce(watched.request, watched.first_block, end)

    def cleared(self) -> None:
        """The namespace was reset: every block of it is gone for loads. Blocks of requests
        still being confirmed were named before the reset: never announced."""
        self._watched.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        now = time.monotonic()
        stale = [r for r, w in self._watched.items() if now - w.since > _FORGET_AFTER_S]
        for req_id in stale:
            del self._watched[req_id]
        if stale:
            self.forgotten += len(stale)
            logger.warning(
                "RedisConnector: %d finished request(s) never had their saves confirmed by "
                "every rank; their blocks are not announced (%d so far)",
                len(stale),
                self.forgotten,
            )
        events, self._events = self._events, []
        return events

    def _announce_groups(self, request: Request, first: int, end: int, loadable: list[int]) -> None:
        """A model with state groups: the blocks [first, end) once per attention group, and
        each state group's block at ``e - 1`` for each hit length ``e`` a load can end at, as
        vLLM's own events name a hybrid model's groups: a router takes a hit to end where
        every group has the block."""
        end = min(end, len(request.block_hashes) // self._ratio)
        for group in self.groups:
            if not group.is_state:
                self._announce(request, first, end, group)
                continue
            for e in loadable:
                if first < e <= end:
                    self._announce(request, e - 1, e, group)

    def _announce(
        self, request: Request, first: int, end: int, group: EventGroup | None = None
    ) -> None:
        # vLLM hashes only whole hash blocks of tokens it has seen: never name past them
        end = min(end, len(request.block_hashes) // self._ratio)
        if end <= first:
            return
        bs = self.block_size
        hashes = [self._hash(request, i) for i in range(first, end)]
        lora = request.lora_request
        fields: dict[str, Any] = {
            "block_hashes": hashes,
            "parent_block_hash": self._hash(request, first - 1) if first > 0 else None,
            "token_ids": list(request.all_token_ids[first * bs : end * bs]),
            "block_size": bs,
            "lora_id": lora.adapter_id if lora else None,
            "lora_name": lora.name if lora else None,
            "medium": MEDIUM_CPU,
            "extra_keys": self._extra_keys(request, first, end),
            "locality": "REMOTE",
            "ownership": f"redis:{self.namespace}",
        }
        if group is not None:
            fields["group_idx"] = group.index
            fields["kv_cache_spec_kind"] = group.kind
            fields["kv_cache_spec_sliding_window"] = group.sliding_window
        # older releases lack the later fields: pass only those this one defines
        self._events.append(
            BlockStored(**{k: v for k, v in fields.items() if k in _BLOCK_STORED_FIELDS})
        )

    def _hash(self, request: Request, block: int) -> Any:
        return maybe_convert_block_hash(request.block_hashes[(block + 1) * self._ratio - 1])

    def _extra_keys(self, request: Request, first: int, end: int) -> Iterable[Any] | None:
        # the extra keys (LoRA, multimodal, cache salt) a router hashes with, where this vLLM
        # release publishes them
        generate = getattr(kv_cache_utils, "generate_block_hash_extra_keys", None)
        convert = getattr(kv_cache_utils, "to_event_extra_keys", None)
        if generate is None or convert is None:
            return None
        keys: list[Any] = []
        mm_index = 0
        for i in range(end):  # the multimodal index runs from the prompt's start
            extra, mm_index = generate(
                request, i * self.block_size, (i + 1) * self.block_size, mm_index
            )
            if i >= first:
                keys.append(extra)
        return convert(keys)


def event_groups(layout: KVLayout, kv_cache_config: Any) -> tuple[EventGroup, ...]:
    """The stored groups as events name them, with the kind and window vLLM's own events give
    each group (where this release says)."""
    from vllm.v1 import kv_cache_interface

    kind_of = getattr(kv_cache_interface, "get_kv_cache_spec_kind", None)
    window_of = getattr(kv_cache_interface, "get_kv_cache_spec_sliding_window", None)
    out = []
    for g in layout.groups:
        kind: str | None = None
        window: int | None = None
        if kind_of is not None and window_of is not None and kv_cache_config is not None:
            spec = kv_cache_config.kv_cache_groups[g.index].kv_cache_spec
            kind, window = str(kind_of(spec).value), window_of(spec)
        out.append(EventGroup(g.index, kind, window, g.is_state))
    return tuple(out)


def events_wanted(vllm_config: Any) -> bool:
    """vLLM publishes KV events (``--kv-events-config '{"enable_kv_cache_events": true}'``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def hash_block_size(vllm_config: Any, kv_cache_config: Any, block_size: int) -> int:
    """The token count vLLM hashes blocks at (``Request.block_hashes``): the block size, except
    for models of several KV-cache groups on releases that hash finer."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError:  # releases that hash at the block size only
        return block_size
    try:
        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except Exception:  # a config this release cannot resolve: the events would be wrong, so
        logger.warning("RedisConnector: cannot tell vLLM's hash block size", exc_info=True)
        return 0  # none are published (the emitter warns)
