"""Scheduler side: which prompt blocks are in Redis, which to load, which to save.

Every request gets one deadline for everything Redis-related (lookup, waiting for the producer,
load), scaled with its prompt length; when it passes -- or the store's circuit breaker is open
-- the request recomputes. Redis round trips never run on the scheduler's thread: lookups go to
a small pool of their own, deletes to another, and the scheduler only looks at finished Futures.

Handoffs (disaggregated prefill): a producer salts each request's chain with a fresh handoff id
in consume mode, so two requests never share keys; when the request finishes its worker
publishes a commit record saying how many leading blocks it really wrote (shed and failed
saves excluded). The consumer waits for that record -- milliseconds, not a timeout -- claims the
handoff once, loads what is there and recomputes the rest at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore import KVStoreError, LookupBuffer, chain_hashes
from kvstore.keys import NAME_RE

from .config import TRANSFER_PARAMS_KEY, RedisConnectorConfig
from .layout import KVLayout
from .logs import FailureCounts
from .metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from .stats import StatsBuffer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("connector.scheduler")
# how often a dropped handoff checks whether its producer has finished writing
_DROP_POLL_S = 0.05

# How often a request waiting for a producer's commit record re-checks Redis.
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


def handoff_salt(salt: str, handoff_id: str) -> str:
    """The chain salt of a consume-mode handoff: private to one request."""
    return f"{salt}|handoff={handoff_id}"


@dataclass
class Handoff:
    """A producer's handoff, read from validated ``kv_transfer_params``."""

    handoff_id: str
    num_blocks: int
    scoped: bool  # the chain is salted with the handoff id (consume mode): ours alone
    state: str = "waiting"  # waiting -> claimed | taken | abandoned
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)  # who claims it


@dataclass
class LookupResult:
    present: int  # leading blocks present (absolute index)
    committed: int | None = None  # handoff: blocks the producer committed, None if not yet
    taken: bool = False  # handoff: another consumer claimed it
    pending: bool = False  # handoff: the producer is writing it (its record says so)


@dataclass
class _RequestState:
    num_tokens: int  # prompt tokens
    load_hashes: list[str]  # the chain loads look up (the handoff's, or the shared one)
    save_hashes: list[str]  # the chain saves write (ours)
    save_handoff: str  # the id our commit record is published under
    deadline: float
    first_seen: float
    handoff: Handoff | None = None  # an incoming handoff to wait for
    lookup: Future[LookupResult] | None = None
    lookup_span: tuple[int, int] = (0, 0)
    lookup_started: float = 0.0
    next_poll: float = 0.0  # no new lookup before this time
    present_blocks: int = 0  # last lookup's answer
    load_range: tuple[int, int] = (0, 0)
    load_planned: bool = False
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks of save_hashes saved or known to be in Redis
    save_start: int | None = None  # saved_blocks when the first save was planned
    cleaned: bool = False  # a scoped handoff that will not be loaded was deleted
    gave_up: bool = False  # stopped waiting on Redis: recomputes
    preemptions: int = 0

    @property
    def same_chain(self) -> bool:
        return self.load_hashes is self.save_hashes


class RedisConnectorScheduler:
    def __init__(self, config: RedisConnectorConfig, layout: KVLayout, store: LookupBuffer) -> None:
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.store = store
        self.fingerprints = layout.all_fingerprints()
        self.failures = FailureCounts()
        self.stats = StatsBuffer()
        self._reqs: dict[str, _RequestState] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_commits: list[CommitSpec] = []
        # block hash -> request loading it now (share mode). A request whose blocks another
        # request of this instance is loading waits for that load: the blocks then become local
        # prefix-cache hits.
        self._loading: dict[str, str] = {}
        # block id -> (request, chain position) of blocks being loaded, to repair failed loads
        self._load_blocks: dict[int, tuple[str, int]] = {}
        self._lookup_io = ThreadPoolExecutor(
            config.lookup_threads, thread_name_prefix="redis-kv-lookup"
        )
        # deletes and handoff records never hold up lookups
        self._background_io = ThreadPoolExecutor(1, thread_name_prefix="redis-kv-background")
        # handoffs dropped unloaded wait here for their producer to finish writing
        self._drop_io = ThreadPoolExecutor(2, thread_name_prefix="redis-kv-drop")
        self._breaker_reported: bool | None = None
        self._breaker_opens_reported = 0

    def loads_handoff(self, request: Request) -> bool:
        """Whether this request's Redis hits come from a producer's handoff (else: the shared
        pool)."""
        st = self._reqs.get(request.request_id)
        return st is not None and st.handoff is not None

    # ------------------------------------------------------------------ request state
    def _state(self, request: Request) -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is not None:
            if request.num_preemptions != st.preemptions:
                # preempted after its load: it starts over with a fresh budget (a consumed
                # handoff is never waited for again)
                st.preemptions = request.num_preemptions
                st.deadline = time.monotonic() + self.config.request_deadline_s(st.num_tokens)
                st.gave_up = st.load_planned = False
            return st
        salt = request_salt(request)
        tokens = request.prompt_token_ids or []
        save_handoff = uuid.uuid4().hex
        # the content chain: what share mode saves and loads, and what incoming params are
        # checked against (a consume-mode producer needs none of it)
        shared: list[str] = []
        if self.config.loads or not self.config.consume:
            shared = chain_hashes(tokens, self.block_size, salt)
        save_hashes = shared
        if self.config.saves and self.config.consume:  # a chain private to this request
            save_hashes = chain_hashes(tokens, self.block_size, handoff_salt(salt, save_handoff))
        handoff, load_hashes = None, shared
        if self.config.loads:
            handoff, load_hashes = self._incoming_handoff(request, shared, salt)
        now = time.monotonic()
        st = _RequestState(
            num_tokens=len(tokens),
            load_hashes=load_hashes,
            save_hashes=save_hashes,
            save_handoff=save_handoff,
            deadline=now + self.config.request_deadline_s(len(tokens)),
            first_seen=now,
            handoff=handoff,
            preemptions=request.num_preemptions,
        )
        self._reqs[request.request_id] = st
        return st

    def _incoming_handoff(
        self, request: Request, shared: list[str], salt: str
    ) -> tuple[Handoff | None, list[str]]:
        """The producer's handoff from the request's ``kv_transfer_params`` and the chain it
        wrote, if the params are ours and match this instance and prompt; anything else is
        ignored with a sparse warning (the chain is then the shared one)."""
        params = request.kv_transfer_params
        ours = params.get(TRANSFER_PARAMS_KEY) if isinstance(params, dict) else None
        if ours is None:
            return None, shared
        problem = None
        if not isinstance(ours, dict):
            problem = "not a mapping"
        elif ours.get("namespace") != self.config.namespace:
            problem = f"namespace {ours.get('namespace')!r} is not {self.config.namespace!r}"
        elif ours.get("block_size") != self.block_size:
            problem = f"block size {ours.get('block_size')!r} is not {self.block_size}"
        else:
            handoff_id, n = ours.get("handoff"), ours.get("num_blocks")
            scoped = ours.get("scope") == "handoff"
            if not isinstance(handoff_id, str) or not NAME_RE.match(handoff_id):
                problem = "no valid handoff id"
            elif not isinstance(n, int) or not 0 < n <= len(shared):
                problem = f"num_blocks {n!r} does not fit a prompt of {len(shared)} blocks"
            else:
                chain = shared
                if scoped:
                    tokens = (request.prompt_token_ids or [])[: n * self.block_size]
                    chain = chain_hashes(tokens, self.block_size, handoff_salt(salt, handoff_id))
                if ours.get("last_hash") == chain[n - 1]:
                    return Handoff(handoff_id, n, scoped), chain
                problem = "last_hash does not match this prompt (another model or prompt?)"
        self.stats.add(transfer_params_ignored=1)
        total = self.failures.add(f"params:{problem.split()[0]}")
        if total:
            logger.warning(
                "request %s: ignoring the producer's kv_transfer_params (%s); %d so far. The "
                "prompt is computed here. Producer and consumer need the same namespace, block "
                "size, model and prompt.",
                request.request_id,
                problem,
                total,
            )
        return None, shared

    def _give_up(self, st: _RequestState, rid: str, why: str) -> tuple[int, bool]:
        """Stop waiting on Redis for this request: it recomputes (whatever it had not loaded)."""
        st.gave_up = True
        self.stats.add(requests_given_up=1)
        if st.handoff is not None and st.handoff.state == "waiting":
            st.handoff.state = "abandoned"
        total = self.failures.add(f"give-up:{why}")
        if total:
            logger.warning(
                "request %s: not loading from Redis (%s); recomputing (%d so far)", rid, why, total
            )
        return 0, False

    # ------------------------------------------------------------------ lookups
    def _lookupable(self, st: _RequestState) -> bool:
        if st.gave_up:
            return False
        if st.handoff is not None:
            return st.handoff.state == "waiting"
        return not self.config.consume  # consume mode loads only what was handed off to it

    def _lookup(self, hashes: list[str], start: int, handoff: Handoff | None) -> LookupResult:
        """One lookup, on a lookup thread."""
        t0 = time.perf_counter()
        try:
            if handoff is None:
                return LookupResult(start + self.store.longest_prefix(hashes, self.fingerprints))
            state = self.store.read_handoff(handoff.handoff_id, hashes, self.fingerprints)
            committed, taken = state.committed, state.taken
            if committed is not None and self.config.consume and handoff.scoped:
                # take it for this request, exactly once (a retried request finds it taken)
                taken = not self.store.claim_handoff(
                    handoff.handoff_id, self.fingerprints, owner=handoff.owner
                )
            return LookupResult(start + state.present, committed, taken, state.pending)
        finally:
            self.stats.observe("lookup_seconds", time.perf_counter() - t0)

    def _poll_lookup(self, st: _RequestState, start: int, end: int) -> LookupResult | None:
        """The answer of this request's lookup, started now if needed; None while in flight."""
        if st.lookup is None or st.lookup_span != (start, end):
            st.lookup_span = (start, end)
            st.lookup_started = time.monotonic()
            st.lookup = self._lookup_io.submit(
                self._lookup, st.load_hashes[start:end], start, st.handoff
            )
            self.stats.add(lookups=1)
            # a fast answer is used in this step; a slow one is picked up by a later call,
            # so many waiting requests never add up to a long scheduler step
            wait([st.lookup], timeout=self.config.lookup_wait_s)
        fut = st.lookup
        if not fut.done():  # tell a slow answer from an error by done(), never by exception type
            if time.monotonic() - st.lookup_started > self.config.control_timeout_s + 0.25:
                # hung beyond its socket timeout: count it, so a hung server opens the breaker
                self.store.breaker.record_failure("a lookup did not come back in time")
            return None
        st.lookup = None
        try:
            return fut.result()
        except KVStoreError as exc:
            self.stats.add(redis_errors=1)
            total = self.failures.add(f"lookup:{type(exc).__name__}")
            if total:
                logger.warning("Redis lookup failed (%d so far); recomputing: %s", total, exc)
        except Exception as exc:  # whatever it was, the request must not wait for it
            self.stats.add(redis_errors=1)
            logger.exception("Redis lookup raised %r; recomputing", exc)
        return LookupResult(present=-1)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if not self.config.loads:
            return 0, False
        rid = request.request_id
        # Never claim the last prompt token: vLLM must compute at least one to sample from.
        max_blocks = min(len(st.load_hashes), (request.num_prompt_tokens - 1) // self.block_size)
        start = num_computed_tokens // self.block_size
        if max_blocks <= start or not self._lookupable(st):
            return 0, False
        now = time.monotonic()
        if now >= st.deadline:
            return self._give_up(st, rid, "deadline passed")
        if not self.store.available:
            return self._give_up(st, rid, "Redis unavailable (circuit breaker open)")
        if not self.config.consume and any(
            self._loading.get(h, rid) != rid for h in st.load_hashes[start:max_blocks]
        ):
            return None, False  # another request is loading these blocks; wait for it
        if st.lookup is None and now < st.next_poll:
            return None, False  # polled Redis a moment ago; do not hammer it while waiting
        result = self._poll_lookup(st, start, max_blocks)
        if result is None:
            return None, False
        if result.present < 0:  # the lookup failed
            return self._give_up(st, rid, "lookup failed")
        n = result.present
        if st.handoff is not None:
            if result.taken:
                st.handoff.state = "taken"
                return self._give_up(st, rid, "handoff already taken by another request")
            waited = now - st.first_seen
            if result.committed is None and (
                result.pending or waited < self.config.handoff_grace_s
            ):
                # the producer is still writing (or its first write is just landing)
                st.next_poll = now + _POLL_INTERVAL_S
                return None, False
            st.handoff.state = "claimed"
            self.stats.observe("handoff_wait_seconds", waited)
            if result.committed is not None:
                n = min(n, result.committed)  # anything else was shed, failed or is gone
            # else: no record at all (evicted, or the producer never wrote): load what is there
        st.present_blocks = n
        if n <= start:
            return 0, False
        st.load_range = (start, n)
        return (n - start) * self.block_size, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._state(request)
        st.block_ids = list(blocks.get_block_ids()[0])
        if st.same_chain:
            st.saved_blocks = max(st.saved_blocks, st.present_blocks)  # in Redis already
        if num_external_tokens > 0:
            start, _ = st.load_range
            end = start + num_external_tokens // self.block_size
            st.load_range = (start, end)
            st.load_planned = True
            if not self.config.consume:
                for h in st.load_hashes[start:end]:
                    self._loading[h] = request.request_id
            for pos in range(start, end):
                self._load_blocks[st.block_ids[pos]] = (request.request_id, pos)
            drop = st.load_hashes if self._owns_handoff(st) else []
            st.cleaned = bool(drop)
            self._pending_loads.append(
                LoadSpec(
                    req_id=request.request_id,
                    block_ids=st.block_ids[start:end],
                    hashes=st.load_hashes[start:end],
                    timeout_s=max(0.0, st.deadline - time.monotonic()),
                    drop_hashes=list(drop),
                )
            )
            if st.same_chain:
                st.saved_blocks = max(st.saved_blocks, end)  # already in Redis
        elif not st.load_planned:
            self._drop_handoff(st)  # handed off to us but not loaded (e.g. a local hit)

    def _owns_handoff(self, st: _RequestState) -> bool:
        """A consume-mode handoff chain is this request's alone: it deletes it when done."""
        return self.config.consume and st.handoff is not None and st.handoff.scoped

    def _drop_handoff(self, st: _RequestState) -> None:
        """Consume mode leaves nothing behind: delete a handoff's blocks it will not load (e.g.
        vLLM's local prefix cache had them), and its record."""
        if self._owns_handoff(st) and not st.cleaned and st.handoff is not None:
            st.cleaned = True
            fut = self._drop_io.submit(self._delete_handoff, st.handoff, st.load_hashes)
            fut.add_done_callback(self._log_background_failure)

    def _delete_handoff(self, handoff: Handoff, hashes: list[str]) -> None:
        """Delete a handoff's chain and record. Its producer may still be writing it (the
        prefill's response comes back before its writes are acknowledged, and vLLM's local
        prefix cache can make the consumer skip the load at once): deleting then left the
        late blocks behind for their whole TTL. So this waits, off every request's path, until
        no producer rank's record says "pending" -- at most ``deadline_max_s``, for a producer
        that died writing."""
        give_up = time.monotonic() + self.config.deadline_max_s
        while time.monotonic() < give_up:
            state = self.store.read_handoff(handoff.handoff_id, hashes[:1], self.fingerprints)
            if not state.pending:
                break
            time.sleep(_DROP_POLL_S)
        self.store.delete(hashes, self.fingerprints)
        self.store.delete_handoff(handoff.handoff_id, self.fingerprints)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for block_id in output.invalid_block_ids or ():
            owner = self._load_blocks.get(block_id)
            st = self._reqs.get(owner[0]) if owner else None
            if owner and st is not None and st.same_chain:
                # share mode: save the recomputed block again, so the bad value is replaced
                st.saved_blocks = min(st.saved_blocks, owner[1])
                st.present_blocks = min(st.present_blocks, owner[1])
        for req_id in output.finished_recving or ():
            self._release(req_id)

    def _release(self, req_id: str) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        start, end = st.load_range
        for h in st.load_hashes[start:end]:
            if self._loading.get(h) == req_id:
                del self._loading[h]
        for block_id in st.block_ids[start:end]:
            if self._load_blocks.get(block_id, ("",))[0] == req_id:
                del self._load_blocks[block_id]
        if st.handoff is not None:
            st.handoff.state = "claimed"  # done: a preempted request never waits again
        st.load_range = (0, 0)

    # ------------------------------------------------------------------ saves
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RedisConnectorMetadata:
        meta = RedisConnectorMetadata(loads=self._pending_loads, commits=self._pending_commits)
        self._pending_loads, self._pending_commits = [], []
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
            full = min(done // self.block_size, len(st.save_hashes), len(st.block_ids))
            if full > st.saved_blocks:
                if st.save_start is None:
                    st.save_start = st.saved_blocks
                    # a consumer that finds this before the commit record knows to wait
                    fut = self._background_io.submit(
                        self.store.open_handoff, st.save_handoff, self.fingerprints
                    )
                    fut.add_done_callback(self._log_background_failure)
                meta.saves.append(
                    SaveSpec(
                        req_id=req_id,
                        block_ids=st.block_ids[st.saved_blocks : full],
                        hashes=st.save_hashes[st.saved_blocks : full],
                        first_position=st.saved_blocks,
                        handoff=st.save_handoff,
                    )
                )
                st.saved_blocks = full
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A producer returns the handoff a consumer waits for; its worker publishes the commit
        record once the saves are acknowledged. True: the worker reports when the blocks may be
        freed (finished sending) -- at once today, since saves copy them out when staging."""
        self._release(request.request_id)
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.handoff is not None and st.handoff.state == "waiting":
            st.handoff.state = "abandoned"  # e.g. aborted while waiting for the producer
        if not st.load_planned:
            self._drop_handoff(st)
        if not self.config.saves or st.saved_blocks == 0:
            return False, None
        n = st.saved_blocks
        saved_any = st.save_start is not None
        self._pending_commits.append(
            CommitSpec(
                req_id=request.request_id,
                handoff=st.save_handoff,
                num_blocks=n,
                present_blocks=st.save_start if saved_any else n,  # type: ignore[arg-type]
            )
        )
        params = {
            TRANSFER_PARAMS_KEY: {
                "handoff": st.save_handoff,
                "scope": "handoff" if self.config.consume else "shared",
                "num_blocks": n,
                "last_hash": st.save_hashes[n - 1],
                "namespace": self.config.namespace,
                "block_size": self.block_size,
            }
        }
        return True, params

    def _log_background_failure(self, fut: Future[Any]) -> None:
        if fut.cancelled():  # cancelled at shutdown
            return
        exc = fut.exception()
        if exc is None:
            return
        self.stats.add(redis_errors=1)
        total = self.failures.add(f"background:{type(exc).__name__}")
        if total:
            logger.warning(
                "Redis: a background call (deleting unused blocks, marking a handoff) failed "
                "(%d so far): %s",
                total,
                exc,
            )

    def take_stats(self) -> dict[str, Any]:
        data = self.stats.take()
        is_open = not self.store.available
        if is_open != self._breaker_reported:
            data["breaker_open"] = int(is_open)
            self._breaker_reported = is_open
        opens = self.store.breaker.opens
        if opens > self._breaker_opens_reported:
            data["breaker_opens"] = opens - self._breaker_opens_reported
            self._breaker_opens_reported = opens
        return data

    def shutdown(self) -> None:
        self._lookup_io.shutdown(wait=False, cancel_futures=True)
        self._background_io.shutdown(wait=False, cancel_futures=True)
        self._drop_io.shutdown(wait=False, cancel_futures=True)
        self.store.close()
