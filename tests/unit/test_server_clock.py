"""The server's clock that drop_select's claims read in the background (ServerClock): closing
the buffer waits for a reading under way and allows no more, and a reading that breaks in an
unexpected way is logged, not lost with its thread.

Found by a busy run of .ci/run: a reading still running when ``LookupBuffer.close`` closed the
connections broke inside redis-py (``TypeError`` on a socket closed under it), an exception
nobody saw but pytest's thread hook, and could open a connection again after the close."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from kvstore.values import drop_select
from kvstore.values.drop_select import ServerClock
from testing.threads import returns_only_once_set


def join_clock_threads() -> None:
    for thread in threading.enumerate():
        if thread.name == "kvstore-clock":
            thread.join(30)
            assert not thread.is_alive()


@pytest.fixture
def thread_crashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException]]:
    """What escaped any thread while the test ran."""
    crashes: list[BaseException] = []
    monkeypatch.setattr(
        threading, "excepthook", lambda args: crashes.append(args.exc_value or Exception())
    )
    yield crashes


def test_close_waits_for_a_reading_under_way_and_no_reading_follows_it(
    monkeypatch: pytest.MonkeyPatch, thread_crashes: list[BaseException]
) -> None:
    started, release = threading.Event(), threading.Event()
    reads: list[int] = []

    def read() -> float:
        reads.append(1)
        started.set()
        assert release.wait(30)
        return 0.5

    clock = ServerClock(read)
    assert clock.late_ms(1.0) == ""  # unknown yet: no limit; a reading starts in the background
    assert started.wait(30)
    returns_only_once_set(lambda: clock.close(30.0), release)  # nothing may close under the reading
    assert clock.offset_s == 0.5

    monkeypatch.setattr(drop_select, "_CLOCK_EVERY_S", -1.0)  # a reading due on every call
    clock.late_ms(1.0)
    clock.read_now()
    join_clock_threads()
    assert reads == [1]
    assert thread_crashes == []


def test_an_unexpected_error_while_reading_is_logged_and_the_clock_stays_unknown(
    caplog: pytest.LogCaptureFixture, thread_crashes: list[BaseException]
) -> None:
    def read() -> float:
        raise TypeError("argument must be an int, or have a fileno() method.")

    clock = ServerClock(read)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert clock.late_ms(1.0) == ""
        join_clock_threads()
    assert "reading the server's clock failed unexpectedly" in caplog.text
    assert "TypeError" in caplog.text
    assert clock.offset_s is None
    assert clock.late_ms(1.0) == ""  # claims still go, without a limit
    assert thread_crashes == []


def test_close_gives_up_on_a_reading_that_outlasts_its_wait_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by a review: a client without a socket timeout, on a hung server, held close()
    # for as long as the server hung
    in_read, release = threading.Event(), threading.Event()

    def read() -> float:
        in_read.set()
        assert release.wait(30)
        return 0.0

    clock = ServerClock(read)
    clock.late_ms(1.0)
    assert in_read.wait(30)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        clock.close(wait_s=0.1)
    assert "a reading of the server's clock still runs after 0.1s" in caplog.text
    release.set()
    join_clock_threads()


@pytest.mark.parametrize(
    "reply",
    [ValueError("invalid literal for int()"), (1,), ("x", "y"), None, (10**400, 0), {}],
)
def test_a_time_reply_of_another_shape_fails_typed_and_keeps_the_last_offset(
    monkeypatch: pytest.MonkeyPatch, reply: object
) -> None:
    """Found by a review: a ``TIME`` answered with anything but two numbers (redis-py's
    conversion raising ``ValueError``, or a reply that does not unpack) went up as a
    ``ValueError`` through a claim whose "too late" made it read the clock."""
    import fakeredis

    from kvstore import LookupBuffer
    from kvstore.errors import StoreCommandError

    with LookupBuffer(fakeredis.FakeRedis(), namespace="d", fingerprint="f0", ttl_s=60) as buf:
        claims = buf._claims
        claims.clock.read_now()
        known = claims.clock.offset_s
        assert known is not None

        def time() -> object:
            if isinstance(reply, Exception):
                raise reply
            return reply

        monkeypatch.setattr(claims._client, "time", time)
        with pytest.raises(StoreCommandError, match="TIME"):
            claims.server_offset()
        claims.clock.read_now()  # (what a "too late" claim does: no exception escapes it)
        assert claims.clock.offset_s == known
