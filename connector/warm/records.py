"""Records of documents stored in the pool ahead of use (``connector.warm``), so that what was
stored can be listed and checked later without the model.

    <prefix>:<namespace>:<fingerprint>:doc:<document id>  ->  JSON

A record holds the document's name, its token count, its chain of block hashes, the
fingerprints (one per slice of the KV heads) its blocks were stored under, the model, a hash of
its text and when it was stored. The id is the chain's last hash: the same text rendered the
same way has one record. A record outlives its blocks by a minute, so ``volatile-ttl`` evicts
blocks before the record that describes them.

Anyone who can write to the server can plant a key under this pattern: what is read back is
checked (:func:`parse_record`: its size before it is read, its nesting before it is parsed,
then every field), and whatever is not a record is a :class:`RecordProblem` to report.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvstore.net.bounded_replies import MAX_CONTROL_REPLY_BYTES
from kvstore.net.connection import error_code
from kvstore.net.key_scan import scan_keys
from kvstore.values.keys import BLOCK_NAME_RE, NAME_RE

if TYPE_CHECKING:
    from kvstore.lookup_buffer import BlockInfo, LookupBuffer

RECORD_EXTRA_TTL_MS = 60_000


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


class RecordTooLargeError(ValueError):
    """A document whose record would be larger than ``--check`` reads (:data:`MAX_RECORD_BYTES`)."""


def save_record(buf: LookupBuffer, record: DocumentRecord) -> None:
    """Store (or replace) a document's record under its first fingerprint, with the buffer's
    TTL plus a minute. A record ``--check`` would refuse as oversize is not written
    (:class:`RecordTooLargeError`): its blocks are stored, but it cannot be listed."""
    key = buf.keys.document(record.document_id, record.fingerprints[0])
    value = json.dumps(asdict(record), separators=(",", ":"))
    if len(value) > MAX_RECORD_BYTES:
        raise RecordTooLargeError(
            f"not recorded: its record would take {len(value)} bytes, over the "
            f"{MAX_RECORD_BYTES} --check reads (a chain of {len(record.chain)} blocks); its "
            "blocks are stored but --check cannot list it"
        )
    ttl = buf.ttl_ms + RECORD_EXTRA_TTL_MS if buf.ttl_ms else None
    buf.guard.call("SET", lambda: buf.client.set(key, value, px=ttl))


class MalformedRecordError(ValueError):
    """A document record that is not one the warm command writes (planted, or damaged): why."""


@dataclass(frozen=True)
class RecordProblem:
    """A key under the records' pattern that holds no readable record, and why."""

    key: str  # as read back, bytes that are not UTF-8 as \xNN: show it with printable()
    problem: str


# A record is about 35 bytes per block of its chain: ~4 MiB holds a chain of some 120,000
# blocks (1.9M tokens at a block size of 16), more than any context; what is larger is refused
# before it is read, so a planted value costs the check bounded memory and time. It is read
# by redis-py, whose replies kvstore bounds (bounded_replies.py): a record must fit in one,
# framing included, or a planted 5 MiB one ended the whole check with a dropped connection.
MAX_RECORD_BYTES = MAX_CONTROL_REPLY_BYTES - (64 << 10)
# A record nests two deep (an object of lists); a planted one must not reach the parser's
# recursion limit (RecursionError)
MAX_RECORD_DEPTH = 8
# of the name, model and text hash: far beyond a real one (a path, a model id, a hex digest)
MAX_RECORD_TEXT_CHARS = 65_536
# values read per round trip, in bytes: a namespace of many large records is read in parts
_READ_BUDGET_BYTES = 64 * 2**20

_REQUIRED_FIELDS = ("name", "tokens", "chain", "fingerprints", "model", "text_hash")
_FIELDS = {f.name for f in fields(DocumentRecord)}
# JSON's escapes, then its strings, then all but its brackets: what is left says how deep it
# nests. Each pattern matches in one pass, whatever the bytes (none backtracks).
_JSON_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_JSON_STRING = re.compile(rb'"[^"]*"')
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]+")


def _nesting(raw: bytes) -> int:
    """How deep ``raw``'s arrays and objects nest, brackets inside strings not counted; it
    stops counting past :data:`MAX_RECORD_DEPTH`."""
    brackets = _NOT_A_BRACKET.sub(b"", _JSON_STRING.sub(b"", _JSON_ESCAPE.sub(b"", raw)))
    depth = deepest = 0
    for ch in brackets:
        depth += 1 if ch in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_RECORD_DEPTH:
                break
    return deepest


def parse_record(raw: bytes | str) -> DocumentRecord:
    """A record as stored (JSON), checked field by field; ``MalformedRecordError`` says what
    is wrong with anything else. Its messages never quote the record's text."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > MAX_RECORD_BYTES:
        raise MalformedRecordError(f"{len(data)} bytes: more than a record holds")
    if _nesting(data) > MAX_RECORD_DEPTH:
        raise MalformedRecordError(f"nested more than {MAX_RECORD_DEPTH} deep")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise MalformedRecordError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise MalformedRecordError(f"a JSON {type(doc).__name__}, not an object")
    missing = [k for k in _REQUIRED_FIELDS if k not in doc]
    if missing:
        raise MalformedRecordError(f"missing {', '.join(missing)}")
    unknown = len(doc.keys() - _FIELDS)
    if unknown:
        raise MalformedRecordError(f"{unknown} field(s) a record does not have")
    for name in ("name", "model", "text_hash"):
        if not isinstance(doc[name], str) or len(doc[name]) > MAX_RECORD_TEXT_CHARS:
            raise MalformedRecordError(
                f"{name} is not a text of at most {MAX_RECORD_TEXT_CHARS} characters"
            )
    tokens = doc["tokens"]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens < 2**63:
        raise MalformedRecordError("tokens is not a count")
    chain, fps = doc["chain"], doc["fingerprints"]
    if not isinstance(chain, list) or not chain:
        raise MalformedRecordError("chain is not a list of block hashes")
    if not all(isinstance(h, str) and BLOCK_NAME_RE.match(h) for h in chain):
        raise MalformedRecordError("chain holds something other than block hashes")
    if not isinstance(fps, list) or not fps:
        raise MalformedRecordError("fingerprints is not a list of fingerprints")
    if not all(isinstance(fp, str) and NAME_RE.match(fp) for fp in fps):
        raise MalformedRecordError("fingerprints holds something other than fingerprints")
    stored_at = doc.get("stored_at", 0.0)
    if (
        not isinstance(stored_at, (int, float))
        or isinstance(stored_at, bool)
        or not math.isfinite(stored_at)
    ):
        raise MalformedRecordError("stored_at is not a time")
    return DocumentRecord(**doc)


def read_records(
    buf: LookupBuffer, model: str | None = None
) -> tuple[list[DocumentRecord], list[RecordProblem]]:
    """Every document record in the buffer's namespace (any fingerprint; only ``model``'s when
    given), walked with SCAN, and each key under their pattern that holds no readable record
    (:func:`parse_record`; whatever its model), whatever was planted there: a value larger
    than a record is never read."""
    pattern = f"{buf.key_prefix}:{buf.namespace}:*:doc:*"

    def scan() -> list[tuple[bytes, Any]]:
        """(key, what it holds): its bytes (a record's at most, plus one), an int (its size,
        too large to read), an exception (another type), or None (gone since SCAN)."""
        keys = list(scan_keys(buf.client, pattern))
        if not keys:
            return []
        pipe = buf.client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        # a key of another type (WRONGTYPE) is a problem of its own, not the whole check's
        sizes = pipe.execute(raise_on_error=False)
        out: list[tuple[bytes, Any]] = []
        small: list[tuple[bytes, int]] = []
        for key, size in zip(keys, sizes, strict=True):
            if isinstance(size, Exception):
                if error_code(size) != "WRONGTYPE":
                    raise size  # NOPERM and the like: about the server, not this key
                out.append((key, size))
            elif size > MAX_RECORD_BYTES:
                out.append((key, size))
            else:
                small.append((key, size))
        for part in _batches(small, _READ_BUDGET_BYTES):
            pipe = buf.client.pipeline(transaction=False)
            for k in part:
                pipe.exists(k)
                # never more than a record's bytes, should it have grown since STRLEN
                pipe.getrange(k, 0, MAX_RECORD_BYTES)
            replies = pipe.execute(raise_on_error=False)
            for i, key in enumerate(part):
                exists, value = replies[2 * i : 2 * i + 2]
                out.append((key, value if exists else None))
        return out

    records: list[DocumentRecord] = []
    problems: list[RecordProblem] = []
    for key, value in buf.guard.call("SCAN", scan):
        name = key.decode(errors="backslashreplace")
        if value is None:  # expired between SCAN and GET
            continue
        if isinstance(value, Exception):
            problems.append(RecordProblem(name, "not a string value (another type)"))
            continue
        if isinstance(value, int):
            problems.append(RecordProblem(name, f"{value} bytes: more than a record holds"))
            continue
        try:
            record = parse_record(value)
        except MalformedRecordError as exc:
            problems.append(RecordProblem(name, str(exc)))
            continue
        if model is None or record.model == model:
            records.append(record)
    records.sort(key=lambda r: (r.name, -r.stored_at))
    problems.sort(key=lambda p: p.key)
    return records, problems


def load_records(buf: LookupBuffer, model: str | None = None) -> tuple[list[DocumentRecord], int]:
    """:func:`read_records`, with how many keys held something unreadable."""
    records, problems = read_records(buf, model)
    return records, len(problems)


def _as_bytes(key: bytes | str) -> bytes:
    return key if isinstance(key, bytes) else str(key).encode()


def _batches(sized: list[tuple[bytes, int]], budget: int) -> Iterator[list[bytes]]:
    """The keys in runs whose sizes add up to at most ``budget`` bytes (or one key)."""
    part: list[bytes] = []
    total = 0
    for key, size in sized:
        if part and total + size > budget:
            yield part
            part, total = [], 0
        part.append(key)
        total += size
    if part:
        yield part


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
