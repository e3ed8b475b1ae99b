"""Issue 52: ``connector.warm --check`` reads every document record in the namespace, and
anyone who can write to Redis can plant one. A record of the wrong types raised TypeError, a
deeply nested one RecursionError, a key of another type or a chain of things that are not block
hashes ended the whole check (exit 2), and a name's escape sequences went to the terminal.
Now each malformed record is a counted, named problem (its key escaped), the other records are
still reported, and the check fails (exit 1)."""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import pytest
import torch

import connector.warm.records
from connector.warm import cli
from connector.warm.records import DocumentRecord, save_record
from kvstore import LookupBuffer, chain_hashes

BLOCK = 16
CHAIN = chain_hashes(list(range(BLOCK * 3)), BLOCK)
URL = "redis://fake:1/0"
# a name a terminal would act on: a title, a screen clear, a forged line of output
HOSTILE_NAME = "doc\x1b]0;pwned\x07\x1b[2J\nforged line"
SHOWN_NAME = "doc\\x1b]0;pwned\\x07\\x1b[2J\\nforged line"
# brackets and quotes inside a legitimate name are text, not nesting
BRACKETED_NAME = "notes [" + "[" * 40 + '] "quoted {{{{{{{{{{" \\ end.txt'

RECORD: dict[str, Any] = {
    "name": "manual.txt",
    "tokens": BLOCK * len(CHAIN),
    "chain": CHAIN,
    "fingerprints": ["f"],
    "model": "m",
    "text_hash": "t",
    "stored_at": 1.0,
}


def _with(**fields: Any) -> bytes:
    return json.dumps({**RECORD, **fields}).encode()


# (what is planted, words of the problem reported)
MALFORMED: dict[str, tuple[bytes, str]] = {
    "wrong types": (
        _with(name=5, tokens="x", chain="abc", fingerprints=[["f"]], model=None),
        "name is not a text",
    ),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "nested more than"),
    "nested in a field": (_with(chain=[[[[[[[[[["x"]]]]]]]]]]), "nested more than"),
    "not block hashes": (_with(chain=["a b", "\x1b[2J"]), "chain holds something other"),
    "not fingerprints": (_with(fingerprints=["f", "kv:other:*"]), "fingerprints holds"),
    "no chain": (_with(chain=[]), "chain is not a list"),
    "a negative count": (_with(tokens=-1), "tokens is not a count"),
    "a time that is not one": (_with(stored_at=float("nan")), "stored_at is not a time"),
    "missing fields": (b'{"name": "x"}', "missing tokens"),
    "unknown fields": (_with(extra=1), "field(s) a record does not have"),
    "not an object": (b'["a list"]', "not an object"),
    "not JSON": (b"{broken", "not JSON"),
    "not UTF-8": (b'{"name": "\xff"}', "not JSON"),
}
KEY = b"kv:w:f:doc:\x1b[31mplanted\nforged line"
SHOWN_KEY = "kv:w:f:doc:\\x1b[31mplanted\\nforged line"


@pytest.fixture
def store(fake_redis: fakeredis.FakeRedis) -> LookupBuffer:
    """A namespace with one warmed document whose blocks are all present."""
    buf = LookupBuffer(fake_redis, namespace="w", fingerprint="f", ttl_s=600)
    buf.insert_many([(h, {"kv": torch.full((2, BLOCK, 4), float(i))}) for i, h in enumerate(CHAIN)])
    save_record(buf, DocumentRecord(**RECORD))
    return buf


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["--url", URL, "--namespace", "w", "--check", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _assert_nothing_raw(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "Traceback" not in text
    assert not any(line.startswith("forged line") for line in text.splitlines())


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_record_is_a_named_problem_and_the_others_are_still_checked(
    store: LookupBuffer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a row on one line, the problem's words unfolded
    planted, problem = MALFORMED[kind]
    store.client.set(KEY, planted)
    rc, out, err = _check(capsys)
    assert rc == 1  # the check failed: a record could not be read
    _assert_nothing_raw(out + err)
    assert "1 malformed document record(s) skipped" in out
    line = next(ln for ln in out.splitlines() if SHOWN_KEY in ln)
    assert problem in line
    row = next(ln for ln in out.splitlines() if "manual.txt" in ln)
    assert "complete" in row and "100%" in row

    rc, out, err = _check(capsys, "--json")
    report = json.loads(out)
    assert rc == 1
    _assert_nothing_raw(out + err)
    (malformed,) = report["malformed_records"]
    assert malformed["key"] == KEY.decode() and problem in malformed["problem"]
    assert [r["status"] for r in report["documents"]] == ["complete"]


def test_a_key_of_another_type_is_a_named_problem(
    store: LookupBuffer, capsys: pytest.CaptureFixture[str]
) -> None:
    store.client.rpush(KEY, b"x")
    rc, out, err = _check(capsys)
    assert rc == 1
    _assert_nothing_raw(out + err)
    assert SHOWN_KEY in out and "another type" in out


def test_a_record_larger_than_any_record_is_refused_unread(
    store: LookupBuffer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connector.warm.records, "MAX_RECORD_BYTES", 1000)
    large = _with(name="x" * 2000)
    store.client.set(KEY, large)
    parsed: list[bytes] = []  # everything read is parsed
    real = connector.warm.records.parse_record

    def parse(raw: bytes | str) -> DocumentRecord:
        parsed.append(raw if isinstance(raw, bytes) else raw.encode())
        return real(raw)

    monkeypatch.setattr(connector.warm.records, "parse_record", parse)
    rc, out, _ = _check(capsys, "--json")
    (malformed,) = json.loads(out)["malformed_records"]
    assert rc == 1 and malformed["problem"] == f"{len(large)} bytes: more than a record holds"
    assert len(parsed) == 1 and b"manual.txt" in parsed[0]  # the large one never came over


def test_the_writer_never_stores_a_record_the_check_would_refuse(
    store: LookupBuffer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is the writer's too: a document whose record is over it is stored but not
    recorded (said so), never written as a record --check then lists as planted."""
    monkeypatch.setattr(connector.warm.records, "MAX_RECORD_BYTES", 1000)
    long_chain = chain_hashes(list(range(BLOCK * 60)), BLOCK)
    long_doc = DocumentRecord(**{**RECORD, "name": "long.txt", "chain": long_chain})
    with pytest.raises(connector.warm.records.RecordTooLargeError, match="not recorded"):
        save_record(store, long_doc)
    assert not store.client.exists(store.keys.document(long_doc.document_id, "f"))
    rc, out, _ = _check(capsys, "--json")
    assert rc == 0 and json.loads(out)["malformed_records"] == []


def test_names_reach_the_terminal_escaped_and_brackets_in_names_are_not_nesting(
    store: LookupBuffer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    for i, name in enumerate((HOSTILE_NAME, BRACKETED_NAME)):
        chain = chain_hashes(list(range(1000 * (i + 1), 1000 * (i + 1) + BLOCK)), BLOCK)
        save_record(store, DocumentRecord(name, BLOCK, chain, ["f"], "m", text_hash="t"))
    rc, out, err = _check(capsys)
    assert rc == 1  # their blocks are not in the pool
    _assert_nothing_raw(out + err)
    assert SHOWN_NAME in out and BRACKETED_NAME in out
    assert "malformed" not in out
