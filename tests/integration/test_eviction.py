"""Under memory pressure the recommended policy evicts chains' tails, not their heads: a chain
is usable up to its first hole, so blocks behind a hole are dead weight."""

from __future__ import annotations

import pytest

from scripts.eviction import measure

pytestmark = pytest.mark.redis


def test_volatile_ttl_keeps_what_survives_usable() -> None:
    r = measure("volatile-ttl", samples=10, chains=30, spread_s=2.0)
    assert r.blocks_kept < r.blocks_written  # it did evict
    # each block's TTL is 1 ms shorter than its parent's: tails expire (and are evicted) first
    assert r.usable_fraction >= 0.85, r
