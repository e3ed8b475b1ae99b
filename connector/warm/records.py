"""Records of documents stored in the pool ahead of use (``connector.warm``), so that what was
stored can be listed and checked later without the model.

    <prefix>:<namespace>:<fingerprint>:doc:<document id>  ->  JSON

A record holds the document's name, its token count, its chain of block hashes, the
fingerprints (one per slice of the KV heads) its blocks were stored under, the model, a hash of
its text and when it was stored. The id is the chain's last hash: the same text rendered the
same way has one record. A record outlives its blocks by a minute, so ``volatile-ttl`` evicts
blocks before the record that describes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.lookup_buffer import BlockInfo, LookupBuffer

RECORD_EXTRA_TTL_MS = 60_000
_SCAN_COUNT = 1000


@dataclass
class DocumentRecord:
    name: str
    tokens: int
    chain: list[str]
    fingerprints: list[str]
    model: str
    text_hash: str  # xxh3-64 of the document's text as read: a changed file is noticed
    stored_at: float = field(default_factory=time.time)

    @property
    def document_id(self) -> str:
        return self.chain[-1]


@dataclass(frozen=True)
class DocumentPresence:
    """How much of a recorded document's chain is in the store now."""

    blocks: int  # the chain's length
    present: int  # blocks present under every fingerprint, wherever they are in the chain
    usable: int  # leading blocks present: what a request can load (a hole ends it)
    bytes: int
    ttl_s: float | None  # the shortest TTL left among present blocks; None: no expiry or none

    @property
    def fraction(self) -> float:
        return self.present / self.blocks if self.blocks else 0.0


def save_record(buf: LookupBuffer, record: DocumentRecord) -> None:
    """Store (or replace) a document's record under its first fingerprint, with the buffer's
    TTL plus a minute."""
    key = buf.keys.document(record.document_id, record.fingerprints[0])
    value = json.dumps(asdict(record), separators=(",", ":"))
    ttl = buf.ttl_ms + RECORD_EXTRA_TTL_MS if buf.ttl_ms else None
    buf.guard.call("SET", lambda: buf.client.set(key, value, px=ttl))


def load_records(buf: LookupBuffer, model: str | None = None) -> tuple[list[DocumentRecord], int]:
    """Every document record in the buffer's namespace (any fingerprint; only ``model``'s when
    given), walked with SCAN, and how many keys held something unreadable."""
    pattern = f"{buf.key_prefix}:{buf.namespace}:*:doc:*"

    def scan() -> list[Any]:
        keys = list(buf.client.scan_iter(match=pattern, count=_SCAN_COUNT))
        if not keys:
            return []
        pipe = buf.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return list(pipe.execute())

    values = buf.guard.call("SCAN", scan)
    records, unreadable = [], 0
    for value in values:
        if value is None:  # expired between SCAN and GET
            continue
        try:
            record = DocumentRecord(**json.loads(value))
        except (TypeError, ValueError):
            unreadable += 1
            continue
        if not record.chain or not record.fingerprints:
            unreadable += 1
        elif model is None or record.model == model:
            records.append(record)
    return sorted(records, key=lambda r: (r.name, -r.stored_at)), unreadable


# Keys per round trip when checking many documents: bounded, so a corpus of any size costs
# bounded client memory and never one pipeline of millions of commands.
PRESENCE_BATCH_KEYS = 20_000


def presence(
    buf: LookupBuffer, chain: Sequence[str], fingerprints: Sequence[str]
) -> DocumentPresence:
    """One round trip: which of the chain's blocks are present, their bytes and TTL left."""
    return presences(buf, [(chain, fingerprints)])[0]


def presences(
    buf: LookupBuffer, chains: Sequence[tuple[Sequence[str], Sequence[str]]]
) -> list[DocumentPresence]:
    """``presence`` of many (chain, fingerprints), in batches of about
    :data:`PRESENCE_BATCH_KEYS` keys per round trip."""
    out: list[DocumentPresence] = []
    start = 0
    while start < len(chains):
        end, keys = start, 0
        while end < len(chains) and (end == start or keys < PRESENCE_BATCH_KEYS):
            keys += len(chains[end][0]) * max(1, len(chains[end][1]))
            end += 1
        part = chains[start:end]
        by_fps: dict[tuple[str, ...], list[int]] = {}
        for i, (_, fps) in enumerate(part):
            by_fps.setdefault(tuple(fps), []).append(i)
        infos: list[list[BlockInfo]] = [[] for _ in part]
        for fps, idx in by_fps.items():
            flat = buf.block_info([h for i in idx for h in part[i][0]], list(fps))
            at = 0
            for i in idx:
                infos[i] = flat[at : at + len(part[i][0])]
                at += len(part[i][0])
        out += [_summary(len(chain), info) for (chain, _), info in zip(part, infos, strict=True)]
        start = end
    return out


def _summary(blocks: int, infos: Sequence[BlockInfo]) -> DocumentPresence:
    usable = 0
    while usable < len(infos) and infos[usable].present:
        usable += 1
    ttls = [i.ttl_s for i in infos if i.present and i.ttl_s is not None]
    return DocumentPresence(
        blocks=blocks,
        present=sum(i.present for i in infos),
        usable=usable,
        bytes=sum(i.size for i in infos),
        ttl_s=min(ttls) if ttls else None,
    )
