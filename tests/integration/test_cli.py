"""The kvstore CLI on fakeredis (fast); test_e2e_serving.py runs it on real connector output."""

from __future__ import annotations

import json
import os
import struct
import time
from datetime import datetime

import fakeredis
import pytest
import redis
import torch

import kvstore.cli
from kvstore import LookupBuffer, chain_hashes
from kvstore.cli import created_epoch
from kvstore.values.codec import encode_value

HASHES = chain_hashes(list(range(64)), 16)


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeRedis:
    c = fakeredis.FakeRedis()
    monkeypatch.setattr(kvstore.cli, "make_client", lambda *a, **k: c)
    a = LookupBuffer(c, namespace="a", layout={"m": 1}, ttl_s=100)
    a.insert_many([(h, {"kv": torch.ones(2, 16)}) for h in HASHES[:3]])
    LookupBuffer(c, namespace="b", layout={"m": 2}).insert(HASHES[0], {"kv": torch.ones(4)})
    c.set("unrelated", b"x")
    return c


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = kvstore.cli.main(["--url", "redis://fake:1/0", *args])
    return rc, capsys.readouterr().out


def test_ls_groups_by_namespace_and_fingerprint(client, capsys) -> None:
    rc, out = run(capsys, "ls", "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["namespace"], r["blocks"]) for r in rows] == [("a", 3), ("b", 1)]
    assert 90 < rows[0]["ttl_max_s"] <= 100 and rows[1]["ttl_max_s"] is None
    assert rows[0]["bytes"] > 3 * 2 * 16 * 4
    rc, out = run(capsys, "ls", "--namespace", "b", "--json")
    assert [r["namespace"] for r in json.loads(out)] == ["b"]
    rc, out = run(capsys, "ls")  # the human table
    assert rc == 0 and "namespace" in out and "kv:a:" in out


def test_ls_streams_a_big_namespace_in_bounded_pipelines(client, capsys, monkeypatch) -> None:
    """Issue 20: ls pipelined three commands per key of a whole namespace at once (gigabytes of
    client memory for millions of blocks). Now every pipeline holds at most one SCAN batch, and
    the totals are the same."""
    many = LookupBuffer(client, namespace="many", layout={"m": 3}, ttl_s=100)
    many.insert_many([(h, {"kv": torch.ones(8)}) for h in chain_hashes(list(range(16 * 40)), 16)])
    rc, out = run(capsys, "ls", "--namespace", "many", "--json")
    whole = json.loads(out)
    monkeypatch.setattr(kvstore.cli, "_SCAN_COUNT", 7)
    sizes: list[int] = []
    real = client.pipeline

    def recording_pipeline(*a, **k):  # type: ignore[no-untyped-def]
        pipe = real(*a, **k)
        execute = pipe.execute

        def counted(*ea, **ek):  # type: ignore[no-untyped-def]
            sizes.append(len(pipe.command_stack))
            return execute(*ea, **ek)

        pipe.execute = counted
        return pipe

    monkeypatch.setattr(client, "pipeline", recording_pipeline)
    rc, out = run(capsys, "ls", "--namespace", "many", "--json")
    streamed = json.loads(out)
    assert rc == 0 and streamed[0]["blocks"] == 40
    moving = ("age_min_s", "age_max_s", "ttl_min_s", "ttl_max_s", "read_blocks", "unread_blocks",
              "unread_bytes", "unknown_blocks")  # fmt: skip
    for row in (whole[0], streamed[0]):  # ages move on between the two runs, and on Redis 7.0
        for name in moving:  # the first listing's reads count as reads in the second
            row.pop(name)
    assert streamed == whole
    # four commands a key, and the listing's own five (no-touch on and off, the server's time,
    # uptime and policy)
    assert sizes and max(sizes) <= 4 * 7 + 5


def test_inspect_reports_header_and_checksum(client, capsys) -> None:
    key = next(k.decode() for k in client.scan_iter(match="kv:a:*"))
    rc, out = run(capsys, "--json", "inspect", key)
    info = json.loads(out)
    assert rc == 0 and info["valid"] and info["checksum_ok"]
    assert info["tensors"] == [{"name": "kv", "dtype": "F32", "shape": [2, 16], "bytes": 128}]
    value = bytearray(client.get(key))
    value[-1] ^= 1
    client.set(key, bytes(value))
    rc, out = run(capsys, "inspect", key, "--json")
    assert rc == 1 and json.loads(out)["checksum_ok"] is False
    rc, out = run(capsys, "inspect", "kv:a:nope:nope", "--json")
    assert rc == 1 and json.loads(out)["exists"] is False


def test_inspect_shows_a_signed_value_as_signed_not_as_a_bad_checksum(client, capsys) -> None:
    signed = LookupBuffer(client, namespace="s", layout={"m": 1}, secret=b"s" * 32)
    signed.insert(HASHES[0], {"kv": torch.ones(2, 16)})
    key = signed.redis_key(HASHES[0])
    rc, out = run(capsys, "--json", "inspect", key)
    info = json.loads(out)
    # without the secret its MAC is not checked: unverified, never valid (issue 52)
    assert rc == kvstore.cli.ExitStatus.UNVERIFIED and info["verdict"] == "unverified"
    assert not info["valid"] and info["signed"] and info["checksum_ok"] is None
    assert "s" * 32 not in out  # the secret never shows (this command has none anyway)


def test_stats_counts_only_kvstore_keys(client, capsys) -> None:
    rc, out = run(capsys, "stats", "--json")
    stats = json.loads(out)
    assert rc == 0 and stats["kv_keys"] == 4 and stats["keys_by_namespace"] == {"a": 3, "b": 1}
    # b's store was made without a TTL: its key never expires, and an operator is told whose
    assert stats["keys_without_ttl_by_namespace"] == {"b": 1}


def test_stats_names_a_namespace_whose_writer_skips_the_ttl(
    private_redis, capsys, monkeypatch
) -> None:
    """Issue 52: an ACL cannot make a writer set a TTL; under volatile-ttl its keys are never
    evicted and every other tenant's go first. What cannot be refused is shown."""
    real = redis.Redis(port=private_redis.port)
    monkeypatch.setattr(kvstore.cli, "make_client", lambda *a, **k: real)
    real.config_set("maxmemory-policy", "volatile-ttl")
    with LookupBuffer(real, namespace="b", fingerprint="fp", ttl_s=100) as b:
        b.insert(HASHES[0], {"kv": torch.ones(4)})
    real.set(f"kv:a:fp:{'ee' * 16}", b"planted forever")
    real.set("kv:a:generation", 3)  # meant to last: not counted
    rc, out = run(capsys, "stats")
    assert rc == 0
    text = " ".join(out.split())
    assert "namespace 'a' holds 1 keys without a TTL" in text and "volatile-ttl" in text


def test_flush_deletes_one_namespace_only(client, capsys) -> None:
    client.set("kv:a:generation", 4)
    rc, out = run(capsys, "flush", "--namespace", "a", "--yes", "--json")
    assert rc == 0 and json.loads(out)["deleted"] == 3
    assert client.exists("unrelated") and len(list(client.scan_iter(match="kv:b:*"))) == 1
    # the counter stays: a flushed one read 0, and blocks named before the resets loaded again
    assert client.get("kv:a:generation") == b"4"


def test_flush_without_yes_refuses_when_not_interactive(client, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    rc, _ = run(capsys, "flush", "--namespace", "a")
    assert rc == 2 and len(list(client.scan_iter(match="kv:a:*"))) == 3


def test_unreachable_server_and_bad_url_exit_2_with_a_message(capsys) -> None:
    assert kvstore.cli.main(["--url", "redis://127.0.0.1:1/0", "ls"]) == 2
    assert "cannot reach" in capsys.readouterr().err.replace("\n", " ")
    assert kvstore.cli.main(["--url", "http://x", "ls"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    # the message names the URL forms, brackets included: printed as text, not as rich markup
    assert "invalid store URL" in err and "<service>[/db]" in err


@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Europe/Berlin", "Australia/Sydney"])
@pytest.mark.parametrize("stamp", ["2026-01-15T12:00:00.250Z", "2026-07-15T12:00:00.250Z"])
def test_ages_are_right_in_every_time_zone_on_both_sides_of_daylight_saving(
    monkeypatch: pytest.MonkeyPatch, zone: str, stamp: str
) -> None:
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        head = b'{"__metadata__":{"kvstore.created":"' + stamp.encode() + b'","x":"y"}}'
        want = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        assert created_epoch(head) == want
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_the_codec_writes_utc_timestamps_that_ls_reads_back() -> None:
    before = time.time()
    value = encode_value({"k": torch.zeros(4)}, fingerprint="f" * 16, block_hash="0" * 32)
    age = time.time() - (created_epoch(value[:1024]) or 0)
    assert -1 < age < time.time() - before + 1


# ---------------------------------------------------------------- hostile keys and values
def _with_header_field(value: bytes, old: bytes, new: bytes) -> bytes:
    """``value`` with ``old`` replaced by ``new`` in its JSON header (the length prefix
    rewritten): a header as a hostile writer would make it."""
    (n,) = struct.unpack_from("<Q", value, 0)
    header = value[8 : 8 + n]
    assert old in header, header
    header = header.replace(old, new, 1)
    return struct.pack("<Q", len(header)) + header + value[8 + n :]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"data_offsets":[0,', b'"data_offsets":[1e999,'),  # int(inf): OverflowError
        (b'"shape":[', b'"shape":[1e999,'),
        (b'"kvstore.raw_bytes":"', b'"kvstore.raw_bytes":1e999,"kvstore.was":"'),
    ],
)
def test_inspect_reports_a_header_with_huge_numbers_as_corrupt_without_a_traceback(
    client, capsys, old: bytes, new: bytes
) -> None:
    """Issue: a header field like 1e999 (JSON's infinity) raised OverflowError out of the
    codec, and inspect died with a traceback."""
    key = next(k.decode() for k in client.scan_iter(match="kv:a:*"))
    client.set(key, _with_header_field(client.get(key), old, new))
    rc, out = run(capsys, "inspect", key, "--json")
    info = json.loads(out)
    assert rc == 1 and info["exists"] and info["valid"] is False and info["reason"]
    rc, out = run(capsys, "inspect", key)
    assert rc == 1 and "INVALID" in out and "Traceback" not in out


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "4000")  # no table cell wraps: names are found whole


HOSTILE_NAMESPACES = [
    b"[/x]",
    b"[bold]ns[/bold]",
    b"ns\x1b[31mred\x1b]0;title\x07",  # ANSI escapes: a terminal would act on them
    b"ns\\",  # a trailing backslash escapes rich's next tag
    b"\xff\xfe-not-utf8",
    b"n" * 5000,
]


@pytest.fixture
def hostile(client: fakeredis.FakeRedis) -> fakeredis.FakeRedis:
    key = next(k for k in client.scan_iter(match=b"kv:a:*"))
    value = client.get(key)
    for ns in HOSTILE_NAMESPACES:
        client.set(b"kv:" + ns + b":fp[/y]:h", value)
    client.set(b"kv:odd:fp:h", value.replace(b'"kvstore.created":"', b'"kvstore.created":"\xff'))
    client.rpush(b"kv:odd:fp:list", b"x")  # a block key of another type
    client.set(b"kv:odd:generation", b"3")  # what `kvstore reset` writes
    return client


def _no_raw_control_characters(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "Traceback" not in text


def test_ls_and_stats_show_hostile_key_names_as_text(hostile, capsys, wide) -> None:
    """Issue: names went to rich as markup: one key named like kv:[/x]:fp:h made ls fail for
    the whole server (MarkupError), and [bold] styled the output."""
    rc, out = run(capsys, "ls")
    assert rc == 0
    _no_raw_control_characters(out)
    for shown in ("[/x]", "[bold]ns[/bold]", "ns\\x1b[31mred", "ns\\", "\\xff\\xfe-not-utf8"):
        assert shown in out, shown
    assert "fp[/y]" in out and "n" * 300 + "... (4700 more characters)" in out
    assert "(namespace generations)" in out and "(block keys that do not hold a string)" in out
    rc, out = run(capsys, "ls", "--json")
    rows = {r["namespace"]: r for r in json.loads(out)}
    assert rc == 0 and rows["[/x]"]["fingerprint"] == "fp[/y]" and rows["n" * 5000]["blocks"] == 1
    assert rows["\\xff\\xfe-not-utf8"]["blocks"] == 1 and rows["odd"]["blocks"] == 1
    for args in (["stats"], ["stats", "--json"], ["ls", "--namespace", "[/x]"]):
        rc, out = run(capsys, *args)
        assert rc == 0
        _no_raw_control_characters(out)
        assert "[/x]" in out


@pytest.mark.parametrize("ns", HOSTILE_NAMESPACES)
def test_inspect_and_flush_take_and_show_hostile_key_names(hostile, capsys, wide, ns) -> None:
    key = b"kv:" + ns + b":fp[/y]:h"
    arg = os.fsdecode(key)  # as the shell hands it over: bytes that are not UTF-8 included
    rc, out = run(capsys, "inspect", arg)
    assert rc == 1 and "INVALID" in out  # its fingerprint is not the key's
    _no_raw_control_characters(out)
    name = key.decode(errors="backslashreplace")[:300]  # what a terminal may show of it
    assert "".join(c if c.isprintable() else repr(c)[1:-1] for c in name) in out
    rc, out = run(capsys, "inspect", arg, "--json")
    assert json.loads(out)["exists"] is True
    rc, out = run(capsys, "flush", "--namespace", os.fsdecode(ns), "--yes")
    assert rc == 0 and "deleted 1 keys" in out
    _no_raw_control_characters(out)
    assert not hostile.exists(key)


def test_inspect_shows_hostile_header_fields_as_text(client, capsys, wide) -> None:
    key = next(k.decode() for k in client.scan_iter(match="kv:a:*"))
    value = client.get(key)
    value = _with_header_field(
        value, b'"__metadata__":{', b'"__metadata__":{"[/x]":"[bold]\\u001b[2J",'
    )
    client.set(key, value)
    rc, out = run(capsys, "inspect", key)
    assert rc in (0, 1) and "[/x]" in out and "[bold]\\x1b[2J" in out
    _no_raw_control_characters(out)


@pytest.mark.redis
def test_ls_and_inspect_survive_hostile_keys_on_a_real_server(redis_url, capsys, wide) -> None:
    real = redis.Redis.from_url(redis_url)
    try:
        value = encode_value({"k": torch.zeros(4)}, fingerprint="f" * 16, block_hash="0" * 32)
        for ns in HOSTILE_NAMESPACES:
            real.set(b"kv:" + ns + b":fp:h", value)
        real.rpush(b"kv:odd:fp:list", b"x")
        rc, out = kvstore.cli.main(["--url", redis_url, "ls"]), capsys.readouterr().out
        assert rc == 0 and "[/x]" in out and "\\xff\\xfe-not-utf8" in out
        _no_raw_control_characters(out)
        rc = kvstore.cli.main(
            ["--url", redis_url, "inspect", os.fsdecode(b"kv:\xff\xfe-not-utf8:fp:h")]
        )
        out = capsys.readouterr().out
        assert rc == 1 and "\\xff\\xfe-not-utf8" in out  # found: its fingerprint is not "fp"
        # a key of another type is no value of ours: INVALID, exit 1 -- it was the server's
        # WRONGTYPE and exit 2, "could not run" (a review's)
        rc = kvstore.cli.main(["--url", redis_url, "--json", "inspect", "kv:odd:fp:list"])
        info = json.loads(capsys.readouterr().out)
        assert rc == 1 and info["verdict"] == "INVALID" and info["reason"] == "wrong-type"
        assert "list" in info["detail"]
    finally:
        real.close()


@pytest.mark.parametrize("pattern", ["?", "*", "[ab]"])
def test_flush_and_ls_take_a_namespace_literally_never_as_a_pattern(
    client, capsys, pattern: str
) -> None:
    """Issue: the namespace went into the SCAN pattern as it was: flush --namespace '?'
    deleted namespaces a and b."""
    rc, out = run(capsys, "flush", "--namespace", pattern, "--yes", "--json")
    assert rc == 0 and json.loads(out)["deleted"] == 0
    assert len(list(client.scan_iter(match="kv:[ab]:*"))) == 4
    rc, out = run(capsys, "ls", "--namespace", pattern, "--json")
    assert rc == 0 and json.loads(out) == []


@pytest.mark.redis
def test_inspect_reads_a_value_larger_than_any_control_reply(redis_url, capsys) -> None:
    """Found by a review: inspect read a value whole through redis-py, whose replies are now
    bounded at 4 MiB for us, so every real value over 4 MiB failed inspect. It reads a value a
    MiB at a time."""
    with LookupBuffer.from_url(redis_url, namespace="big", fingerprint="fp") as store:
        store.insert("ab" * 16, {"kv": torch.arange(3 << 20, dtype=torch.float32)})  # 12 MiB
        key = store.redis_key("ab" * 16)
    rc = kvstore.cli.main(["--url", redis_url, "inspect", key, "--json"])
    info = json.loads(capsys.readouterr().out)
    assert rc == 0 and info["verdict"] == "valid" and info["bytes"] > 12 << 20


def test_ls_at_80_columns_shows_each_fingerprint_and_pattern_whole(
    client, capsys, monkeypatch
) -> None:
    """Found by a review: at 80 columns (a pipe's default) ls cut what it exists to show:
    "namesp…", "3e37d7…", and a redis-cli pattern nobody could paste."""
    monkeypatch.setenv("COLUMNS", "80")
    rc, out = run(capsys, "ls")
    rows = json.loads(run(capsys, "ls", "--json")[1])
    assert rc == 0 and rows and "…" not in out
    for r in rows:
        assert r["fingerprint"] in out and f"'{r['pattern']}'" in out


def test_ls_prints_each_pattern_quoted_for_a_shell_and_literal_for_scan(client, capsys) -> None:
    """Found by a review: a namespace holding a quote (anyone who may write a key names one)
    closed ls's naive quoting, and pasting the line ran what followed; a namespace holding a
    glob character matched other namespaces' keys."""
    import shlex

    client.set("kv:x';touch /tmp/PWNED;echo ':3e37d709d305466b:" + "a" * 32, b"junk")
    client.set("kv:a*:3e37d709d305466b:" + "b" * 32, b"junk")
    client.set("kv:a\x1bb:3e37d709d305466b:" + "c" * 32, b"junk")  # (shown escaped: "ax1bb")
    rows = json.loads(run(capsys, "ls", "--json")[1])
    rc, out = run(capsys, "ls")
    printed = [ln.strip() for ln in out.splitlines()[out.splitlines().index(
        "each row's keys: redis-cli --scan --pattern <pattern>") + 1:] if ln.strip()]  # fmt: skip
    assert rc == 0 and len(printed) == len(rows)
    for line, r in zip(printed, rows, strict=True):
        if "\x1b" in r["namespace"]:
            assert "no pattern" in line  # none that would name namespace "ax1bb"
        else:
            assert shlex.split(line) == [r["pattern"]]  # one word: nothing runs after it
    assert "kv:a\\*:3e37d709d305466b:*" in [r["pattern"] for r in rows]
