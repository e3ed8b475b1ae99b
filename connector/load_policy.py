"""How to serve a prompt's blocks found in Redis: load them all before the request runs
(``async``), load the first of them layer by layer while vLLM computes the rest of the prompt in
the same forward pass (``split``), or load nothing (``recompute``). Chosen per request from
what this instance measures (``figures.py``), to give the earliest first token -- counting
what each way costs the other requests whose first token is still to come.

The model behind the choice, for a request whose blocks ``[s, s + h)`` are in Redis (``s``
blocks cached locally), ``n`` prompt tokens, ``B`` the block size. vLLM runs steps; each holds
the running decodes, then prompt tokens up to its token budget (``Engine``), the requests
already computing their prompts first (``Busy``), each request at most ``chunk_tokens`` of
its prompt per step. A pass costs ``ComputeFit.pass_seconds`` of what it holds.

- recompute: the passes that compute tokens ``[s B, n)``, chunk by chunk;
- async: the load (``LoadFit``: its lag after the step starts, its overhead, then its bytes
  after the bytes of the loads already in flight, which share the store), rounded up to the
  end of the step it lands in (vLLM hears of it with that step's output), then the passes
  that compute the rest;
- split of ``j`` blocks (``SplitFit``), in ``b`` bands of layers: the admitting step computes
  its first chunk of the rest while the bands land; each band of layers of the pass waits for
  its band, so with ``x`` a band's transfer and ``c`` the pass's compute per band of layers,
  the step takes ``first + max(x + b c, b x + c)`` -- loading and computing overlap, the slower
  sets the pace; later chunks follow as passes. The bands share the store with the loads in
  flight while those have bytes left (``_Model.band_seconds``). One split a pass: a hit decided
  beside another's split, where recomputing is its way now, may wait for the next pass
  (``Reason.AFTER_THIS_PASS``: the end of the pass being planned, then its split there, the
  requests queued behind it admitted meanwhile and ahead of it), once, where that beats
  recomputing by ``WAIT_MARGIN``; one hit a step (``Busy.next_split_taken``), and the pass
  keeps its split for it (``Busy.split_reserved``). ``j`` leaves at least ``MIN_SPLIT_REST``
  tokens to compute (a one-token pass is a uniform decode batch, which vLLM replays as a full
  CUDA graph: no per-layer wait runs).

Each way's cost is the request's own time to first token plus what it adds to the others'
(``BusyWeights``):
- every request still computing its prompt loses the time the way adds to the passes it shares
  with it (a split stalls the whole pass while it waits for bands);
- every request loading loses what it waits longer for this one's bytes on the store it
  shares (at most this load's transfer each, and at most its own rest: in all, at most the
  bytes still ahead), and, if its load lands while this request's passes run, half a pass;
- decodes count at ``decode`` weight (0 by default: the policy never trades a request's first
  token for the others' inter-token gaps);
- the requests queued for admission behind it (``Busy.waiting``: vLLM's waiting queue, which the
  connector hears of) are served later by all the engine time a way takes -- counted between a
  split and recomputing only, both of which hold the engine: what a split saves of it, every
  request queued gains (below).
An idle engine reduces this to the request's own time; on a busy one ``async`` (which takes
nothing of the forward pass) gains, until the loads in flight make it slow.

A load is chosen only where its cost beats recomputing's by ``MARGIN``, and a split only where
it beats a plain load by as much: a gain within the model's error is no gain.

Where recomputing wins so and requests are queued behind (``WaitingQueue``), a split is taken
instead (``Reason.FOR_THE_QUEUE``; against recomputing alone) if it is no slower for the
request itself, saves at least ``MIN_QUEUED_SAVING`` of recomputing's engine time, and what it
saves the queue (each queued request gains that engine time) both tips the balance by the
margin and is at least ``QUEUED_GAIN_SHARE`` of recomputing's cost. On a saturated engine this
is where a split pays:
16 clients of 32k-token hits at 0.94 GB/s in the simulator, a split of every hit 7-14% sooner
than recomputing, which auto chose for every hit while each split looked 2-4% ahead for its
own request. Loads get no such credit: on a busy engine they land at 0.5-0.8 of their
predicted time (behind the prompts admitted meanwhile), and pricing the queue for them made
auto load where a split of every hit was best (``docs/benchmarks.md``).

A way that is pinned (``load_policy``, or a request's own) is taken as it is: a pinned
``split`` loads the best ``j`` where the figures are measured, the whole hit before. Until the
instance has measured the store, a share-mode hit is recomputed while background probes
(``probes.py``) measure it, not users' requests; a handoff (made for this request to load) is
loaded, but no longer than recomputing it would plausibly take (``plausible_recompute_s``): a
load past that ends and the request recomputes, and what landed by then is a figure
(``figures.py``). A measured choice's load waits at most its prediction plus recomputing's.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from connector.figures import (
    ComputeFit,
    LoadFit,
    SplitFit,
    StepShape,
    attention_work,
    step_shape,
)

# a split leaves at least this many prompt tokens to compute in its pass (see above)
MIN_SPLIT_REST = 2
# a load is chosen only where it is predicted to cost at least this much less than recomputing
# (a fraction of recomputing's cost), and a split only where it beats a plain load by as much:
# the model's errors are of this order. In the simulator (scripts/sim_load_policy.py, 384
# cells, 2026-11-29) 0.05 missed its targets in 21 cells (splits 6-8% faster than recomputing
# never taken), 0.04 in 15, 0.03 and 0.02 in 14 and 12 but with one cell's p99 at 1.27x
# recomputing's (splits of a slow store's bands taken on a thin predicted gain); 0.10 lost more
MARGIN = 0.04
# before any prefill was measured: what a prompt plausibly costs at most (a slow CPU's figures:
# a GPU computes a token 30-300x faster, and is measured within its first passes)
PRIOR_STEP_S = 0.05
PRIOR_TOKEN_S = 1e-3
# past this many steps of others' prompts ahead, the rest is taken as one lump (bounded work)
_MAX_STEPS = 256
# a hit waits for the next pass to split in only where that beats recomputing now by this much
# (a fraction of recomputing's cost): the next pass is not planned yet, and what the step
# admits after the hit is not known. In the simulator the waits predicted 30-45% ahead paid;
# with the plain 4% margin, waits predicted 5-15% ahead made busy cells up to 1.35x slower
WAIT_MARGIN = 0.2
# asynchronous loads a worker runs at once (more queue for a thread; the model counts them)
LOAD_THREADS = 2
# a split is taken for the queue's sake only where the queue gains at least this share of
# recomputing's cost: about the model's error on a busy engine (a split lands at 0.89-0.97 of
# its prediction there). Without it, a queue of 1-3 tipped thin choices: in the simulator's
# 70B, 0.94 GB/s, 4 clients of 32k-token hits the mix moved to loads that landed late, and
# p99 went from 0.98x recomputing's to 1.23-1.27x
QUEUED_GAIN_SHARE = 0.10
# ... and saves each of them at least this share of recomputing's engine time: a long queue
# clears the floor above with any saving, and a saving of a fraction of a percent is noise (a
# review: with 30 or more queued, a split saving 0.55% was taken). The simulator's splits taken
# for the queue save 2.4-5.1% (least to median)
MIN_QUEUED_SAVING = 0.02


class Way(enum.Enum):
    ASYNC = "async"
    SPLIT = "split"
    RECOMPUTE = "recompute"


class LoadPolicy(enum.Enum):
    """How an instance serves its hits (its ``load_policy`` setting): ``auto`` chooses per
    request by the model above; any other pins one way."""

    AUTO = "auto"
    ASYNC = Way.ASYNC.value
    SPLIT = Way.SPLIT.value
    RECOMPUTE = Way.RECOMPUTE.value

    @classmethod
    def parse(cls, value: object) -> LoadPolicy:
        """The policy a config value names; ``ValueError`` naming the choices."""
        if isinstance(value, LoadPolicy):
            return value
        for policy in cls:
            if value == policy.value:
                return policy
        raise ValueError(f"load_policy must be one of {POLICIES}, got {value!r}")

    @property
    def pinned(self) -> Way | None:
        """The way it pins, or None (``auto``: the policy chooses per request)."""
        return None if self is LoadPolicy.AUTO else Way(self.value)


# the ``load_policy`` setting's values
POLICIES = tuple(p.value for p in LoadPolicy)


class Reason(enum.Enum):
    """Why a hit is served the way it is."""

    NO_HIT = "no hit"
    PINNED = "pinned"
    MEASURED = "measured"
    NOT_MEASURED = "not measured yet"
    FOR_THE_QUEUE = "measured, for the requests queued behind"
    AFTER_THIS_PASS = "measured, a split in the next pass"
    SPLIT_UNAVAILABLE = "split unavailable"


@dataclass(frozen=True)
class Hit:
    """A request's blocks in Redis: ``[start, end)`` (absolute block positions; blocks before
    ``start`` are cached locally), of a prompt of ``prompt_tokens``."""

    start: int
    end: int
    prompt_tokens: int
    block_size: int
    block_bytes: int  # what one rank reads for one block, every layer
    bands: int  # how many bands of layers a split reads a block in

    @property
    def blocks(self) -> int:
        return self.end - self.start

    def max_split(self) -> int:
        """The most blocks a split may load: it leaves ``MIN_SPLIT_REST`` tokens to compute."""
        room = (self.prompt_tokens - MIN_SPLIT_REST) // self.block_size - self.start
        return max(0, min(self.blocks, room))


@dataclass(frozen=True)
class Engine:
    """What vLLM's scheduler lets one step hold (its scheduler config)."""

    token_budget: int = 8192  # max_num_batched_tokens
    chunk_tokens: int = 0  # the most prompt tokens one request gets per step (0: the budget)
    # whether a split's reads overlap the pass's compute: on a GPU they do (the pass runs on
    # the device); on vLLM's CPU backend the pass runs on the cores the loader threads share
    overlap: bool = True

    @property
    def cap(self) -> int:
        budget = max(1, self.token_budget)
        return min(budget, self.chunk_tokens) if self.chunk_tokens > 0 else budget


@dataclass(frozen=True)
class Busy:
    """What the engine holds as a request is admitted (its other requests)."""

    batch: StepShape = field(default_factory=StepShape)  # their next pass: decodes, prompts
    prefills: int = 0  # requests still computing their prompts (their first token waits)
    prefill_tokens_ahead: int = 0  # prompt tokens those still compute: served first
    loads: int = 0  # requests loading asynchronously now (their first token waits on it)
    load_bytes_ahead: float = 0.0  # what a rank still receives for those loads
    split_bytes: float = 0.0  # what a rank reads for the splits of the pass being planned
    # a hit waits for the next pass to split in (``Decision.waits_a_pass``): that pass's split
    # is taken; and the split of the pass being planned is kept for a hit that waited for it,
    # not asked about yet (vLLM puts the requests it skipped back at the head of its queue,
    # each asked about in turn: one ahead of that hit would take its split)
    next_split_taken: bool = False
    split_reserved: bool = False
    waiting: int = 0  # requests queued for admission behind it (vLLM's waiting queue)


IDLE = Busy()


def next_pass(rows: Sequence[tuple[int, int, bool, int]], engine: Engine) -> Busy:
    """The engine's next pass as the pass just scheduled leaves it, from its requests' (tokens
    cached before it, tokens it computes, whether they are prompt tokens, prompt length):
    its decodes (a prompt finished now decodes next), and the prompts still being computed,
    a chunk each."""
    prefills: list[tuple[int, int]] = []  # (computed after this pass, tokens left)
    decode_rows = decode_context = 0
    for before, n, prompt, prompt_len in rows:
        done = before + n
        if prompt and done < prompt_len:
            prefills.append((done, prompt_len - done))
        else:
            decode_rows += 1
            decode_context += done
    batch = step_shape([(done, min(left, engine.cap), True) for done, left in prefills])
    return Busy(
        batch=batch.plus(StepShape(decode_rows=decode_rows, decode_context=decode_context)),
        prefills=len(prefills),
        prefill_tokens_ahead=sum(left for _, left in prefills),
    )


class LoadsInFlight:
    """Asynchronous loads running now: what a new load queues behind at the store. The store
    serves a rank's loads first come first served at its whole-load rate (``LoadFit``), so
    what is left of them is a backlog: each load adds its bytes as it starts, the link drains
    it at the figure's rate while there is any, and no more is left than the bytes of the
    loads still running (one that landed took its bytes with it). Before: each load's bytes
    left the queue over its own predicted time to first token, so loads queued behind others
    looked half gone before their first byte, and the model made up for it by counting the
    queue into every load's start-up lag -- which then said an idle store's load starts 2 s
    late (the simulator's busy cells: splits chosen over loads 6x faster than predicted)."""

    def __init__(self) -> None:
        self._loads: dict[str, float] = {}  # request -> the bytes a rank loads for it
        self._backlog = 0.0  # bytes the store has still to give them, as of ``_at``
        self._at: float | None = None

    def __len__(self) -> int:
        return len(self._loads)

    def _drain(self, now: float, bytes_per_s: float | None) -> None:
        if self._at is not None and bytes_per_s is not None and now > self._at:
            self._backlog = max(0.0, self._backlog - bytes_per_s * (now - self._at))
        self._at = now if self._at is None else max(self._at, now)

    def started(self, req_id: str, nbytes: float, now: float, bytes_per_s: float | None) -> None:
        self._drain(now, bytes_per_s)
        self._loads[req_id] = float(nbytes)
        self._backlog += float(nbytes)

    def ended(self, req_id: str, now: float, bytes_per_s: float | None) -> None:
        # (drained to now first: clamped before, the drain since the last call was taken
        # again from what was left, and the model fell gigabytes behind the store)
        self._drain(now, bytes_per_s)
        self._loads.pop(req_id, None)
        self._backlog = min(self._backlog, sum(self._loads.values()))

    def bytes_left(self, now: float, bytes_per_s: float | None) -> float:
        """What a rank still receives for the loads running, by the whole loads' figure now
        (None: not measured, nothing drained)."""
        self._drain(now, bytes_per_s)
        return self._backlog


class WaitingQueue:
    """vLLM's waiting queue as the connector hears of it: the requests added and neither
    admitted nor finished, in the order they came. vLLM admits first come first served, but
    leaves a request at the head that cannot go yet (its lookup still out, a handoff not
    committed) and admits those after it: that one is ahead of them, not behind. A preempted
    request back in the queue was not added again and is not counted; asked about, everyone
    waiting is behind it (vLLM puts it first)."""

    def __init__(self) -> None:
        self._order: dict[str, int] = {}  # request -> its place in arrival order
        self._places: list[int] = []  # the places of those waiting, ascending
        self._next = 0

    def __len__(self) -> int:
        return len(self._places)

    def add(self, req_id: str) -> None:
        if req_id in self._order:
            return
        self._order[req_id] = self._next
        self._places.append(self._next)
        self._next += 1

    def remove(self, req_id: str) -> None:
        """Admitted, or finished while it waited (an abort); nothing if not waiting."""
        place = self._order.pop(req_id, None)
        if place is not None:
            del self._places[bisect.bisect_left(self._places, place)]

    def behind(self, req_id: str) -> int:
        """How many of those waiting came after ``req_id``."""
        place = self._order.get(req_id)
        if place is None:
            return len(self._places)
        return len(self._places) - bisect.bisect_right(self._places, place)


def admitted(busy: Busy, hit: Hit, decision: Decision) -> Busy:
    """What an admission adds to what the engine holds, for the next admission of the step (a
    hit that waits for the next pass takes that pass's split)."""
    if decision.waits_a_pass:
        return replace(busy, next_split_taken=True)
    if decision.way is Way.ASYNC:
        return replace(
            busy,
            loads=busy.loads + 1,
            load_bytes_ahead=busy.load_bytes_ahead + hit.blocks * hit.block_bytes,
        )
    loaded = hit.start + decision.blocks
    computed = max(0, hit.prompt_tokens - loaded * hit.block_size)
    return replace(
        busy,
        prefills=busy.prefills + 1,
        prefill_tokens_ahead=busy.prefill_tokens_ahead + computed,
        split_bytes=busy.split_bytes
        + decision.blocks * hit.block_bytes * (decision.way is Way.SPLIT),
    )


@dataclass(frozen=True)
class BusyWeights:
    """What a second of each kind of other request's delay counts for, against a second of
    the request's own time to first token."""

    prefill: float = 1.0  # a request computing its prompt: its first token
    load: float = 1.0  # a request waiting for its load: its first token
    decode: float = 0.0  # a decode: one inter-token gap


@dataclass(frozen=True)
class Figures:
    loads: LoadFit | None = None  # whole loads
    splits: SplitFit | None = None  # split loads, band by band
    compute: ComputeFit | None = None  # forward passes


@dataclass(frozen=True)
class Decision:
    """A way to serve a hit, how many of its blocks it loads, why, and for how long its load
    may run before the request recomputes instead."""

    way: Way
    blocks: int  # loaded from the hit's start (0 to recompute)
    reason: Reason
    # each way's predicted time to the first token (seconds), when figures were used
    predicted_s: dict[str, float] = field(default_factory=dict)
    wait_s: float | None = None  # None: the request's deadline alone

    @property
    def waits_a_pass(self) -> bool:
        """Not admitted now: asked again next step, when the pass it splits in is free of
        another split (``choose``'s ``may_wait_a_pass``)."""
        return self.reason is Reason.AFTER_THIS_PASS

    @property
    def recomputed_for_the_store(self) -> bool:
        """Recomputed on what the store's figures say (measured, or only bounded by an expired
        load), not pinned: the store stays under watch."""
        judged = self.reason in (Reason.MEASURED, Reason.NOT_MEASURED)
        return judged and self.way is Way.RECOMPUTE

    @property
    def gain_s(self) -> float | None:
        """What the choice is predicted to save against recomputing (None: not predicted)."""
        chosen = self.predicted_s.get(self.way.value)
        recompute = self.predicted_s.get(Way.RECOMPUTE.value)
        return None if chosen is None or recompute is None else max(0.0, recompute - chosen)


class _Predicted(NamedTuple):
    """One way's prediction: the request's time to first token, what the way costs the others
    the engine holds, and the engine time it takes (what the requests queued wait longer)."""

    seconds: float
    cost_s: float
    engine_s: float

    @property
    def total_s(self) -> float:
        """What the way is judged by: its own time plus what it costs the others."""
        return self.seconds + self.cost_s


@dataclass(frozen=True)
class _Passes:
    """Passes computing a request's prompt tokens: until its last one (seconds); what it adds
    to them in all (what each decode loses), summed over the others computing their prompts
    that each of those passes holds (what they lose), and to the longest of them (what a
    request whose load lands meanwhile waits for at most, before it is scheduled)."""

    seconds: float
    added_s: float
    prefills_lose_s: float
    longest_s: float


class _Model:
    """Each way's time to first token and what it costs the others, for one hit."""

    def __init__(
        self,
        hit: Hit,
        compute: ComputeFit,
        engine: Engine,
        busy: Busy,
        weights: BusyWeights,
        loads: LoadFit | None = None,
    ) -> None:
        self.hit, self.c, self.engine, self.busy, self.w = hit, compute, engine, busy, weights
        self.loads = loads  # (the next pass's model is built with the same figure)
        # how long the store takes for the loads in flight (their landings spread over it)
        rate = loads.bytes_per_s if loads is not None else math.inf
        self.load_bytes_per_s = rate
        self.loads_drain_s = max(busy.load_bytes_ahead / rate, 1e-3)
        batch = busy.batch
        self.decodes = StepShape(decode_rows=batch.decode_rows, decode_context=batch.decode_context)
        # the others' prompt tokens: the context work each brings (their average)
        self.others_attention = (
            batch.prefill_attention / batch.prefill_tokens if batch.prefill_tokens else 0.0
        )
        # the steps the engine runs meanwhile, without this request (an idle engine's steps
        # run no forward pass: they take next to nothing)
        self.step_s = 0.0 if batch.empty else compute.pass_seconds(batch)

    def band_seconds(self, splits: SplitFit, band_bytes: float) -> float:
        """One band of a split of ``band_bytes`` (every split's in the pass, a block's band
        each), read beside the loads in flight. Each load a worker runs at once
        (``LOAD_THREADS``) takes an even share of the link while it has bytes left, so the
        bands share it for at most the time the store takes for the loads' backlog, then have
        it alone. Before, they shared it for the whole split: beside a load with next to
        nothing left, a split looked twice as slow as it was, auto loaded instead, and the
        next hit found a load beside it in turn (the simulator's 4 clients of 32k-token hits
        at 8 GB/s: 24 of 68 hits loaded, 1.20x a split of every hit). The policy knows the
        loads' backlog, not each one's rest: the backlog bounds them together (the simulator
        shares with each load apart, as the store does)."""
        bands = max(1, self.hit.bands)
        alone_s = bands * band_bytes / splits.bytes_per_s
        beside = min(self.busy.loads, LOAD_THREADS)
        shared_s = beside * alone_s
        if self.load_bytes_per_s < math.inf:  # (the loads' rate unknown: the whole split)
            shared_s = min(shared_s, self.busy.load_bytes_ahead / self.load_bytes_per_s)
        return splits.band_s + (alone_s + shared_s) / bands

    # ------------------------------------------------------------------ passes
    def _others(self, tokens: int) -> StepShape:
        return self.decodes.plus(StepShape(tokens, tokens * self.others_attention))

    @staticmethod
    def _own(context: int, tokens: int) -> StepShape:
        """This request's part of a pass: ``tokens`` prompt tokens after ``context``."""
        return StepShape(tokens, attention_work(tokens, context)) if tokens > 0 else StepShape()

    def _pending(self, ahead: int) -> int:
        """How many others still compute their prompts while ``ahead`` of their tokens are
        left (their average size from what the engine holds)."""
        busy = self.busy
        if ahead <= 0 or busy.prefills <= 0:
            return 0
        size = max(1.0, busy.prefill_tokens_ahead / busy.prefills)
        return min(busy.prefills, math.ceil(ahead / size))

    def passes(self, first: int, end: int, ahead: int) -> _Passes:
        """Compute prompt tokens ``[first, end)`` from now, after ``ahead`` others' prompt
        tokens (the budget serves them first, ``cap`` per request and step): every pass this
        request's tokens are in is longer for the others it holds."""
        c, engine, busy = self.c, self.engine, self.busy
        room = max(1, engine.token_budget - busy.batch.decode_rows)
        per_step_ahead = max(1, busy.prefills) * engine.cap
        t = added = lose = longest = 0.0
        ctx, left, steps = first, max(0, end - first), 0
        if left > 0 and per_step_ahead >= room and ahead > room:
            # passes the others fill whole: this request gets nothing of them
            full = (ahead - 1) // room
            t += full * c.pass_seconds(self._others(room))
            ahead -= full * room
        while left > 0 and ahead > 0:
            if steps >= _MAX_STEPS:  # the rest of the others' tokens, as one lump
                t += c.pass_seconds(self._others(ahead))
                ahead = 0
                break
            pending = self._pending(ahead)  # (those finishing in this pass wait for it too)
            take = min(ahead, room, per_step_ahead)
            ahead -= take
            own = min(left, engine.cap, room - take)
            others = self._others(take)
            base = c.pass_seconds(others)
            mine = c.pass_seconds(others.plus(self._own(ctx, own))) - base
            added += mine
            lose += mine * pending
            longest = max(longest, mine)
            t += base + mine
            ctx += own
            left -= own
            steps += 1
        if left <= 0:
            return _Passes(t, added, lose, longest)
        # the others are done: full chunks of ``size`` tokens, then what is left
        size = max(1, min(engine.cap, room))
        full, rest = divmod(left, size)
        base = c.pass_seconds(self.decodes)
        if full:
            # chunk i computes [ctx + i size, ctx + (i + 1) size): its attention grows with i
            work = size * (full * ctx + size * full * (full - 1) / 2 + full * size / 2)
            chunks = full * c.token_s * size + c.attention_s * work
            # (each chunk's pass at least the decodes' own)
            passes_s = max(full * base, full * c.chunk_base_seconds(self.decodes) + chunks)
            added += passes_s - full * base
            t += passes_s
            if size >= room:
                # each chunk fills the budget: a request whose load lands meanwhile is
                # scheduled only after the last of them (running requests go first), not
                # after one pass (the simulator: async loads that landed in 1 s waited 3 s
                # behind a 32k prompt recomputed beside them, which the policy had counted at
                # half a pass)
                longest = max(longest, passes_s)
            else:
                last_chunk = c.prefill_seconds(ctx + (full - 1) * size, ctx + full * size)
                longest = max(longest, last_chunk)
            ctx += full * size
        if rest:
            last = c.pass_seconds(self.decodes.plus(self._own(ctx, rest))) - base
            added += last
            longest = max(longest, last)
            t += base + last
        return _Passes(t, added, lose, longest)

    # ------------------------------------------------------------------ ways
    def recompute(self) -> _Predicted:
        hit = self.hit
        first = hit.start * hit.block_size
        p = self.passes(first, hit.prompt_tokens, self.busy.prefill_tokens_ahead)
        return _Predicted(p.seconds, self._compute_cost(p), p.added_s)

    def async_(self, loads: LoadFit) -> _Predicted:
        hit, busy = self.hit, self.busy
        own = hit.blocks * hit.block_bytes
        ahead = busy.load_bytes_ahead + busy.split_bytes  # the store serves them meanwhile
        landed = loads.lag_s + loads.overhead_s + (ahead + own) / loads.bytes_per_s
        if self.step_s > 0:  # vLLM hears of it with the output of the step it lands in
            landed = math.ceil(landed / self.step_s) * self.step_s
        # the prompts being computed now are done by then, but a busy engine admits others
        # meanwhile, which it serves before this one once it landed: as many, say
        p = self.passes(hit.end * hit.block_size, hit.prompt_tokens, busy.prefill_tokens_ahead)
        # what the loads in flight wait longer for this one's bytes, at most: sharing the store,
        # each is held back by this load's transfer and by no more than its own rest, so in all
        # by at most the backlog (served first come first served, less: the bound stands in
        # for the loads that will queue behind this one, which are not counted). Each was
        # charged the whole transfer: three loads with 7 GB left lost 3 x 4.3 GB's time (1.6 s)
        # to a 4.3 GB load, and auto split a 32k hit whose load was 0.2 s sooner (the
        # simulator's 8B, 8 GB/s, 4 clients). Charging the loads to come by the rate loads
        # began missed more cells (19 and 21 against 15 and 13 on two seeds): not kept
        delay = min(busy.loads * own, busy.load_bytes_ahead) / loads.bytes_per_s
        return _Predicted(
            landed + p.seconds, self.w.load * delay + self._compute_cost(p), p.added_s
        )

    def split(self, splits: SplitFit, j: int) -> _Predicted:
        hit, busy, c, engine = self.hit, self.busy, self.c, self.engine
        b = max(1, hit.bands)
        loaded = (hit.start + j) * hit.block_size
        room = max(1, engine.token_budget - busy.batch.decode_rows)
        take = min(busy.prefill_tokens_ahead, room - 1, max(1, busy.prefills) * engine.cap)
        own = min(hit.prompt_tokens - loaded, engine.cap, room - take)
        others = self._others(take)
        base = c.pass_seconds(others)
        compute = c.pass_seconds(others.plus(self._own(loaded, own)))
        # the pass waits for every split of it, read beside the loads running
        x = self.band_seconds(splits, (j * hit.block_bytes + busy.split_bytes) / b)
        if engine.overlap:
            step = splits.first_s + max(x + compute, b * x + compute / b)
        else:  # one after the other
            step = splits.first_s + b * x + compute
        later = self.passes(loaded + own, hit.prompt_tokens, busy.prefill_tokens_ahead - take)
        # what the pass takes longer for it (its loads and its own compute): everyone in it
        stall = step - base
        pending = self._pending(busy.prefill_tokens_ahead)
        # (a load landing meanwhile waits for the longer of its pass and the later ones'; a
        # review argued for both where its pass fills the budget, as a recompute's count --
        # tried, and the simulator's busy 32k cells went from 1.03x the best fixed way to
        # 1.07-1.21x: tiny splits chosen over loads)
        lost = _Passes(
            0.0,
            stall + later.added_s,
            stall * pending + later.prefills_lose_s,
            max(stall, later.longest_s),
        )
        return _Predicted(step + later.seconds, self._compute_cost(lost), lost.added_s)

    def _compute_cost(self, p: _Passes) -> float:
        """What the others lose to this request's passes: those computing their prompts in
        them; those whose loads land while they run, half a pass each; and the decodes, all
        of them."""
        w, busy = self.w, self.busy
        # the loads in flight land over the time the store takes for them: those landing
        # while this request's passes run wait, on average, half a pass
        landing = busy.loads * min(1.0, p.added_s / self.loads_drain_s) if busy.loads else 0.0
        return (
            w.prefill * p.prefills_lose_s
            + w.load * landing * p.longest_s / 2
            + w.decode * busy.batch.decode_rows * p.added_s
        )


def plausible_recompute_s(hit: Hit, compute: ComputeFit | None, token_s: float | None) -> float:
    """How long computing the hit's request plausibly takes, for how long a load without
    figures may run: the fit's prediction, else the slowest prompt token measured, else a slow
    CPU's figures (``PRIOR_TOKEN_S``)."""
    first = hit.start * hit.block_size
    if compute is not None:
        return compute.seconds(first, hit.prompt_tokens)
    per_token = token_s if token_s is not None else PRIOR_TOKEN_S
    return PRIOR_STEP_S + per_token * (hit.prompt_tokens - first)


def pinned(
    way: Way,
    hit: Hit,
    split_ok: bool,
    figures: Figures = Figures(),
    engine: Engine = Engine(),
    busy: Busy = IDLE,
) -> Decision:
    """``way`` as it is: the whole hit, or a split of the best size where the figures are
    measured (a split that is not possible here loads asynchronously)."""
    if way is Way.RECOMPUTE:
        return Decision(way, 0, Reason.PINNED)
    if way is Way.SPLIT and (not split_ok or hit.max_split() < 1):
        return Decision(Way.ASYNC, hit.blocks, Reason.SPLIT_UNAVAILABLE)
    if way is Way.SPLIT and figures.splits is not None and figures.compute is not None:
        model = _Model(hit, figures.compute, engine, busy, BusyWeights(), figures.loads)
        blocks, split = _best_split(model, figures.splits)
        seconds, recompute = split.seconds, model.recompute().seconds
        predicted = _rounded({way: seconds, Way.RECOMPUTE: recompute})
        return Decision(way, blocks, Reason.PINNED, predicted, wait_s=seconds + recompute)
    if way is Way.SPLIT:
        return Decision(way, hit.max_split(), Reason.PINNED)
    return Decision(way, hit.blocks, Reason.PINNED)


def choose(
    hit: Hit,
    figures: Figures,
    *,
    engine: Engine = Engine(),
    busy: Busy = IDLE,
    split_ok: bool = True,
    weights: BusyWeights = BusyWeights(),
    token_s: float | None = None,
    unmeasured: Way = Way.RECOMPUTE,
    may_wait_a_pass: bool = False,
) -> Decision:
    """The way that gives ``hit``'s request its first token soonest, counting what it costs
    the others ``busy`` holds (see the module docstring). Before the figures exist:
    ``unmeasured``, either recompute (the probes measure the store meanwhile) or load it all
    (a handoff, made for this request to load), waiting no longer than recomputing plausibly
    takes (``token_s``: the slowest prompt token measured, before the fit exists).
    ``may_wait_a_pass``: the request may be left unanswered for a step, its split made in the
    next pass (``Decision.waits_a_pass``), where another split holds this one."""
    if hit.blocks <= 0:
        return Decision(Way.RECOMPUTE, 0, Reason.NO_HIT)
    loads, compute = figures.loads, figures.compute
    if loads is None:
        if unmeasured is Way.RECOMPUTE:
            return Decision(Way.RECOMPUTE, 0, Reason.NOT_MEASURED)
        wait = plausible_recompute_s(hit, compute, token_s)
        return Decision(Way.ASYNC, hit.blocks, Reason.NOT_MEASURED, wait_s=wait)
    if compute is None:
        # the store is measured, the engine not yet (an instance that loads every prompt):
        # loading it all against what recomputing plausibly takes
        plausible = plausible_recompute_s(hit, None, token_s)
        own = hit.blocks * hit.block_bytes + busy.load_bytes_ahead
        load = loads.lag_s + loads.seconds(own)
        guesses = _rounded({Way.ASYNC: load, Way.RECOMPUTE: plausible})
        if load < (1 - MARGIN) * plausible:
            return Decision(Way.ASYNC, hit.blocks, Reason.NOT_MEASURED, guesses, load + plausible)
        return Decision(Way.RECOMPUTE, 0, Reason.NOT_MEASURED, guesses)
    model = _Model(hit, compute, engine, busy, weights, loads)
    predicted = {Way.RECOMPUTE: model.recompute(), Way.ASYNC: model.async_(loads)}
    j = 0
    # one split a pass: a second one's bands would slow the first's past its wait
    splits_now = not busy.split_bytes and not busy.split_reserved
    if split_ok and figures.splits is not None and hit.max_split() >= 1 and splits_now:
        j, predicted[Way.SPLIT] = _best_split(model, figures.splits)
    times = {way: p.seconds for way, p in predicted.items()}
    total = {way: p.total_s for way, p in predicted.items()}
    # a gain within the model's error is no gain: a load must beat recomputing by the margin,
    # and a split (which stalls its whole pass, and fails it if a band is late) a plain load
    if Way.SPLIT in total and total[Way.SPLIT] > (1 - MARGIN) * total[Way.ASYNC]:
        del total[Way.SPLIT]
    way = min(total, key=lambda w: (total[w], w is not Way.RECOMPUTE))
    if total[way] > (1 - MARGIN) * total[Way.RECOMPUTE]:
        way = Way.RECOMPUTE
    reason = Reason.MEASURED
    if way is Way.RECOMPUTE and j and _split_for_the_queue(predicted, busy.waiting):
        way, reason = Way.SPLIT, Reason.FOR_THE_QUEUE
    if (
        may_wait_a_pass
        and way is Way.RECOMPUTE
        and split_ok
        and figures.splits is not None
        and busy.split_bytes
        and not busy.next_split_taken
    ):
        later = _split_after_this_pass(model, figures.splits)
        if later is not None and later[1].total_s < (1 - WAIT_MARGIN) * total[way]:
            blocks_later, split_later = later
            times[Way.SPLIT] = split_later.seconds
            return Decision(Way.SPLIT, blocks_later, Reason.AFTER_THIS_PASS, _rounded(times))
    blocks = {Way.RECOMPUTE: 0, Way.ASYNC: hit.blocks, Way.SPLIT: j}[way]
    # a load may wait as long as it was predicted to take plus recomputing (past that, even
    # landing it has cost more than recomputing would have)
    wait = times[way] + times[Way.RECOMPUTE]
    return Decision(way, blocks, reason, _rounded(times), wait_s=wait)


def _split_for_the_queue(predicted: dict[Way, _Predicted], waiting: int) -> bool:
    """Whether a split beats the recomputing chosen once the requests queued behind are
    counted (module docstring): no slower for the request itself, and the engine time it saves
    them large enough to trust and to tip the balance by the margin."""
    split, recompute = predicted[Way.SPLIT], predicted[Way.RECOMPUTE]
    saved_s = recompute.engine_s - split.engine_s
    queued_gain = waiting * saved_s
    recompute_total = recompute.total_s
    return (
        split.seconds <= recompute.seconds
        and saved_s >= MIN_QUEUED_SAVING * recompute.engine_s
        and queued_gain >= QUEUED_GAIN_SHARE * recompute_total
        and split.total_s - queued_gain < (1 - MARGIN) * recompute_total
    )


def _split_after_this_pass(model: _Model, splits: SplitFit) -> tuple[int, _Predicted] | None:
    """The best split of the hit in the pass after the one being planned, which holds another
    split already (one split a pass): the time to the end of that pass (its split's bands
    landing beside its compute), then the split as the engine will be then (the others'
    prompts a chunk further, and ahead of them those queued behind this one, which vLLM
    admits meanwhile: their prompts are taken as long as this one's, within a step's budget)."""
    hit, busy, c, engine = model.hit, model.busy, model.c, model.engine
    if hit.max_split() < 1:
        return None
    b = max(1, hit.bands)
    room = max(1, engine.token_budget - busy.batch.decode_rows)
    take = min(busy.prefill_tokens_ahead, room, max(1, busy.prefills) * engine.cap)
    compute = c.pass_seconds(model._others(take))
    x = model.band_seconds(splits, busy.split_bytes / b)
    if engine.overlap:
        this_pass = splits.first_s + max(x + compute, b * x + compute / b)
    else:
        this_pass = splits.first_s + b * x + compute
    own = max(1, hit.prompt_tokens - hit.start * hit.block_size)
    behind = min(busy.waiting * own, room)
    # the loads in flight drain meanwhile: the next pass's bands share the store with the rest
    drained = this_pass * model.load_bytes_per_s if model.load_bytes_per_s < math.inf else 0.0
    then = replace(
        busy,
        load_bytes_ahead=max(0.0, busy.load_bytes_ahead - drained),
        split_bytes=0.0,
        prefills=busy.prefills + math.ceil(behind / own),
        prefill_tokens_ahead=busy.prefill_tokens_ahead - take + behind,
    )
    nxt = _Model(hit, c, engine, then, model.w, model.loads)
    nxt.loads_drain_s = model.loads_drain_s  # (the landings' spread as the step began)
    j, split = _best_split(nxt, splits)
    return j, split._replace(seconds=this_pass + split.seconds)


def best_split(hit: Hit, figures: Figures, engine: Engine = Engine()) -> tuple[int, float]:
    """(blocks, predicted seconds) of the best split of ``hit`` on an idle engine."""
    assert figures.splits is not None and figures.compute is not None
    model = _Model(hit, figures.compute, engine, IDLE, BusyWeights())
    j, predicted = _best_split(model, figures.splits)
    return j, predicted.seconds


def _best_split(model: _Model, splits: SplitFit) -> tuple[int, _Predicted]:
    """The split that costs least (its time plus the others'): near where its bands' transfer
    takes as long as its pass computes, searched by bisection on their difference (which only
    grows with ``j``), and on an even grid besides (later chunks bend the curve)."""
    hit = model.hit
    top = hit.max_split()
    if top < 1:
        return 0, _Predicted(math.inf, 0.0, 0.0)
    cache: dict[int, _Predicted] = {}

    def at(j: int) -> _Predicted:
        if j not in cache:
            cache[j] = model.split(splits, j)
        return cache[j]

    b = max(1, hit.bands)
    first = hit.start * hit.block_size

    busy = model.busy

    base = model.c.pass_seconds(model._others(0))

    def transfer_longer(j: int) -> bool:
        loaded = first + j * hit.block_size
        compute = model.c.prefill_seconds(loaded, min(hit.prompt_tokens, loaded + model.engine.cap))
        band = (j * hit.block_bytes + busy.split_bytes) / b
        return b * model.band_seconds(splits, band) >= base + compute

    def cost(j: int) -> tuple[float, int]:
        return at(j).total_s, -j

    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi) // 2
        if transfer_longer(mid):
            hi = mid
        else:
            lo = mid + 1
    candidates = {1, top, lo, max(1, lo - 1), min(top, lo + 1)}
    candidates |= {max(1, round(top * k / 8)) for k in range(1, 8)}
    best = min(candidates, key=cost)
    # then down to the block, around the best found (later chunks bend the curve)
    lo, hi = max(1, best - top // 8 - 1), min(top, best + top // 8 + 1)
    while hi - lo > 2:
        left, right = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if cost(left) <= cost(right):
            hi = right
        else:
            lo = left
    best = min({best, *range(lo, hi + 1)}, key=cost)
    return best, at(best)


def _rounded(times: dict[Way, float]) -> dict[str, float]:
    return {way.value: round(t, 6) for way, t in times.items()}
