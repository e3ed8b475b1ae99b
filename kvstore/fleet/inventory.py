"""What is stored, without moving values: presence of blocks and chains (``EXISTS``), sizes and
TTLs left (``STRLEN`` / ``PTTL``), renewing TTLs and deleting. Small calls, on the control
client, one pipelined round trip each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.fleet.handoff import presence
from kvstore.net.bounded_replies import integer_reply
from kvstore.net.guard import Guard
from kvstore.net.transport import Transport
from kvstore.values.keys import KeySpace
from kvstore.values.ttl import ChainTtl


@dataclass(frozen=True)
class BlockInfo:
    """A stored block as ``block_info`` sees it (summed / the minimum over fingerprints)."""

    present: bool
    size: int  # bytes stored
    ttl_s: float | None  # seconds left; None: no expiry (or not present)


class Inventory:
    def __init__(self, transport: Transport, guard: Guard, keys: KeySpace, ttl: ChainTtl) -> None:
        self._transport = transport
        self._guard = guard
        self._keys = keys
        self._ttl = ttl

    def exists(self, keys: Sequence[str]) -> list[int]:
        """``EXISTS`` per key, in one round trip."""

        def fill(pipe: Any) -> None:
            for k in keys:
                pipe.exists(k)

        replies = self._guard.call("EXISTS", lambda: self._transport.pipeline(fill))
        return [integer_reply(x, "EXISTS") for x in replies]

    def longest_prefixes(
        self, chains: Sequence[Sequence[str]], fingerprints: Sequence[str] | None = None
    ) -> list[int]:
        """Per chain, how many leading blocks are present under every fingerprint."""
        return [
            next((i for i, b in enumerate(blocks) if not b), len(blocks))
            for blocks in self.presences(chains, fingerprints)
        ]

    def presences(
        self, chains: Sequence[Sequence[str]], fingerprints: Sequence[str] | None = None
    ) -> list[list[bool]]:
        """Per chain, per block, whether it is present under every fingerprint (one round
        trip)."""
        fps = self._keys.fingerprints(fingerprints)
        keys = self.presence_keys(chains, fps)
        return split_presences(self.exists(keys) if keys else [], chains, len(fps))

    def presence_keys(self, chains: Sequence[Sequence[str]], fps: Sequence[str]) -> list[str]:
        """The keys whose ``EXISTS`` replies ``split_presences`` reads, in its order."""
        return [self._keys.block(h, fp) for chain in chains for h in chain for fp in fps]

    def block_info(
        self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> list[BlockInfo]:
        fps = self._keys.fingerprints(fingerprints)
        keys = [self._keys.block(h, fp) for h in hashes for fp in fps]

        def fill(pipe: Any) -> None:
            for k in keys:
                pipe.strlen(k)
                pipe.pttl(k)

        replies = self._guard.call("STRLEN", lambda: self._transport.pipeline(fill)) if keys else []
        out = []
        for i in range(len(hashes)):
            span = replies[2 * i * len(fps) : 2 * (i + 1) * len(fps)]
            sizes = [integer_reply(x, "STRLEN") for x in span[0::2]]
            pttls = [integer_reply(x, "PTTL") for x in span[1::2]]
            present = all(p != -2 for p in pttls)  # -2: no such key (an empty value is -1/>=0)
            ttls = [p / 1000 for p in pttls if p >= 0]
            out.append(BlockInfo(present, sum(sizes), min(ttls) if ttls else None))
        return out

    def renew(self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None) -> int:
        """Give a chain's blocks their TTL again, counted from now; how many keys changed."""
        if not hashes:
            return 0
        fps = self._keys.fingerprints(fingerprints)

        def fill(pipe: Any) -> None:
            for pos, h in enumerate(hashes):
                ttl = self._ttl.at(pos)
                for fp in fps:
                    key = self._keys.block(h, fp)
                    if ttl is None:
                        pipe.persist(key)
                    else:
                        pipe.pexpire(key, ttl)

        replies = self._guard.call("PEXPIRE", lambda: self._transport.pipeline(fill))
        return sum(int(bool(r)) for r in replies)

    def delete(self, keys: Sequence[str]) -> int:
        """``UNLINK`` the keys; how many existed."""
        return self._guard.call("UNLINK", lambda: self._transport.unlink(keys))


def split_presences(
    exists: Sequence[Any], chains: Sequence[Sequence[str]], per_block: int
) -> list[list[bool]]:
    """Per chain, per block, whether its ``per_block`` EXISTS replies (one per fingerprint) of
    ``Inventory.presence_keys`` are all 1."""
    out, at = [], 0
    for chain in chains:
        span = len(chain) * per_block
        out.append(presence(exists[at : at + span], per_block))
        at += span
    return out
