"""Scheduler side: which prompt blocks are in Redis, which to load, which to save."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore import KVStoreError, LookupBuffer, chain_hashes

from .config import TRANSFER_PARAMS_KEY, KVLayout, RedisConnectorConfig
from .metadata import LoadSpec, RedisConnectorMetadata, SaveSpec
from .stats import FailureCounts

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("connector.scheduler")

# How often a request waiting for a producer's blocks re-checks Redis.
_POLL_INTERVAL_S = 0.01


def request_salt(request: Request) -> str:
    """Everything besides the tokens that changes the KV of a prompt: LoRA adapter, cache_salt,
    multimodal inputs. It seeds the chain, so such prompts never share blocks by accident."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}")
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    for feature in getattr(request, "mm_features", None) or []:
        parts.append(
            f"mm={getattr(feature, 'identifier', '')}@{getattr(feature, 'mm_position', '')}"
        )
    return "|".join(parts)


@dataclass
class _RequestState:
    hashes: list[str]  # the prompt's full blocks
    first_seen: float
    expected_blocks: int | None  # from the producer's kv_transfer_params, if any
    handed_off: bool = False  # a producer saved this prompt for us (consume mode cleans up)
    lookup: Future[int] | None = None
    lookup_span: tuple[int, int] = (0, 0)
    next_poll: float = 0.0  # while waiting for a producer: no new lookup before this time
    present_blocks: int = 0  # last lookup's answer
    load_range: tuple[int, int] = (0, 0)
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading prompt blocks saved (or known to be in Redis already)


@dataclass
class SchedulerStats:
    lookup_errors: int


class RedisConnectorScheduler:
    def __init__(self, config: RedisConnectorConfig, layout: KVLayout, store: LookupBuffer) -> None:
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.store = store
        self.fingerprints = layout.all_fingerprints()
        self.failures = FailureCounts()
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: list[LoadSpec] = []
        # block hash -> request loading it now. A request whose blocks another request of this
        # instance is loading waits for that load: the blocks then become local prefix-cache
        # hits (in consume mode the second request would otherwise find them gone).
        self._loading: dict[str, str] = {}
        # One thread: Redis round trips never run on the scheduler's own thread.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="redis-kv-sched")

    # ------------------------------------------------------------------ lookups
    def _state(self, request: Request) -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            params = request.kv_transfer_params or {}
            ours = params.get(TRANSFER_PARAMS_KEY) if isinstance(params, dict) else None
            expected = None
            if isinstance(ours, dict) and isinstance(ours.get("num_blocks"), int):
                expected = ours["num_blocks"]
            st = _RequestState(
                hashes=chain_hashes(
                    request.prompt_token_ids or [], self.block_size, request_salt(request)
                ),
                first_seen=time.monotonic(),
                expected_blocks=expected,
                handed_off=expected is not None,
            )
            self._reqs[request.request_id] = st
        return st

    def _present_blocks(self, st: _RequestState, start: int, max_blocks: int) -> int | None:
        """How far the chain is present in Redis for every TP rank, counting from ``start``
        (the blocks before it are computed locally; a block's hash already covers its prefix).
        None while Redis has not answered."""
        if st.lookup is None or st.lookup_span != (start, max_blocks):
            st.lookup_span = (start, max_blocks)
            st.lookup = self._io.submit(
                self.store.longest_prefix, st.hashes[start:max_blocks], self.fingerprints
            )
        try:
            n = st.lookup.result(timeout=self.config.lookup_wait_s)
        except FutureTimeout:
            return None
        except KVStoreError as exc:
            total = self.failures.add("lookup")
            if total:
                logger.warning(
                    "Redis lookup failed (%d so far), recomputing the prompt: %s", total, exc
                )
            n = 0
        st.lookup = None
        st.present_blocks = start + n
        return start + n

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if not self.config.loads:
            return 0, False
        # Never claim the last prompt token: vLLM must compute at least one to sample from.
        max_blocks = min(len(st.hashes), (request.num_prompt_tokens - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        if max_blocks <= start:
            return 0, False
        rid = request.request_id
        if any(self._loading.get(h, rid) != rid for h in st.hashes[start:max_blocks]):
            return None, False  # another request is loading these blocks; wait for it
        if st.lookup is None and time.monotonic() < st.next_poll:
            return None, False  # polled Redis a moment ago; do not hammer it while waiting
        n = self._present_blocks(st, start, max_blocks)
        if n is None:
            return None, False
        if st.expected_blocks is not None and n < min(st.expected_blocks, max_blocks):
            # The producer's saves may still be in flight (or, in consume mode, another request
            # of this instance is loading the shared prefix, which then becomes a local hit):
            # ask again, until load_timeout_s.
            now = time.monotonic()
            if now - st.first_seen < self.config.load_timeout_s:
                st.next_poll = now + _POLL_INTERVAL_S
                return None, False
            logger.warning(
                "request %s: %d of %d expected blocks in Redis after %.1fs; recomputing the rest",
                request.request_id,
                n,
                st.expected_blocks,
                self.config.load_timeout_s,
            )
            st.expected_blocks = None
        if n <= start:
            return 0, False
        st.load_range = (start, n)
        return (n - start) * self.block_size, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._state(request)
        st.block_ids = list(blocks.get_block_ids()[0])
        if self.config.mode == "share":
            st.saved_blocks = max(st.saved_blocks, st.present_blocks)  # in Redis already
        if num_external_tokens > 0:
            start, _ = st.load_range
            end = start + num_external_tokens // self.block_size
            st.load_range = (start, end)
            for h in st.hashes[start:end]:
                self._loading[h] = request.request_id
            self._pending_loads.append(
                LoadSpec(
                    req_id=request.request_id,
                    block_ids=st.block_ids[start:end],
                    hashes=st.hashes[start:end],
                    consume=self.config.mode == "consume",
                )
            )
            st.saved_blocks = max(st.saved_blocks, end)  # already in Redis
            self._drop(st.hashes[:start] + st.hashes[end:])
        elif st.handed_off:
            self._drop(st.hashes)  # handed off to us but not needed (e.g. local cache hit)

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        for req_id in finished_recving or ():
            self._release(req_id)

    def _release(self, req_id: str) -> None:
        st = self._reqs.get(req_id)
        if st is not None:
            start, end = st.load_range
            for h in st.hashes[start:end]:
                if self._loading.get(h) == req_id:
                    del self._loading[h]

    def _drop(self, hashes: list[str]) -> None:
        """Consume mode leaves nothing behind: delete the blocks this instance will not load."""
        if hashes and self.config.mode == "consume":
            fut = self._io.submit(self.store.delete, hashes, self.fingerprints)
            fut.add_done_callback(self._log_delete_failure)

    # ------------------------------------------------------------------ saves
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RedisConnectorMetadata:
        meta = RedisConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.config.saves:
            return meta
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                progress.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            progress.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in progress:
            st = self._reqs[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(done // self.block_size, len(st.hashes), len(st.block_ids))
            if full > st.saved_blocks:
                meta.saves.append(
                    SaveSpec(
                        req_id=req_id,
                        block_ids=st.block_ids[st.saved_blocks : full],
                        hashes=st.hashes[st.saved_blocks : full],
                    )
                )
                st.saved_blocks = full
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are copied to staging before the step ends, so vLLM may free them now. A
        producer returns what the consumer must wait for: the chain's length and last hash."""
        self._release(request.request_id)
        st = self._reqs.pop(request.request_id, None)
        if st is None or not self.config.saves or st.saved_blocks == 0:
            return False, None
        n = st.saved_blocks
        return False, {
            TRANSFER_PARAMS_KEY: {
                "num_blocks": n,
                "last_hash": st.hashes[n - 1],
                "namespace": self.config.namespace,
                "block_size": self.block_size,
            }
        }

    def _log_delete_failure(self, fut: Future[Any]) -> None:
        exc = fut.exception()
        total = self.failures.add("delete") if exc is not None else None
        if total:
            logger.warning("Redis: deleting unused blocks failed (%d so far): %s", total, exc)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(lookup_errors=self.failures["lookup"])

    def shutdown(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
