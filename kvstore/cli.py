"""``kvstore`` (or ``python -m kvstore``): see what is cached in Redis/Valkey.

    kvstore --url redis://127.0.0.1:6379/0 ls [--namespace NS] [--json]
    kvstore --url ... inspect KEY [--json]
    kvstore --url ... stats [--json]
    kvstore --url ... flush --namespace NS [--yes]
    kvstore --url ... reset --namespace NS [--no-sweep]

Keys are walked with SCAN (never KEYS), so it is safe on a busy server. ``ls`` groups keys by
namespace and layout fingerprint; ``inspect`` decodes a value's header and verifies its checksum;
``flush`` deletes one namespace (never FLUSHALL) after confirmation; ``reset`` invalidates a
namespace at once (a new generation; vLLM's ``reset_prefix_cache`` does the same) and unlinks
the older blocks. Which leading blocks of a prompt a connector would load needs vLLM's rules for
its KV-cache groups: ``vllm-redis-presence`` (``connector.presence_cli``) answers that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster

from kvstore.errors import CorruptValueError, KVStoreError
from kvstore.net.connection import error_code, make_client, parse_url, translated_errors
from kvstore.values.keys import DEFAULT_KEY_PREFIX, parse_key

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

_SCAN_COUNT = 1000
_SHOWN_CHARS = 300  # of one name or field in the human output (--json keeps them whole)


def _scan(client: redis.Redis, pattern: str) -> Iterator[tuple[str, bytes]]:
    """Keys as (name to show and parse, the key's own bytes to send back). A key need not be
    UTF-8: its other bytes are shown as ``\\xNN`` and it is addressed by its bytes."""
    # a pattern from the command line may hold bytes that were not UTF-8: sent as they were
    for key in client.scan_iter(match=os.fsencode(pattern), count=_SCAN_COUNT):
        raw = key if isinstance(key, bytes) else str(key).encode()
        yield raw.decode(errors="backslashreplace"), raw


def _glob_literal(text: str) -> str:
    """``text`` matching only itself in a SCAN pattern: a namespace named ``a*`` or ``[/x]``
    must not select (or flush) other namespaces' keys."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _printable(value: object, limit: int | None = _SHOWN_CHARS) -> str:
    """Text from Redis (or a value's header) as a terminal may show it: control and other
    unprintable characters -- ANSI escapes, bytes that were not UTF-8 -- spelled as Python
    escapes, and past ``limit`` characters cut, saying how many."""
    text = str(value)
    cut = ""
    if limit is not None and len(text) > limit:
        text, cut = text[:limit], f"... ({len(text) - limit} more characters)"
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text + cut


def _shown(value: object, limit: int | None = _SHOWN_CHARS, style: str = "") -> Text:
    """``value`` as rich text, never as markup: a name like ``[/x]`` or ``[bold]`` is shown as
    it is instead of failing the whole output or styling it."""
    from rich.text import Text

    return Text(_printable(value, limit), style=style)


@dataclass
class _Group:
    """Running totals of one (namespace, fingerprint)'s blocks."""

    blocks: int = 0
    nbytes: int = 0
    ttls: tuple[float, float] | None = None
    ages: tuple[float, float] | None = None

    def add(self, size: int, ttl_s: float | None, age_s: float | None) -> None:
        self.blocks += 1
        self.nbytes += size
        self.ttls = _widen(self.ttls, ttl_s)
        self.ages = _widen(self.ages, age_s)


def _widen(span: tuple[float, float] | None, x: float | None) -> tuple[float, float] | None:
    if x is None:
        return span
    return (x, x) if span is None else (min(span[0], x), max(span[1], x))


def list_prefixes(client: redis.Redis, prefix: str, namespace: str | None) -> list[dict[str, Any]]:
    """One row per (namespace, fingerprint): blocks, bytes, TTL range, age range. Streams: keys
    are read as SCAN returns them, :data:`_SCAN_COUNT` per pipeline, and only running totals
    are kept, so a namespace of millions of blocks costs bounded client memory."""
    pattern = f"{_glob_literal(prefix)}:{_glob_literal(namespace) if namespace else '*'}:*"
    groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
    others: dict[str, int] = defaultdict(int)  # claims, handoff and document records, probes
    now = time.time()

    def flush(batch: list[tuple[str, str, bytes]]) -> None:
        pipe = client.pipeline(transaction=False)
        for _, _, k in batch:
            pipe.strlen(k)
            pipe.pttl(k)
            pipe.getrange(k, 0, 1023)
        # one key of another type (WRONGTYPE) must not fail the listing of the others
        replies = pipe.execute(raise_on_error=False)
        for i, (ns, fp, _) in enumerate(batch):
            size, pttl, head = replies[3 * i : 3 * i + 3]
            errors = [r for r in (size, pttl, head) if isinstance(r, Exception)]
            if errors:
                if any(error_code(e) != "WRONGTYPE" for e in errors):
                    raise errors[0]  # NOPERM and the like: about the server, not this key
                others["wrong-type"] += 1
                continue
            if pttl == -2:  # expired or deleted since SCAN saw it
                continue
            created = created_epoch(head)
            groups[(ns, fp)].add(
                int(size), pttl / 1000 if pttl >= 0 else None, now - created if created else None
            )

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
                "pattern": f"{prefix}:{ns}:{fp}:*",
            }
        )
    labels = {
        "claim": "(in-flight drop_select claims)",
        "handoff": "(handoff commit records)",
        "probe": "(permission probes)",
        "document": "(warmed-document records)",
        "generation": "(namespace generations)",
        "wrong-type": "(block keys that do not hold a string)",
    }
    for kind, count in sorted(others.items()):
        rows.append({"namespace": labels.get(kind, f"({kind} records)"), "blocks": count})
    return rows


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


def inspect_key(client: redis.Redis, key: str | bytes) -> dict[str, Any]:
    """A value's header and checks. ``key`` as bytes, or as text: a command-line argument's
    bytes that were not UTF-8 come back as they were (``os.fsencode``)."""
    from kvstore.values.codec import checksum_ok, read_header  # torch: only for this command

    raw = key if isinstance(key, bytes) else os.fsencode(key)
    name = raw.decode(errors="backslashreplace")
    value = client.get(raw)
    if not isinstance(value, bytes):
        return {"key": name, "exists": False}
    out: dict[str, Any] = {
        "key": name,
        "exists": True,
        "bytes": len(value),
        "ttl_s": (lambda t: None if t < 0 else t / 1000)(client.pttl(raw)),
    }
    try:
        header = read_header(value)
        # a signed value's checksum is keyed: this command has no secret to verify it with
        sum_ok = None if header.mac else checksum_ok(value, header)
        parsed = parse_key(name)
        fingerprint_ok = parsed is None or parsed.fingerprint == header.fingerprint
        fields = dict(
            valid=sum_ok is not False and fingerprint_ok,
            signed=bool(header.mac),
            checksum=header.checksum,
            checksum_ok=sum_ok,
            fingerprint=header.fingerprint,
            fingerprint_matches_key=fingerprint_ok,
            block_hash=header.block_hash,
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
    except CorruptValueError as exc:
        out.update(valid=False, reason=exc.reason, detail=str(exc))
        return out
    except Exception as exc:  # any header content is data to report, never a traceback
        # a header the codec's checks let through but cannot use (a number like 1e999)
        out.update(
            valid=False,
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
    for key, _ in _scan(client, f"{_glob_literal(prefix)}:*"):
        keys += 1
        parsed = parse_key(key, prefix)
        if parsed:
            namespaces[parsed.namespace] += 1
            blocks += parsed.kind == "block"
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
    deleted = 0
    batch: list[bytes] = []
    for _, raw in _scan(client, _namespace_pattern(prefix, namespace)):
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
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    # --json is accepted before or after the subcommand
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_ls = sub.add_parser("ls", parents=[common], help="cached prefixes by namespace/fingerprint")
    p_ls.add_argument("--namespace")
    p_in = sub.add_parser("inspect", parents=[common], help="decode a value's header, verify it")
    p_in.add_argument("key")
    sub.add_parser("stats", parents=[common], help="key counts, memory, hit/miss counters")
    p_fl = sub.add_parser("flush", parents=[common], help="delete every key of one namespace")
    p_fl.add_argument("--namespace", required=True)
    p_fl.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p_rs = sub.add_parser(
        "reset", parents=[common], help="invalidate a namespace's blocks at once (new generation)"
    )
    p_rs.add_argument("--namespace", required=True)
    p_rs.add_argument(
        "--no-sweep", action="store_true", help="leave older blocks to their TTL, unlink nothing"
    )
    # moved to vllm-redis-presence: whatever follows is taken, and the user told where it went
    p_moved = sub.add_parser("present", add_help=False, prefix_chars="\0", help=argparse.SUPPRESS)
    p_moved.add_argument("rest", nargs="*")
    args = ap.parse_args(argv)
    if args.cmd == "present":
        print(
            "kvstore: 'present' moved to vllm-redis-presence (python -m connector.presence_cli),"
            " which knows vLLM's KV-cache groups; same options",
            file=sys.stderr,
        )
        return 2
    from rich.console import Console  # after parsing: --help stays fast
    from rich.text import Text

    # emoji off: rich would render key parts such as ":b:" as emoji. Everything that comes
    # from Redis, a value or the user is printed as Text (_shown), never as markup.
    console = Console(emoji=False, highlight=False)
    err = Console(stderr=True, emoji=False, highlight=False)
    try:
        address = parse_url(args.url)
        client = make_client(address)
        with translated_errors(address.safe_url):
            return _run(args, client, console, err)
    except KVStoreError as exc:
        err.print(Text.assemble(("error:", "red"), " ", _shown(exc, limit=None)))
        return 2


def _json(data: object, indent: int | None = 2) -> None:
    """``data`` for machines: any value a header held is written (``str`` of what JSON has no
    form for), and text that was not UTF-8 stays escaped."""
    print(json.dumps(data, indent=indent, default=str))


def _run(args: argparse.Namespace, client: redis.Redis, console: Console, err: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    if args.cmd == "ls":
        rows = list_prefixes(client, args.prefix, args.namespace)
        if args.json:
            _json(rows)
            return 0
        table = Table(
            title=_shown(f"cached KV blocks ({args.prefix}:<namespace>:<fingerprint>:<hash>)")
        )
        for col in ("namespace", "fingerprint", "blocks", "bytes", "TTL", "age", "pattern"):
            table.add_column(col)
        for r in rows:
            table.add_row(
                _shown(r["namespace"]),
                _shown(r.get("fingerprint", "")),
                str(r["blocks"]),
                human_size(r.get("bytes")),
                _range(r.get("ttl_min_s"), r.get("ttl_max_s")),
                _range(r.get("age_min_s"), r.get("age_max_s")),
                _shown(r.get("pattern", "")),
            )
        console.print(table if rows else "no kvstore keys found")
        return 0
    if args.cmd == "inspect":
        info = inspect_key(client, args.key)
        if args.json:
            _json(info)
        elif not info["exists"]:
            console.print(Text.assemble(_shown(info["key"]), ": no such key"))
        else:
            console.print(
                Text.assemble(
                    _shown(info["key"], style="bold"),
                    "  ",
                    ("valid", "green") if info.get("valid") else ("INVALID", "red"),
                    f"  {human_size(info['bytes'])}",
                )
            )
            shown = ("reason", "detail", "format", "codec", "fingerprint", "block_hash", "signed",
                     "checksum", "checksum_ok", "created", "ttl_s", "metadata")  # fmt: skip
            for k in shown:
                if k in info:
                    console.print(Text.assemble(f"  {k}: ", _shown(info[k], limit=2000)))
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
        return 0 if info.get("valid") else 1
    if args.cmd == "stats":
        stats = server_stats(client, args.prefix)
        if args.json:
            _json(stats)
        else:
            table = Table("", "value", title="kvstore server stats")
            for k, v in stats.items():
                table.add_row(k, _shown(v, limit=2000))
            console.print(table)
        return 0
    if args.cmd == "flush":
        namespace = _printable(repr(args.namespace), limit=None)
        if not args.yes:
            if not sys.stdin.isatty():
                err.print("refusing to flush without --yes when not run interactively")
                return 2
            count = sum(1 for _ in _scan(client, _namespace_pattern(args.prefix, args.namespace)))
            answer = input(f"delete {count} keys of namespace {namespace}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                err.print("nothing deleted")
                return 1
        deleted = flush_namespace(client, args.prefix, args.namespace)
        if args.json:
            _json({"namespace": args.namespace, "deleted": deleted}, indent=None)
        else:
            console.print(_shown(f"deleted {deleted} keys of namespace {namespace}", limit=None))
        return 0
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
        return 0
    raise AssertionError(args.cmd)


def reset_namespace(url: str, prefix: str, namespace: str, sweep: bool = True) -> dict[str, Any]:
    """A new generation for ``namespace`` (every instance stops loading older blocks with its
    next lookup), then, unless told not to, the older blocks unlinked."""
    from kvstore.lookup_buffer import LookupBuffer

    with LookupBuffer.from_url(url, namespace=namespace, key_prefix=prefix, check=False) as buf:
        generation = buf.reset()
        unlinked = buf.sweep(generation) if sweep else 0
    return {"namespace": namespace, "generation": generation, "unlinked": unlinked}


if __name__ == "__main__":
    sys.exit(main())
