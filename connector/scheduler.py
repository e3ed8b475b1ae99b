"""Scheduler side: which prompt blocks are in Redis, which to load, which to save -- one
request's life as a state machine, driven here by vLLM's callbacks. Its parts are beside it:
what is kept of each request (``request_state.py``), its lookups polled (``lookup_polls.py``),
how each hit is served (``load_choices.py``), the loads in flight and what they delivered
(``load_tracking.py``), consume-mode handoffs claimed and deleted (``consumed_handoffs.py``),
blocks a failed split left wrong (``taints.py``), and each step's saves (``save_plans.py``).

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
nothing. (A split never meets a preemption mid-load: that happens in scheduling, and the split
ends with its step. An abort may come during the split's step -- vLLM's EngineCore takes it
after the forward pass, before the step's output -- and then request_finished comes before the
split's failed blocks: the split's state is kept until that output, so they are still tainted.)

A model with several KV-cache groups (full attention, sliding window) keeps one chain of
positions: each group's block at a position is its own key (``KVLayout.chain_names``), a hit
needs every full-attention block and only a windowed group's window (``usable_prefix``), and
loads and saves carry every group's block ids (a sliding window's past is vLLM's null block,
which the worker skips).

"Drop the handoff" (consume mode): once its producer is done writing, claim it, and delete its
chain and record unless another request's claim is there (``drops.py``). "Finished sending"
is only ever reported for a request vLLM holds for us, so no report can free blocks a load is
still writing, or name a request vLLM has let go.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from connector.chains import RequestChains
from connector.config import LOAD_POLICY_KEY, RedisConnectorConfig
from connector.consumed_handoffs import ConsumedHandoffs
from connector.drops import HandoffDrops
from connector.figures import step_shape
from connector.layout import ChainNames, KVLayout
from connector.load_choices import LoadChoices
from connector.load_policy import Engine, LoadPolicy, Way
from connector.load_tracking import LoadTracker
from connector.logs import FailureCounts, log_bug
from connector.lookup_polls import LookupPolls
from connector.lookups import LookupBatcher
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.request_state import Phase, RequestState
from connector.resets import NamespaceResets
from connector.save_plans import SavePlanner
from connector.save_policy import SaveAllowance, marked_for_saving
from connector.stats import StatsBuffer
from connector.taints import TaintedBlocks, step_blocks
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
# an instance that does no lookups (a producer) reads the namespace's generation at most this
# often, in the background: it names its saves in a reset's generation within about a second
_GENERATION_REFRESH_S = 1.0


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
        self.events = events  # KV events for routers, when vLLM publishes them
        self.layout = layout
        self.block_size = layout.block_size
        self.stats = StatsBuffer()
        # how each hit is served, and what the load policy decides it from
        self.load_choices = LoadChoices(
            config, self.block_size, self.stats, split_refusal, load_shape, engine
        )
        # requests whose split load the metadata being built carries; and those of the step
        # before, counted (and released) once its output is in
        self._splits_planned: list[str] = []
        self._splits_running: list[str] = []
        # a request's lookup answered "not yet" in the step being scheduled: the step is empty
        # of its prompt only for that, and the next one computes it (``build_connector_meta``)
        self._held_back = False
        # of those, requests finished while their split's step ran -- vLLM's EngineCore takes
        # an abort that came during a forward pass after it and before its output -- kept
        # until that output: its failed blocks are still theirs to taint
        self._splits_finished: dict[str, RequestState] = {}
        # blocks vLLM's prefix cache holds with wrong KV after a failed split
        self._taints = TaintedBlocks(self.block_size, self.stats)
        # what a producer's kv_transfer_params must match here (transfer_params.py)
        self._this_instance = ThisInstance(config.namespace, layout.block_size, layout)
        self.store = store
        self.fingerprints = layout.all_fingerprints()
        self.failures = FailureCounts()
        self._reqs: dict[str, RequestState] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_commits: list[CommitSpec] = []
        # saves of finished requests, planned as they finished (``request_finished``)
        self._pending_saves: list[SaveSpec] = []
        # the loads planned until vLLM reports them finished, and what each delivered
        self._loads = LoadTracker(self.block_size, self.stats)
        self._lookups = LookupBatcher(
            store, self.fingerprints, config.lookup_threads, self.stats, layout
        )
        self._polls = LookupPolls(
            config, store, self._lookups, self._loads, self.stats, self.failures
        )
        # deletes and handoff records never hold up lookups
        self._background_io = ThreadPoolExecutor(1, thread_name_prefix="redis-kv-background")
        # handoffs dropped unloaded wait here for their producer to finish writing
        self._drops = HandoffDrops(
            store, self.fingerprints, config.deadlines.max_s, self._report_background_failure
        )
        self._handoffs = ConsumedHandoffs(config.consume, self._drops)
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
                st.preempted(
                    request.num_preemptions,
                    time.monotonic() + self.config.deadlines.for_prompt(st.num_tokens),
                )
            return st
        generation = self.store.generation
        chains = RequestChains(request, self.block_size, generation)
        save_handoff = uuid.uuid4().hex
        # the content chain: what share mode saves and loads, and what incoming params are
        # checked against (a consume-mode producer needs none of it)
        content = chains.shared() if self.config.loads or not self.config.consume else []
        shared = self.layout.chain_names(content, generation)
        save_names = shared
        if self.config.saves and self.config.consume:  # a chain private to this request
            save_names = self.layout.chain_names(chains.handoff(save_handoff), generation)
        handoff, load_names = None, shared
        if self.config.loads:
            handoff, load_names = self._incoming_handoff(request, shared, chains)
        st = RequestState(
            num_tokens=len(chains.tokens),
            load_names=load_names,
            save_names=save_names,
            save_handoff=save_handoff,
            deadline=time.monotonic() + self.config.deadlines.for_prompt(len(chains.tokens)),
            handoff=handoff,
            preemptions=request.num_preemptions,
            generation=generation,
            pin=self._pinned_by_request(request),
            save_marked=marked_for_saving(request.kv_transfer_params),
        )
        self._reqs[request.request_id] = st
        return st

    def _incoming_handoff(
        self, request: Request, shared: ChainNames, chains: RequestChains
    ) -> tuple[Handoff | None, ChainNames]:
        """The producer's handoff from the request's ``kv_transfer_params`` and the names of
        the chain it wrote, if the params are ours and match this instance and prompt; anything
        else is ignored with a sparse warning (the chain is then the shared one)."""
        handoff, names, problem = read_handoff(
            request.kv_transfer_params, self._this_instance, chains, shared
        )
        if problem is None:
            return handoff, names
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
        if asked is None:
            return None
        try:
            return LoadPolicy.parse(asked).pinned
        except ValueError:
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

    def _max_blocks(self, st: RequestState, request: Request) -> int:
        # Never load the last prompt token: vLLM must compute at least one to sample from.
        return min(len(st.load_names), (request.num_prompt_tokens - 1) // self.block_size)

    # ------------------------------------------------------------------ lookups
    def on_new_request(self, request: Request) -> None:
        """vLLM added a request: start its lookup now, so the answer is usually back before
        the request's first scheduling step asks for it."""
        self.load_choices.waiting.add(request.request_id)
        self._refresh_generation()
        st = self._state(request)
        end = self._max_blocks(st, request)
        if self.config.loads and end > 0 and self._lookupable(st) and self.store.available:
            self._polls.start(st, 0, end)

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
            return st.handoff_waiting
        return not self.config.consume  # consume mode loads only what was handed off to it

    def _waits_for_idle_samples(self, st: RequestState) -> bool:
        """Whether the request's lookup is not answered yet because the policy's choice for it
        (nothing pinned) waits for samples the workers' idle probes may hold: from its first
        ask after an idle spell until the output of the step scheduled next has come in
        (``LoadChoices.output_pending``). Once a request."""
        if st.pin is not None or self.config.load_policy.pinned:
            return False
        choices = self.load_choices
        if st.idle_wait_from is None:
            if not choices.idle_samples_may_wait():
                return False
            st.idle_wait_from = choices.wait_mark()
        return choices.output_pending(st.idle_wait_from)

    def _writes_back(self, st: RequestState) -> bool:
        """Share mode: its chain is the pool's, and what Redis lacks of it is written back."""
        return st.same_chain and self._lookupable(st)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched = self._matched_tokens(request, num_computed_tokens)
        if matched[0] is None:
            self._held_back = True
        return matched

    def _matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        start = num_computed_tokens // self.block_size
        if st.phase is Phase.WAITING_A_PASS:
            if start >= st.answer_start and self._lookupable(st):
                # its lookup still holds (no reset since): the choice, made now
                end = self._max_blocks(st, request)
                st.asked_after_a_pass(time.monotonic())
                present = self._polls.still_present(st, request.request_id, start, end)
                if present is None:
                    return None, False
                st.answered(start, max(start, min(present, end)))
                self.load_choices.decide(st, request, start)
                return st.answer(start, self.block_size)
            st.local_hits_shrank()
        if st.phase is Phase.ANSWERED:
            if start >= st.answer_start:  # asked again (vLLM could not allocate): same answer
                self.load_choices.answered_again(st, request)
                return st.answer(start, self.block_size)
            st.local_hits_shrank()
        if st.phase is not Phase.LOOKING_UP:
            return 0, False  # one load per admission: a failed load is recomputed, not retried
        end = self._max_blocks(st, request)
        present = 0
        if self.config.loads and end > start and self._lookupable(st):
            if self._waits_for_idle_samples(st):
                # the first request after an idle spell: a step's output brings what the
                # workers' idle probes measured (``idle_probes.py``); its lookup runs meanwhile
                if self.store.available:
                    self._polls.ask(st, start, end)
                return None, False
            found = self._polls.present_blocks(st, request.request_id, start, end)
            if found is None:
                return None, False
            present = found
        elif self.config.saves and self.config.loads and end > 0 and self._writes_back(st):
            # all of it a local hit: nothing to load, so the admission does not wait; its
            # saves wait for the answer instead (``save_plans.py``), so a prefix Redis lost
            # is written back and one it holds is not written twice
            if st.lookup is None and self.store.available:
                self._polls.start(st, 0, end)
            st.lookup_kept_for_saves()
            if st.presence is not None and not st.presence.future.done():
                self._polls.wait_in_step(st.presence.future)  # (usually back: asked on arrival)
        st.answered(start, min(present, end))
        self.load_choices.decide(st, request, start)
        if st.phase is Phase.WAITING_A_PASS:
            return None, False  # (vLLM asks again next step)
        return st.answer(start, self.block_size)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.load_choices.left_the_queue(request.request_id)
        st = self._state(request)
        st.allocated(self._per_group(blocks.get_block_ids()))
        if st.phase in (Phase.LOADING, Phase.RUNNING):
            return  # admitted again after its load: nothing changes
        if st.phase in (Phase.LOOKING_UP, Phase.WAITING_A_PASS):
            # admitted without an answer from us: nothing to load
            st.admitted_unanswered()
        else:
            self.load_choices.count_choice(st)  # (the policy's answer took effect)
        if st.same_chain:
            st.saved_up_to(st.present_blocks)  # in Redis already
        start, answered_end = st.load_range
        # vLLM may allocate fewer tokens than answered (its token budget): load whole blocks
        end = min(answered_end, start + math.ceil(num_external_tokens / self.block_size))
        if end <= start:
            st.start_running()
            # handed off to us but not loaded: deleted, unless its blocks are what the probe
            # that measures a store judged slow reads (a local hit's never are)
            hold_s = self.load_choices.probes.hold_s(request.request_id)
            self._handoffs.drop_unloaded(request.request_id, st, hold_s=hold_s)
            return
        now = time.monotonic()
        st.load_planned(start, end, now)
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
            self._splits_planned.append(rid)
        else:
            nbytes = (end - start) * self.load_choices.block_bytes
            self.load_choices.load_started(rid, nbytes, now)
        self._loads.planned(
            rid,
            st,
            others_wait=not st.layered and not self.config.consume,
            # (otherwise vLLM hears of the whole request)
            traces_blocks=not self.layout.fails_per_request,
        )
        claim = self._handoffs.claim_for_load(rid, st)
        self._pending_loads.append(
            LoadSpec(
                req_id=rid,
                block_ids=[ids[start:end] for ids in st.block_ids],
                names=st.load_names.span(start, end),
                timeout_s=timeout,
                claim=claim,
                owner=st.handoff.owner if st.handoff is not None else "",
                layered=st.layered,
            )
        )
        if st.same_chain:
            st.saved_up_to(end)  # already in Redis

    def _per_group(self, block_ids: Sequence[Sequence[int]] | None) -> list[list[int]]:
        """vLLM's block ids (one list per KV-cache group) of the groups the layout stores."""
        if not block_ids:
            return [[] for _ in self.layout.groups]
        return [list(block_ids[g.index]) for g in self.layout.groups]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if self.events is not None:
            self.events.reported(getattr(output, "kv_cache_events", None))
        self.load_choices.take_samples(getattr(output, "kv_connector_stats", None))
        if self._handoffs.held:  # the probes may have measured the store with them
            loads = self.load_choices.figures().loads
            probes = self.load_choices.probes
            self._handoffs.release_unneeded(lambda rid: probes.needs(rid, loads))
        failed_split_blocks: set[int] = set()
        for block_id in output.invalid_block_ids or ():
            owner = self._loads.block_failed(block_id)  # (vLLM recomputes from it on)
            if owner is None:
                continue
            st = self._reqs.get(owner[0])
            if owner[0] in self._splits_running:  # (a failed async load was never cached)
                split = st if st is not None else self._splits_finished.get(owner[0])
                if split is not None:
                    self._taints.taint(split, owner[1])
                failed_split_blocks.add(block_id)
            if st is not None and st.same_chain:
                # share mode: save the recomputed block again, so the bad value is replaced
                st.recomputed_from(owner[1])
        if failed_split_blocks:
            self._taints.taint_readers(failed_split_blocks)
        for req_id in getattr(output, "failed_recving", None) or ():
            # a load failed as a whole (several groups, or a windowed one): vLLM recomputes the
            # whole prompt
            self._loads.load_failed(req_id)
            st = self._reqs.get(req_id)
            if st is not None and st.same_chain:  # share mode: save what was not loaded again
                st.recomputed_from(st.load_range[0])
        for req_id in output.finished_recving or ():
            self.load_choices.load_ended(req_id)
            self._loads.count(req_id)
            st = self._reqs.get(req_id)
            if st is not None and st.phase is Phase.LOADING:
                st.start_running()
                self._loads.release(req_id, st)
            self._handoffs.loaded(req_id)  # (aborted or not: every rank is done with it)
        self._finish_splits()

    def _finish_splits(self) -> None:
        """The splits of the step whose output came in: counted (its failed blocks came with
        it), released, and their handoffs dropped (consume mode: every rank has read them).
        Called at the end of ``update_connector_output``, and when the next step's metadata is
        built (a step whose output carried nothing for the connector)."""
        for req_id in self._splits_running:
            self._loads.count(req_id)
            st = self._reqs.get(req_id) or self._splits_finished.get(req_id)
            if st is not None:
                self._loads.release(req_id, st)
            self._handoffs.loaded(req_id)
        self._splits_running = []
        self._splits_finished.clear()
        self._taints.forget_step()

    # ------------------------------------------------------------------ steps and commits
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RedisConnectorMetadata:
        self._polls.new_step()  # the step is over: the next one may wait again
        held_back, self._held_back = self._held_back, False
        self._finish_splits()
        self._splits_running, self._splits_planned = self._splits_planned, []
        rows = self._scheduled_rows(scheduler_output)
        meta = RedisConnectorMetadata(
            loads=self._pending_loads,
            commits=self._pending_commits,
            step=step_shape([(before, n, prompt) for before, n, prompt, _ in rows]),
        )
        self.load_choices.next_pass(rows)
        if self.config.loads:
            # (a step empty only because a request's answer is pending is not quiet: a probe
            # it carried read the store through the prompt's pass after it, on the CPU bench
            # for a second of every recomputed prompt's 1.7 s while the store was slow)
            quiet_step = meta.step.prefill_tokens == 0 and not meta.loads and not held_back
            probe, idle = self.load_choices.step_probes(quiet_step, bool(self._splits_running))
            if probe is not None:
                meta.probes.append(probe)
            meta.idle_probes = idle
        self._pending_loads, self._pending_commits = [], []
        progress, fresh = self._track_block_tables(scheduler_output)
        if self._splits_running:  # what a failed split would taint (``taints.py``)
            self._taints.remember_step(
                step_blocks(scheduler_output, progress, self._reqs, self.block_size)
            )
        held: set[str] = set()  # requests whose blocks of this step are saved a step later
        if self._taints.blocks:
            rows_now = step_blocks(scheduler_output, progress, self._reqs, self.block_size)
            meta.reject_blocks, held = self._taints.screen(rows_now, fresh, meta.loads)
        if not self.config.saves:
            return meta
        meta.saves = self._pending_saves + self._save_planner.plan(
            scheduler_output, self._reqs, progress, held, meta.loads
        )
        self._pending_saves = []
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
                st.allocated(self._per_group(new.block_ids))
                progress.append((new.req_id, new.num_computed_tokens))
                st.scheduled(new.num_computed_tokens + scheduled.get(new.req_id, 0))
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
                st.allocated(self._per_group(new_ids))
                first = computed // self.block_size
                fresh[req_id] = st.block_ids[0][first:] if st.block_ids else []
            elif new_ids:
                more_ids = self._per_group(new_ids)
                st.blocks_appended(more_ids)
                fresh[req_id] = more_ids[0] if more_ids else []
            progress.append((req_id, computed))
            st.scheduled(computed + scheduled.get(req_id, 0))
        return progress, fresh

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Finished or aborted, in any state. A producer returns the handoff a consumer waits
        for; its worker publishes the commit record once the saves are acknowledged. True only
        for a request whose saves were planned and that is not loading: the worker then reports
        it finished sending once every save is staged. An aborted load returns False: vLLM
        itself holds the blocks until the load's finished_recving."""
        self.load_choices.left_the_queue(request.request_id)
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        loading = st.phase is Phase.LOADING
        if not loading:
            self.load_choices.load_ended(request.request_id)
        if request.request_id in self._splits_running:
            # its step's output, with the split's failed blocks, comes after this: released
            # then (``_finish_splits``), so what failed is still traced and tainted
            self._splits_finished[request.request_id] = st
        else:
            self._loads.release(request.request_id, st, load_runs=loading)
        if not loading:
            # not loaded, and never will be: claim and delete it
            self._handoffs.drop_unloaded(request.request_id, st)
        if (
            self.config.saves
            and request.request_id in self._save_planner.held_for_splits
            and st.running
            and _finished_its_output(request)
        ):
            # its blocks of the step just run were held for that step's output (it ran on a
            # split's blocks), and its output ended with the step: vLLM handles the step's
            # failed blocks before it finishes any request, and ends no output over a failed
            # block, so what it computed stands -- saved now, with its commit (it was lost: a
            # prompt finished in its split's step saved nothing past the split). Not an abort
            # (it may come during the step, before the step's failures are known), nor an
            # error (kv_load_failure_policy=fail ends those on a failed load's blocks: a
            # review found their KV saved)
            # (the window's rule at every token computed: it may skip a block vLLM still
            # holds, never read one it gave away -- no table of vLLM's comes with this call)
            spec = self._save_planner.plan_request(
                request.request_id,
                st,
                request.num_computed_tokens,
                computed=request.num_computed_tokens,
            )
            if spec is not None:
                self._pending_saves.append(spec)
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
            saved=st.save_names,
            num_blocks=n,
            opened=st.record_opened(),
        )
        return holds, params

    def _log_background_failure(self, fut: Future[Any]) -> None:
        if fut.cancelled():  # cancelled at shutdown
            return
        exc = fut.exception()
        if exc is not None:
            self._report_background_failure(exc)

    def _report_background_failure(self, exc: BaseException) -> None:
        if not isinstance(exc, KVStoreError):  # a bug, not Redis's doing: with its traceback
            self.stats.add(internal_errors=1)
            log_bug(self.failures, logger, "background", exc, "a background call")
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

    # ------------------------------------------------------------------ resets
    def reset_cache(self) -> bool:
        """Invalidate every block of the namespace (``resets.NamespaceResets``)."""
        return self._resets.reset()

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (vLLM publishes them every step)."""
        return self.events.take() if self.events is not None else []

    def take_stats(self) -> dict[str, Any]:
        """vLLM asks for them with every step's output."""
        self.load_choices.output_seen()
        data = self.stats.take()
        self.load_choices.report(data)
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
        # (bounded too: a call that hangs in no socket -- a bug -- held shutdown for ever; the
        # executor offers no bounded wait, so its threads are joined)
        threads = list(getattr(self._background_io, "_threads", ()))
        until = time.monotonic() + limit
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            logger.warning(
                "RedisConnector: a background call (a handoff mark, a deletion) is still "
                "running %.0f s into shutdown; closing without it",
                limit,
            )
        self._resets.close(limit)
        self.store.close()


def _finished_its_output(request: Request) -> bool:
    """Whether vLLM finished ``request`` because its output ended (a stop, its length, a
    repetition) -- not aborted, not failed (kv_load_failure_policy=fail finishes the requests
    on a failed load's blocks as errors, before the connector hears of the failure), not
    ignored."""
    from vllm.v1.request import RequestStatus

    return request.status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_REPETITION,
    )
