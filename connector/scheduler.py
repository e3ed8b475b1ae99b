"""Scheduler side: which prompt blocks are in Redis, which to load, which to save -- one
request's life as a state machine. (Which blocks each step saves is planned in
``save_plans.py``, from the state kept here.)

Every request gets one deadline for everything Redis-related (lookup, waiting for the producer,
load), scaled with its prompt length; when it passes -- or the store's circuit breaker is open
-- the request recomputes. Time spent waiting for vLLM to find room in the KV cache does not
count against it. Redis round trips never run on the scheduler's thread: lookups go to a few
threads of their own that send every lookup queued at once in one round trip (``lookups.py``;
started when vLLM adds the request, so most are back before it is scheduled), deletes to
another, and the scheduler only looks at finished Futures. One scheduler step waits at most
``lookup_wait_s`` for lookups in all, however many requests it looks at.

Handoffs (disaggregated prefill): a producer salts each request's chain with a fresh handoff id
in consume mode, so two requests never share keys; when the request finishes its worker
publishes a commit record saying how many leading blocks it really wrote (shed and failed
saves excluded). The consumer waits for that record -- milliseconds, not a timeout -- and
loads what is there; the worker claims the handoff (exactly once, for this request) before it
reads, so a claim is only ever made for blocks vLLM has allocated. A handoff the request will
not load (a local hit, a deadline, an abort) is claimed and deleted off the request's path.

States of a request (``Phase``), and the one thing each vLLM callback does in each:

LOOKING_UP: a lookup is out, or the producer's commit record is awaited.
  get_num_new_matched_tokens: poll the lookup within this step's shared wait; None while it is
      out, else the answer -> ANSWERED.
  request_finished (aborted): drop the handoff; (False, None).
ANSWERED: vLLM was told n tokens (n may be 0) and has not allocated blocks yet.
  get_num_new_matched_tokens (vLLM could not allocate and asks again): the same answer; fewer
      tokens if its local hits grew; a new lookup (-> LOOKING_UP) if they shrank.
  update_state_after_alloc: n > 0 -> LOADING, the load (and its claim) planned; a split ->
      RUNNING, its layered load planned for this step's forward pass; 0 -> RUNNING, drop the
      handoff.
  request_finished (aborted): drop the handoff; (False, None).
  How the answer serves the hit is the load policy's choice (``load_policy.py``): all of it
  asynchronously (``(n, True)``), its first ``k`` blocks as a split (``(k, False)``: vLLM runs
  the request in this very step, computing the rest), or none (``(0, False)``, recompute).
LOADING: the worker claims the handoff (consume mode) and writes the allocated blocks.
  update_connector_output, finished_recving: -> RUNNING; consume mode: drop the handoff (every
      rank has finished reading it; several ranks may read one value). Also after an abort.
  request_finished (aborted): (False, params): vLLM itself holds the blocks until the load
      reports finished receiving; nothing reports finished sending for it.
RUNNING: computing, after its load or with nothing to load.
  get_num_new_matched_tokens: (0, False): one load per admission; a failed load is recomputed,
      not retried.
  (a split's step) the worker writes its blocks during the forward pass, each band of layers
      before those layers run (the worker's ``wait_for_layer_load``), and ends it with the
      step: a band late past its timeout fails the load, and its blocks come back as invalid
      block ids in that step's output (vLLM recomputes them and drops the step's token).
      update_connector_output of that output counts it (and, consume mode, drops the handoff;
      failing that, build_connector_meta of the next step does): splits are chosen only where
      vLLM schedules the next step after this one's output. What the step computes over the
      split's blocks is saved a step later, once the output says it landed on every rank.
  build_connector_meta: plan the saves of the prompt blocks this step completes
      (``save_plans.py``).
  update_connector_output, invalid blocks (or, for a model with several KV-cache groups, the
      whole load failed): save the recomputed blocks again (share mode).
  request_finished: (True, params) if saves were planned -- the worker reports finished
      sending once it has taken the commit, every save staged -- else (False, params).
Any state, after a preemption: -> LOOKING_UP with a fresh deadline (a handoff loaded or dropped
is not waited for again). A callback not listed for a state is not made in it, or changes
nothing. (A split never meets an abort or a preemption mid-load: both happen between steps, and
the split ends with its step.)

A model with several KV-cache groups (full attention, sliding window) keeps one chain of
positions: each group's block at a position is its own key (``KVLayout.group_block_hash``), a hit
needs every full-attention block and only a windowed group's window (``usable_prefix``), and
loads and saves carry every group's block ids (a sliding window's past is vLLM's null block,
which the worker skips).

"Drop the handoff" (consume mode): once its producer is done writing, claim it, and delete its
chain and record unless another request's claim is there (``drops.py``). "Finished sending"
is only ever reported for a request vLLM holds for us, so no report can free blocks a load is
still writing, or name a request vLLM has let go.
"""

from __future__ import annotations

import enum
import logging
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.chains import RequestChains
from connector.config import LOAD_POLICY_KEY, RedisConnectorConfig
from connector.drops import HandoffDrops
from connector.figures import (
    ComputeRate,
    LoadRate,
    SplitRate,
    StepShape,
    splits_within_loads,
    step_shape,
)
from connector.layout import KVLayout
from connector.load_policy import (
    Busy,
    BusyWeights,
    Decision,
    Engine,
    Figures,
    Hit,
    LoadsInFlight,
    Reason,
    Way,
    admitted,
    choose,
    next_pass,
    pinned,
)
from connector.logs import FailureCounts
from connector.lookups import Lookup, LookupBatcher, LookupResult
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata
from connector.probes import ProbePlanner
from connector.resets import NamespaceResets
from connector.save_plans import SavePlanner
from connector.save_policy import SaveAllowance, marked_for_saving
from connector.stats import StatsBuffer
from connector.transfer_params import Handoff, ThisInstance, producer_params, read_handoff
from kvstore import KVStoreError, LookupBuffer

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from connector.events import KVEventsEmitter

logger = logging.getLogger("connector.scheduler")
# How often a request waiting for a producer's commit record re-checks Redis.
_POLL_INTERVAL_S = 0.01
# an instance that does no lookups (a producer) reads the namespace's generation at most this
# often, in the background: it names its saves in a reset's generation within about a second
_GENERATION_REFRESH_S = 1.0
# splits whose forward pass ran layers without waiting for their bands (a full CUDA graph):
# after this many, no split is chosen any more (each such split fails and is recomputed)
UNWAITED_SPLITS_LIMIT = 2


def opened(fut: Future[None] | None) -> bool:
    """Whether a background "pending" record write has landed."""
    return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None


class Phase(enum.Enum):
    LOOKING_UP = "looking up"
    ANSWERED = "answered"
    LOADING = "loading"
    RUNNING = "running"


@dataclass(frozen=True)
class StepBlocks:
    """One request's blocks in one step (first KV-cache group): what it runs on, computed
    before the step; what it completes from their first token on; the full blocks it computes
    (vLLM caches them as it allocates them)."""

    context: list[int]
    whole: list[int]
    cached: list[int]


@dataclass
class RequestState:
    """What the scheduler keeps of one request: its state machine's, and its saves' (read and
    written by ``save_plans.SavePlanner`` each step)."""

    num_tokens: int  # prompt tokens
    load_hashes: list[str]  # the chain loads look up (the handoff's, or the shared one)
    save_hashes: list[str]  # the chain saves write (ours)
    save_handoff: str  # the id our commit record is published under
    deadline: float
    handoff: Handoff | None = None  # an incoming handoff to wait for
    phase: Phase = Phase.LOOKING_UP
    first_seen: float = field(default_factory=time.monotonic)
    lookup: Lookup | None = None
    lookup_start: int = 0  # the first block the lookup in flight asks about
    next_poll: float = 0.0  # no new lookup before this time
    present_blocks: int = 0  # the answer: leading blocks present (absolute)
    load_end: int = 0  # the answer: where the blocks it loads end (absolute; the policy's)
    layered: bool = False  # the answer is a split (a synchronous, layer-by-layer load)
    decision: Decision | None = None  # how the load policy served the hit, and why
    pin: Way | None = None  # the way the request's own params pinned (request_load_policy)
    answer_start: int = 0  # vLLM's local hit (blocks) the answer was given for
    answered_at: float = 0.0
    load_range: tuple[int, int] = (0, 0)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    computed_tokens: int = 0  # what its last scheduled step leaves computed (vLLM's view)
    saved_blocks: int = 0  # leading blocks of save_hashes saved or known to be in Redis
    save_start: int | None = None  # saved_blocks when the first save was planned
    opening: Future[None] | None = None  # the "pending" record being written
    preemptions: int = 0
    # (group, chain position) of the states saved from vLLM's offers (state groups)
    states_saved: set[tuple[int, int]] = field(default_factory=set)
    generation: int = 0  # the namespace's generation its chains are named in
    # share mode, all of it a local hit: the lookup that says what Redis holds of its chain,
    # which its saves wait for (None: known, or not asked)
    presence: Lookup | None = None
    # share mode: whether its caller asked for it to be written (save_policy.py), and how many
    # leading blocks the save policy lets it write (None: not decided yet), and the blocks
    # beyond that counted as skipped so far
    save_marked: bool = False
    save_allowance: int | None = None
    save_skipped_to: int = 0

    def renamable(self) -> bool:
        """Nothing of it is in flight or planned yet: its chains may be named again."""
        return (
            self.phase is Phase.LOOKING_UP
            and self.save_start is None
            and self.load_range == (0, 0)
            and (self.handoff is None or self.handoff.state == "waiting")
        )

    @property
    def same_chain(self) -> bool:
        return self.load_hashes is self.save_hashes

    @property
    def running(self) -> bool:
        """In ``Phase.RUNNING``: what its steps compute may be saved (``save_plans.py``)."""
        return self.phase is Phase.RUNNING


class RedisConnectorScheduler:
    def __init__(
        self,
        config: RedisConnectorConfig,
        layout: KVLayout,
        store: LookupBuffer,
        events: KVEventsEmitter | None = None,
        split_refusal: str | None = None,
        load_shape: tuple[int, int] = (0, 0),
        engine: Engine | None = None,
    ) -> None:
        self.config = config
        # why this engine cannot take a split (None: it can), and what the policy decides from
        self.split_refusal = split_refusal
        self.engine = engine or Engine()
        self.load_rate = LoadRate()
        self.split_rate = SplitRate()
        self.compute_rate = ComputeRate()
        self.weights = BusyWeights(decode=config.busy_decode_weight)
        self.probes = ProbePlanner()
        self._unwaited_splits = 0  # splits whose forward pass skipped their waits
        # what the engine runs besides a request being admitted (``_busy``): the pass just
        # scheduled, seen as the next one, and what this step's admissions added to it
        self._running = Busy()
        self._admitted = Busy()
        self._loads_out = LoadsInFlight()  # requests loading asynchronously
        # one block, every layer, as a worker rank reads it (the most over ranks), and the bands
        # of layers a split reads it in (the fewest): vLLM's page sizes say, until the workers
        # report what they read
        self._block_bytes, self._bands = load_shape
        # requests whose split load the metadata being built carries; and those of the step
        # before, counted (and released) once its output is in
        self._splits_planned: list[str] = []
        self._splits_running: list[str] = []
        # the blocks each request of the running splits' step ran on and computed: a failed
        # split taints what its same-step readers computed too (``_taint_readers``)
        self._split_step_blocks: dict[str, StepBlocks] = {}
        # block ids (first KV-cache group) vLLM's prefix cache holds with wrong KV after a
        # failed split, until computed again (``_taint``)
        self._tainted: set[int] = set()
        self.events = events  # KV events for routers, when vLLM publishes them
        self.layout = layout
        self.block_size = layout.block_size
        # what a producer's kv_transfer_params must match here (transfer_params.py)
        self._this_instance = ThisInstance(config.namespace, layout.block_size, layout)
        self.store = store
        self.fingerprints = layout.all_fingerprints()
        self.failures = FailureCounts()
        self.stats = StatsBuffer()
        self._reqs: dict[str, RequestState] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_commits: list[CommitSpec] = []
        # block hash -> request loading it now (share mode). A request whose blocks another
        # request of this instance is loading waits for that load: the blocks then become local
        # prefix-cache hits.
        self._loading: dict[str, str] = {}
        # block id -> (request, chain position) of blocks being loaded, to repair failed loads
        self._load_blocks: dict[int, tuple[str, int]] = {}
        # this step's lookups wait together until this moment (None: no wait yet this step)
        self._step_wait_until: float | None = None
        self._lookups = LookupBatcher(
            store, self.fingerprints, config.lookup_threads, self.stats, layout
        )
        # deletes and handoff records never hold up lookups
        self._background_io = ThreadPoolExecutor(1, thread_name_prefix="redis-kv-background")
        # handoffs dropped unloaded wait here for their producer to finish writing
        self._drops = HandoffDrops(
            store, self.fingerprints, config.deadline_max_s, self._report_background_failure
        )
        # consume mode: request -> the handoff it is loading, dropped (claimed for it again and
        # deleted) once every rank has finished loading: several ranks may read one value
        self._consumed: dict[str, tuple[Handoff, list[str]]] = {}
        # request -> [first, end, first failed] chain positions of its load, counted once vLLM
        # reports it finished on every rank (a worker's own count would add up over TP ranks)
        self._load_outcomes: dict[str, list[int]] = {}
        self._breaker_reported: bool | None = None
        self._breaker_opens_reported = 0
        # which blocks of which requests each step saves
        self._save_planner = SavePlanner(
            layout,
            store,
            self.fingerprints,
            self.stats,
            self._background_io,
            self._log_background_failure,
            # share mode only: a consume-mode producer writes its handoff whole
            None if config.consume else SaveAllowance(config.save_policy),
        )
        self._generation_read_at = 0.0
        self._resets = NamespaceResets(store, config, self.stats, events)
        try:  # best effort: lookups and a background refresh read it again
            store.read_generation()
            self._generation_read_at = time.monotonic()
        except KVStoreError as exc:
            logger.warning("Redis: could not read the namespace's generation yet: %s", exc)

    def loads_handoff(self, request: Request) -> bool:
        """Whether this request's Redis hits come from a producer's handoff (else: the shared
        pool)."""
        st = self._reqs.get(request.request_id)
        return st is not None and st.handoff is not None

    # ------------------------------------------------------------------ request state
    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is not None and st.generation != self.store.generation and st.renamable():
            # the namespace was reset since its chains were named: name them again
            del self._reqs[request.request_id]
            st = None
        if st is not None:
            if request.num_preemptions != st.preemptions:
                # preempted: it starts over with a fresh budget (a handoff it loaded or dropped
                # is never waited for again)
                st.preemptions = request.num_preemptions
                st.deadline = time.monotonic() + self.config.request_deadline_s(st.num_tokens)
                st.phase, st.lookup, st.next_poll = Phase.LOOKING_UP, None, 0.0
                st.load_range, st.layered, st.decision = (0, 0), False, None
            return st
        generation = self.store.generation
        chains = RequestChains(request, self.block_size, generation)
        save_handoff = uuid.uuid4().hex
        # the content chain: what share mode saves and loads, and what incoming params are
        # checked against (a consume-mode producer needs none of it)
        shared: list[str] = []
        if self.config.loads or not self.config.consume:
            shared = chains.shared()
        save_hashes = shared
        if self.config.saves and self.config.consume:  # a chain private to this request
            save_hashes = chains.handoff(save_handoff)
        handoff, load_hashes = None, shared
        if self.config.loads:
            handoff, load_hashes = self._incoming_handoff(request, shared, chains)
        st = RequestState(
            num_tokens=len(chains.tokens),
            load_hashes=load_hashes,
            save_hashes=save_hashes,
            save_handoff=save_handoff,
            deadline=time.monotonic() + self.config.request_deadline_s(len(chains.tokens)),
            handoff=handoff,
            preemptions=request.num_preemptions,
            generation=generation,
            pin=self._pinned_by_request(request),
            save_marked=marked_for_saving(request.kv_transfer_params),
        )
        self._reqs[request.request_id] = st
        return st

    def _incoming_handoff(
        self, request: Request, shared: list[str], chains: RequestChains
    ) -> tuple[Handoff | None, list[str]]:
        """The producer's handoff from the request's ``kv_transfer_params`` and the chain it
        wrote, if the params are ours and match this instance and prompt; anything else is
        ignored with a sparse warning (the chain is then the shared one)."""
        handoff, chain, problem = read_handoff(
            request.kv_transfer_params, self._this_instance, chains, shared
        )
        if problem is None:
            return handoff, chain
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

    def _pinned_by_request(self, request: Request) -> Way | None:
        """The way the request's params pin (``request_load_policy``), or None (auto: the
        instance's policy decides)."""
        if not self.config.request_load_policy or not isinstance(request.kv_transfer_params, dict):
            return None
        asked = request.kv_transfer_params.get(LOAD_POLICY_KEY)
        if asked is None or asked == "auto":
            return None
        if asked not in tuple(w.value for w in Way):
            self.stats.add(transfer_params_ignored=1)
            total = self.failures.add("params:load_policy")
            if total:
                logger.warning(
                    "request %s: %s=%r is not auto, async, split or recompute; ignored (%d so far)",
                    request.request_id,
                    LOAD_POLICY_KEY,
                    str(asked)[:32],
                    total,
                )
            return None
        return Way(asked)

    def _max_blocks(self, st: RequestState, request: Request) -> int:
        # Never load the last prompt token: vLLM must compute at least one to sample from.
        return min(len(st.load_hashes), (request.num_prompt_tokens - 1) // self.block_size)

    # ------------------------------------------------------------------ lookups
    def on_new_request(self, request: Request) -> None:
        """vLLM added a request: start its lookup now, so the answer is usually back before
        the request's first scheduling step asks for it."""
        self._refresh_generation()
        st = self._state(request)
        end = self._max_blocks(st, request)
        if self.config.loads and end > 0 and self._lookupable(st) and self.store.available:
            self._start_lookup(st, 0, end)

    def _refresh_generation(self) -> None:
        """Read the namespace's generation in the background, at most every second (lookups
        read it too, so this matters for an instance that only saves)."""
        now = time.monotonic()
        if now - self._generation_read_at < _GENERATION_REFRESH_S or not self.store.available:
            return
        self._generation_read_at = now
        fut = self._background_io.submit(self.store.read_generation)
        fut.add_done_callback(self._log_background_failure)

    def _lookupable(self, st: RequestState) -> bool:
        if st.generation != self.store.generation:
            return False  # named before a reset, and no longer renamable: never load it
        if st.handoff is not None:
            return st.handoff.state == "waiting"
        return not self.config.consume  # consume mode loads only what was handed off to it

    def _writes_back(self, st: RequestState) -> bool:
        """Share mode: its chain is the pool's, and what Redis lacks of it is written back."""
        return st.same_chain and self._lookupable(st)

    def _start_lookup(self, st: RequestState, start: int, end: int) -> None:
        st.lookup_start = start
        handoff_id = st.handoff.handoff_id if st.handoff is not None else None
        st.lookup = self._lookups.submit(st.load_hashes[start:end], start, handoff_id)
        self.stats.add(lookups=1)

    def _wait_in_step(self, fut: Future[LookupResult]) -> None:
        """Wait for a lookup, within the one ``lookup_wait_s`` this step shares among all its
        requests: a fast answer is used in this step, a slow one by a later call, so many
        new requests never add up to a long step."""
        now = time.monotonic()
        if self._step_wait_until is None:
            self._step_wait_until = now + self.config.lookup_wait_s
        left = self._step_wait_until - now
        if left > 0:
            wait([fut], timeout=left)

    def _poll_lookup(self, st: RequestState, start: int, end: int) -> LookupResult | None:
        """The answer of a lookup covering ``start``, started now if needed; None while out.
        A failed lookup answers ``present=-1``. A request that loads and saves one chain
        (share mode, an instance that saves) always asks from the chain's first block: what
        Redis lacks of vLLM's local hit is what it must write back, and a load or announcement
        may only follow a head that is there."""
        ask_from = 0 if self.config.saves and st.same_chain else start
        if st.lookup is not None and st.lookup_start > ask_from:
            st.lookup = None  # it asks about fewer blocks than vLLM now needs: ask again
        if st.lookup is None:
            self._start_lookup(st, ask_from, end)
        lookup = st.lookup
        assert lookup is not None
        fut = lookup.future
        if not fut.done():
            self._wait_in_step(fut)
        if not fut.done():  # tell a slow answer from an error by done(), never by exception type
            trip = lookup.trip
            hung = lookup.out_for(time.monotonic()) > self.config.control_timeout_s + 0.25
            if hung and trip is not None and not trip.reported_hung:
                # Redis has had it beyond its socket timeout (time queued behind other lookups
                # does not count): one failure per round trip, so a hung server opens the
                # breaker and a slow one does not
                trip.reported_hung = True
                self.store.breaker.record_failure("a lookup did not come back in time")
            return None
        st.lookup = None
        try:
            result = fut.result()
        except KVStoreError as exc:
            self.stats.add(redis_errors=1)
            total = self.failures.add(f"lookup:{type(exc).__name__}")
            if total:
                logger.warning("Redis lookup failed (%d so far); recomputing: %s", total, exc)
            return LookupResult(present=-1)
        except Exception as exc:  # whatever it was, the request must not wait for it
            self.stats.add(redis_errors=1)
            logger.exception("Redis lookup raised %r; recomputing", exc)
            return LookupResult(present=-1)
        if result.generation != st.generation:
            return None  # a reset: the request is named again and asks again (``_state``)
        if result.present < start and st.lookup_start < start and ask_from == start:
            # it stopped before vLLM's local hit: the blocks after it are still unknown
            self._start_lookup(st, start, end)
            return None
        return result

    def _give_up(self, st: RequestState, rid: str, why: str) -> int:
        """Stop waiting on Redis for this request: it recomputes (whatever it had not loaded)."""
        self.stats.add(requests_given_up=1)
        total = self.failures.add(f"give-up:{why}")
        if total:
            logger.warning(
                "request %s: not loading from Redis (%s); recomputing (%d so far)", rid, why, total
            )
        return 0

    def _present_blocks(self, st: RequestState, rid: str, start: int, end: int) -> int | None:
        """LOOKING_UP: the leading blocks vLLM may load (absolute), or None while unknown."""
        now = time.monotonic()
        if now >= st.deadline:
            return self._give_up(st, rid, "deadline passed")
        if not self.store.available:
            return self._give_up(st, rid, "Redis unavailable (circuit breaker open)")
        if not self.config.consume and any(
            self._loading.get(h, rid) != rid for h in st.load_hashes[start:end]
        ):
            return None  # another request is loading these blocks; wait for it
        if st.lookup is None and now < st.next_poll:
            return None  # polled Redis a moment ago; do not hammer it while waiting
        result = self._poll_lookup(st, start, end)
        if result is None:
            return None
        if result.present < 0:
            return self._give_up(st, rid, "lookup failed")
        if st.handoff is None:
            return result.present
        if result.taken:
            st.handoff.state = "taken"
            return self._give_up(st, rid, "handoff already taken by another request")
        waited = now - st.first_seen
        if result.committed is None and (
            result.pending or not st.handoff.opened or waited < self.config.handoff_grace_s
        ):
            # the producer is still writing (or its first write, or its record, is just landing)
            st.next_poll = now + _POLL_INTERVAL_S
            return None
        self.stats.observe("handoff_wait_seconds", waited)
        if result.committed is not None:
            return min(result.present, result.committed)  # the rest was shed, failed or is gone
        return result.present  # no record at all (evicted, never written): load what is there

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        start = num_computed_tokens // self.block_size
        if st.phase is Phase.ANSWERED:
            if start >= st.answer_start:  # asked again (vLLM could not allocate): same answer
                return self._answer(st, start)
            st.phase = Phase.LOOKING_UP  # its local hits shrank: blocks before are unknown
        if st.phase is not Phase.LOOKING_UP:
            return 0, False  # one load per admission: a failed load is recomputed, not retried
        end = self._max_blocks(st, request)
        present = 0
        if self.config.loads and end > start and self._lookupable(st):
            found = self._present_blocks(st, request.request_id, start, end)
            if found is None:
                return None, False
            present = found
        elif self.config.saves and self.config.loads and end > 0 and self._writes_back(st):
            # all of it a local hit: nothing to load, so the admission does not wait; its
            # saves wait for the answer instead (``save_plans.py``), so a prefix Redis lost
            # is written back and one it holds is not written twice
            if st.lookup is None and self.store.available:
                self._start_lookup(st, 0, end)
            st.presence, st.lookup = st.lookup, None
            if st.presence is not None and not st.presence.future.done():
                self._wait_in_step(st.presence.future)  # (usually back: asked on arrival)
        st.phase, st.answer_start, st.answered_at = Phase.ANSWERED, start, time.monotonic()
        st.present_blocks = min(present, end)
        self._decide(st, request, start)
        return self._answer(st, start)

    def _answer(self, st: RequestState, start: int) -> tuple[int, bool]:
        n = st.load_end
        if n <= start:
            st.load_range = (start, start)
            return 0, False
        st.load_range = (start, n)
        return (n - start) * self.block_size, not st.layered

    def figures(self) -> Figures:
        """What the load policy decides from now (``figures.py``)."""
        loads = self.load_rate.estimate() if self._block_bytes > 0 else None
        splits = splits_within_loads(loads, self.split_rate.estimate())
        return Figures(loads, splits, self.compute_rate.estimate())

    @property
    def splits_allowed(self) -> bool:
        return self.split_refusal is None and self._unwaited_splits < UNWAITED_SPLITS_LIMIT

    @property
    def auto_splits(self) -> bool:
        """Whether ``auto`` may choose a split (and its bands need probing). Not where the
        bands' reads cannot overlap the pass (vLLM's CPU backend): there a split is its reads,
        then its compute, holding the whole batch meanwhile, and gains at most the one step an
        async load waits; on the 2-core VM its reads ran slower than a whole load's and auto's
        splits came 1.1-1.2x behind async (a request may still pin one)."""
        return self.splits_allowed and self.engine.overlap

    def _busy(self) -> Busy:
        """What the engine holds besides the request being admitted: the pass just scheduled
        (as the next one), this step's admissions so far, and the loads in flight."""
        run, more = self._running, self._admitted
        return Busy(
            batch=run.batch,
            prefills=run.prefills + more.prefills,
            prefill_tokens_ahead=run.prefill_tokens_ahead + more.prefill_tokens_ahead,
            loads=len(self._loads_out) + more.loads,
            load_bytes_ahead=self._loads_out.bytes_left(time.monotonic()) + more.load_bytes_ahead,
            split_bytes=more.split_bytes,  # (one split a pass: a second waits for the next)
        )

    def _decide(self, st: RequestState, request: Request, start: int) -> None:
        """How to serve the hit ``[start, present)``: the load policy's choice (or a pinned
        way), counted and kept with the request."""
        hit = Hit(
            start,
            max(start, st.present_blocks),
            request.num_prompt_tokens,
            self.block_size,
            self._block_bytes,
            self._bands,
        )
        st.decision, st.layered, st.load_end = None, False, start
        if hit.blocks <= 0:
            return
        self.probes.remember(st.load_hashes[start : hit.end])
        way = st.pin or (
            None if self.config.load_policy == "auto" else Way(self.config.load_policy)
        )
        figures, busy = self.figures(), self._busy()
        if way is not None:
            decision = pinned(way, hit, self.splits_allowed, figures, self.engine, busy)
        else:
            decision = choose(
                hit,
                figures,
                engine=self.engine,
                busy=busy,
                split_ok=self.auto_splits,
                weights=self.weights,
                token_s=self.compute_rate.token_seconds(),
                # a handoff was made for this request to load; the pool's blocks are not
                # loaded before the store is measured (the probes do that meanwhile)
                unmeasured=Way.ASYNC if self.config.consume else Way.RECOMPUTE,
            )
            measured = decision.reason is Reason.MEASURED
            self.probes.note_choice(measured and decision.way is Way.RECOMPUTE)
            if decision.gain_s is not None:
                self.stats.observe("predicted_gain_seconds", decision.gain_s)
        st.decision, st.layered = decision, decision.way is Way.SPLIT
        st.load_end = start + decision.blocks
        self._admitted = admitted(self._admitted, hit, decision)
        self.stats.add(**{f"chose_{decision.way.value}": 1})
        if decision.way is Way.RECOMPUTE:
            self.stats.add(tokens_recompute_chosen=hit.blocks * self.block_size)
        logger.debug(
            "request %s: %d block(s) in Redis after %d local: %s %d (%s; predicted %s)",
            request.request_id,
            hit.blocks,
            start,
            decision.way.value,
            decision.blocks,
            decision.reason.value,
            decision.predicted_s or "-",
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._state(request)
        st.block_ids = self._per_group(blocks.get_block_ids())
        if st.phase in (Phase.LOADING, Phase.RUNNING):
            return  # admitted again after its load: nothing changes
        if st.phase is Phase.LOOKING_UP:  # admitted without an answer from us: nothing to load
            st.lookup, st.present_blocks, st.load_range = None, 0, (0, 0)
        if st.same_chain:
            st.saved_blocks = max(st.saved_blocks, st.present_blocks)  # in Redis already
        start, answered_end = st.load_range
        # vLLM may allocate fewer tokens than answered (its token budget): load whole blocks
        end = min(answered_end, start + math.ceil(num_external_tokens / self.block_size))
        if end <= start:
            st.phase = Phase.RUNNING
            self._drop_handoff(st)  # handed off to us but not loaded (e.g. a local hit)
            return
        now = time.monotonic()
        st.deadline += now - st.answered_at  # waiting for room in the KV cache is not Redis
        st.load_range = (start, end)
        rid = request.request_id
        timeout = max(0.0, st.deadline - now)
        # the policy's wait: a load past it has cost more than recomputing would have (and,
        # before any figures, than recomputing plausibly takes)
        wait = st.decision.wait_s if st.decision is not None else None
        if wait is not None:
            timeout = min(timeout, wait)
        if st.layered:
            # it runs in this step: its blocks are vLLM's cached blocks at once, no other
            # request waits for them
            st.phase = Phase.RUNNING
            self._splits_planned.append(rid)
        else:
            st.phase = Phase.LOADING
            if not self.config.consume:
                for h in st.load_hashes[start:end]:
                    self._loading[h] = rid
            predicted = st.decision.predicted_s if st.decision is not None else {}
            nbytes = (end - start) * self._block_bytes
            # its bytes leave the queue until it is predicted to land, the loads ahead of it
            # first (a review suggested its own time alone: loads queued at the store then
            # looked gone long before they were, and in the simulator waits ran out)
            self._loads_out.started(rid, nbytes, now, predicted.get(Way.ASYNC.value) or timeout)
        if not self.layout.fails_per_request:  # (otherwise vLLM hears of the whole request)
            for pos in range(start, end):
                self._load_blocks[st.block_ids[0][pos]] = (rid, pos)
        self._load_outcomes[rid] = [start, end, end]
        claim = None
        if self._owns_handoff(st):
            assert st.handoff is not None
            st.handoff.state, claim = "loading", st.handoff.handoff_id
            self._consumed[rid] = (st.handoff, self.layout.group_block_hashes(st.load_hashes))
        self._pending_loads.append(
            LoadSpec(
                req_id=rid,
                block_ids=[ids[start:end] for ids in st.block_ids],
                hashes=st.load_hashes[start:end],
                timeout_s=timeout,
                claim=claim,
                owner=st.handoff.owner if st.handoff is not None else "",
                layered=st.layered,
            )
        )
        if st.same_chain:
            st.saved_blocks = max(st.saved_blocks, end)  # already in Redis

    def _per_group(self, block_ids: Sequence[Sequence[int]] | None) -> list[list[int]]:
        """vLLM's block ids (one list per KV-cache group) of the groups the layout stores."""
        if not block_ids:
            return [[] for _ in self.layout.groups]
        return [list(block_ids[g.index]) for g in self.layout.groups]

    def _owns_handoff(self, st: RequestState) -> bool:
        """A consume-mode handoff chain is this request's alone: it deletes it when done."""
        return self.config.consume and st.handoff is not None and st.handoff.scoped

    def _drop_handoff(self, st: RequestState) -> None:
        """Consume mode leaves nothing behind: claim a handoff this request will not load (e.g.
        vLLM's local prefix cache had its blocks) and delete its blocks and record."""
        handoff = st.handoff
        if handoff is None or not self._owns_handoff(st) or handoff.state not in ("waiting",):
            return
        handoff.state = "dropped"
        self._drops.drop(
            handoff.handoff_id,
            handoff.owner,
            self.layout.group_block_hashes(st.load_hashes),
            expect_record=not handoff.opened,
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self.events is not None:
            self.events.reported(getattr(output, "kv_cache_events", None))
        self._take_samples(getattr(output, "kv_connector_stats", None))
        failed_split_blocks: set[int] = set()
        for block_id in output.invalid_block_ids or ():
            owner = self._load_blocks.get(block_id)
            if owner is None:
                continue
            outcome = self._load_outcomes.get(owner[0])
            if outcome is not None:  # vLLM recomputes from the first failed block on
                outcome[2] = min(outcome[2], owner[1])
            if owner[0] in self._splits_running:  # (a failed async load was never cached)
                self._taint(*owner)
                failed_split_blocks.add(block_id)
            st = self._reqs.get(owner[0])
            if st is not None and st.same_chain:
                # share mode: save the recomputed block again, so the bad value is replaced
                st.saved_blocks = min(st.saved_blocks, owner[1])
                st.present_blocks = min(st.present_blocks, owner[1])
        if failed_split_blocks:
            self._taint_readers(failed_split_blocks)
        for req_id in getattr(output, "failed_recving", None) or ():
            # a load failed as a whole (several groups, or a windowed one): vLLM recomputes the
            # whole prompt
            outcome = self._load_outcomes.get(req_id)
            if outcome is not None:
                outcome[2] = outcome[0]
            st = self._reqs.get(req_id)
            if st is not None and st.same_chain:  # share mode: save what was not loaded again
                st.saved_blocks = min(st.saved_blocks, st.load_range[0])
                st.present_blocks = min(st.present_blocks, st.load_range[0])
        for req_id in output.finished_recving or ():
            self._loads_out.ended(req_id)
            self._count_load(req_id)
            st = self._reqs.get(req_id)
            if st is not None and st.phase is Phase.LOADING:
                st.phase = Phase.RUNNING
                self._release(req_id, st)
            consumed = self._consumed.pop(req_id, None)
            if consumed is not None:  # every rank is done with it (aborted or not): delete it
                handoff, keys = consumed
                self._drops.drop(handoff.handoff_id, handoff.owner, keys, expect_record=False)
        self._finish_splits()

    def _take_samples(self, stats: Any) -> None:
        """The workers' measurements, for the load policy's figures (``figures.py``): each
        kind as the workers send it (``worker.py``); anything else teaches nothing."""
        data = getattr(stats, "data", None)
        if not isinstance(data, dict):
            return
        kinds: dict[str, Any] = {
            "load_samples": lambda r, b, s, lag: self.load_rate.add(
                b, s, int(r), lag if lag >= 0 else None
            ),
            "load_bounds": lambda r, b, s: self.load_rate.add_bound(b, s, int(r)),
            "split_samples": lambda r, b, first, between, bands: self.split_rate.add(
                b, first, between, int(bands), int(r)
            ),
            "split_bounds": lambda r, b, s: self.split_rate.add_bound(b, s, int(r)),
            "compute_samples": lambda p, a, d, x, s: self.compute_rate.add(
                StepShape(int(p), float(a), int(d), int(x)), s
            ),
        }
        for key, take in kinds.items():
            for values in data.get(key, ()):
                try:
                    take(*(float(v) for v in values))
                except (TypeError, ValueError, OverflowError):  # not what our workers send
                    logger.debug("ignoring a malformed %s in the connector's stats", key)
        try:
            if data.get("rank_block_bytes"):  # each rank's, the slowest sets the pace
                self._block_bytes = max(int(b) for (b,) in data["rank_block_bytes"])
            if data.get("split_bands"):
                self._bands = min(int(b) for (b,) in data["split_bands"])
        except (TypeError, ValueError, OverflowError):
            logger.debug("ignoring a malformed load shape in the connector's stats")
        if data.get("probe_missing"):  # (a list: one entry a probe, any rank)
            self.probes.forget()
        unwaited = data.get("split_unwaited")
        if isinstance(unwaited, list) and unwaited:
            self._unwaited_splits += len(unwaited)
            if self._unwaited_splits >= UNWAITED_SPLITS_LIMIT and self.split_refusal is None:
                logger.warning(
                    "RedisConnector: %d split loads ran in forward passes that did not wait "
                    "for their layers (a full CUDA graph replays none of the waits); no more "
                    "splits are chosen on this engine",
                    self._unwaited_splits,
                )
                self.split_refusal = "forward passes did not wait for split loads"

    def _finish_splits(self) -> None:
        """The splits of the step whose output came in: counted (its failed blocks came with
        it), released, and their handoffs dropped (consume mode: every rank has read them).
        Called at the end of ``update_connector_output``, and when the next step's metadata is
        built (a step whose output carried nothing for the connector)."""
        for req_id in self._splits_running:
            self._count_load(req_id)
            st = self._reqs.get(req_id)
            if st is not None:  # (else request_finished released it)
                self._release(req_id, st)
            consumed = self._consumed.pop(req_id, None)
            if consumed is not None:
                handoff, keys = consumed
                self._drops.drop(handoff.handoff_id, handoff.owner, keys, expect_record=False)
        self._splits_running = []
        self._split_step_blocks = {}

    def _count_load(self, req_id: str) -> None:
        """A load vLLM reports finished on every rank: what it delivered, once per request."""
        outcome = self._load_outcomes.pop(req_id, None)
        if outcome is None:
            return
        start, end, failed = outcome
        self.stats.add(
            loads=1,
            blocks_loaded=failed - start,
            tokens_loaded=(failed - start) * self.block_size,
            blocks_load_failed=end - failed,
            tokens_load_failed=(end - failed) * self.block_size,
        )

    def _release(self, req_id: str, st: RequestState) -> None:
        """Forget the blocks this request was loading (share mode: others stop waiting)."""
        start, end = st.load_range
        for h in st.load_hashes[start:end]:
            if self._loading.get(h) == req_id:
                del self._loading[h]
        for block_id in st.block_ids[0][start:end] if st.block_ids else ():
            if self._load_blocks.get(block_id, ("",))[0] == req_id:
                del self._load_blocks[block_id]
        st.load_range = (0, 0)

    # ------------------------------------------------------------------ steps and commits
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RedisConnectorMetadata:
        self._step_wait_until = None  # the step is over: the next one may wait again
        self._finish_splits()
        self._splits_running, self._splits_planned = self._splits_planned, []
        rows = self._scheduled_rows(scheduler_output)
        meta = RedisConnectorMetadata(
            loads=self._pending_loads,
            commits=self._pending_commits,
            step=step_shape([(before, n, prompt) for before, n, prompt, _ in rows]),
        )
        self._running, self._admitted = next_pass(rows, self.engine), Busy()
        if self.config.loads:
            figures = self.figures()
            # where the pass runs on the cores a probe's reads use (vLLM's CPU backend), a
            # probe waits for a step that computes no prompt and loads nothing (``probes.py``)
            quiet = self.engine.overlap or (
                meta.step.prefill_tokens == 0
                and not meta.loads
                and not len(self._loads_out)
                and not self._splits_running
            )
            probe = self.probes.due(
                figures.loads, figures.splits, self.auto_splits, self._block_bytes, quiet
            )
            if probe is not None:
                meta.probes.append(probe)
        self._pending_loads, self._pending_commits = [], []
        progress, fresh = self._track_block_tables(scheduler_output)
        if self._splits_running:  # what a failed split would taint (``_taint_readers``)
            self._split_step_blocks = self._step_blocks(scheduler_output, progress)
        held: set[str] = set()  # requests whose blocks of this step are saved a step later
        if self._tainted:
            meta.reject_blocks, held = self._screen_tainted(scheduler_output, progress, fresh, meta)
        if not self.config.saves:
            return meta
        meta.saves = self._save_planner.plan(
            scheduler_output, self._reqs, progress, held, meta.loads
        )
        return meta

    def _scheduled_rows(self, out: SchedulerOutput) -> list[tuple[int, int, bool, int]]:
        """(tokens cached before this step, tokens computed in it, whether they are prompt
        tokens, the prompt's length) of each scheduled request (a request this side does not
        track is a prompt while it computes more than one token)."""
        rows: list[tuple[int, int, bool, int]] = []
        cached = out.scheduled_cached_reqs
        pairs = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        pairs += list(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for req_id, before in pairs:
            n = out.num_scheduled_tokens.get(req_id, 0)
            st = self._reqs.get(req_id)
            prompt_len = st.num_tokens if st is not None else (before + n if n > 1 else before)
            rows.append((before, n, before < prompt_len, prompt_len))
        return rows

    def _track_block_tables(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[tuple[str, int]], dict[str, list[int]]]:
        """Keep each scheduled request's block table; (request, tokens computed before this
        step) of each, and the blocks vLLM allocated it afresh (first KV-cache group)."""
        progress: list[tuple[str, int]] = []
        fresh: dict[str, list[int]] = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = self._per_group(new.block_ids)
                progress.append((new.req_id, new.num_computed_tokens))
                st.computed_tokens = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                first = new.num_computed_tokens // self.block_size  # (before: cached hits)
                fresh[new.req_id] = st.block_ids[0][first:] if st.block_ids else []
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids or not st.block_ids:
                st.block_ids = self._per_group(new_ids)
                first = computed // self.block_size
                fresh[req_id] = st.block_ids[0][first:] if st.block_ids else []
            elif new_ids:
                more_ids = self._per_group(new_ids)
                for ids, more in zip(st.block_ids, more_ids, strict=True):
                    ids.extend(more)
                fresh[req_id] = more_ids[0] if more_ids else []
            progress.append((req_id, computed))
            st.computed_tokens = computed + scheduled.get(req_id, 0)
        return progress, fresh

    def _taint(self, req_id: str, position: int) -> None:
        """A split of ``req_id`` failed from chain position ``position``: vLLM keeps its blocks
        from there on in its prefix cache (it allocated them cached, and under
        kv_load_failure_policy=recompute does not evict them) holding KV that is wrong -- not
        loaded, or computed over what was not. Its request computes them again; until a
        request has, no other may run on them (``_screen_tainted``)."""
        st = self._reqs.get(req_id)
        if st is not None and st.block_ids:  # (only full blocks are cached)
            self._tainted.update(st.block_ids[0][position : st.computed_tokens // self.block_size])

    def _step_blocks(
        self, scheduler_output: SchedulerOutput, progress: list[tuple[str, int]]
    ) -> dict[str, StepBlocks]:
        """What each scheduled request's step runs on and computes, in block ids (first
        KV-cache group), from (request, tokens computed before the step)."""
        bs = self.block_size
        rows: dict[str, StepBlocks] = {}
        for req_id, computed in progress:
            ids = self._reqs[req_id].block_ids
            table = ids[0] if ids else []
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            rows[req_id] = StepBlocks(
                context=table[: computed // bs],
                whole=table[-(-computed // bs) : done // bs],
                cached=table[computed // bs : done // bs],
            )
        return rows

    def _taint_readers(self, failed: set[int]) -> None:
        """A split of the step whose output came in failed on ``failed``. vLLM caches a
        split's blocks when it allocates them, so a request admitted after it in the same
        step may have run on them as a local hit: vLLM rewinds such a request, but the full
        blocks it computed over them stay in its prefix cache with wrong KV until it computes
        them again -- which it never does if it is aborted or preempted first. Taint them
        (``_screen_tainted`` then keeps everyone off them), and what any request of the step
        computed over those, settled until nothing changes."""
        bad = set(failed)
        rows = self._split_step_blocks
        while True:
            more = {b for row in rows.values() if bad.intersection(row.context) for b in row.cached}
            if more <= bad:
                break
            bad |= more
        self._tainted |= bad

    def _screen_tainted(
        self,
        scheduler_output: SchedulerOutput,
        progress: list[tuple[str, int]],
        fresh: dict[str, list[int]],
        meta: RedisConnectorMetadata,
    ) -> tuple[list[int], set[str]]:
        """The tainted blocks (``_taint``) this step's requests would run on: reported as
        failed blocks with this step's output, so vLLM drops those requests' tokens and
        computes the blocks again -- the same path as a failed load. A block is clean again
        once vLLM handed it out afresh (its old prefix-cache entry is gone) or a request whose
        own context is clean computed all of it. A request whose context holds a tainted block
        taints what it computes too (vLLM caches it when it allocates it, so another request
        of the same step may read it): settled until nothing changes. Returns the blocks to
        report and the requests that run on them (nothing they compute now is saved)."""
        rows = self._step_blocks(scheduler_output, progress)
        context = {r: row.context for r, row in rows.items()}
        whole = {r: row.whole for r, row in rows.items()}
        cached = {r: row.cached for r, row in rows.items()}
        for handed_out in fresh.values():  # out of the prefix cache: what it held is gone
            self._tainted.difference_update(handed_out)
        for spec in meta.loads:  # written whole by a load (a failed one taints anew)
            self._tainted.difference_update(spec.block_ids[0] if spec.block_ids else [])
        bad: set[str] = set()
        while True:
            cleaned = {b for r, ids in whole.items() if r not in bad for b in ids}
            tainted = (self._tainted | {b for r in bad for b in cached[r]}) - cleaned
            now_bad = {r for r, ids in context.items() if any(b in tainted for b in ids)}
            if now_bad <= bad:
                break
            bad |= now_bad
        rejected = {b for r in bad for b in context[r] if b in tainted}
        self._tainted = tainted
        if rejected:
            self.stats.add(tainted_blocks_rejected=len(rejected))
        return sorted(rejected), bad

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Finished or aborted, in any state. A producer returns the handoff a consumer waits
        for; its worker publishes the commit record once the saves are acknowledged. True only
        for a request whose saves were planned and that is not loading: the worker then reports
        it finished sending once every save is staged. An aborted load returns False: vLLM
        itself holds the blocks until the load's finished_recving."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        loading = st.phase is Phase.LOADING
        if not loading:
            self._loads_out.ended(request.request_id)
        self._release(request.request_id, st)
        if not loading:
            self._drop_handoff(st)  # not loaded, and never will be: claim and delete it
        if not self.config.saves or (st.saved_blocks == 0 and st.save_start is None):
            return False, None
        n = st.saved_blocks
        holds = st.save_start is not None and not loading
        present = n if st.save_start is None else st.save_start
        # a commit even for 0 blocks once a save was planned (a state offered before any
        # attention block of the request was saved): the worker forgets the request only then
        self._pending_commits.append(
            CommitSpec(
                req_id=request.request_id,
                handoff=st.save_handoff,
                num_blocks=n,
                present_blocks=present,
                holds_blocks=holds,
            )
        )
        if self.events is not None and st.generation == self.store.generation:
            self.events.watch(request, present, n)  # announced once the ranks confirm them
        if n == 0:
            return holds, None
        params = producer_params(
            self._this_instance,
            handoff=st.save_handoff,
            consume=self.config.consume,
            num_blocks=n,
            last_hash=st.save_hashes[n - 1],
            generation=st.generation,
            opened=opened(st.opening),
        )
        return holds, params

    def _log_background_failure(self, fut: Future[Any]) -> None:
        if fut.cancelled():  # cancelled at shutdown
            return
        exc = fut.exception()
        if exc is not None:
            self._report_background_failure(exc)

    def _report_background_failure(self, exc: BaseException) -> None:
        self.stats.add(redis_errors=1)
        total = self.failures.add(f"background:{type(exc).__name__}")
        if total:
            logger.warning(
                "Redis: a background call (deleting unused blocks, marking a handoff) failed "
                "(%d so far): %s",
                total,
                exc,
            )

    # ------------------------------------------------------------------ resets
    def reset_cache(self) -> bool:
        """Invalidate every block of the namespace (``resets.NamespaceResets``)."""
        return self._resets.reset()

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (vLLM publishes them every step)."""
        return self.events.take() if self.events is not None else []

    def take_stats(self) -> dict[str, Any]:
        data = self.stats.take()
        figures = self.figures()
        loads, splits, compute = figures.loads, figures.splits, figures.compute
        if loads is not None:
            data["policy_load_bytes_per_second"] = loads.bytes_per_s
            data["policy_load_overhead_seconds"] = loads.overhead_s
        if splits is not None and self.auto_splits:
            # (only where auto may split, and band probes keep it current: elsewhere a figure
            # left from a pinned split, or bounded once, stood in /metrics for good)
            data["policy_split_bytes_per_second"] = splits.bytes_per_s
        if compute is not None:
            data["policy_step_seconds"] = compute.step_s
            data["policy_token_seconds"] = compute.token_s
            data["policy_attention_seconds"] = compute.attention_s
        is_open = not self.store.available
        if is_open != self._breaker_reported:
            data["breaker_open"] = int(is_open)
            self._breaker_reported = is_open
        opens = self.store.breaker.opens
        if opens > self._breaker_opens_reported:
            data["breaker_opens"] = opens - self._breaker_opens_reported
            self._breaker_opens_reported = opens
        return data

    @property
    def drops_waiting(self) -> int:
        """Handoffs this side still has to delete (it waits for their producer's record first);
        a shutdown leaves them to their TTLs."""
        return self._drops.waiting

    def shutdown(self) -> None:
        self._resets.close(0.0)  # sweeps stop (joined below)
        self._lookups.shutdown()
        self._background_io.shutdown(wait=False, cancel_futures=True)
        self._drops.shutdown()
        # Close the connections only once no thread still uses them: closing under a running
        # call breaks it midway (fakeredis even raises in the closing thread). Each call ends
        # within the socket timeout, so this wait is bounded.
        limit = self.config.socket_timeout_s + 1.0
        self._lookups.join(limit)
        self._drops.join(limit)
        self._background_io.shutdown(wait=True)
        self._resets.close(limit)
        self.store.close()
