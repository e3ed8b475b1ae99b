"""Handoff records: a producer's commit record per chain (how many leading blocks it really
wrote), the states a consumer can find it in, how to read several ranks' records at once, and
the calls that write, read and claim them (:class:`HandoffRecords`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.net.guard import Guard
from kvstore.net.server_code import ServerCode, ServerScript
from kvstore.net.transport import Transport
from kvstore.values.keys import KeySpace
from kvstore.values.ttl import ChainTtl

HANDOFF_TAKEN = b"taken"
HANDOFF_PENDING = b"pending"
# A claimed handoff's record lives on this long as "taken", so a retried request learns at
# once that it is gone, then expires (the blocks are deleted by the consumer).
TAKEN_TTL_MS = 60_000
# A commit record matters for the seconds between a prefill and its decode; it never outlives
# this (nor the blocks' TTL), so instances that nobody consumes from leave little behind.
HANDOFF_TTL_MS = 600_000

# Claim every rank's record of one handoff (KEYS, one slot: the handoff id is their hash tag)
# for ARGV[1] (the "taken:<owner>" mark), atomically: when another owner's mark is on any of
# them nothing is written (a loser must not overwrite the winner's mark: the winner's claim
# sent again would then read as lost); else each record that exists takes the mark, for
# ARGV[2] ms. Returns every record's previous value (false: none), as SET ... GET would. It
# runs with allow-oom, so its writes are bounded: existing records only, a short mark, a TTL
# of at most a minute (a tenant sending a 50 MB mark took a full server to 454 MiB).
CLAIM_RECORDS_LUA = """
local ttl = tonumber(ARGV[2])
if #KEYS > 1024 or #ARGV[1] > 1024 or #ARGV[3] > 64 or not ttl or ttl <= 0 or ttl > 60000 then
  return redis.error_reply('ERR KVSTORE a handoff claim takes at most 1024 records, '
    .. 'a mark of at most 1024 bytes, a TTL of at most a minute')
end
local olds, prefix = {}, ARGV[3]
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  olds[i] = v
  if v and v ~= ARGV[1] and string.sub(v, 1, #prefix) == prefix then
    return olds
  end
end
for i, key in ipairs(KEYS) do
  if olds[i] then redis.call('SET', key, ARGV[1], 'PX', ARGV[2]) end
end
return olds
"""
# (allow-oom: it replaces a few bytes of each record; a full server must still hand off)
CLAIM_RECORDS = ServerScript("claim_records", CLAIM_RECORDS_LUA, ("allow-oom",))


# a commit record's count: decimal digits, no more than a block count takes
_COUNT_DIGITS = 16


def _count(record: object) -> int | None:
    """A commit record's block count (``publish`` writes it as decimal digits), or None: not
    a record we can read (``int()`` took " -5 ", "1_0" and a planted count of -1 blocks)."""
    if not isinstance(record, bytes) or not 0 < len(record) <= _COUNT_DIGITS:
        return None
    return int(record) if record.isdigit() else None


@dataclass(frozen=True)
class HandoffState:
    """What a consumer learns of a handoff in one round trip.

    ``committed``: leading blocks the producer wrote and acknowledged (the minimum over the
    fingerprints asked about), or None while any producer rank has not committed yet.
    ``taken``: another consumer already claimed this handoff. ``pending``: a producer rank has
    started writing and not finished (its record says so); with neither a count nor a
    pending record, the record never came or was evicted. ``present``: leading blocks of the
    chain present now under every fingerprint; ``blocks``: each block's presence.
    """

    committed: int | None
    taken: bool
    present: int
    pending: bool = False
    blocks: tuple[bool, ...] = ()


def presence(exists: Sequence[Any], per_block: int) -> list[bool]:
    """Per block, whether its ``per_block`` EXISTS replies (one per fingerprint) are all 1."""
    return [all(exists[i : i + per_block]) for i in range(0, len(exists), per_block)]


class Records:
    """Every producer rank's handoff record, read together: a count (committed), "pending",
    "taken:<owner>" or nothing. A claim this owner already made counts as its count."""

    def __init__(self, replies: Sequence[Any], own: bytes | None = None) -> None:
        counts: list[int] = []
        self.taken = self.pending = False
        for r in replies:
            if r is None:
                continue
            if r == HANDOFF_PENDING:
                self.pending = True
            elif own is not None and r == own:
                counts.append(0)  # ours already (a claim sent twice): the count was read
            elif isinstance(r, bytes) and r.startswith(HANDOFF_TAKEN):
                self.taken = True
            else:
                count = _count(r)
                if count is None:
                    self.taken = True  # not a record we can read: never wait on it
                else:
                    counts.append(count)
        complete = len(counts) == len(replies) and not self.taken
        self.committed: int | None = min(counts) if complete else None


class Claim(enum.Enum):
    """What a consumer's claim of a handoff found (``LookupBuffer.claim_handoff``)."""

    WON = "won"  # every rank's record held a count (or this owner's claim): the chain is ours
    TAKEN = "taken"  # another owner claimed it first: not ours to load or delete
    UNCOMMITTED = "uncommitted"  # a record is missing (evicted, never written) or pending


def claim_outcome(replies: Sequence[Any], own: bytes) -> Claim:
    """The outcome of ``SET record <own> XX GET`` sent for every rank's record."""
    records = Records(replies, own=own)
    if records.taken:
        return Claim.TAKEN
    return Claim.WON if records.committed is not None else Claim.UNCOMMITTED


class HandoffRecords:
    """The commit records of one lookup buffer's handoffs, on the control client: a producer
    opens and publishes them, a consumer reads and claims them (see ``LookupBuffer``)."""

    def __init__(
        self, transport: Transport, guard: Guard, keys: KeySpace, ttl: ChainTtl, code: ServerCode
    ) -> None:
        self._transport = transport
        self._guard = guard
        self._keys = keys
        # a record matters for the seconds between a prefill and its decode: it expires with
        # the blocks, and within HANDOFF_TTL_MS
        self._ttl_ms = ttl.capped(HANDOFF_TTL_MS)
        self._claim_script = code.bind(CLAIM_RECORDS, transport.control)

    def open(self, handoff_id: str, fingerprints: Sequence[str] | None = None) -> None:
        keys = [self._keys.handoff(handoff_id, fp) for fp in self._keys.fingerprints(fingerprints)]

        def fill(pipe: Any) -> None:
            for key in keys:  # NX: never over a final count
                pipe.set(key, HANDOFF_PENDING, nx=True, px=self._ttl_ms)

        self._guard.call("SET", lambda: self._transport.pipeline(fill))

    def publish(self, handoff_id: str, num_blocks: int) -> None:
        key = self._keys.handoff(handoff_id)

        def fill(pipe: Any) -> None:
            pipe.set(key, str(num_blocks), px=self._ttl_ms)

        self._guard.call("SET", lambda: self._transport.pipeline(fill))

    def read(
        self,
        handoffs: Sequence[tuple[str, Sequence[str]]],
        fingerprints: Sequence[str] | None = None,
    ) -> list[HandoffState]:
        """Every rank's record of each handoff and its chain's present leading blocks, in one
        round trip."""
        if not handoffs:
            return []
        fps = self._keys.fingerprints(fingerprints)
        replies = self._guard.call(
            "GET", lambda: self._transport.pipeline(lambda p: self.fill_read(p, handoffs, fps))
        )
        return self.parse_read(replies, handoffs, len(fps))[0]

    def fill_read(
        self, pipe: Any, handoffs: Sequence[tuple[str, Sequence[str]]], fps: Sequence[str]
    ) -> None:
        """``read``'s commands, into a pipeline another caller sends (``survey``)."""
        for handoff_id, hashes in handoffs:
            for fp in fps:
                pipe.get(self._keys.handoff(handoff_id, fp))
            for h in hashes:
                for fp in fps:
                    pipe.exists(self._keys.block(h, fp))

    @staticmethod
    def parse_read(
        replies: Sequence[Any], handoffs: Sequence[tuple[str, Sequence[str]]], per_block: int
    ) -> tuple[list[HandoffState], int]:
        """The states ``fill_read``'s replies say, and how many replies they took."""
        out, at = [], 0
        for _, hashes in handoffs:
            records = Records(replies[at : at + per_block])
            at += per_block
            span = len(hashes) * per_block
            blocks = presence(replies[at : at + span], per_block)
            at += span
            present = next((i for i, b in enumerate(blocks) if not b), len(blocks))
            out.append(
                HandoffState(
                    records.committed, records.taken, present, records.pending, tuple(blocks)
                )
            )
        return out, at

    def claim(
        self, handoff_id: str, fingerprints: Sequence[str] | None = None, *, owner: str = ""
    ) -> Claim:
        """Every rank's record takes this owner's mark, unless another owner's is on one
        (``CLAIM_RECORDS_LUA``; see ``LookupBuffer.claim_handoff``)."""
        mark = HANDOFF_TAKEN + b":" + owner.encode()
        keys = [self._keys.handoff(handoff_id, fp) for fp in self._keys.fingerprints(fingerprints)]
        args: list[bytes | int] = [mark, TAKEN_TTL_MS, HANDOFF_TAKEN + b":"]
        replies = self._guard.call(
            self._claim_script.command, lambda: self._claim_script(keys=keys, args=args)
        )
        return claim_outcome(list(replies) + [None] * (len(keys) - len(replies)), mark)

    def check_script(self, key: str, ttl_ms: int) -> None:
        """Run the claim script on ``key``, which must hold a value (on a missing key the
        script writes nothing, so a rule without SET would pass): the value is replaced by a
        mark that expires after ``ttl_ms``. Raises what the server refuses (for
        ``LookupBuffer.check_access``)."""
        self._claim_script(
            keys=[key], args=[HANDOFF_TAKEN + b":probe", ttl_ms, HANDOFF_TAKEN + b":"]
        )

    def delete(self, handoff_id: str, fingerprints: Sequence[str] | None = None) -> int:
        keys = [self._keys.handoff(handoff_id, fp) for fp in self._keys.fingerprints(fingerprints)]
        return self._guard.call("UNLINK", lambda: self._transport.unlink(keys))
