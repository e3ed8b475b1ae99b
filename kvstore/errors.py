"""Typed exceptions. Each message says what to do; none ever contains a password."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises."""


class InvalidURLError(KVStoreError, ValueError):
    """The store URL cannot be parsed or uses an unsupported scheme."""


class StoreUnavailableError(KVStoreError, ConnectionError):
    """The Redis/Valkey server cannot be reached (refused, DNS, TLS handshake, reset)."""


class StoreAuthenticationError(KVStoreError, PermissionError):
    """The server rejected the username/password (or needs one that was not given)."""


class StoreTimeoutError(KVStoreError, TimeoutError):
    """The server did not answer within the socket timeout."""


class StoreCommandError(KVStoreError, RuntimeError):
    """The server answered a command with an error (e.g. OOM, a read-only replica)."""


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
