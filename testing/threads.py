"""Timing the tests' threads: a call that must block until an event is set, and a wait for a
background call's effect. Bounds are generous, for a busy machine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def returns_only_once_set(call: Callable[[], object], release: threading.Event) -> None:
    """``call``, run on a thread, is still blocked while ``release`` is unset (a slow machine
    can only make this pass, never fail), and returns once it is set."""
    waiter = threading.Thread(target=call)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    release.set()
    waiter.join(30)
    assert not waiter.is_alive()


def until(pred: Callable[[], object], timeout_s: float = 30) -> None:
    """Wait for a background call's effect (a generous bound, for a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def ends_before_release(
    call: Callable[[], object], release: Callable[[], object], within_s: float = 30
) -> BaseException | None:
    """``call``, run on a thread while something it waits for is held, ends on its own (its
    deadline) within ``within_s`` -- generous, for a busy machine, and far inside what it
    waits for -- then ``release()`` runs either way. Returns what ``call`` raised (None: it
    returned)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # (what it raised is the outcome)
            raised.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    waiter.join(within_s)
    ended_first = not waiter.is_alive()
    release()
    waiter.join()
    assert ended_first, "it waited past its deadline for what was held"
    return raised[0] if raised else None
