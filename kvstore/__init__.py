"""kvstore: a Redis/Valkey lookup buffer for KV caches (insert / drop_select / select).

It knows Redis, bytes and torch tensors, and nothing of vLLM (that is ``connector``).
"""

from .codec import FORMAT_VERSION, ValueHeader, decode_value, encode_value, read_header
from .connection import StoreAddress, parse_url, redact_url
from .errors import (
    CorruptValueError,
    InvalidArgumentError,
    InvalidURLError,
    InvalidValueError,
    KVStoreError,
    StoreAuthenticationError,
    StoreCircuitOpenError,
    StoreCommandError,
    StoreOutOfMemoryError,
    StorePermissionError,
    StoreTimeoutError,
    StoreTopologyError,
    StoreUnavailableError,
)
from .hashing import chain_hashes, root_hash
from .lookup_buffer import HandoffState, LookupBuffer, StoreStats, layout_fingerprint

__all__ = [
    "FORMAT_VERSION",
    "CorruptValueError",
    "HandoffState",
    "InvalidArgumentError",
    "InvalidURLError",
    "InvalidValueError",
    "KVStoreError",
    "LookupBuffer",
    "StoreAddress",
    "StoreAuthenticationError",
    "StoreCircuitOpenError",
    "StoreCommandError",
    "StoreOutOfMemoryError",
    "StorePermissionError",
    "StoreStats",
    "StoreTimeoutError",
    "StoreTopologyError",
    "StoreUnavailableError",
    "ValueHeader",
    "chain_hashes",
    "decode_value",
    "encode_value",
    "layout_fingerprint",
    "parse_url",
    "read_header",
    "redact_url",
    "root_hash",
]
