"""Probes a worker runs on its own while its engine is idle (the scheduler side plans them as a
standing order, ``probes.ProbePlanner.idle_order``, sent with a step's metadata when it
changes; ``probe_reads.py`` runs each).

vLLM runs no step while it has no request, so no step carries a probe: a store that recovered
(or slowed down) while nobody asked was measured only by the steps of the next request, after
that request had been served on the old figure. On the CPU bench the first one or two requests
after the store got 30x faster were recomputed, which put auto at 1.11-1.14x of the better
way in those phases.

The scheduler side sends an order only where the next hit's choice hangs on it: a figure
missing or an upper bound, or the store under watch (the last hit recomputed because of it).
Once no step has run for ``IDLE_AFTER_S``, the worker runs the order's probes in turn: the
first ``FEW_SAMPLES`` of each kind one after another (what a changed figure follows,
``figures.py``), then further and further apart, at most ``IDLE_MAX_INTERVAL_S`` (a watched
figure never goes stale), and none once the engine has been idle for ``IDLE_PROBE_FOR_S`` (no
sample older than ``figures.MAX_AGE_S`` is used). A step stops an idle probe still reading (on
the CPU backend it would share the pass's cores; it gives no sample), and a probe that finds
its blocks gone ends the order until a new one comes. The samples go to the scheduler side
with the next step's output; the first request after an idle spell waits for that output
(``scheduler.py``: one step, two with vLLM's async scheduling).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from connector.logs import FailureCounts, log_bug
from connector.probes import (
    FEW_SAMPLES,
    IDLE_AFTER_S,
    IDLE_MAX_INTERVAL_S,
    IDLE_PROBE_FOR_S,
    PROBE_INTERVAL_S,
    ProbeSpec,
)

logger = logging.getLogger("connector.worker")


class IdleProbes:
    """The order's probes, run on a thread of this class while no step runs."""

    def __init__(
        self,
        start_probe: Callable[[ProbeSpec, threading.Event], Future[bool] | None],
        report_bug: Callable[[str, BaseException, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._start_probe = start_probe  # ``ProbeReads.start``
        # ``WorkerContext.bug`` (counted in ``internal_errors`` and logged sparsely); alone,
        # only logged sparsely
        self._report_bug = report_bug or self._log_bug
        self._clock = clock
        self._cond = threading.Condition()
        # under ``_cond``: the standing order; whether a step runs; the idle spells so far (a
        # probe that ends after a step began counts in none) and when this one began; the
        # idle probes run in it and when the last ended; whether the worker shuts down
        self._order: tuple[ProbeSpec, ...] = ()
        self._in_step = False
        self._spell = 0
        self._idle_since = clock()
        self._ran = 0
        self._last_ended = self._idle_since
        self._not_before = 0.0  # (a probe that could not start is tried again after it)
        self._stopped = False
        self._bugs = FailureCounts()
        # set when the spell ends: an idle probe still reading stops (on the CPU backend its
        # reads would share the cores of the step's pass)
        self._step_began = threading.Event()
        self.completed = 0  # idle probes that ended (tests wait on it; under ``_cond``)
        self._thread = threading.Thread(target=self._run, name="redis-kv-idle-probes", daemon=True)
        self._thread.start()

    def step_began(self, order: list[ProbeSpec] | None) -> None:
        """A step began; ``order``: the scheduler side's new standing order (None: unchanged)."""
        with self._cond:
            if not self._in_step:
                self._in_step = True
                self._spell += 1
                self._step_began.set()
            if order is not None:
                self._order = tuple(order)
            self._cond.notify_all()

    def step_ended(self) -> None:
        """The step's output was gathered: an idle spell begins, until the next step. (Outside
        a step -- a test taking the stats -- nothing changes.)"""
        with self._cond:
            if not self._in_step:
                return
            self._in_step = False
            self._ran = 0
            self._idle_since = self._clock()
            self._step_began = threading.Event()
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._step_began.set()
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
        gap = 0.0
        if self._ran >= burst:
            gap = min(IDLE_MAX_INTERVAL_S, PROBE_INTERVAL_S * 2 ** (self._ran - burst))
        return max(self._idle_since + IDLE_AFTER_S, self._last_ended + gap, self._not_before)

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
                order, spell, stop = self._order, self._spell, self._step_began
                spec = order[self._ran % len(order)]
            try:
                found = self._probe(spec, stop)
            except Exception as exc:  # a bug: probing goes on (the thread died of one, silently)
                self._report_bug("idle-probe", exc, "an idle probe of the store")
                found = None
            with self._cond:
                if found is None:
                    # another probe runs (a step's), or nothing to read with (asleep): again
                    # a probe interval later
                    self._not_before = self._clock() + PROBE_INTERVAL_S
                    continue
                self.completed += 1
                self._cond.notify_all()
                if spell != self._spell:
                    continue  # a step began meanwhile: it counts in no spell
                self._ran += 1
                self._last_ended = self._clock()
                if not found and self._order is order:
                    self._order = ()  # its blocks are gone: nothing to probe until told

    def _log_bug(self, where: str, exc: BaseException, what: str) -> None:
        log_bug(self._bugs, logger, where, exc, what)

    def _probe(self, spec: ProbeSpec, stop: threading.Event) -> bool | None:
        """Run one probe to its end: whether its blocks were there (None: it did not run).
        What it raised is logged where it ran (``WorkerContext.track``)."""
        fut = self._start_probe(spec, stop)
        if fut is None:
            return None
        try:
            # (a probe ends within its timeout; the store's calls have deadlines of their own)
            return fut.result(timeout=spec.timeout_s + 30)
        except FutureTimeout:  # (no probe starts while it runs: ``ProbeReads.start``)
            logger.warning(
                "RedisConnector: an idle probe of the store is still running 30 s past its "
                "time; the store's calls should have ended it -- check the store's timeouts"
            )
            return None
        except Exception:
            return True
