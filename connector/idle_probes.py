"""Probes a worker runs on its own while its engine is idle (the scheduler side plans them as a
standing order, ``probes.ProbePlanner.idle_order``, sent with a step's metadata when it
changes; ``probe_reads.py`` runs each).

vLLM runs no step while it has no request, so no step carries a probe: a store that recovered
(or slowed down) while nobody asked was measured only by the steps of the next request, after
that request had been served on the old figure. On the CPU bench the first one or two requests
after the store got 30x faster were recomputed, which put auto at 1.11-1.14x of the better
way in those phases.

Once no step has run for ``IDLE_AFTER_S``, the worker runs the order's probes in turn: the
first ``FEW_SAMPLES`` of each kind one after another (what a changed figure follows,
``figures.py``), then further and further apart, at most ``IDLE_MAX_INTERVAL_S`` (a watched
figure never goes stale), and none once the engine has been idle for ``IDLE_PROBE_FOR_S`` (no
sample older than ``figures.MAX_AGE_S`` is used). Their samples go to the scheduler side with
the next step's output; the first request after an idle spell waits one step for them
(``scheduler.py``). A probe that finds its blocks gone ends the order until a new one comes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from connector.figures import MAX_AGE_S
from connector.probes import FEW_SAMPLES, IDLE_AFTER_S, PROBE_INTERVAL_S, STALE_S, ProbeSpec

logger = logging.getLogger("connector.worker")

# the longest gap between idle probes, and how long an idle engine keeps probing (seconds)
IDLE_MAX_INTERVAL_S = STALE_S / 2
IDLE_PROBE_FOR_S = MAX_AGE_S


class IdleProbes:
    """The order's probes, run on a thread of this class while no step runs."""

    def __init__(
        self,
        start_probe: Callable[[ProbeSpec], Future[bool] | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._start_probe = start_probe  # ``ProbeReads.start``
        self._clock = clock
        self._cond = threading.Condition()
        # under ``_cond``: the standing order, whether a step runs, when the last one ended,
        # the idle probes run since and when the last of them ended (or could not start),
        # and whether the worker shuts down
        self._order: tuple[ProbeSpec, ...] = ()
        self._in_step = False
        self._idle_since = clock()
        self._ran = 0
        self._last_try = self._idle_since
        self._not_before = 0.0  # (a probe that could not start is tried again after it)
        self._stopped = False
        self.completed = 0  # idle probes that ended (tests wait on it; under ``_cond``)
        self._thread = threading.Thread(target=self._run, name="redis-kv-idle-probes", daemon=True)
        self._thread.start()

    def step_began(self, order: list[ProbeSpec] | None) -> None:
        """A step began; ``order``: the scheduler side's new standing order (None: unchanged)."""
        with self._cond:
            self._in_step = True
            self._ran = 0
            if order is not None:
                self._order = tuple(order)
            self._cond.notify_all()

    def step_ended(self) -> None:
        """The step's output was gathered: the engine is idle until the next one begins."""
        with self._cond:
            self._in_step = False
            self._idle_since = self._last_try = self._clock()
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def wait_completed(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` idle probes have ended in all (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.completed >= count, timeout_s)

    def _next_at(self) -> float | None:
        """When the next idle probe is due (under ``_cond``; None: none is)."""
        if self._in_step or not self._order:
            return None
        if self._clock() - self._idle_since > IDLE_PROBE_FOR_S:
            return None
        burst = FEW_SAMPLES * len({spec.kind for spec in self._order})
        if self._ran == 0:
            gap = IDLE_AFTER_S
        elif self._ran < burst:
            gap = 0.0
        else:
            gap = min(IDLE_MAX_INTERVAL_S, PROBE_INTERVAL_S * 2 ** (self._ran - burst))
        return max(self._last_try + gap, self._not_before)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                due = self._next_at()
                now = self._clock()
                if due is None or now < due:
                    self._cond.wait(timeout=None if due is None else due - now)
                    continue
                order = self._order
                spec = order[self._ran % len(order)]
            try:
                found = self._probe(spec)
            except Exception as exc:  # the thread must outlive any one probe
                logger.warning("RedisConnector: an idle probe of the store failed: %r", exc)
                found = True
            with self._cond:
                if found is None:
                    # another probe runs (a step's), or nothing to read with (asleep): again
                    # a probe interval later
                    self._not_before = self._clock() + PROBE_INTERVAL_S
                    continue
                self._last_try = self._clock()
                self._ran += 1
                self.completed += 1
                if not found and self._order is order:
                    self._order = ()  # its blocks are gone: nothing to probe until told
                self._cond.notify_all()

    def _probe(self, spec: ProbeSpec) -> bool | None:
        """Run one probe to its end: whether its blocks were there (None: it did not run)."""
        fut = self._start_probe(spec)
        if fut is None:
            return None
        # (a probe ends within its timeout; the store's calls have deadlines of their own)
        return fut.result(timeout=spec.timeout_s + 30)
