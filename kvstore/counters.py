"""The lookup buffer's counters."""

from __future__ import annotations

import threading
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
    # Cluster only: commands sent again after MOVED / ASK (a slot moved), and claims retried
    # while a slot migrates or after their reply was lost
    redirects: int = 0
    # select / drop_select receive buffers served from recycled memory (buffer_pool.py)
    recycled_buffers: int = 0
    # values whose later tensors could not be read after their head was (gone, replaced or
    # corrupt in between; ``tensor_reads.py``): each was a hit, then this
    range_failures: int = 0
    # claims given back after their call failed (in the background, ``values/drop_select.py``),
    # and claims that could not be given back in time: their values expire under claim keys with
    # the TTL
    claims_given_back: int = 0
    claims_stranded: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Counters:
    """The live, thread-safe counters behind :class:`StoreStats` snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StoreStats()

    def add(self, **deltas: int) -> None:
        """Add to counters by name (``add(hits=3, bytes_in=n)``)."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def add_reads(self, hits: int, misses: int, bytes_in: int, corrupt: list[str]) -> None:
        """One read's outcome, all at once: ``corrupt`` holds the reason of each bad value."""
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.bytes_in += bytes_in
            self._stats.corrupt += len(corrupt)
            by_reason = self._stats.corrupt_by_reason
            for reason in corrupt:
                by_reason[reason] = by_reason.get(reason, 0) + 1

    def add_range_reads(self, bytes_in: int, failures: list[str]) -> None:
        """Later tensors of values whose head was read: bytes that arrived intact, and the
        reason of each value whose range did not."""
        with self._lock:
            self._stats.bytes_in += bytes_in
            self._stats.range_failures += len(failures)
            self._stats.corrupt += len(failures)
            by_reason = self._stats.corrupt_by_reason
            for reason in failures:
                by_reason[reason] = by_reason.get(reason, 0) + 1

    def snapshot(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**asdict(self._stats))
            snap.corrupt_by_reason = dict(self._stats.corrupt_by_reason)
        return snap
