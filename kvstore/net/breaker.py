"""A circuit breaker for one store: when Redis is down or hung, stop sending it work at once.

Closed: calls go through; ``failure_threshold`` availability failures in a row (refused, reset,
timed out, or a caller's deadline passing while it waited) open it. Open: callers are told not
to send anything (``allow()`` is False), so a dead or hung store costs a request microseconds
instead of a socket timeout. A background thread probes the store every ``probe_interval_s``;
(``probe_now`` probes at once, in the caller's thread);
the first probe that succeeds lets calls through again, half-open: the next call that fails
reopens it at once (a flapping server costs one call per cycle), the next that succeeds closes
it. Each transition is logged once and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvstore.breaker")


class CircuitBreaker:
    def __init__(
        self,
        probe: Callable[[], object],
        *,
        name: str = "redis",
        failure_threshold: int = 3,
        probe_interval_s: float = 0.5,
    ) -> None:
        if failure_threshold < 1 or probe_interval_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and probe_interval_s > 0")
        self.name = name
        self.failure_threshold = failure_threshold
        self.probe_interval_s = probe_interval_s
        self._probe = probe
        self._lock = threading.Lock()
        self._failures = 0
        self._open = False
        self._half_open = False
        self._opened_at = 0.0
        self._closed_event = threading.Event()
        self._closed_event.set()
        self._stopped = threading.Event()
        # (several: a caller's probe_now may close the breaker, and the next failure reopen
        # it, while an older prober is still in its probe)
        self._probers: list[threading.Thread] = []
        self.opens = 0  # times it opened since creation
        self.last_error = ""

    @property
    def is_open(self) -> bool:
        return self._open

    def allow(self) -> bool:
        """Whether a call may be sent now (no lock: a racy read only delays a transition)."""
        return not self._open

    def record_success(self) -> None:
        if self._failures or self._half_open:
            with self._lock:
                self._failures = 0
                self._half_open = False

    def record_failure(self, why: str) -> None:
        """One availability failure (never a bad value or a permission error: those are not
        cured by waiting)."""
        with self._lock:
            self.last_error = why
            if self._open:
                return
            self._failures += 1
            if self._failures < self.failure_threshold and not self._half_open:
                return
            self._half_open = False
            self._open = True
            self._opened_at = time.monotonic()
            self.opens += 1
            self._closed_event.clear()
        logger.warning(
            "%s: %d failure(s) in a row (last: %s); not sending it anything until it answers "
            "again (probing every %.1fs). Requests recompute meanwhile.",
            self.name,
            self._failures,
            why,
            self.probe_interval_s,
        )
        prober = threading.Thread(
            target=self._probe_until_closed, name="kvstore-probe", daemon=True
        )
        with self._lock:
            self._probers = [t for t in self._probers if t.is_alive()] + [prober]
        prober.start()

    def _probe_until_closed(self) -> None:
        while not self._stopped.wait(self.probe_interval_s):
            if not self._open or self.probe_now():
                return  # (closed meanwhile by a caller's probe_now)

    def probe_now(self) -> bool:
        """Probe now, in the caller's thread (bounded by the probe's own timeouts), instead of
        waiting for the background probe; True if the breaker is closed afterwards."""
        if not self._open:
            return True
        try:
            self._probe()
        except Exception as exc:  # any failure keeps it open; the next probe tries again
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        with self._lock:
            if not self._open:
                return True
            self._open = False
            self._half_open = True  # one failure reopens it until a call succeeds
            self._failures = 0
            down_s = time.monotonic() - self._opened_at
            self._closed_event.set()
        logger.warning("%s answers again after %.1fs; resuming", self.name, down_s)
        return True

    def wait_closed(self, timeout_s: float) -> bool:
        """Block until the breaker is closed (for tools and tests); True if it is."""
        return self._closed_event.wait(timeout_s)

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop probing (on close), waiting up to ``wait_s`` in all for the probes under way
        (each is bounded by the connect and socket timeouts): one still running as the
        connections close could open one again. A probe that outlasts it is logged and left.
        The breaker stays in its current state."""
        self._stopped.set()
        with self._lock:
            probers = [t for t in self._probers if t is not threading.current_thread()]
        deadline = time.monotonic() + wait_s
        for prober in probers:
            prober.join(max(0.0, deadline - time.monotonic()))
        if any(prober.is_alive() for prober in probers):
            logger.warning(
                "%s: a probe still runs after %.1fs; closing without waiting for it",
                self.name,
                wait_s,
            )
