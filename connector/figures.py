"""What this instance measures while it serves, for the load policy (``load_policy.py``): how
fast each rank loads from Redis, whole and band by band, and how long vLLM's forward passes
take for what they hold. Three paths, three figures; no fit mixes them:

- **Whole loads** (``LoadRate`` -> ``LoadFit``): ``seconds = overhead + bytes / bandwidth``,
  a rank's asynchronous load or background probe read, timed from its first request to Redis
  to its last byte in place (a wait for the GPU's compute fence does not count). The overhead
  is fitted where the sizes differ enough to tell it from the rate, and never exceeds the
  fastest sample; the bandwidth is over the newest few samples, bytes-weighted (a small
  probe's time is mostly its fixed cost), so a store that got ten times slower or faster is
  followed within a few samples. A load also says how long after
  its step began vLLM's call started it (``lag_s``: vLLM starts asynchronous loads after the
  forward pass on some releases and platforms; the queue behind other loads is not in it,
  ``load_policy.LoadsInFlight`` models that).
- **Split loads** (``SplitRate`` -> ``SplitFit``): a split reads every block's band of layers
  ``i`` before any block's band ``i + 1``; band ``i`` lands ``first_s + (i + 1) x`` after the
  split starts, ``x = band_s + band bytes / bandwidth``. Fitted from the band timeline each
  split (or band probe) records: its first band's time and the median time between bands.
- **Forward passes** (``ComputeRate`` -> ``ComputeFit``): ``seconds = step + token x prefill
  tokens + attention x prefill context work + decode_row x decode rows + decode_context x the
  context decodes read``. A pass is classified by the prefill tokens it holds (a batch of 64
  decodes is not a prefill); prefills and other passes keep windows of their own, so a stream
  of decode steps never pushes out the prefills a prompt's cost is predicted from. The line's
  fixed cost is believed where it was measured: a pass doing less work than any sample did is
  predicted no longer than the straight line from a small decode pass
  (``ComputeFit.sampled_seconds``).

Every figure is per TP rank where ranks differ (the loads): the slowest rank sets the pace, so
its figure counts. Samples age from when their rank recorded them, not from the step that
carried them (an idle engine's probes wait for the next step: ``stats.StatsBuffer.timed_sample``),
so a bound and the samples after it keep their order; none older than ``MAX_AGE_S`` is used,
and the policy asks for background probes when the newest is older than it likes
(``probes.py``). A load that expired
or failed, or a probe that did, teaches an upper bound: the store gave at most what landed over
the time spent; the bandwidth is at most that until newer complete samples come, and then it is
theirs alone (the store changed there), unless one shows the store more than
``BOUND_RELEASE`` times faster than the bound (then every sample counts again). Every fit is
bounded: no coefficient below zero, no overhead above the fastest sample, no bandwidth above
what a sample achieved.

Nothing is assumed: until enough has been measured an estimate is None, and the policy serves
hits the way it does without figures (``load_policy.py``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

# loads kept per rank for the overhead's fit, how many it needs, and how many the bandwidth is
# the median of
LOAD_WINDOW = 32
MIN_LOADS = 1
RECENT_LOADS = 3
# splits (or band probes) kept per rank, and how many the fit needs
SPLIT_WINDOW = 16
MIN_SPLITS = 1
# forward passes kept (each window), and how many the fit needs
STEP_WINDOW = 64
MIN_STEPS = 8
MIN_PREFILLS = 2
MIN_DECODE_PASSES = 4  # passes of decodes alone before they get a line of their own
# prompt passes whose sizes span less than this factor do not tell a pass's fixed cost from
# its per-token cost (``_fit_compute``)
SIZES_SPAN = 2.0
# a pass that computed at least this many prompt tokens is a prefill sample
PREFILL_TOKENS = 64
# no sample older than this is used (seconds): a store's speed from minutes ago is not a figure
MAX_AGE_S = 120.0

Clock = Callable[[], float]
# a sample's values and when it came; an upper bound (bytes per second at most) and when
Timed = tuple[tuple[float, ...], float]
Bound = tuple[float, float]


@dataclass(frozen=True)
class LoadFit:
    """One rank's whole loads (the slowest rank's, across ranks)."""

    overhead_s: float  # a load's fixed cost: round trips, claiming
    bytes_per_s: float  # one rank's bandwidth from Redis into its KV cache
    samples: int
    lag_s: float = 0.0  # from the load's step starting to vLLM's call that started it
    age_s: float = 0.0  # how old the newest sample is
    bounded: bool = False  # the bandwidth is an expired or failed load's upper bound
    changed: bool = False  # the newest samples disagree with the window: the store changed

    def seconds(self, nbytes: float) -> float:
        return self.overhead_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class SplitFit:
    """One rank's split loads, band by band (the slowest rank's, across ranks)."""

    first_s: float  # before the first band's bytes: claims, round trips, headers
    band_s: float  # each band's fixed cost: its commands and replies
    bytes_per_s: float  # one rank's bandwidth, band by band
    samples: int
    age_s: float = 0.0
    bounded: bool = False
    changed: bool = False

    def band_seconds(self, band_bytes: float) -> float:
        """One band of a split whose every block's band is ``band_bytes`` in all."""
        return self.band_s + band_bytes / self.bytes_per_s


@dataclass(frozen=True)
class StepShape:
    """What one forward pass computes: prompt tokens (their count and the context work of
    their attention: each token attends to everything before it), and decodes (rows, and the
    context they read: memory-bound)."""

    prefill_tokens: int = 0
    prefill_attention: float = 0.0
    decode_rows: int = 0
    decode_context: int = 0

    @property
    def empty(self) -> bool:
        return self.prefill_tokens <= 0 and self.decode_rows <= 0

    def plus(self, other: StepShape) -> StepShape:
        return StepShape(
            self.prefill_tokens + other.prefill_tokens,
            self.prefill_attention + other.prefill_attention,
            self.decode_rows + other.decode_rows,
            self.decode_context + other.decode_context,
        )

    def features(self) -> list[float]:
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.prefill_attention),
            float(self.decode_rows),
            float(self.decode_context),
        ]


@dataclass(frozen=True)
class DecodeLine:
    """Passes that compute no prompt token: memory-bound (each reads every weight, and each
    decode its context), fitted on their own."""

    step_s: float
    row_s: float  # per decode
    context_s: float  # per context token a decode reads

    def seconds(self, shape: StepShape) -> float:
        return self.step_s + self.row_s * shape.decode_rows + self.context_s * shape.decode_context


@dataclass(frozen=True)
class ComputeFit:
    step_s: float  # a forward pass's fixed cost
    token_s: float  # per prompt token computed
    attention_s: float  # per prompt token x context token it attends to
    decode_row_s: float = 0.0  # per decode in the pass
    decode_context_s: float = 0.0  # per context token a decode reads
    samples: int = 0
    # no pass is faster than a pass of a few decodes: a GPU reads every weight in each, so a
    # pass computing a few tokens costs that, not what the line through larger passes says
    floor_s: float = 0.0
    # passes of decodes alone, where enough were seen (None: the line above serves them)
    decodes: DecodeLine | None = None
    # the least work (the line's seconds above its fixed cost) of a pass the line was drawn
    # through: a pass doing less is outside what was measured (``sampled_seconds``)
    least_work_s: float = 0.0

    def pass_seconds(self, shape: StepShape) -> float:
        """A forward pass holding ``shape`` (its fixed cost alone, if nothing). Never less than
        the pass of its decodes alone: what a pass computes only adds to what it reads, so
        adding prompt tokens never makes a pass cheaper (a short prompt's line, fitted through
        compute-bound passes, lies below a weight-bound decode pass)."""
        if self.decodes is None:
            return max(self.floor_s, self.sampled_seconds(shape, self.floor_s))
        reads = max(self.floor_s, self.decodes.seconds(shape))
        if shape.prefill_tokens <= 0:
            return reads
        return max(reads, self.sampled_seconds(shape, reads))

    def sampled_seconds(self, shape: StepShape, reads_s: float) -> float:
        """The line at ``shape`` where it was measured; below the least work a sample did, the
        line's fixed cost above ``reads_s`` (a small decode pass's, or the pass of the shape's
        decodes alone, so a prompt's tokens beside them never come free: a review) fades to
        it at no work (the straight line between the two passes measured there). The line's
        fixed cost is its reach back to no work from the passes it went through: passes of
        one or two sizes that cost less a token the larger they are (a 2-core CPU's 600 and
        1,500-token prompts) put 0.5-0.6 s there, where a pass of few decodes took 40 ms, and
        a load's last pass (96 tokens over 1,408) was predicted at twice its 0.3 s, so the
        hits that loaded 29% sooner were recomputed. Of the two, the sooner: where passes
        cost more a token the larger they are (a GPU's, weight-bound when small) the line is
        below the straight one and is kept; where less, the pass is predicted short, a load
        is chosen, and its own pass is the sample that corrects the line (a recompute would
        never tell)."""
        line = self.line_seconds(shape)
        over_reads = self.step_s - reads_s
        work = line - self.step_s
        if over_reads <= 0 or reads_s <= 0 or not 0 <= work < self.least_work_s:
            return line
        return line - over_reads * (1.0 - work / self.least_work_s)

    def chunk_base_seconds(self, decodes: StepShape) -> float:
        """The fixed part of a pass that computes a prompt chunk beside ``decodes``, which
        its tokens add to: the prompts' line there where passes of decodes alone have their
        own line (a weight-bound decode pass costs nothing more when a compute-bound chunk
        joins it), else the pass of the decodes alone."""
        if self.decodes is None:
            # (the line's own fixed cost: full chunks are passes of the work it was drawn
            # through, ``sampled_seconds``; faded, a 1,024-token prompt in one chunk of 1,024
            # was predicted 0.32 s sooner than in one pass of 1,023: a review)
            return max(self.floor_s, self.line_seconds(decodes))
        return self.line_seconds(decodes)

    def line_seconds(self, shape: StepShape) -> float:
        """The prompts' line at ``shape``, unbounded below: chunks after chunks add up on it."""
        return (
            self.step_s
            + self.token_s * shape.prefill_tokens
            + self.attention_s * shape.prefill_attention
            + self.decode_row_s * shape.decode_rows
            + self.decode_context_s * shape.decode_context
        )

    def prefill_seconds(self, first: int, end: int) -> float:
        """What computing prompt tokens ``[first, end)`` adds to a pass (tokens before
        ``first`` cached): the tokens', and their attention to the context."""
        n = max(0, end - first)
        return self.token_s * n + self.attention_s * attention_work(n, first)

    def seconds(self, first: int, end: int) -> float:
        """A pass computing prompt tokens ``[first, end)`` and nothing else."""
        n = max(0, end - first)
        return self.pass_seconds(StepShape(n, attention_work(n, first)))


def attention_work(tokens: int, context_before: int) -> float:
    """Context work of ``tokens`` computed after ``context_before`` cached ones: each attends
    to everything before it (causal), ``tokens x (context_before + tokens / 2)``."""
    return tokens * (context_before + tokens / 2)


def step_shape(rows: Sequence[tuple[int, int, bool]]) -> StepShape:
    """A forward pass's shape from its requests' (tokens cached before the pass, tokens
    computed in it, whether they are prompt tokens)."""
    prefill = [(before, n) for before, n, prompt in rows if prompt and n > 0]
    decodes = [before for before, n, prompt in rows if not prompt and n > 0]
    return StepShape(
        prefill_tokens=sum(n for _, n in prefill),
        prefill_attention=sum(attention_work(n, before) for before, n in prefill),
        decode_rows=len(decodes),
        decode_context=sum(decodes),
    )


def _age(age_s: float) -> float:
    """A sample's age as the workers say it: at least 0, at most twice ``MAX_AGE_S`` (what is
    not a finite number: that old, too old to be used)."""
    if not _finite(age_s):
        return 2 * MAX_AGE_S
    return min(max(0.0, float(age_s)), 2 * MAX_AGE_S)


def _finite(*values: float) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


class _RankSamples:
    """One rank's recent samples of one path: complete ones, and the newest upper bound."""

    def __init__(self, window: int) -> None:
        self.samples: deque[Timed] = deque(maxlen=window)
        self.bound: Bound | None = None  # (bytes per second at most, when)

    def fresh(self, now: float) -> list[Timed]:
        """Samples of the last ``MAX_AGE_S`` (with when each came); when there are none (an
        engine idle that long runs no steps, so no probes), the newest few: an old figure,
        probed again as soon as steps run (its age says so), beats recomputing every hit until
        then."""
        fresh = [(s, at) for s, at in self.samples if now - at <= MAX_AGE_S]
        return fresh or list(self.samples)[-RECENT_LOADS:]

    def newest(self) -> float:
        # (the newest by its time: a sample carried late may be older than one before it)
        return max((at for _, at in self.samples), default=-math.inf)

    def bound_now(self, now: float) -> Bound | None:
        """The upper bound and when it came, unless it is too old."""
        if self.bound is None or now - self.bound[1] > MAX_AGE_S:
            return None
        return self.bound


# an upper bound marks where the store changed: the samples after it are the figure, the ones
# before it no longer count -- unless one after it shows the store this many times faster than
# the bound (a passing hiccup: everything counts again). Before, the first complete sample
# ended the bound, and one small probe read at a slow store's speed, bytes-weighted beside the
# big fast loads before it, handed the figure back to the fast store
BOUND_RELEASE = 2.0


def _since_bound(
    bound: Bound | None, timed: list[Timed], transfers: list[tuple[float, float]], fixed: float
) -> tuple[list[tuple[float, float]] | None, float | None]:
    """(the transfers the figure comes from, None for all of them; the upper bound in force).
    A sample's speed is its bytes over its time less the fitted fixed cost. ``transfers``:
    ``timed``'s (bytes, seconds), in order."""
    if bound is None:
        return None, None
    rate, at = bound
    later = [bt for (_, when), bt in zip(timed, transfers, strict=True) if when > at]
    if not later:
        return None, rate  # nothing measured since: at most the bound
    if any(b / max(t - fixed, 0.1 * t) > BOUND_RELEASE * rate for b, t in later if t > 0):
        return None, None  # measured well above it since
    return later, None


class _PerRank:
    """Samples per TP rank, thread-safe, with the fit made again only after new samples."""

    def __init__(self, window: int, clock: Clock) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, _RankSamples] = {}
        self._window = window
        self.clock = clock
        self.count = 0  # samples and bounds ever added: tells a fresh sample from an old fit

    def add(self, rank: int, values: tuple[float, ...], age_s: float = 0.0) -> None:
        """A sample recorded ``age_s`` ago (it may have waited for a step to carry it)."""
        with self._lock:
            self._rank(rank).samples.append((values, self.clock() - _age(age_s)))
            self.count += 1

    def add_bound(self, rank: int, bytes_per_s: float, age_s: float = 0.0) -> None:
        with self._lock:
            samples = self._rank(rank)
            at = self.clock() - _age(age_s)
            if samples.bound is None or at >= samples.bound[1]:  # (the newest bound counts)
                samples.bound = (bytes_per_s, at)
            self.count += 1

    def _rank(self, rank: int) -> _RankSamples:
        return self._ranks.setdefault(int(rank), _RankSamples(self._window))

    def snapshot(
        self,
    ) -> tuple[float, list[tuple[list[Timed], Bound | None, float]]]:
        """(now, per rank: fresh samples with their times, upper bound and its time, newest
        sample's time)."""
        now = self.clock()
        with self._lock:
            return now, [(r.fresh(now), r.bound_now(now), r.newest()) for r in self._ranks.values()]


class LoadRate:
    """The whole-load bandwidth each rank gets, from its recent loads and probes."""

    def __init__(self, window: int = LOAD_WINDOW, clock: Clock = time.monotonic) -> None:
        self._ranks = _PerRank(window, clock)
        self._fit: tuple[int, float, LoadFit | None] = (-1, 0.0, None)

    @property
    def count(self) -> int:
        return self._ranks.count

    def add(
        self,
        nbytes: float,
        seconds: float,
        rank: int = 0,
        lag_s: float | None = None,
        age_s: float = 0.0,
    ) -> None:
        """A whole load (or probe) that landed: ``nbytes`` in ``seconds`` from its first byte;
        ``lag_s``: from its step's start to vLLM's call that started it (None: not a step's
        load); ``age_s``: how long ago it ended."""
        if not _finite(nbytes, seconds) or nbytes <= 0 or seconds <= 0:
            return
        lag = float(lag_s) if lag_s is not None and _finite(lag_s) and lag_s >= 0 else math.nan
        self._ranks.add(rank, (float(nbytes), float(seconds), lag), age_s)

    def add_bound(self, nbytes: float, seconds: float, rank: int = 0, age_s: float = 0.0) -> None:
        """A load (or probe) that expired or failed after ``seconds`` with ``nbytes`` landed,
        ``age_s`` ago: the store was at most that fast (nothing landed: as good as not at
        all)."""
        if not _finite(nbytes, seconds) or seconds <= 0 or nbytes < 0:
            return
        self._ranks.add_bound(rank, max(float(nbytes), 1.0) / float(seconds), age_s)

    def estimate(self) -> LoadFit | None:
        """The slowest rank's fit over its recent loads, or None while any rank that reported
        has too few."""
        now, ranks = self._ranks.snapshot()
        if self._fit[0] == self.count and now - self._fit[1] < 1.0:
            return self._fit[2]
        fits = [_fit_loads(samples, bound, now - newest) for samples, bound, newest in ranks]
        fit = _slowest_load(fits) if fits and all(f is not None for f in fits) else None
        self._fit = (self.count, now, fit)
        return fit


def _fit_loads(timed: list[Timed], bound: Bound | None, age: float) -> LoadFit | None:
    samples = [s for s, _ in timed]
    if len(samples) < MIN_LOADS:
        # an upper bound alone is a figure: at most that fast (the policy then loads only
        # what would pay even at that speed)
        return None if bound is None else LoadFit(0.0, bound[0], 0, bounded=True)
    transfers = [(s[0], s[1]) for s in samples]
    overhead, rate, changed = fixed_and_rate(transfers)
    since, limit = _since_bound(bound, timed, transfers, overhead)
    if since is not None:  # the store changed at the bound: only what came after it
        overhead, rate, changed = fixed_and_rate(since)
    lags = [s[2] for s in samples[-RECENT_LOADS * 2 :] if not math.isnan(s[2])]
    return LoadFit(
        overhead_s=overhead,
        bytes_per_s=min(rate, limit) if limit is not None else rate,
        samples=len(since) if since is not None else len(samples),
        lag_s=float(np.median(lags)) if lags else 0.0,
        age_s=max(0.0, age),
        bounded=limit is not None and limit < rate,
        changed=changed,
    )


def fixed_and_rate(samples: Sequence[tuple[float, float]]) -> tuple[float, float, bool]:
    """(fixed seconds, bytes per second, whether the store changed) of transfers given as
    (bytes, seconds), the window oldest first. Where sizes differ enough, a line through them
    tells the fixed cost from the rate (the fixed cost never above the fastest sample). The
    rate is the line's while the newest samples agree with it (within 2x), else theirs --
    bytes-weighted, a small probe's time being mostly its fixed cost: a store that changed is
    followed within a few samples (and measured again at once: ``probes.py``)."""
    sizes = np.array([b for b, _ in samples])
    times = np.array([t for _, t in samples])
    fixed, line = 0.0, None
    if len(samples) >= 2 and sizes.max() > 1.5 * sizes.min():
        fit = nonnegative_fit(np.stack([np.ones_like(sizes), sizes], axis=1), times)
        fixed = min(fit[0], float(times.min()))
        if fit[1] > 0:
            line = 1.0 / fit[1]
    recent = samples[-RECENT_LOADS:]
    rate = sum(b for b, _ in recent) / sum(max(t - fixed, 0.1 * t) for _, t in recent)
    if line is not None and line / 2 <= rate <= 2 * line:
        return fixed, line, False
    return fixed, rate, line is not None


def _slowest_load(fits: Sequence[LoadFit | None]) -> LoadFit:
    known = [f for f in fits if f is not None]
    slow = min(known, key=lambda f: f.bytes_per_s)
    return LoadFit(
        overhead_s=max(f.overhead_s for f in known),
        bytes_per_s=slow.bytes_per_s,
        samples=min(f.samples for f in known),
        lag_s=max(f.lag_s for f in known),
        age_s=max(f.age_s for f in known),
        bounded=any(f.bounded for f in known),
        changed=any(f.changed for f in known),
    )


class SplitRate:
    """Each rank's split loads, band by band, from the band timelines splits record."""

    def __init__(self, window: int = SPLIT_WINDOW, clock: Clock = time.monotonic) -> None:
        self._ranks = _PerRank(window, clock)
        self._fit: tuple[int, float, SplitFit | None] = (-1, 0.0, None)

    @property
    def count(self) -> int:
        return self._ranks.count

    def add(
        self,
        band_bytes: float,
        first_s: float,
        between_s: float,
        bands: int,
        rank: int = 0,
        age_s: float = 0.0,
    ) -> None:
        """A split whose every band landed, ``age_s`` ago: each band ``band_bytes`` (every
        block's), the first landed ``first_s`` after it started, later ones ``between_s``
        apart (the median)."""
        if not _finite(band_bytes, first_s, between_s) or band_bytes <= 0 or first_s <= 0:
            return
        if bands < 2 or between_s <= 0:
            between_s = math.nan  # one band: nothing between bands
        self._ranks.add(rank, (float(band_bytes), float(first_s), float(between_s)), age_s)

    def add_bound(self, nbytes: float, seconds: float, rank: int = 0, age_s: float = 0.0) -> None:
        """A split that ended before its bands landed, ``age_s`` ago: ``nbytes`` (what landed
        and the band it waited for) in ``seconds``: its bands came at most that fast."""
        if not _finite(nbytes, seconds) or seconds <= 0 or nbytes < 0:
            return
        self._ranks.add_bound(rank, max(float(nbytes), 1.0) / float(seconds), age_s)

    def estimate(self) -> SplitFit | None:
        now, ranks = self._ranks.snapshot()
        if self._fit[0] == self.count and now - self._fit[1] < 1.0:
            return self._fit[2]
        fits = [_fit_splits(samples, bound, now - newest) for samples, bound, newest in ranks]
        fit = _slowest_split(fits) if fits and all(f is not None for f in fits) else None
        self._fit = (self.count, now, fit)
        return fit


def _fit_splits(timed: list[Timed], bound: Bound | None, age: float) -> SplitFit | None:
    samples = [s for s, _ in timed]
    if len(samples) < MIN_SPLITS:
        return None if bound is None else SplitFit(0.0, 0.0, bound[0], 0, bounded=True)
    # a band's time: the gap between bands where a sample has them, else its first band's
    transfers = [(b, x if not math.isnan(x) else f) for b, f, x in samples]
    band_s, rate, changed = fixed_and_rate(transfers)
    since, limit = _since_bound(bound, timed, transfers, band_s)
    recent = samples[-RECENT_LOADS:]
    if since is not None:  # the store changed at the bound: only what came after it
        band_s, rate, changed = fixed_and_rate(since)
        recent = samples[-min(len(since), RECENT_LOADS) :]
    if limit is not None:
        rate = min(rate, limit)
    firsts = [max(0.0, f - (band_s + b / rate)) for b, f, _ in recent]
    return SplitFit(
        first_s=float(np.median(firsts)),
        band_s=band_s,
        bytes_per_s=rate,
        samples=len(since) if since is not None else len(samples),
        age_s=max(0.0, age),
        bounded=limit is not None and limit <= rate,
        changed=changed,
    )


def _slowest_split(fits: Sequence[SplitFit | None]) -> SplitFit:
    known = [f for f in fits if f is not None]
    slow = min(known, key=lambda f: f.bytes_per_s)
    return SplitFit(
        first_s=max(f.first_s for f in known),
        band_s=max(f.band_s for f in known),
        bytes_per_s=slow.bytes_per_s,
        samples=min(f.samples for f in known),
        age_s=max(f.age_s for f in known),
        bounded=any(f.bounded for f in known),
        changed=any(f.changed for f in known),
    )


# a split's bands are read from the same store over the same link as whole loads: where the
# whole-load figure has fallen far below the bands' (the store slowed since the last split), the
# bands' figure is held to this many times the whole loads' until bands are measured again
# (on the H200 host bands ran at a third of whole loads; on this CPU at about the same rate)
SPLIT_OVER_WHOLE_MAX = 1.5


def splits_within_loads(loads: LoadFit | None, splits: SplitFit | None) -> SplitFit | None:
    """The split figure, held to what the whole-load figure says the store gives now: a store
    that slowed is seen first by whichever path reads it next, and a split planned on the band
    figure from before would wait for bands that cannot come in time. Held, it is an upper
    bound, so band probes measure it again (``probes.py``)."""
    if loads is None or splits is None:
        return splits
    limit = SPLIT_OVER_WHOLE_MAX * loads.bytes_per_s
    if splits.bytes_per_s <= limit:
        return splits
    return replace(splits, bytes_per_s=limit, bounded=True)


class ComputeRate:
    """How long forward passes take for what they hold, from recent ones (rank 0's)."""

    def __init__(self, window: int = STEP_WINDOW) -> None:
        self._lock = threading.Lock()
        self._prefills: deque[tuple[StepShape, float]] = deque(maxlen=window)
        self._others: deque[tuple[StepShape, float]] = deque(maxlen=window)
        # passes of a few prompt tokens (a load's or split's last, under ``PREFILL_TOKENS``):
        # not prefill samples, but the least work the prompts' line was measured at, which a
        # stream of decode passes must not push out (``ComputeFit.sampled_seconds``: a load
        # chosen on a short guess, whose pass said otherwise, was chosen again once an
        # answer's decodes had filled the window)
        self._short_prompts: deque[tuple[StepShape, float]] = deque(maxlen=window)
        self.count = 0
        self._fit: tuple[int, ComputeFit | None] = (-1, None)

    def add(self, shape: StepShape, seconds: float) -> None:
        values = (*shape.features(), seconds)
        if not _finite(*values) or min(values) < 0 or seconds <= 0 or shape.empty:
            return
        with self._lock:
            prefill = shape.prefill_tokens >= PREFILL_TOKENS
            if prefill:
                window = self._prefills
            else:
                window = self._short_prompts if shape.prefill_tokens > 0 else self._others
            window.append((shape, float(seconds)))
            self.count += 1

    def estimate(self) -> ComputeFit | None:
        """The fit over the recent forward passes (made again only after new ones), or None
        while too few prefills were seen to predict a prompt's cost."""
        with self._lock:
            count = self.count
            prefills = list(self._prefills)
            others = list(self._others) + list(self._short_prompts)
        if self._fit[0] != count:
            self._fit = (count, _fit_compute(prefills, others))
        return self._fit[1]

    def token_seconds(self) -> float | None:
        """A prompt token's cost by the slowest prefill seen (its fixed cost included): what a
        prompt plausibly costs before the fit exists. None before any prefill."""
        with self._lock:
            rates = [s / shape.prefill_tokens for shape, s in self._prefills]
        return max(rates) if rates else None


def _fit_compute(
    prefills: list[tuple[StepShape, float]], others: list[tuple[StepShape, float]]
) -> ComputeFit | None:
    samples = prefills + others
    if len(samples) < MIN_STEPS or len(prefills) < MIN_PREFILLS:
        return None  # a prompt's cost is not predicted from decode steps alone
    decode_only = [(shape, s) for shape, s in others if shape.prefill_tokens == 0]
    # the floor: a pass of a few decodes (the median of those seen)
    few = [s for shape, s in decode_only if shape.decode_rows <= 16]
    floor = float(np.median(few)) if few else 0.0
    # passes of decodes alone get their own line, and the prompts' line is drawn through the
    # passes that computed prompt tokens: a GPU's decode pass is bound by reading the weights
    # (an MoE's 61 GB: 18 ms on an H100), a prompt's pass by computing, and one line through
    # both put the decode passes' cost into every prompt's fixed cost. The simulator's MoE
    # beside 64 decodes: auto split every hit (its passes give no compute sample), the decode
    # passes took over the window, and recomputing was predicted 10% slower than it ran
    # (only where the prompts' passes came in at least two sizes: one size alone does not
    # tell their fixed cost from their per-token cost)
    prompts = [(shape, s) for shape, s in samples if shape.prefill_tokens > 0]
    sizes = {shape.prefill_tokens for shape, _ in prompts}
    decodes = None
    if len(decode_only) >= MIN_DECODE_PASSES and len(sizes) >= 2:
        decodes, samples = _fit_decodes(decode_only), prompts
    # the line through the passes above it (those at the floor say nothing of their tokens),
    # where enough prefills are
    above = [(shape, s) for shape, s in samples if s > 1.5 * floor]
    if sum(1 for shape, _ in above if shape.prefill_tokens >= PREFILL_TOKENS) >= MIN_PREFILLS:
        samples = above
    x = np.array([shape.features() for shape, _ in samples])
    y = np.array([s for _, s in samples])
    step, token, attention, row, context = nonnegative_fit(x, y)
    shapes = [shape for shape, _ in samples if shape.prefill_tokens > 0]
    unfit = step > floor or (token <= 0 and attention <= 0)
    if floor > 0 and unfit and not _spans(shape.prefill_tokens for shape in shapes):
        # prompts of one size (an instance that recomputed every hit of a workload, before
        # any load): a line through them says little of a pass's fixed cost, and noise chose
        # it (0.42 s on the 2-core VM, where a pass of 92 tokens took ~0.25 s: a load's last
        # pass was predicted 0.27 s long and auto recomputed hits that loaded 14% sooner).
        # Where it came out above a small decode pass's, it is that (a prompt pass's fixed
        # cost is not more, and on a GPU, where a decode pass reads every weight, less: the
        # line is kept where it is below), and the prompt tokens cost the rest; their
        # attention where the contexts they attend to tell it apart (a long prompt's chunks of
        # one size: the same tokens, ever more context)
        columns = [1, 2, 3, 4]
        if not _spans(shape.prefill_attention / shape.prefill_tokens for shape in shapes):
            columns = [1, 3, 4]
        coef = dict(zip(columns, nonnegative_fit(x[:, columns], y - floor), strict=True))
        if coef[1] > 0 or coef.get(2, 0.0) > 0:  # (else prompts faster than the floor: the line)
            step = floor
            token, attention, row, context = (coef.get(k, 0.0) for k in (1, 2, 3, 4))
    if token <= 0 and attention <= 0:
        return None  # nothing grows with the prompt: not a usable fit yet
    work = x[:, 1:] @ np.array([token, attention, row, context])
    least = float(work.min()) if len(work) else 0.0
    return ComputeFit(step, token, attention, row, context, len(samples), floor, decodes, least)


def _spans(values: Iterable[float]) -> bool:
    """Whether positive ``values`` span at least ``SIZES_SPAN`` (a fit can tell their
    coefficient from a constant's)."""
    seen = [v for v in values if v > 0]
    return bool(seen) and max(seen) >= SIZES_SPAN * min(seen)


def _fit_decodes(samples: list[tuple[StepShape, float]]) -> DecodeLine:
    x = np.array(
        [[1.0, float(shape.decode_rows), float(shape.decode_context)] for shape, _ in samples]
    )
    y = np.array([s for _, s in samples])
    step, row, context = nonnegative_fit(x, y)
    return DecodeLine(step, row, context)


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: a coefficient the plain fit makes negative
    (noise on a term that barely varies) is dropped and the rest refitted."""
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep = [k for k, v in zip(keep, sol, strict=True) if v >= 0] if (sol >= 0).any() else []
    return [float(c) for c in coef]
