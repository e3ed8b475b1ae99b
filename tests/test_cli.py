"""The kvstore CLI on fakeredis (fast); test_e2e_serving.py runs it on real connector output."""

from __future__ import annotations

import json
import time
from datetime import datetime

import fakeredis
import pytest
import torch

import kvstore.cli
from kvstore import LookupBuffer, chain_hashes
from kvstore.cli import created_epoch
from kvstore.codec import encode_value

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
    for row in (whole[0], streamed[0]):  # ages move on between the two runs
        row.pop("age_min_s"), row.pop("age_max_s"), row.pop("ttl_min_s"), row.pop("ttl_max_s")
    assert streamed == whole
    assert sizes and max(sizes) <= 3 * 7


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


def test_stats_counts_only_kvstore_keys(client, capsys) -> None:
    rc, out = run(capsys, "stats", "--json")
    stats = json.loads(out)
    assert rc == 0 and stats["kv_keys"] == 4 and stats["keys_by_namespace"] == {"a": 3, "b": 1}


def test_flush_deletes_one_namespace_only(client, capsys) -> None:
    rc, out = run(capsys, "flush", "--namespace", "a", "--yes", "--json")
    assert rc == 0 and json.loads(out)["deleted"] == 3
    assert client.exists("unrelated") and len(list(client.scan_iter(match="kv:b:*"))) == 1


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
