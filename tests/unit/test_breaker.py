"""The circuit breaker's states, with a probe we control."""

from __future__ import annotations

import logging
import threading

import pytest

from kvstore.net.breaker import CircuitBreaker
from testing.threads import returns_only_once_set


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


def test_a_caller_can_probe_now_instead_of_waiting_for_the_background_probe() -> None:
    """Issue 38, item 8: after a restart, calls were refused until the background probe (every
    ``probe_interval_s``) succeeded; a caller had no way to ask sooner."""
    healthy = threading.Event()

    def probe() -> None:
        if not healthy.is_set():
            raise ConnectionError("down")

    b = CircuitBreaker(probe, failure_threshold=1, probe_interval_s=3600)  # (never, here)
    b.record_failure("refused")
    assert not b.probe_now() and not b.allow() and "down" in b.last_error
    healthy.set()
    assert b.probe_now() and b.allow()
    assert b.probe_now()  # closed: nothing to do
    b.stop()


def test_stop_waits_for_a_probe_under_way_and_no_probe_follows() -> None:
    # (a probe still running as a buffer closes its connections could open one again)
    started, release = threading.Event(), threading.Event()
    probes: list[int] = []

    def probe() -> None:
        probes.append(1)
        started.set()
        assert release.wait(30)
        raise ConnectionError("still down")

    b = CircuitBreaker(probe, failure_threshold=1, probe_interval_s=0.01)
    b.record_failure("refused")
    assert started.wait(30)
    returns_only_once_set(b.stop, release)  # the probe holds it
    assert probes == [1] and b.is_open  # no probe after the stop; the state stays


def test_stop_waits_for_an_older_probe_too() -> None:
    # Found by a review: a caller's probe_now closes the breaker, the next failure reopens it
    # and starts a second prober while the first is still in its probe; stop() waited for the
    # newest only.
    first_in_probe, release_first = threading.Event(), threading.Event()
    first: list[threading.Thread] = []

    def probe() -> None:
        if threading.current_thread() is threading.main_thread():
            return  # the caller's probe_now: the store answers
        if not first:
            first.append(threading.current_thread())
            first_in_probe.set()
            assert release_first.wait(30)
        raise ConnectionError("still down")

    b = CircuitBreaker(probe, failure_threshold=1, probe_interval_s=0.01)
    b.record_failure("refused")
    assert first_in_probe.wait(30)
    assert b.probe_now()  # closed (half-open)
    b.record_failure("again")  # reopened at once: a second prober starts
    returns_only_once_set(b.stop, release_first)  # the first prober's probe holds it
    assert not first[0].is_alive()


def test_stop_gives_up_on_a_probe_that_outlasts_its_wait_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    in_probe, release = threading.Event(), threading.Event()

    def probe() -> None:
        in_probe.set()
        assert release.wait(30)  # a server hung, a client without a socket timeout
        raise ConnectionError("still down")

    b = CircuitBreaker(probe, failure_threshold=1, probe_interval_s=0.01, name="Redis at x")
    b.record_failure("refused")
    assert in_probe.wait(30)
    with caplog.at_level(logging.WARNING, logger="kvstore.breaker"):
        b.stop(wait_s=0.1)
    assert "Redis at x: a probe still runs after 0.1s" in caplog.text
    release.set()
