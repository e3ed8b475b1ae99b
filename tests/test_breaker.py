"""The circuit breaker's states, with a probe we control."""

from __future__ import annotations

import threading

from kvstore.breaker import CircuitBreaker


def test_opens_after_the_threshold_and_a_success_in_between_resets_the_count() -> None:
    b = CircuitBreaker(lambda: None, failure_threshold=3, probe_interval_s=60)
    b.record_failure("x")
    b.record_failure("x")
    b.record_success()
    b.record_failure("x")
    b.record_failure("x")
    assert b.allow()
    b.record_failure("x")
    assert not b.allow() and b.opens == 1
    b.stop()


def test_a_probe_lets_calls_through_and_one_failure_then_reopens_it() -> None:
    healthy = threading.Event()

    def probe() -> None:
        if not healthy.is_set():
            raise ConnectionError("down")

    b = CircuitBreaker(probe, failure_threshold=3, probe_interval_s=0.02)
    for _ in range(3):
        b.record_failure("refused")
    assert not b.allow()
    assert not b.wait_closed(0.1)  # probes fail: it stays open
    healthy.set()
    assert b.wait_closed(2) and b.allow()
    b.record_failure("flapping")  # half-open: one failure is enough
    assert not b.allow() and b.opens == 2
    assert b.wait_closed(2)
    b.record_success()  # now closed for real: it takes the full count again
    b.record_failure("x")
    assert b.allow()
    b.stop()
