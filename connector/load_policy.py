"""How to serve a prompt's blocks found in Redis: load them all before the request runs
(``async``), load the first of them layer by layer while vLLM computes the rest of the prompt in
the same forward pass (``split``), or load nothing (``recompute``). Chosen per request from
what this instance measures (``figures.py``), to give the earliest first token -- and, on a
busy engine, to delay the other requests least.

The model behind the choice, for a request whose blocks ``[s, s + h)`` are in Redis (``s``
blocks cached locally), ``n`` prompt tokens, ``B`` the block size:

- recompute: ``T = C(s B)``, ``C(a)`` a forward pass computing tokens ``[a, n)`` (its fixed
  cost, the tokens, their attention over the context: ``ComputeFit.seconds``);
- async: ``T = L(h) + C((s + h) B) + step``: the load, then the rest of the prompt in the next
  pass; ``L(j)`` a load of ``j`` blocks (``LoadFit.seconds``);
- split of ``j`` blocks, read in ``b`` bands of layers: the forward pass waits for each band
  before its layers run, so with ``x = (L(j) - o) / b`` per band and ``c = C((s + j) B) / b``
  per band of layers, ``T = o + max(x + b c, b x + c)`` -- loading and computing overlap, and
  the slower of the two sets the pace. ``j`` is the crossing of the two, searched.

On a busy engine every second a forward pass runs is a second the ``R`` other requests it holds
wait, so each way costs its ``T`` plus ``R`` times the forward time it takes (the whole ``T``
for a split, whose pass also waits for its loads; only the compute for the others): a busy
engine prefers ``async``, which costs its forward passes nothing while it loads.

A way that is pinned (``load_policy``, or a request's own) is taken as it is: a pinned
``split`` loads the best ``j`` where the figures are measured, the whole hit before. Until the
instance has measured loads and forward passes the choice is ``async``, as the connector always
did. A store judged too slow is still probed now and then (``PROBE_EVERY``), so a store that
got faster is noticed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from connector.figures import ComputeFit, LoadFit

# after this many hits in a row recomputed by choice, one is loaded (a split, if possible)
# sized as if the store were twice as fast as measured: the bandwidth is measured again
PROBE_EVERY = 16


class Way(enum.Enum):
    ASYNC = "async"
    SPLIT = "split"
    RECOMPUTE = "recompute"


POLICIES = ("auto", *(w.value for w in Way))


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


@dataclass(frozen=True)
class Decision:
    """A way to serve a hit, how many of its blocks it loads, and why."""

    way: Way
    blocks: int  # loaded from the hit's start (0 to recompute)
    reason: str  # "pinned", "measured", "probe", "not measured yet", "split unavailable", ...
    # each way's predicted time to the first token (seconds), when figures were used
    predicted_s: dict[str, float] = field(default_factory=dict)


def pinned(
    way: Way,
    hit: Hit,
    split_ok: bool,
    loads: LoadFit | None = None,
    compute: ComputeFit | None = None,
) -> Decision:
    """``way`` as it is: the whole hit, or a split of the best size where the figures are
    measured (a split that is not possible here loads asynchronously)."""
    if way is Way.RECOMPUTE:
        return Decision(way, 0, "pinned")
    if way is Way.SPLIT and not split_ok:
        return Decision(Way.ASYNC, hit.blocks, "split unavailable")
    if way is Way.SPLIT and loads is not None and compute is not None and hit.blocks > 0:
        blocks, seconds = best_split(hit, loads, compute)
        recompute = compute.seconds(hit.start * hit.block_size, hit.prompt_tokens)
        return Decision(way, blocks, "pinned", _rounded({way: seconds, Way.RECOMPUTE: recompute}))
    return Decision(way, hit.blocks, "pinned")


def choose(
    hit: Hit,
    loads: LoadFit | None,
    compute: ComputeFit | None,
    *,
    others: int = 0,
    split_ok: bool = True,
    probe: bool = False,
) -> Decision:
    """The way that gives ``hit``'s request its first token soonest (plus what it costs the
    ``others`` requests the engine holds), from the measured figures; ``probe``: measure the
    store again (see the module docstring)."""
    if hit.blocks <= 0:
        return Decision(Way.RECOMPUTE, 0, "no hit")
    if loads is None or compute is None:
        return Decision(Way.ASYNC, hit.blocks, "not measured yet")
    n, bs = hit.prompt_tokens, hit.block_size
    s, h = hit.start, hit.blocks

    def compute_from(block: int) -> float:
        return compute.seconds(block * bs, n)

    def load(blocks: int) -> float:
        return loads.seconds(blocks * hit.block_bytes)

    times = {
        Way.RECOMPUTE: compute_from(s),
        Way.ASYNC: load(h) + compute_from(s + h) + compute.step_s,
    }
    engine = {Way.RECOMPUTE: times[Way.RECOMPUTE], Way.ASYNC: compute_from(s + h)}
    j = 0
    if split_ok:
        j, times[Way.SPLIT] = best_split(hit, loads, compute)
        engine[Way.SPLIT] = times[Way.SPLIT]  # the pass waits for its loads: all of it
    if probe:
        faster = LoadFit(loads.overhead_s, 2 * loads.bytes_per_s, loads.samples)
        way = Way.SPLIT if split_ok else Way.ASYNC
        blocks = max(1, best_split(hit, faster, compute)[0]) if split_ok else h
        return Decision(way, blocks, "probe", _rounded(times))
    cost = {way: t + others * engine[way] for way, t in times.items()}
    way = min(cost, key=lambda w: (cost[w], w is not Way.RECOMPUTE))  # ties: recompute
    blocks = {Way.RECOMPUTE: 0, Way.ASYNC: h, Way.SPLIT: j}[way]
    return Decision(way, blocks, "measured" if not others else "measured, busy", _rounded(times))


def best_split(hit: Hit, loads: LoadFit, compute: ComputeFit) -> tuple[int, float]:
    """(blocks, predicted seconds) of the best split of ``hit``: the loads of ``j`` blocks and
    the computing of the rest overlap band by band, so the best ``j`` is near where the two
    take as long; searched by bisection on their difference, which only grows with ``j``."""
    b = max(1, hit.bands)

    def parts(j: int) -> tuple[float, float]:
        transfer = loads.seconds(j * hit.block_bytes) - loads.overhead_s
        return transfer, compute.seconds((hit.start + j) * hit.block_size, hit.prompt_tokens)

    def total(j: int) -> float:
        transfer, rest = parts(j)
        return loads.overhead_s + max(transfer / b + rest, transfer + rest / b)

    lo, hi = 1, hit.blocks
    while lo < hi:  # the first j whose transfer takes at least as long as the rest
        mid = (lo + hi) // 2
        transfer, rest = parts(mid)
        if transfer >= rest:
            hi = mid
        else:
            lo = mid + 1
    candidates = {1, hit.blocks, lo, max(1, lo - 1)}
    best = min(candidates, key=lambda j: (total(j), -j))
    return best, total(best)


def _rounded(times: dict[Way, float]) -> dict[str, float]:
    return {way.value: round(t, 6) for way, t in times.items()}
