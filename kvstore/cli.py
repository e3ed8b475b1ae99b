"""``kvstore`` (or ``python -m kvstore``): see what is cached in Redis/Valkey.

    kvstore --url redis://127.0.0.1:6379/0 ls [--namespace NS] [--json]
    kvstore --url ... inspect KEY [--secret-file PATH] [--json]
    kvstore --url ... stats [--json]
    kvstore --url ... flush --namespace NS [--yes]
    kvstore --url ... reset --namespace NS [--no-sweep]

Keys are walked with SCAN (never KEYS), so it is safe on a busy server. ``ls`` groups keys by
namespace and layout fingerprint; ``inspect`` decodes a value's header and verifies its checksum
and, given the namespace's secret (``--secret-file``), its MAC -- without it a signed value is
"unverified", never valid; ``flush`` deletes one namespace (never FLUSHALL) after confirmation;
``reset`` invalidates a namespace at once (a new generation; vLLM's ``reset_prefix_cache`` does
the same) and unlinks the older blocks. Which leading blocks of a prompt a connector would load
needs vLLM's rules for its KV-cache groups: ``vllm-redis-presence`` (``connector.presence_cli``)
answers that.

Exit statuses (:class:`ExitStatus`): 0 done (``inspect``: the value is valid); 1 ``inspect``:
no such key or a value that fails a check (corrupt, another layout, forged / wrong secret,
unsigned where a secret was given), ``flush``: declined; 2 the command could not run (the store
unreachable or refusing, a bad option or secret file); 3 ``inspect``: a signed value and no
secret to verify its MAC with (unverified).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import textwrap
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster

from kvstore.errors import (
    CorruptValueError,
    InvalidArgumentError,
    KVStoreError,
    StorePermissionError,
)
from kvstore.fleet.readership import NoTouch, Readership, readership, untouched_pipelines
from kvstore.net.connection import (
    AclScope,
    error_code,
    make_client,
    parse_url,
    translated_errors,
)
from kvstore.net.key_scan import scan_keys
from kvstore.text import printable as _printable
from kvstore.text import shown as _shown
from kvstore.values.keys import DEFAULT_KEY_PREFIX, ParsedKey, generation_key, parse_key
from kvstore.values.value_auth import UNAUTHENTICATED, ValueKey, load_secret

if TYPE_CHECKING:
    from rich.console import Console

    from kvstore.values.codec import ValueHeader

_SCAN_COUNT = 1000  # keys per pipeline of reads (SCAN pages: key_scan.SCAN_COUNT)


class ExitStatus(IntEnum):
    """What the command's exit status says (the module's docstring; ``inspect --help``)."""

    OK = 0
    FAILED = 1  # inspect: no such key, or the value fails a check; flush: declined;
    # functions: the server's library is missing or not this release's
    ERROR = 2  # the command could not run: the store, an option, the secret file
    UNVERIFIED = 3  # inspect: a signed value, and no secret to check its MAC with


class Verdict(Enum):
    """What ``inspect`` says of a value, as it prints it."""

    VERIFIED = "verified"  # signed, and its MAC verifies with the namespace's secret
    VALID = "valid"  # unsigned, its checksum and layout right, and no secret given
    UNVERIFIED = "unverified"  # signed, and no secret to check the MAC with
    FORGED = "forged / wrong secret"  # signed, and its MAC does not verify with the secret
    UNSIGNED = "unsigned"  # no MAC where a secret was given: readers with it refuse it
    INVALID = "INVALID"  # corrupt, truncated, another layout, a checksum that does not match
    MISSING = "no such key"

    @property
    def exit_status(self) -> ExitStatus:
        if self in (Verdict.VERIFIED, Verdict.VALID):
            return ExitStatus.OK
        if self is Verdict.UNVERIFIED:
            return ExitStatus.UNVERIFIED
        return ExitStatus.FAILED


# what inspect's exit statuses mean, for its --help
_INSPECT_EXITS = {
    ExitStatus.OK: f"{Verdict.VERIFIED.value}: signed, and its MAC verifies with --secret-file; "
    f"or {Verdict.VALID.value}: unsigned, its checksum right, no --secret-file given (a "
    "namespace with a secret loads no unsigned value: check those with --secret-file)",
    ExitStatus.FAILED: f"{Verdict.MISSING.value}; {Verdict.FORGED.value}; "
    f"{Verdict.UNSIGNED.value} (with --secret-file); {Verdict.INVALID.value}: corrupt, or "
    "another layout's or block's value",
    ExitStatus.ERROR: "the command could not run: the store unreachable or refusing, a bad "
    "option, an unreadable or too short secret file",
    ExitStatus.UNVERIFIED: f"{Verdict.UNVERIFIED.value}: signed, and no --secret-file to "
    "check its MAC with",
}
INSPECT_EXIT_STATUSES = "exit statuses:\n" + "\n".join(
    textwrap.fill(text, 88, initial_indent=f"  {status:d}  ", subsequent_indent="     ")
    for status, text in _INSPECT_EXITS.items()
)
# how inspect's human output colours a verdict; any other is red
_VERDICT_STYLES = {
    Verdict.VERIFIED: "green",
    Verdict.VALID: "green",
    Verdict.UNVERIFIED: "yellow",
}


def _scan(client: redis.Redis, pattern: str) -> Iterator[tuple[str, bytes]]:
    """Keys as (name to show and parse, the key's own bytes to send back). A key need not be
    UTF-8: its other bytes are shown as ``\\xNN`` and it is addressed by its bytes."""
    # a pattern from the command line may hold bytes that were not UTF-8: sent as they were
    for raw in scan_keys(client, os.fsencode(pattern)):
        yield raw.decode(errors="backslashreplace"), raw


def _glob_literal(text: str) -> str:
    """``text`` matching only itself in a SCAN pattern: a namespace named ``a*`` or ``[/x]``
    must not select (or flush) other namespaces' keys."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


@dataclass
class _Group:
    """Running totals of one (namespace, fingerprint)'s blocks."""

    blocks: int = 0
    nbytes: int = 0
    ttls: tuple[float, float] | None = None
    ages: tuple[float, float] | None = None
    # readership.py: blocks read since written, never read (and their bytes), not known
    read: int = 0
    unread: int = 0
    unread_bytes: int = 0

    def add(self, size: int, ttl_s: float | None, age_s: float | None, seen: Readership) -> None:
        self.blocks += 1
        self.nbytes += size
        self.ttls = _widen(self.ttls, ttl_s)
        self.ages = _widen(self.ages, age_s)
        if seen is Readership.READ:
            self.read += 1
        elif seen is Readership.UNREAD:
            self.unread += 1
            self.unread_bytes += size


def _widen(span: tuple[float, float] | None, x: float | None) -> tuple[float, float] | None:
    if x is None:
        return span
    return (x, x) if span is None else (min(span[0], x), max(span[1], x))


@dataclass
class Listing:
    """What ``ls`` found: a row per (namespace, fingerprint), then the other keys' counts;
    and what the read figures are worth (``readership.py``)."""

    rows: list[dict[str, Any]]
    no_touch: set[NoTouch] = field(default_factory=set)  # what the servers answered
    no_idle_times: bool = False  # a server keeps none (an LFU policy): nothing read counted
    idle_refused: bool = False  # this user may not ask for idle times: nothing read counted
    before_restart: bool = False  # blocks older than a restart that reset their idle times

    @property
    def touched(self) -> bool:
        """The listing's own reads moved LRU clocks: the blocks it read look read now."""
        return bool(self.no_touch - {NoTouch.KEPT})

    @property
    def notes(self) -> list[str]:
        out = []
        if self.no_idle_times:
            out.append(
                "read/unread not counted where the server's maxmemory-policy is LFU (it keeps "
                "no idle times): use an LRU or volatile-ttl policy to see them"
            )
        if self.idle_refused:
            out.append(
                "read/unread not counted: this user may not run OBJECT IDLETIME (grant "
                "+object|idletime, and on Redis 7.2+ or Valkey +client|no-touch, so that "
                "looking is not reading)"
            )
        if self.before_restart:
            out.append(
                "blocks written before the server's last restart are not counted: a restart "
                "keeps idle times only under an LRU maxmemory-policy"
            )
        if NoTouch.UNSUPPORTED in self.no_touch:
            out.append(
                "the server has no CLIENT NO-TOUCH (Redis before 7.2): this listing's figures "
                "are right, but reading the headers touched every block, so the next listing "
                "counts them as read and LRU eviction sees them as recently used"
            )
        if NoTouch.REFUSED in self.no_touch:
            out.append(
                "this user may not run CLIENT NO-TOUCH (grant +client|no-touch): this "
                "listing's figures are right, but reading the headers touched every block, so "
                "the next listing counts them as read and LRU eviction sees them as recently used"
            )
        return out


def list_prefixes(client: redis.Redis, prefix: str, namespace: str | None) -> list[dict[str, Any]]:
    """:func:`list_blocks`' rows."""
    return list_blocks(client, prefix, namespace).rows


def list_blocks(client: redis.Redis, prefix: str, namespace: str | None) -> Listing:
    """One row per (namespace, fingerprint): blocks, bytes, TTL range, age range, blocks read
    since written and not (``readership.py``). Streams: keys are read as SCAN returns them,
    :data:`_SCAN_COUNT` per pipeline, and only running totals are kept, so a namespace of
    millions of blocks costs bounded client memory."""
    pattern = f"{_glob_literal(prefix)}:{_glob_literal(namespace) if namespace else '*'}:*"
    groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
    others: dict[str, int] = defaultdict(int)  # claims, handoff and document records, probes
    listing = Listing([])

    def fill(pipe: Any, key: bytes) -> None:
        pipe.object("IDLETIME", key)  # first: the server's own reads of it, not this listing's
        pipe.strlen(key)
        pipe.pttl(key)
        pipe.getrange(key, 0, 1023)

    def flush(batch: list[tuple[str, str, bytes]]) -> None:
        # one key of another type (WRONGTYPE) must not fail the listing of the others
        listed = untouched_pipelines(client, [k for _, _, k in batch], fill, per_key=4)
        if listed.moved:
            others["moved"] += len(listed.moved)
        for part in listed.parts:
            listing.no_touch.add(part.no_touch)
            now = part.now_s if part.now_s is not None else time.time()
            for n, i in enumerate(part.indexes):
                ns, fp, _ = batch[i]
                idle, size, pttl, head = part.replies[4 * n : 4 * n + 4]
                errors = [r for r in (size, pttl, head) if isinstance(r, Exception)]
                if errors:
                    if any(error_code(e) != "WRONGTYPE" for e in errors):
                        raise errors[0]  # NOPERM and the like: about the server, not this key
                    others["wrong-type"] += 1
                    continue
                if pttl == -2:  # expired or deleted since SCAN saw it
                    continue
                if isinstance(idle, redis.exceptions.NoPermissionError):
                    listing.idle_refused = True  # not counted: the notes say why
                elif isinstance(idle, Exception):
                    listing.no_idle_times = True  # an LFU policy keeps none
                created = created_epoch(head)
                age = now - created if created else None
                seen = readership(idle, age, part.kept_since_s)
                if part.kept_since_s is not None and age is not None and age > part.kept_since_s:
                    listing.before_restart = True
                groups[(ns, fp)].add(int(size), pttl / 1000 if pttl >= 0 else None, age, seen)

    batch: list[tuple[str, str, bytes]] = []
    for key, raw in _scan(client, pattern):
        parsed = parse_key(key, prefix)
        if parsed is None:
            continue
        if parsed.kind != "block":
            others[parsed.kind] += 1
            continue
        batch.append((parsed.namespace, parsed.fingerprint, raw))
        if len(batch) >= _SCAN_COUNT:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    rows = []
    for (ns, fp), g in sorted(groups.items()):
        rows.append(
            {
                "namespace": ns,
                "fingerprint": fp,
                "blocks": g.blocks,
                "bytes": g.nbytes,
                "ttl_min_s": round(g.ttls[0], 1) if g.ttls else None,
                "ttl_max_s": round(g.ttls[1], 1) if g.ttls else None,
                "age_min_s": round(g.ages[0], 1) if g.ages else None,
                "age_max_s": round(g.ages[1], 1) if g.ages else None,
                # read since written (by any instance), never read, and what those hold
                "read_blocks": g.read,
                "unread_blocks": g.unread,
                "unread_bytes": g.unread_bytes,
                # not told either way: the notes say why (an LFU policy, a refused command, a
                # restart, a header without its creation time)
                "unknown_blocks": g.blocks - g.read - g.unread,
                # (literal: a namespace or fingerprint holding *, ? or [ matches only itself)
                "pattern": f"{_glob_literal(prefix)}:{_glob_literal(ns)}:{_glob_literal(fp)}:*",
            }
        )
    labels = {
        "claim": "(in-flight drop_select claims)",
        "handoff": "(handoff commit records)",
        "probe": "(permission probes)",
        "document": "(warmed-document records)",
        "generation": "(namespace generations)",
        "wrong-type": "(block keys that do not hold a string)",
        "moved": "(block keys whose Cluster slot kept moving during the listing)",
    }
    for kind, count in sorted(others.items()):
        rows.append({"namespace": labels.get(kind, f"({kind} records)"), "blocks": count})
    listing.rows = rows
    return listing


_CREATED = re.compile(rb'"kvstore.created":"([^"]{1,40})"')


def created_epoch(head: bytes) -> float | None:
    """Creation time (seconds since the epoch) from the first KiB of a value's header, for ls;
    the header stores UTC in ISO 8601."""
    match = _CREATED.search(head)
    if match is None:
        return None
    try:  # any bytes may stand there: not UTF-8, not a date, out of range
        when = datetime.fromisoformat(match[1].decode().replace("Z", "+00:00"))
        if when.tzinfo is None:  # written without a zone: it is UTC all the same
            when = when.replace(tzinfo=timezone.utc)
        return when.timestamp()
    except (ValueError, OverflowError, OSError):
        return None


@dataclass(frozen=True)
class _Checks:
    """What inspect found of one value whose header parses."""

    verdict: Verdict
    checksum_ok: bool | None  # None: a signed value's keyed checksum, not checked without the key
    mac_ok: bool | None  # None: not checked (no secret given, or the value is unsigned)
    fingerprint_ok: bool  # the header's layout fingerprint is the key's
    block_ok: bool  # the header's block hash is the key's: not another block's value replayed
    reason: str | None = None
    detail: str | None = None


def _checked(
    value: bytes, header: ValueHeader, value_key: ValueKey | None, parsed: ParsedKey | None
) -> _Checks:
    """``value``'s verdict. With ``value_key`` its MAC is checked as a reader checks it: the
    header's tag (``read_header`` with the key), then the payload's keyed checksum."""
    from kvstore.values.codec import checksum_ok, read_header

    fingerprint_ok = parsed is None or parsed.fingerprint == header.fingerprint
    # a block's value names its block: under another block's key, it was copied there
    block_ok = (
        parsed is None or parsed.kind not in ("block", "claim") or parsed.name == header.block_name
    )
    placed = fingerprint_ok and block_ok
    if value_key is not None:
        try:
            read_header(value, value_key=value_key)
        except CorruptValueError as exc:
            if exc.reason not in UNAUTHENTICATED:
                raise
            if not header.mac:  # "unsigned": readers with the secret refuse it
                sum_ok = checksum_ok(value, header)
                return _Checks(
                    Verdict.UNSIGNED, sum_ok, None, fingerprint_ok, block_ok, exc.reason, str(exc)
                )
            return _Checks(
                Verdict.FORGED, None, False, fingerprint_ok, block_ok, exc.reason, str(exc)
            )
        if not checksum_ok(value, header, value_key):
            detail = (
                "the payload's keyed checksum does not verify: written without this "
                "namespace's secret, or with another one"
            )
            return _Checks(Verdict.FORGED, False, False, fingerprint_ok, block_ok, "forged", detail)
        verdict = Verdict.VERIFIED if placed else Verdict.INVALID
        return _Checks(verdict, True, True, fingerprint_ok, block_ok)
    if header.mac:
        if not placed:
            return _Checks(Verdict.INVALID, None, None, fingerprint_ok, block_ok)
        detail = (
            "the value is signed (kvstore.mac) and its MAC is not checked: give the "
            "namespace's secret with --secret-file to verify it"
        )
        return _Checks(
            Verdict.UNVERIFIED, None, None, fingerprint_ok, block_ok, "no-secret", detail
        )
    sum_ok = checksum_ok(value, header)
    verdict = Verdict.VALID if sum_ok and placed else Verdict.INVALID
    return _Checks(verdict, sum_ok, None, fingerprint_ok, block_ok)


# a value is read a piece at a time: each reply within what redis-py parses for us
# (kvstore/net/bounded_replies.py), however large the value (a review: every value over 4 MiB
# failed inspect)
READ_PIECE_BYTES = 1 << 20


def _key_type(client: redis.Redis, key: bytes) -> str:
    kind = client.type(key)
    return kind.decode(errors="replace") if isinstance(kind, bytes) else str(kind)


def read_value(client: redis.Redis, key: bytes) -> bytes | None:
    """A string value whole, read by ``GETRANGE`` a MiB at a time (``STRLEN`` first); None
    when there is no such key. A key of another type raises redis-py's ``ResponseError``."""
    size = int(client.strlen(key))
    if size == 0:  # missing, or an empty string: GET says which
        value = client.get(key)
        return value if isinstance(value, bytes) else None
    pieces = []
    for start in range(0, size, READ_PIECE_BYTES):
        piece = client.getrange(key, start, min(size, start + READ_PIECE_BYTES) - 1)
        if not isinstance(piece, bytes) or not piece:
            return None  # deleted (or shortened) meanwhile
        pieces.append(piece)
    return b"".join(pieces)


def inspect_key(
    client: redis.Redis,
    key: str | bytes,
    secret: bytes | None = None,
    prefix: str = DEFAULT_KEY_PREFIX,
    epoch: str = "",
) -> dict[str, Any]:
    """A value's header, checks and :class:`Verdict` (``verdict``; ``valid`` is true only for
    one verified with the secret or an unsigned one that checks out). With the namespace's
    ``secret`` a signed value's MAC is verified as the connector verifies it, with the key
    derived from the secret and the key's namespace; without, a signed value is "unverified",
    never valid. ``key`` as bytes, or as text: a command-line argument's bytes that were not
    UTF-8 come back as they were (``os.fsencode``). Raises :class:`InvalidArgumentError` when
    a secret is given for a key whose namespace cannot be told."""
    from kvstore.values.codec import read_header  # torch: only for this command

    raw = key if isinstance(key, bytes) else os.fsencode(key)
    name = raw.decode(errors="backslashreplace")
    parsed = parse_key(name, prefix)
    value_key = None
    if secret is not None:
        if parsed is None:
            raise InvalidArgumentError(
                f"cannot verify {name}: it is not a kvstore key under prefix {prefix!r} "
                f"({prefix}:<namespace>:<fingerprint>:<hash>), so the namespace that keys its "
                "MAC is not known; give --prefix if the store uses another key prefix"
            )
        # as the connector derives it (with its epoch: the weights' version, value_auth.py)
        value_key = ValueKey(secret, parsed.namespace, epoch)
    try:
        value = read_value(client, raw)
    except redis.exceptions.ResponseError as exc:
        if "WRONGTYPE" not in str(exc):
            raise
        # a list, a hash...: no value of ours (``ls`` counts it among "keys that do not hold
        # a string"); was a server error and exit 2, "could not run" (a review's)
        return {
            "key": name,
            "exists": True,
            "valid": False,
            "verdict": Verdict.INVALID.value,
            "reason": "wrong-type",
            "detail": f"the key holds a {_key_type(client, raw)}, not a string: no kvstore value",
        }
    if not isinstance(value, bytes):
        return {"key": name, "exists": False, "valid": False, "verdict": Verdict.MISSING.value}
    out: dict[str, Any] = {
        "key": name,
        "exists": True,
        "bytes": len(value),
        "ttl_s": (lambda t: None if t < 0 else t / 1000)(client.pttl(raw)),
    }
    try:
        # parsed unauthenticated first: its fields are shown whatever the verdict
        header = read_header(value)
        checks = _checked(value, header, value_key, parsed)
        fields = dict(
            valid=checks.verdict.exit_status is ExitStatus.OK,
            verdict=checks.verdict.value,
            signed=bool(header.mac),
            mac_ok=checks.mac_ok,
            checksum=header.checksum,
            checksum_ok=checks.checksum_ok,
            fingerprint=header.fingerprint,
            fingerprint_matches_key=checks.fingerprint_ok,
            block_hash=header.block_name,  # (the name scripts read in inspect --json)
            block_hash_matches_key=checks.block_ok,
            format=header.format_version,
            codec=header.codec,
            raw_bytes=header.raw_bytes,
            payload_bytes=header.payload_bytes,
            created=header.created,
            metadata=header.metadata,
            tensors=[
                {
                    "name": e.name,
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "bytes": e.end - e.start,
                }
                for e in header.tensors
            ],
        )
        if checks.reason is not None:
            fields.update(reason=checks.reason, detail=checks.detail)
    except CorruptValueError as exc:
        out.update(valid=False, verdict=Verdict.INVALID.value, reason=exc.reason, detail=str(exc))
        return out
    except Exception as exc:  # any header content is data to report, never a traceback
        # a header the codec's checks let through but cannot use (a number like 1e999)
        out.update(
            valid=False,
            verdict=Verdict.INVALID.value,
            reason="corrupt-header",
            detail=f"the header does not decode: {type(exc).__name__}: {exc}",
        )
        return out
    out.update(fields)
    return out


def _summed(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One INFO section for a whole Cluster: numbers summed over its masters, the rest as the
    first master says (versions, policies); ``*_human`` sizes are dropped, not recomputed."""
    out = dict(infos[0]) if infos else {}
    for key, value in out.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = sum(i.get(key, 0) for i in infos)
    out = {k: v for k, v in out.items() if not k.endswith("_human")}
    out["masters"] = len(infos)
    return out


def server_stats(client: redis.Redis, prefix: str) -> dict[str, Any]:
    def info(section: str) -> dict[str, Any]:
        # managed services often deny INFO through ACLs; report the keys anyway
        try:
            if isinstance(client, RedisCluster):  # the whole cluster: counters summed per master
                per_node = client.info(section, target_nodes=RedisCluster.PRIMARIES)
                return _summed(list(per_node.values()))
            return dict(client.info(section))
        except redis.exceptions.ResponseError:
            return {}

    info_mem, info_stats, info_server = info("memory"), info("stats"), info("server")
    keys = blocks = 0
    namespaces: dict[str, int] = defaultdict(int)
    # keys that never expire: the connector sets a TTL on every key unless told ttl_s=0, and
    # an ACL cannot make a writer set one. Under a volatile-* policy such keys are never
    # evicted, and every tenant's blocks go first: said per namespace, so it is seen.
    without_ttl: dict[str, int] = defaultdict(int)
    page: list[tuple[str, bytes]] = []

    def count_without_ttl() -> None:
        pipe = client.pipeline(transaction=False)
        for _, raw in page:
            pipe.pttl(raw)
        for (key, _), pttl in zip(page, pipe.execute(raise_on_error=False), strict=True):
            parsed = parse_key(key, prefix)
            if parsed and pttl == -1:
                without_ttl[parsed.namespace] += 1
        page.clear()

    for key, raw in _scan(client, f"{_glob_literal(prefix)}:*"):
        keys += 1
        parsed = parse_key(key, prefix)
        if parsed:
            namespaces[parsed.namespace] += 1
            blocks += parsed.kind == "block"
            if parsed.kind != "generation":
                page.append((key, raw))
        if len(page) >= _SCAN_COUNT:
            count_without_ttl()
    if page:
        count_without_ttl()
    return {
        "server": (
            f"{info_server.get('server_name', 'redis')} {info_server['redis_version']}"
            if "redis_version" in info_server
            else "unknown (INFO not permitted)"
        ),
        "masters": info_server.get("masters", 1),  # a Cluster's figures are summed over these
        "kv_keys": keys,
        "blocks": blocks,  # the rest: handoff records, in-flight claims, permission probes
        "keys_by_namespace": dict(namespaces),
        # (the generation counters are meant to last: not counted)
        "keys_without_ttl_by_namespace": dict(without_ttl),
        "used_memory": info_mem.get("used_memory"),
        "used_memory_human": info_mem.get("used_memory_human"),
        "maxmemory": info_mem.get("maxmemory"),
        "maxmemory_policy": info_mem.get("maxmemory_policy"),
        "keyspace_hits": info_stats.get("keyspace_hits"),
        "keyspace_misses": info_stats.get("keyspace_misses"),
        "evicted_keys": info_stats.get("evicted_keys"),
        "expired_keys": info_stats.get("expired_keys"),
    }


def _namespace_pattern(prefix: str, namespace: str) -> str:
    return f"{_glob_literal(prefix)}:{_glob_literal(namespace)}:*"


def flush_namespace(client: redis.Redis, prefix: str, namespace: str) -> int:
    """Unlink every key of ``namespace`` but its generation counter: blocks, claims, handoff
    and document records. The counter stays, so instances never go back a generation (a
    flushed counter read 0, and a value replayed from before the last reset loaded again),
    and flushing needs only ``+scan +unlink ~<prefix>:<ns>:*:*``, the blocks' own pattern."""
    counter = os.fsencode(generation_key(prefix, namespace))
    deleted = 0
    batch: list[bytes] = []
    for _, raw in _scan(client, _namespace_pattern(prefix, namespace)):
        if raw == counter:
            continue
        batch.append(raw)
        if len(batch) >= 500:
            deleted += int(client.unlink(*batch))
            batch = []
    if batch:
        deleted += int(client.unlink(*batch))
    return deleted


def human_size(n: float | None) -> str:
    """Bytes for people: 512 B, 1.5 MiB; '-' for unknown."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _share(part: int | None, whole: int) -> str:
    if part is None:
        return ""
    return f"{part} ({100 * part / whole:.0f}%)" if whole else str(part)


def _read(row: dict[str, Any]) -> str:
    if "read_blocks" not in row:
        return ""
    if row["unknown_blocks"] == row["blocks"]:
        return "-"  # not counted: the notes say why
    return _share(row["read_blocks"], row["blocks"])


def _unread(row: dict[str, Any]) -> str:
    if "unread_blocks" not in row:
        return ""
    if row["unknown_blocks"] == row["blocks"]:
        return "-"
    return f"{_share(row['unread_blocks'], row['blocks'])},\n{human_size(row['unread_bytes'])}"


def _range(lo: float | None, hi: float | None) -> str:
    if lo is None:
        return "-"
    return f"{lo:.0f}s" if lo == hi else f"{lo:.0f}-{hi:.0f}s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore", description="Look inside a kvstore Redis/Valkey.")
    ap.add_argument(
        "--url",
        default=os.environ.get("KVSTORE_URL", "redis://127.0.0.1:6379/0"),
        help="store URL (default: $KVSTORE_URL or redis://127.0.0.1:6379/0)",
    )
    ap.add_argument("--prefix", default=DEFAULT_KEY_PREFIX, help="key prefix (default: kv)")
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=10.0,
        help="seconds each reply of the server may take (default %(default)s)",
    )
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    # --json is accepted before or after the subcommand
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    sub = ap.add_subparsers(
        dest="cmd", required=True, metavar="{ls,inspect,stats,flush,reset,functions}"
    )
    p_ls = sub.add_parser("ls", parents=[common], help="cached prefixes by namespace/fingerprint")
    p_ls.add_argument("--namespace")
    p_in = sub.add_parser(
        "inspect",
        parents=[common],
        help="decode a value's header, verify it",
        description="Decode a value's header and verify its checksum; with --secret-file, its\n"
        "MAC too. Without the namespace's secret a signed value is unverified, never valid.",
        epilog=INSPECT_EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_in.add_argument("key")
    p_in.add_argument(
        "--secret-file",
        metavar="PATH",
        help="the file holding the namespace's secret (the connector's secret_file): a signed "
        "value's MAC is verified with it, as the connector verifies it. The secret is never shown",
    )
    p_in.add_argument(
        "--epoch",
        default="",
        help="the connector's epoch (the weights' version), with --secret-file: a value signed "
        "in another epoch is forged to this one",
    )
    sub.add_parser("stats", parents=[common], help="key counts, memory, hit/miss counters")
    p_fl = sub.add_parser(
        "flush",
        parents=[common],
        help="delete every key of one namespace but its generation counter (resets stay)",
    )
    p_fl.add_argument("--namespace", required=True)
    p_fl.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p_rs = sub.add_parser(
        "reset", parents=[common], help="invalidate a namespace's blocks at once (new generation)"
    )
    p_rs.add_argument("--namespace", required=True)
    p_rs.add_argument(
        "--no-sweep", action="store_true", help="leave older blocks to their TTL, unlink nothing"
    )
    p_fn = sub.add_parser(
        "functions",
        parents=[common],
        help="load or show the kvstore functions (FUNCTION LOAD; roles then need only +fcall)",
        description="Every role runs kvstore's Lua as functions of one library, loaded once by\n"
        "the admin (on every master of a Cluster). 'show' compares the server's with this\n"
        "release's; 'load' loads this release's (--replace: over a different one of the same\n"
        "version, once every instance runs this release).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_fn.add_argument("action", choices=["load", "show"])
    p_fn.add_argument("--replace", action="store_true", help="replace a library of this version")
    # moved to vllm-redis-presence: whatever follows is taken, and the user told where it went
    # (no help=: a subcommand's help=SUPPRESS is listed as "==SUPPRESS==", and the metavar
    # above names only the others)
    p_moved = sub.add_parser("present", add_help=False, prefix_chars="\0")
    p_moved.add_argument("rest", nargs="*")
    args = ap.parse_args(argv)
    if args.cmd == "present":
        print(
            "kvstore: 'present' moved to vllm-redis-presence (python -m connector.presence_cli),"
            " which knows vLLM's KV-cache groups; same options",
            file=sys.stderr,
        )
        return ExitStatus.ERROR
    from rich.console import Console  # after parsing: --help stays fast
    from rich.text import Text

    # emoji off: rich would render key parts such as ":b:" as emoji. Everything that comes
    # from Redis, a value or the user is printed as Text (_shown), never as markup.
    console = Console(emoji=False, highlight=False)
    err = Console(stderr=True, emoji=False, highlight=False)
    try:
        # read before connecting: a wrong path fails at once, naming the file (never its bytes)
        args.secret = _secret(args.secret_file) if args.cmd == "inspect" else None
        if args.cmd == "inspect" and args.epoch and args.secret is None:
            raise InvalidArgumentError(
                "--epoch keys a value's MAC with the secret: give --secret-file too"
            )
        if not 0 < args.timeout_s < math.inf:
            raise InvalidArgumentError("--timeout-s must be a number of seconds > 0")
        address = parse_url(args.url)
        client = make_client(address, socket_timeout_s=args.timeout_s)
        with translated_errors(address.safe_url, scope=_acl_scope(args)):
            return _run(args, client, console, err)
    except KVStoreError as exc:
        err.print(Text.assemble(("error:", "red"), " ", _shown(exc, limit=None)))
        return ExitStatus.ERROR


def _secret(secret_file: str | None) -> bytes | None:
    """The namespace secret ``--secret-file`` names, read as the connector reads its
    ``secret_file`` (surrounding whitespace, a trailing newline, is not part of it)."""
    if secret_file is None:
        return None
    if not secret_file.strip():
        raise InvalidArgumentError("--secret-file needs the path of the namespace's secret file")
    return load_secret(secret_file=secret_file)


def _acl_scope(args: argparse.Namespace) -> AclScope:
    """The namespace a permission error's hint grants keys in: the one the command works on
    (``--namespace``, or the namespace of the key inspected), else a placeholder."""
    namespace = getattr(args, "namespace", None)
    if namespace is None and args.cmd == "inspect":
        parsed = parse_key(args.key, args.prefix)
        namespace = parsed.namespace if parsed is not None else None
    return AclScope(namespace, args.prefix) if namespace else AclScope(prefix=args.prefix)


def _json(data: object, indent: int | None = 2) -> None:
    """``data`` for machines: any value a header held is written (``str`` of what JSON has no
    form for), and text that was not UTF-8 stays escaped."""
    print(json.dumps(data, indent=indent, default=str))


def _run(args: argparse.Namespace, client: redis.Redis, console: Console, err: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    if args.cmd == "ls":
        listing = list_blocks(client, args.prefix, args.namespace)
        rows = listing.rows
        for note in listing.notes:  # (on stderr: --json's output stays the rows)
            err.print(f"note: {note}")
        if args.json:
            _json(rows)
            return ExitStatus.OK
        from rich import box

        table = Table(
            title=_shown(f"cached KV blocks ({args.prefix}:<namespace>:<fingerprint>:<hash>)"),
            box=box.SIMPLE_HEAD,  # (no column rules: eight columns fit 80)
            pad_edge=False,
            collapse_padding=True,
        )
        # what ls exists to show -- the namespace, the fingerprint, the pattern to paste into
        # redis-cli -- is never cut to "…": at 80 columns (a pipe's default) the table showed
        # "namesp…", "3e37d7…" and no usable pattern (a review's). The names fold; the
        # patterns go below the table, one line each
        table.add_column("namespace", overflow="fold")
        table.add_column("fingerprint", overflow="fold", min_width=16)
        for col in ("blocks", "bytes", "TTL", "age", "read", "unread"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(
                _shown(r["namespace"]),
                _shown(r.get("fingerprint", "")),
                str(r["blocks"]),
                human_size(r.get("bytes")),
                _range(r.get("ttl_min_s"), r.get("ttl_max_s")),
                _range(r.get("age_min_s"), r.get("age_max_s")),
                _read(r),
                _unread(r),
            )
        console.print(table if rows else "no kvstore keys found")
        if rows:
            console.print(
                "read: blocks read since written, by any instance (a load, a probe, a warm "
                "renewal); unread: blocks nobody read, and the memory they hold"
            )
            console.print("each row's keys: redis-cli --scan --pattern <pattern>")
            for r in rows:
                # quoted for a shell (anyone who may write a key names a namespace: a quote in
                # it closed a naive quoting and ran what followed, a review's), then shown
                # escaped as every other name
                quoted = shlex.quote(str(r.get("pattern", "")))
                line = _shown(quoted, limit=None)
                if line.plain != quoted:  # shown escaped, it would name another namespace
                    line = Text("  (its namespace holds bytes a terminal cannot show: no pattern)")
                console.print(Text.assemble("  ", line), soft_wrap=True)
        return ExitStatus.OK
    if args.cmd == "inspect":
        info = inspect_key(client, args.key, args.secret, args.prefix, args.epoch)
        verdict = Verdict(info["verdict"])
        if args.json:
            _json(info)
        elif not info["exists"]:
            console.print(Text.assemble(_shown(info["key"]), f": {verdict.value}"))
        else:
            console.print(
                Text.assemble(
                    _shown(info["key"], style="bold"),
                    "  ",
                    (verdict.value, _VERDICT_STYLES.get(verdict, "red")),
                    f"  {human_size(info['bytes'])}",
                )
            )
            shown = ("reason", "detail", "format", "codec", "fingerprint", "block_hash",
                     "signed", "mac_ok", "checksum", "checksum_ok", "created", "ttl_s",
                     "metadata")  # fmt: skip
            for k in shown:
                if k in info:
                    console.print(Text.assemble(f"  {k}: ", _shown(info[k], limit=2000)))
            if verdict is Verdict.VALID:  # unsigned, and nothing said whether it should be
                console.print(
                    "  note: unsigned; readers of a namespace with a secret refuse it "
                    "(check such a namespace's values with --secret-file)"
                )
            if info.get("tensors"):
                table = Table("tensor", "dtype", "shape", "bytes")
                for t in info["tensors"]:
                    table.add_row(
                        _shown(t["name"]),
                        _shown(t["dtype"]),
                        _shown(t["shape"]),
                        human_size(t["bytes"]),
                    )
                console.print(table)
        return verdict.exit_status
    if args.cmd == "stats":
        stats = server_stats(client, args.prefix)
        if args.json:
            _json(stats)
        else:
            table = Table("", "value", title="kvstore server stats")
            for k, v in stats.items():
                table.add_row(k, _shown(v, limit=2000))
            console.print(table)
            policy = str(stats.get("maxmemory_policy") or "")
            for namespace, n in sorted(stats["keys_without_ttl_by_namespace"].items()):
                why = (
                    f"under {policy} they are never evicted, and every namespace's blocks with a "
                    "TTL go first"
                    if policy.startswith("volatile")
                    else "they stay until deleted"
                )
                console.print(
                    _shown(
                        f"namespace {namespace!r} holds {n} keys without a TTL: {why}. The "
                        "connector sets one unless ttl_s is 0; a writer that does not is "
                        "bypassing it (docs/operations.md, Tenants)",
                        limit=None,
                    )
                )
        return ExitStatus.OK
    if args.cmd == "flush":
        namespace = _printable(repr(args.namespace), limit=None)
        if not args.yes:
            if not sys.stdin.isatty():
                err.print("refusing to flush without --yes when not run interactively")
                return ExitStatus.ERROR
            count = sum(1 for _ in _scan(client, _namespace_pattern(args.prefix, args.namespace)))
            answer = input(f"delete {count} keys of namespace {namespace}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                err.print("nothing deleted")
                return ExitStatus.FAILED
        deleted = flush_namespace(client, args.prefix, args.namespace)
        if args.json:
            _json({"namespace": args.namespace, "deleted": deleted}, indent=None)
        else:
            console.print(_shown(f"deleted {deleted} keys of namespace {namespace}", limit=None))
        return ExitStatus.OK
    if args.cmd == "reset":
        result = reset_namespace(args.url, args.prefix, args.namespace, sweep=not args.no_sweep)
        if args.json:
            _json(result, indent=None)
        else:
            console.print(
                _shown(
                    f"namespace {args.namespace!r} is now in generation "
                    f"{result['generation']}; unlinked {result['unlinked']} older keys",
                    limit=None,
                )
            )
        return ExitStatus.OK
    if args.cmd == "functions":
        return _functions(args, client, console)
    raise AssertionError(args.cmd)


def library_state(client: redis.Redis) -> dict[str, Any]:
    """The servers' kvstore library against this release's: its name, this release's digest,
    each server's (each master of a Cluster; None where it has none), whether all match."""
    from kvstore.fleet.functions import LIBRARY
    from kvstore.net.server_code import LIBRARY_NAME, server_digest, servers

    digests = {name or "server": server_digest(server, LIBRARY) for name, server in servers(client)}
    return {
        "library": LIBRARY_NAME,
        "release_digest": LIBRARY.digest,
        "server_digests": digests,
        "matches": all(d == LIBRARY.digest for d in digests.values()),
    }


def _functions(args: argparse.Namespace, client: redis.Redis, console: Console) -> int:
    from kvstore.fleet.functions import LIBRARY
    from kvstore.net.server_code import load_library

    if args.action == "load":
        try:
            load_library(client, LIBRARY, replace=args.replace)
        except redis.exceptions.NoPermissionError as exc:
            raise StorePermissionError(
                f"this user may not load functions ({exc}): run it as the server's operator "
                "-- the default user, or a user of its own with +function|load, never a "
                "namespace's role (it could then load any Lua)",
                command="FUNCTION LOAD",
            ) from None
    state = library_state(client)
    if args.json:
        _json(state, indent=None)
        return ExitStatus.OK if state["matches"] else ExitStatus.FAILED
    for server, digest in state["server_digests"].items():
        if digest is None:
            verdict = "not loaded (python -m kvstore functions load)"
        elif digest == LIBRARY.digest:
            verdict = f"loaded (digest {digest}), this release's"
        else:
            verdict = (
                f"loaded (digest {digest}) but NOT this release's: python -m kvstore functions "
                "load --replace, once every instance runs this release"
            )
        console.print(_shown(f"{server}: {state['library']} {verdict}", limit=None))
    return ExitStatus.OK if state["matches"] else ExitStatus.FAILED


def reset_namespace(url: str, prefix: str, namespace: str, sweep: bool = True) -> dict[str, Any]:
    """A new generation for ``namespace`` (every instance stops loading older blocks with its
    next lookup), then, unless told not to, the older blocks unlinked."""
    from kvstore.fleet.access import acl_rule
    from kvstore.lookup_buffer import LookupBuffer

    with LookupBuffer.from_url(url, namespace=namespace, key_prefix=prefix, check=False) as buf:
        try:
            generation = buf.reset()
            unlinked = buf.sweep(generation) if sweep else 0
        except StorePermissionError as exc:
            # a reset writes the namespace's generation counter, which only the admin's rule
            # may: the refused command's own hint cannot say so
            rule = acl_rule(["ping", "generation", "reset", "sweep"], namespace, prefix)
            raise StorePermissionError(
                f"{exc}. Resetting namespace {namespace!r} takes the admin's rule: "
                f"ACL SETUSER <user> {rule}",
                command=exc.command,
            ) from None
    return {"namespace": namespace, "generation": generation, "unlinked": unlinked}


if __name__ == "__main__":
    sys.exit(main())
