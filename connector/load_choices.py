"""How this instance serves each hit it answers: the load policy's choice (``load_policy.py``)
from what the instance measured -- whole loads, split bands and forward passes, as the workers
report them (``figures.py``), the store between them probed in the background (``probes.py``) --
and from what the engine is busy with: the pass just scheduled, this step's admissions, the
loads in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from connector.config import RedisConnectorConfig
from connector.figures import (
    MAX_AGE_S,
    ComputeRate,
    LoadFit,
    LoadRate,
    SplitRate,
    StepShape,
    splits_within_loads,
)
from connector.load_policy import (
    Busy,
    BusyWeights,
    Decision,
    Engine,
    Figures,
    Hit,
    LoadsInFlight,
    Reason,
    WaitingQueue,
    Way,
    admitted,
    choose,
    next_pass,
    pinned,
)
from connector.probes import IDLE_AFTER_S, IDLE_PROBE_FOR_S, ProbePlanner, ProbeSpec
from connector.request_state import CountedOnce, RequestState
from connector.stats import StatsBuffer

if TYPE_CHECKING:
    from vllm.v1.request import Request

# the scheduler side's log: its lines keep the name they are filtered by
logger = logging.getLogger("connector.scheduler")
# splits whose forward pass ran layers without waiting for their bands (a full CUDA graph):
# after this many, no split is chosen any more (each such split fails and is recomputed)
UNWAITED_SPLITS_LIMIT = 2
# the most steps a request waits for the samples of the workers' idle probes, and how long
# after the last step they may still be worth waiting for (the workers probe for
# ``IDLE_PROBE_FOR_S``, and samples are used for ``MAX_AGE_S``)
IDLE_WAIT_STEPS = 4
# the most steps a pass's split is kept for a hit that waited for it, before vLLM asks about it
RESERVED_STEPS = 2
IDLE_SAMPLES_USABLE_S = IDLE_PROBE_FOR_S + MAX_AGE_S


class LoadChoices:
    def __init__(
        self,
        config: RedisConnectorConfig,
        block_size: int,
        stats: StatsBuffer,
        split_refusal: str | None,
        load_shape: tuple[int, int],
        engine: Engine | None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.stats = stats
        # why this engine cannot take a split (None: it can), and what the policy decides from
        self.split_refusal = split_refusal
        self.engine = engine or Engine()
        self.load_rate = LoadRate()
        self.split_rate = SplitRate()
        self.compute_rate = ComputeRate()
        self.weights = BusyWeights(decode=config.busy_decode_weight)
        self.probes = ProbePlanner()
        # the idle probes the workers were last sent (``probes.ProbePlanner.idle_order``);
        # when a step was last scheduled or its output came in (``time.monotonic``); and the
        # steps scheduled and outputs taken so far
        self._idle_order: tuple[ProbeSpec, ...] = ()
        self._step_seen_at = time.monotonic()
        self._steps_built = 0
        self._outputs_seen = 0
        self._unwaited_splits = 0  # splits whose forward pass skipped their waits
        # what the engine runs besides a request being admitted (``_busy``): the pass just
        # scheduled, seen as the next one, and what this step's admissions added to it
        self._running = Busy()
        self._admitted = Busy()
        # this step's asynchronous admissions not yet started: request -> the bytes
        # ``_admitted`` holds for it (a load that starts moves into ``loads_out``)
        self._admitted_loads: dict[str, float] = {}
        self.loads_out = LoadsInFlight()  # requests loading asynchronously
        self.waiting = WaitingQueue()  # vLLM's, as the connector hears of it
        # the request whose split waits for the pass after this step's (it was promised that
        # pass's split), and the one the pass being planned keeps its split for, until it is
        # asked about again (``load_policy.Busy.split_reserved``), for at most
        # ``RESERVED_STEPS`` steps scheduled
        self._promised: str | None = None
        self._reserved: str | None = None
        self._reserved_steps = 0
        # one block, every layer, as a worker rank reads it (the most over ranks), and the bands
        # of layers a split reads it in (the fewest): vLLM's page sizes say, until the workers
        # report what they read
        self.block_bytes, self.bands = load_shape

    def figures(self) -> Figures:
        """What the load policy decides from now (``figures.py``)."""
        loads = self._loads()
        splits = splits_within_loads(loads, self.split_rate.estimate())
        return Figures(loads, splits, self.compute_rate.estimate())

    def _loads(self) -> LoadFit | None:
        """The whole loads' figure (none before a rank said how large its blocks are)."""
        return self.load_rate.estimate() if self.block_bytes > 0 else None

    def _load_rate(self) -> float | None:
        """The whole loads' bandwidth now, what the loads in flight drain at (None: not
        measured)."""
        loads = self._loads()
        return loads.bytes_per_s if loads is not None else None

    def load_started(self, req_id: str, nbytes: float, now: float) -> None:
        """An asynchronous load of ``nbytes`` a rank starts now (``time.monotonic``): in the
        loads in flight from now, and no longer among this step's admissions (vLLM starts it
        before it asks about the next request of the step, which saw it twice)."""
        self.loads_out.started(req_id, nbytes, now, self._load_rate())
        planned = self._admitted_loads.pop(req_id, None)
        if planned is not None:
            more = self._admitted
            self._admitted = replace(
                more,
                loads=max(0, more.loads - 1),
                load_bytes_ahead=max(0.0, more.load_bytes_ahead - planned),
            )

    def load_ended(self, req_id: str) -> None:
        """The asynchronous load of ``req_id`` landed, failed or was given up."""
        self.loads_out.ended(req_id, time.monotonic(), self._load_rate())

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
            loads=len(self.loads_out) + more.loads,
            load_bytes_ahead=self.loads_out.bytes_left(time.monotonic(), self._load_rate())
            + more.load_bytes_ahead,
            split_bytes=more.split_bytes,  # (one split a pass: a second waits for the next)
            next_split_taken=self._promised is not None,  # (... and one hit waits for that)
        )

    def left_the_queue(self, req_id: str) -> None:
        """vLLM admitted ``req_id`` or ended it: no longer waiting, and no pass kept for it."""
        self.waiting.remove(req_id)
        if self._promised == req_id:
            self._promised = None
        if self._reserved == req_id:
            self._reserved = None

    def decide(self, st: RequestState, request: Request, start: int) -> None:
        """How to serve the hit ``[start, present)``: the load policy's choice (or a pinned
        way), counted and kept with the request."""
        hit = Hit(
            start,
            max(start, st.present_blocks),
            request.num_prompt_tokens,
            self.block_size,
            self.block_bytes,
            self.bands,
        )
        st.decided(None, start)
        if hit.blocks <= 0:
            return
        self.probes.remember(st.load_names.first_group(start, hit.end), request.request_id)
        way = st.pin or self.config.load_policy.pinned
        figures, busy = self.figures(), self._busy()
        rid = request.request_id
        busy = replace(
            busy,
            waiting=self.waiting.behind(rid),
            split_reserved=self._reserved is not None and self._reserved != rid,
        )
        if self._reserved == rid:
            self._reserved = None  # (asked about: the pass's split is its to take or leave)
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
                may_wait_a_pass=not st.waited_a_pass,
            )
            if decision.waits_a_pass:
                # another split holds this step's pass: asked again next step, and decided
                # then (never waiting twice)
                st.waits_a_pass()
                self._promised = request.request_id
                self.stats.add(splits_after_a_pass=1)
                logger.debug(
                    "request %s: %d block(s) in Redis after %d local: a split of %d waits "
                    "for the next pass (predicted %s; %d queued)",
                    request.request_id,
                    hit.blocks,
                    start,
                    decision.blocks,
                    decision.predicted_s,
                    busy.waiting,
                )
                return
            # recomputed because of the store: it stays under watch, and this hit is what
            # probes read
            self.probes.note_choice(decision.recomputed_for_the_store)
        st.decided(decision, start + decision.blocks)
        self._take_share(request.request_id, hit, decision)
        # counted when it takes effect (``count_choice``): a request whose local hits shrank
        # is decided again, and the last decision is the one served
        st.chosen = (decision, hit, way is None)
        logger.debug(
            "request %s: %d block(s) in Redis after %d local: %s %d (%s; predicted %s; %d queued)",
            request.request_id,
            hit.blocks,
            start,
            decision.way.value,
            decision.blocks,
            decision.reason.value,
            decision.predicted_s or "-",
            busy.waiting,
        )

    def answered_again(self, st: RequestState, request: Request) -> None:
        """vLLM asks again, in a later step, about a request it could not allocate: the same
        answer takes the same share of this step's pass and store (a split decided before
        left none, and a second split could share its pass: a review)."""
        if st.chosen is None:
            return
        decision, hit, _ = st.chosen
        self._take_share(request.request_id, hit, decision)

    def _take_share(self, req_id: str, hit: Hit, decision: Decision) -> None:
        """An answer given in this step takes its share of the pass and of the store."""
        self._admitted = admitted(self._admitted, hit, decision)
        if decision.way is Way.ASYNC:
            self._admitted_loads[req_id] = hit.blocks * hit.block_bytes

    def count_choice(self, st: RequestState) -> None:
        """The request's last decision took effect (vLLM allocated its blocks): counted, once
        an admission."""
        if st.chosen is None or not st.count_once(CountedOnce.CHOICE):
            return
        decision, hit, measured = st.chosen
        self.stats.add(**{f"chose_{decision.way.value}": 1})
        if decision.way is Way.RECOMPUTE:
            self.stats.add(tokens_recompute_chosen=hit.blocks * self.block_size)
        if decision.gain_s is not None and measured:
            self.stats.observe("predicted_gain_seconds", decision.gain_s)
        if decision.reason is Reason.FOR_THE_QUEUE:
            self.stats.add(splits_for_the_queue=1)

    def next_pass(self, rows: Sequence[tuple[int, int, bool, int]]) -> None:
        """A step was scheduled (``rows``: see ``load_policy.next_pass``): it is the pass the
        next admissions run beside, and none of them is admitted yet."""
        self._running, self._admitted = next_pass(rows, self.engine), Busy()
        self._admitted_loads.clear()
        # the passes after it keep their split for the hit that waited for one, until it is
        # asked about (vLLM may not ask that step: a preemption, a budget the running requests
        # used up), for a few steps at most
        if self._promised is not None:
            self._reserved, self._reserved_steps = self._promised, RESERVED_STEPS
            self._promised = None
        elif self._reserved is not None:
            self._reserved_steps -= 1
            if self._reserved_steps <= 0:
                self._reserved = None
        self._step_seen_at = time.monotonic()
        self._steps_built += 1

    def output_seen(self) -> None:
        """A step's output was taken (vLLM asks the scheduler side for its stats with each)."""
        self._step_seen_at = time.monotonic()
        self._outputs_seen += 1

    def step_probes(
        self, quiet_step: bool, splits_running: bool
    ) -> tuple[ProbeSpec | None, list[ProbeSpec] | None]:
        """What this step's metadata carries for probing the store (``probes.py``): the probe
        due now, if any, and the workers' idle probes when they changed (None: unchanged).
        ``quiet_step``: the step computes no prompt and loads nothing; ``splits_running``: a
        split's load runs in it."""
        figures = self.figures()
        # where the pass runs on the cores a probe's reads use (vLLM's CPU backend), a
        # probe waits for a step that computes no prompt and loads nothing (``probes.py``)
        quiet = self.engine.overlap or (
            quiet_step and not len(self.loads_out) and not splits_running
        )
        due = self.probes.due(
            figures.loads, figures.splits, self.auto_splits, self.block_bytes, quiet
        )
        order: tuple[ProbeSpec, ...] = ()
        if self.config.load_policy.pinned is None:
            # (an instance whose every hit is served one fixed way decides nothing from
            # them: on the bench's shared core, a recomputing server's idle probes slowed
            # the auto server's prompts beside them by 5%)
            order = self.probes.idle_order(
                figures.loads, figures.splits, self.auto_splits, self.block_bytes
            )
        if order == self._idle_order:
            return due, None
        self._idle_order = order
        return due, list(order)

    def idle_samples_may_wait(self) -> bool:
        """Whether the workers may hold samples of idle probes this side has not seen, which
        the next hit's choice hangs on: they had an order (only sent while a figure is missing
        or an upper bound, or the store is under watch), and no step has been scheduled, nor
        its output come in, for ``IDLE_AFTER_S`` -- nor for so long that what they measured
        is too old to use (``idle_probes.py``)."""
        idle_s = time.monotonic() - self._step_seen_at
        return bool(self._idle_order) and IDLE_AFTER_S <= idle_s <= IDLE_SAMPLES_USABLE_S

    def wait_mark(self) -> tuple[int, int]:
        """Where a wait for the next step's output begins: (steps scheduled, outputs taken)."""
        return self._steps_built, self._outputs_seen

    def output_pending(self, mark: tuple[int, int]) -> bool:
        """Whether no step's output has come in since ``mark`` (``wait_mark``; after an idle
        spell none is in flight, and with vLLM's async scheduling the next step is scheduled
        before the first one's output comes), for at most ``IDLE_WAIT_STEPS`` steps: an
        output vLLM did not hand over must not hold anyone."""
        built, seen = mark
        return self._outputs_seen <= seen and self._steps_built - built < IDLE_WAIT_STEPS

    def _take_compute_sample(
        self, tokens: float, attention: float, rows: float, context: float, seconds: float
    ) -> None:
        shape = StepShape(int(tokens), float(attention), int(rows), int(context))
        self.compute_rate.add(shape, seconds)
        # (what the compute figure is fitted from, for reading a choice's prediction back)
        logger.debug(
            "a forward pass: %d prompt token(s) attending %.0f, %d decode(s) reading %d: %.1f ms",
            shape.prefill_tokens,
            shape.prefill_attention,
            shape.decode_rows,
            shape.decode_context,
            seconds * 1e3,
        )

    def take_samples(self, stats: Any) -> None:
        """The workers' measurements, for the load policy's figures (``figures.py``): each
        kind as the workers send it (``worker.py``); anything else teaches nothing."""
        data = getattr(stats, "data", None)
        if not isinstance(data, dict):
            return
        # (each with how long ago the rank recorded it, last: ``StatsBuffer.timed_sample``)
        kinds: dict[str, Any] = {
            "load_samples": lambda r, b, s, lag, age=0.0: self.load_rate.add(
                b, s, int(r), lag if lag >= 0 else None, age
            ),
            "load_bounds": lambda r, b, s, age=0.0: self.load_rate.add_bound(b, s, int(r), age),
            "split_samples": lambda r, b, first, between, bands, age=0.0: self.split_rate.add(
                b, first, between, int(bands), int(r), age
            ),
            "split_bounds": lambda r, b, s, age=0.0: self.split_rate.add_bound(b, s, int(r), age),
            "compute_samples": self._take_compute_sample,
        }
        for key, take in kinds.items():
            for values in _entries(data, key):
                try:
                    take(*(float(v) for v in values))
                except (TypeError, ValueError, OverflowError):  # not what our workers send
                    logger.debug("ignoring a malformed %s in the connector's stats", key)
        try:
            if data.get("rank_block_bytes"):  # each rank's, the slowest sets the pace
                self.block_bytes = max(int(b) for (b,) in data["rank_block_bytes"])
            if data.get("split_bands"):
                self.bands = min(int(b) for (b,) in data["split_bands"])
        except (TypeError, ValueError, OverflowError):
            logger.debug("ignoring a malformed load shape in the connector's stats")
        # (lists: one entry a probe and rank, each the probe's ``probe_id``)
        for key, report in (
            ("probe_done", self.probes.reported),
            ("probe_missing", self.probes.missing),
        ):
            for values in _entries(data, key):
                try:
                    (probe_id,) = values
                    report(int(probe_id))
                except (TypeError, ValueError, OverflowError):
                    logger.debug("ignoring a malformed %s in the connector's stats", key)
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

    def report(self, data: dict[str, Any]) -> None:
        """The figures the policy decides from, into the metrics ``data``."""
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


def _entries(data: dict[str, Any], key: str) -> list[Any]:
    """The entries of one kind of sample in the workers' stats: a sequence of sequences (lists,
    or tuples after a serializer); anything else (not what our workers send) is none."""
    entries = data.get(key)
    if not isinstance(entries, list | tuple):
        return []
    return [e for e in entries if isinstance(e, list | tuple)]
