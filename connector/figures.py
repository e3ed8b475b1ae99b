"""What this instance measures while it serves, for the load policy (``load_policy.py``): how
fast one rank loads from Redis, and how long vLLM's forward passes take for the tokens they
compute. Both are least-squares fits over recent samples the worker sends with its stats
(``worker.py``), so they follow the store and the engine as they change.

- Loads: ``seconds = overhead + bytes / bandwidth`` (a rank's bytes, from the first request to
  Redis to the last block in the KV cache). The overhead is fitted over the recent loads (it
  shows only where their sizes differ); the bandwidth is the median of the newest
  ``RECENT_LOADS`` loads' own, so a store that got ten times slower or faster is followed
  within two loads, not averaged with what it was.
- Forward passes: ``seconds = step + token * tokens + attention * context work``, where a
  step's context work is the sum over its requests of tokens x (the context each token attends
  to, on average): how attention grows with the prompt. Passes that computed many tokens and
  those that computed few are kept in windows of their own, so a stream of decode steps does
  not push the prefills a prompt's cost is predicted from out of the fit.

Nothing is assumed: until enough has been measured, ``estimate()`` is None and the policy
behaves as the connector always did (it loads every hit).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# loads kept for the overhead's fit, how many it needs, and how many the bandwidth is from
LOAD_WINDOW = 32
MIN_LOADS = 2
RECENT_LOADS = 3
# forward passes kept (each window) and how many the fit needs
STEP_WINDOW = 64
MIN_STEPS = 8
# a pass that computed at least this many tokens goes to the prefill window
PREFILL_TOKENS = 64


@dataclass(frozen=True)
class LoadFit:
    overhead_s: float  # a load's fixed cost: round trips, claiming, scheduling
    bytes_per_s: float  # one rank's bandwidth from Redis into the KV cache
    samples: int

    def seconds(self, nbytes: float) -> float:
        return self.overhead_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class ComputeFit:
    step_s: float  # a forward pass's fixed cost
    token_s: float  # per token computed
    attention_s: float  # per token x context token attended to
    samples: int

    def seconds(self, first: int, end: int) -> float:
        """A forward pass computing prompt tokens ``[first, end)``, tokens before ``first``
        cached: its fixed cost, the tokens', and their attention to the context."""
        n = max(0, end - first)
        return self.step_s + self.token_s * n + self.attention_s * n * (first + end) / 2


def attention_work(tokens: int, context_before: int) -> float:
    """Context work of ``tokens`` computed after ``context_before`` cached ones: each attends
    to everything before it (causal), ``tokens x (context_before + tokens / 2)``."""
    return tokens * (context_before + tokens / 2)


class LoadRate:
    """The load bandwidth one rank gets, from its recent loads."""

    def __init__(self, window: int = LOAD_WINDOW) -> None:
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.count = 0  # samples ever added: tells a fresh sample from an old fit
        self._fit: tuple[int, LoadFit | None] = (0, None)  # (count it was made at, the fit)

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and seconds > 0 and math.isfinite(nbytes) and math.isfinite(seconds):
            with self._lock:
                self._samples.append((float(nbytes), float(seconds)))
                self.count += 1

    def estimate(self) -> LoadFit | None:
        """The fit over the recent loads (made again only after new ones), or None."""
        with self._lock:
            count, samples = self.count, list(self._samples)
        if self._fit[0] != count:
            self._fit = (count, self._estimate(samples))
        return self._fit[1]

    @staticmethod
    def _estimate(samples: list[tuple[float, float]]) -> LoadFit | None:
        if len(samples) < MIN_LOADS:
            return None
        sizes = np.array([s[0] for s in samples])
        times = np.array([s[1] for s in samples])
        overhead = 0.0
        if sizes.max() > 1.5 * sizes.min():  # sizes spread enough to tell overhead from rate
            fit = _nonnegative_fit(np.stack([np.ones_like(sizes), sizes], axis=1), times)
            if fit[1] > 0:
                overhead = min(fit[0], float(times.min()))
        recent = samples[-RECENT_LOADS:]
        rates = [b / max(t - overhead, 1e-3 * t) for b, t in recent]
        return LoadFit(overhead, float(np.median(rates)), len(samples))


class PrefillRate:
    """How long forward passes take for what they compute, from recent ones."""

    def __init__(self, window: int = STEP_WINDOW) -> None:
        self._lock = threading.Lock()
        self._prefills: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._others: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.count = 0
        self._fit: tuple[int, ComputeFit | None] = (0, None)

    def add(self, tokens: float, attention: float, seconds: float) -> None:
        values = (tokens, attention, seconds)
        if not all(math.isfinite(v) for v in values) or tokens <= 0 or seconds <= 0:
            return
        if attention < 0:
            return
        with self._lock:
            window = self._prefills if tokens >= PREFILL_TOKENS else self._others
            window.append((float(tokens), float(attention), float(seconds)))
            self.count += 1

    def estimate(self) -> ComputeFit | None:
        """The fit over the recent forward passes (made again only after new ones), or None."""
        with self._lock:
            count = self.count
            samples = list(self._prefills) + list(self._others)
            prefills = len(self._prefills)
        if self._fit[0] != count:
            self._fit = (count, self._estimate(samples, prefills))
        return self._fit[1]

    @staticmethod
    def _estimate(samples: list[tuple[float, float, float]], prefills: int) -> ComputeFit | None:
        if len(samples) < MIN_STEPS or prefills < 2:
            return None  # a prompt's cost is not predicted from decode steps alone
        x = np.array([[1.0, s[0], s[1]] for s in samples])
        y = np.array([s[2] for s in samples])
        step, token, attention = _nonnegative_fit(x, y)
        if token <= 0 and attention <= 0:
            return None  # nothing grows with the tokens: not a usable fit yet
        return ComputeFit(step, token, attention, len(samples))


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
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


def step_shape(rows: Sequence[tuple[int, int]]) -> tuple[int, float]:
    """A forward pass's (tokens, context work) from its requests' (tokens cached before the
    pass, tokens computed in it)."""
    tokens = sum(n for _, n in rows)
    return tokens, sum(attention_work(n, before) for before, n in rows)
