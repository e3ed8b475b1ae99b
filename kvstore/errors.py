"""Typed exceptions. Each message says what to do; none ever contains a password."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises."""


class InvalidURLError(KVStoreError, ValueError):
    """The store URL cannot be parsed or uses an unsupported scheme."""


class StoreUnavailableError(KVStoreError, ConnectionError):
    """The Redis/Valkey server cannot be reached (refused, DNS, TLS handshake, reset, loading)."""


class StoreClosedError(StoreUnavailableError):
    """The ``LookupBuffer`` was closed: it makes no new connection (make a new one). Not
    counted against the server by the circuit breaker."""


class StoreBusyError(KVStoreError):
    """Every connection of this client's pool stayed in use for the pool's whole wait: the
    client is short of connections (``max_connections``), not the server down -- so the circuit
    breaker does not count it against the server."""


class DeadlinePassedError(KVStoreError):
    """The caller's deadline for a batch of replies (a load's own) passed before the batch was
    read: it ends there, what it did not read is missing, and its connection is dropped (a
    server that sends each reply just within the reply's own deadline no longer holds a reader
    for the batch's length times that). The caller's deadline, not the server failing: the
    circuit breaker does not count it."""


class StoreCircuitOpenError(StoreUnavailableError):
    """Recent calls failed, so this one was not sent: the store is skipped until a background
    probe sees it answer again (see :class:`kvstore.net.breaker.CircuitBreaker`)."""


class StoreAuthenticationError(KVStoreError, PermissionError):
    """The server rejected the username/password (or needs one that was not given)."""


class StorePermissionError(KVStoreError, PermissionError):
    """The ACL user may not run a command or touch a key (the server answered NOPERM).

    ``command`` names the command that was refused, where known.
    """

    def __init__(self, message: str, command: str | None = None) -> None:
        super().__init__(message)
        self.command = command


class StoreTimeoutError(KVStoreError, TimeoutError):
    """The server did not answer within the socket timeout.

    It is a builtin ``TimeoutError`` too, which on Python >= 3.11 is also
    ``concurrent.futures.TimeoutError``: code that waits on a Future holding kvstore work must
    tell the two apart by ``Future.done()``, never by catching the type.
    """


class StoreCommandError(KVStoreError, RuntimeError):
    """The server answered a command with an error, or sent a reply that could not be parsed."""


class StoreReplyTooLargeError(StoreCommandError):
    """A control reply (not a value) was over kvstore's bound on them; its connection was
    dropped. A SCAN page of planted long key names, or a URL that names another service."""


class StoreOutOfMemoryError(StoreCommandError):
    """The server refused a write because it reached ``maxmemory`` (OOM)."""


class StoreCodeError(StoreCommandError):
    """The server's kvstore functions cannot be used: not this release's, or functions were
    required (``lua="functions"``) where the server or the user's rule has none. Load this
    release's (``python -m kvstore functions load <url>``) or choose ``lua="scripts"``."""


class StoreTopologyError(StoreCommandError):
    """The server is part of a cluster or a replica set and did not serve the key here
    (MOVED, ASK, CLUSTERDOWN, TRYAGAIN, CROSSSLOT, MASTERDOWN, or READONLY on a replica)."""


class InvalidValueError(KVStoreError, TypeError):
    """A value passed to insert is not a mapping of contiguous-able torch tensors."""


class InvalidArgumentError(KVStoreError, ValueError):
    """An argument is out of range or of the wrong shape (empty key list, bad namespace, ...)."""


class CorruptValueError(KVStoreError, ValueError):
    """A stored value failed validation. Lookups never raise it: they count a miss instead.

    ``reason`` is a short machine-readable tag (``checksum``, ``truncated``, ``fingerprint``,
    ``format``, ``oversize``, ``not-kvstore``, ``wrong-type``, ``key``) used for counters.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
