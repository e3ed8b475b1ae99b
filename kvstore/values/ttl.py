"""How long a stored block lives: the buffer's TTL, a little shorter for each position further
down its chain, so that under ``volatile-ttl`` eviction a prompt's tail goes before its head (a
head without its tail is still useful; not vice versa)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainTtl:
    """``ttl_ms`` None: blocks never expire. ``step_ms``: how much shorter per chain position."""

    ttl_ms: int | None
    step_ms: int

    @classmethod
    def from_seconds(cls, ttl_s: float | None, step_ms: int | None = None) -> ChainTtl:
        ttl_ms = int(ttl_s * 1000) if ttl_s else None
        # 0.1 s per chain position at a 1 h TTL: measured (scripts/eviction.py) to cut the dead
        # weight left by volatile-ttl eviction 2-3x when prompts arrive over time
        return cls(ttl_ms, step_ms if step_ms is not None else (ttl_ms or 0) // 36_000)

    def at(self, position: int) -> int | None:
        """The TTL of the block at ``position`` in its chain (never below half the TTL)."""
        if self.ttl_ms is None:
            return None
        return max(self.ttl_ms // 2, self.ttl_ms - position * self.step_ms)

    def capped(self, cap_ms: int) -> int:
        """The TTL of a record that must expire with the blocks and within ``cap_ms``."""
        return min(self.ttl_ms or cap_ms, cap_ms)
