"""One round trip that answers everything a batch of lookups asks: which blocks of many chains
are present, what many producers' commit records say, and the namespace's generation (so a
reset is seen by the very lookup it would have misled)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.fleet.generations import Generations
from kvstore.fleet.handoff import HandoffRecords, HandoffState
from kvstore.fleet.inventory import Inventory, split_presences
from kvstore.net.bounded_replies import integer_reply
from kvstore.net.guard import Guard
from kvstore.net.transport import Transport
from kvstore.values.keys import KeySpace


@dataclass(frozen=True)
class Survey:
    presences: list[list[bool]]  # per chain, per block: present under every fingerprint
    handoffs: list[HandoffState]  # per handoff asked about
    generation: int  # the namespace's generation as read with them (never lower than known)


def survey(
    transport: Transport,
    guard: Guard,
    keys: KeySpace,
    parts: tuple[Inventory, HandoffRecords, Generations],
    chains: Sequence[Sequence[str]],
    handoffs: Sequence[tuple[str, Sequence[str]]],
    fingerprints: Sequence[str] | None,
) -> Survey:
    inventory, records, generations = parts
    fps = keys.fingerprints(fingerprints)
    block_keys = inventory.presence_keys(chains, fps)

    def fill(pipe: Any) -> None:
        for k in block_keys:
            pipe.exists(k)
        records.fill_read(pipe, handoffs, fps)
        pipe.get(generations.key)

    replies = guard.call("EXISTS", lambda: transport.pipeline(fill))
    at = len(block_keys)
    exists = [integer_reply(x, "EXISTS") for x in replies[:at]]
    presences = split_presences(exists, chains, len(fps))
    states, used = records.parse_read(replies[at:], handoffs, len(fps))
    generation = generations.observe(replies[at + used])
    if generations.unknown:  # a signed namespace lost its counter: no block name is safe
        presences = [[False] * len(p) for p in presences]
    return Survey(presences, states, generation)
