"""kvstore: a Redis/Valkey lookup buffer for KV caches (insert / drop_select / select).

It knows Redis, bytes and torch tensors, and nothing of vLLM (that is ``connector``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.errors import (
    CorruptValueError,
    DeadlinePassedError,
    InvalidArgumentError,
    InvalidURLError,
    InvalidValueError,
    KVStoreError,
    StoreAuthenticationError,
    StoreBusyError,
    StoreCircuitOpenError,
    StoreClosedError,
    StoreCodeError,
    StoreCommandError,
    StoreOutOfMemoryError,
    StorePermissionError,
    StoreReplyTooLargeError,
    StoreTimeoutError,
    StoreTopologyError,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from kvstore.counters import StoreStats
    from kvstore.fleet.handoff import Claim, HandoffState
    from kvstore.lookup_buffer import LookupBuffer, layout_fingerprint
    from kvstore.net.connection import StoreAddress, parse_url, redact_url
    from kvstore.net.server_code import ScriptMode
    from kvstore.values.codec import (
        FORMAT_VERSION,
        ValueHeader,
        decode_value,
        encode_value,
        read_header,
    )
    from kvstore.values.hashing import chain_hashes, root_hash

# Imported on first use (PEP 562), so `kvstore --help` and the CLI's Redis-only commands do not
# pay for torch and redis-py at startup.
_LAZY = {
    "FORMAT_VERSION": "values.codec",
    "ValueHeader": "values.codec",
    "decode_value": "values.codec",
    "encode_value": "values.codec",
    "read_header": "values.codec",
    "StoreAddress": "net.connection",
    "parse_url": "net.connection",
    "redact_url": "net.connection",
    "ScriptMode": "net.server_code",
    "chain_hashes": "values.hashing",
    "root_hash": "values.hashing",
    "Claim": "fleet.handoff",
    "HandoffState": "fleet.handoff",
    "LookupBuffer": "lookup_buffer",
    "StoreStats": "counters",
    "layout_fingerprint": "lookup_buffer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "FORMAT_VERSION",
    "Claim",
    "CorruptValueError",
    "DeadlinePassedError",
    "HandoffState",
    "InvalidArgumentError",
    "InvalidURLError",
    "InvalidValueError",
    "KVStoreError",
    "LookupBuffer",
    "ScriptMode",
    "StoreAddress",
    "StoreAuthenticationError",
    "StoreBusyError",
    "StoreCircuitOpenError",
    "StoreClosedError",
    "StoreCodeError",
    "StoreCommandError",
    "StoreOutOfMemoryError",
    "StorePermissionError",
    "StoreReplyTooLargeError",
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
