"""kvstore/fleet/readership.py: whether a block was read since written, from the server's idle
time and the value's age (the servers' own behaviour: tests/integration/test_backends.py)."""

from __future__ import annotations

from kvstore.fleet.readership import LRU_SLACK_S, Readership, readership


def test_idle_for_its_whole_age_is_unread_and_idle_for_less_is_read() -> None:
    assert readership(100, 100.4) is Readership.UNREAD
    assert readership(99, 100.4) is Readership.UNREAD  # the LRU clock's whole seconds
    assert readership(int(100 - LRU_SLACK_S) - 1, 100.4) is Readership.READ
    assert readership(0, 100.4) is Readership.READ


def test_what_cannot_be_told_is_unknown_not_unread() -> None:
    assert readership(Exception("LFU"), 100.0) is Readership.UNKNOWN  # refused, or an LFU policy
    assert readership(True, 100.0) is Readership.UNKNOWN  # not an idle time
    assert readership(5, None) is Readership.UNKNOWN  # no creation time in the header
    # written before a restart that reset idle times (every block would look freshly read)
    assert readership(0, 100.0, kept_since_s=50.0) is Readership.UNKNOWN
    assert readership(0, 40.0, kept_since_s=50.0) is Readership.READ


def test_a_block_written_just_after_the_start_is_not_taken_for_one_written_before() -> None:
    """Found by a review: the uptime comes in whole seconds and the age from the writer's
    clock, so blocks written within a second of the server's start read "unknown", and
    ``ls`` said they were written before the server's last restart."""
    assert readership(30, 30.6, kept_since_s=30.0) is Readership.UNREAD
    assert readership(30, 30.0 + LRU_SLACK_S + 0.5, kept_since_s=30.0) is Readership.UNKNOWN
