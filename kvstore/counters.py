"""The lookup buffer's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StoreStats:
    """Counters since the buffer was created (a snapshot; see ``LookupBuffer.stats``)."""

    inserts: int = 0
    insert_errors: int = 0
    hits: int = 0
    misses: int = 0
    bytes_out: int = 0  # written to Redis
    bytes_in: int = 0  # read from Redis (valid values only)
    corrupt: int = 0
    corrupt_by_reason: dict[str, int] = field(default_factory=dict)
    breaker_opens: int = 0  # times the circuit breaker opened (Redis refusing, hung, gone)
    redirects: int = 0  # Cluster only: values sent again after MOVED / ASK (a slot moved)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
