"""Errors are classified by the server's error type (redis-py's exception classes), never by
message text: redis-py strips the NOPERM / OOM / MOVED codes from the messages."""

from __future__ import annotations

import pytest
import redis.exceptions as rex

from kvstore import (
    StoreAuthenticationError,
    StoreBusyError,
    StoreCommandError,
    StoreOutOfMemoryError,
    StorePermissionError,
    StoreTimeoutError,
    StoreTopologyError,
    StoreUnavailableError,
)
from kvstore.net.connection import translated_errors

CASES = [
    # redis-py parses "NOPERM this user has no ..." into NoPermissionError("this user has no ...")
    (rex.NoPermissionError("this user has no permissions to run the 'strlen' command"),
     StorePermissionError, "may not run STRLEN"),
    (rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
     StoreOutOfMemoryError, "maxmemory-policy"),
    (rex.MovedError("3999 127.0.0.1:6381"), StoreTopologyError, "redis-cluster://"),
    (rex.AskError("3999 127.0.0.1:6381"), StoreTopologyError, "redis-cluster://"),
    # a Cluster down or resharding is unavailable for now, not a wrong URL (issue 20)
    (rex.ClusterDownError("The cluster is down"), StoreUnavailableError, "master is down"),
    (rex.TryAgainError("Multiple keys request during rehashing of slot"),
     StoreUnavailableError, "slot is moving"),
    (rex.ClusterError("TTL exhausted."), StoreUnavailableError, "slot is moving"),
    (rex.SlotNotCoveredError("Slot 12 is not covered"), StoreUnavailableError, "master is down"),
    (rex.ReadOnlyError("You can't write against a read only replica."),
     StoreTopologyError, "read-only replica"),
    (rex.AuthenticationError("invalid username-password pair"), StoreAuthenticationError, ""),
    (rex.BusyLoadingError("Redis is loading the dataset in memory"),
     StoreUnavailableError, "loading"),
    (rex.TimeoutError("Timeout reading from socket"), StoreTimeoutError, ""),
    (rex.ConnectionError("Error 111 connecting"), StoreUnavailableError, "cannot reach"),
    # a pool run out is a busy client, not the server down (it opened the breaker: a review's)
    (rex.MaxConnectionsError("Too many connections"), StoreBusyError, "max_connections"),
    (rex.ResponseError("WRONGTYPE Operation against a key"), StoreCommandError, "WRONGTYPE"),
    (rex.InvalidResponse("Protocol Error: b'H'"), StoreCommandError, "Redis/Valkey"),
    (ConnectionResetError(104, "Connection reset by peer"), StoreUnavailableError, ""),
]  # fmt: skip


@pytest.mark.parametrize(("raised", "expected", "advice"), CASES)
def test_errors_are_typed_by_class(raised: Exception, expected: type, advice: str) -> None:
    with pytest.raises(expected) as info, translated_errors("redis://h:6379/0", "STRLEN"):
        raise raised
    assert advice in str(info.value)


@pytest.mark.parametrize("url", ["rediss://h:6379/0", "valkeys-cluster://h:1", "redis://h:6379/0"])
def test_a_tls_url_that_times_out_says_the_port_may_not_speak_tls(url: str) -> None:
    """Found by a review: rediss:// at a plain server waits out the timeout in the handshake,
    and the message said only to raise socket_timeout_s."""
    with pytest.raises(StoreTimeoutError) as info, translated_errors(url):
        raise rex.TimeoutError("Timeout connecting to server")
    assert ("plain scheme" in str(info.value)) is (not url.startswith("redis://"))
