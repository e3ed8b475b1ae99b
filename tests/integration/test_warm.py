"""The warm command's parts without an engine: reading documents, rendering the prompt requests
share, the store calls it makes (many chains in one lookup, block info, TTL renewal, document
records), ``--check`` against a real redis-server, and its prefill / confirm / retry loop driven
by a stand-in engine that writes blocks the way the connector does."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis

from connector.warm import cli
from connector.warm.engine import Finished, StoreLayout
from connector.warm.inputs import Document, PromptStyle, read_documents, render
from connector.warm.records import DocumentRecord, load_records, presence, save_record
from kvstore import LookupBuffer, chain_hashes
from kvstore.values.keys import parse_key
from testing.blocks import filled_block

BLOCK = 16


small_block = partial(filled_block, shape=(2, BLOCK, 4))


# ------------------------------------------------------------------------------ reading documents
def test_read_documents_from_files_directories_globs_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "sub" / "a.md").write_text("ay")
    (tmp_path / "d" / ".hidden").write_text("never")
    (tmp_path / "g1.txt").write_text("one")
    (tmp_path / "g2.txt").write_text("two")
    lines = [
        json.dumps({"id": "x1", "text": "first"}),
        json.dumps({"text": "no id"}),
        "",
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"id": "x5", "body": "other field"}),
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    docs = read_documents(
        [str(tmp_path / "d"), str(tmp_path / "g*.txt"), str(tmp_path / "r.jsonl")]
    )
    got = [(Path(d.name).name, d.text, d.error is not None) for d in docs]
    assert got == [
        ("b.txt", "bee", False),
        ("a.md", "ay", False),
        ("g1.txt", "one", False),
        ("g2.txt", "two", False),
        ("r.jsonl#x1", "first", False),
        ("r.jsonl:2", "no id", False),
        ("r.jsonl:4", None, True),
        ("r.jsonl:5", None, True),
        ("r.jsonl#x5", None, True),
    ]
    assert 'field "text"' in (docs[-1].error or "")


def test_unreadable_documents_are_reported_and_the_others_still_read(tmp_path: Path) -> None:
    (tmp_path / "bin.txt").write_bytes(b"\x80\x81 not utf-8")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "none").mkdir()
    specs = ["bin.txt", "missing.txt", "empty.txt", "nomatch*.txt", "none", "ok.txt"]
    docs = read_documents([str(tmp_path / s) for s in specs])
    errors = {Path(d.name).name: d.error for d in docs}
    assert "not UTF-8" in errors["bin.txt"]
    assert "No such file" in errors["missing.txt"]
    assert errors["empty.txt"] == "empty"
    assert "no file matches" in errors["nomatch*.txt"]
    assert "no files" in errors["none"]
    assert errors["ok.txt"] is None
    assert docs[-1].text == "fine"


# ------------------------------------------------------------------------------ rendering
@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_plain_prompts_are_prefix_document_suffix_with_special_tokens() -> None:
    style = PromptStyle(prefix="Manual:\n", suffix="\n---\n")
    assert render(style, "DOC", tokenizer=None) == ("Manual:\nDOC\n---\n", True)


@pytest.mark.parametrize("system", [None, "Answer from the manual."])
def test_the_chat_prefix_is_what_every_chat_request_on_the_document_starts_with(
    tokenizer: Any, system: str | None
) -> None:
    style = PromptStyle(suffix="\n\n", chat=True, system=system)
    warmed, special = render(style, "THE DOCUMENT", tokenizer)
    assert not special  # the template places the special tokens, as vLLM's chat endpoint does
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": "THE DOCUMENT\n\nWhat is it?"})
    request = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert request.startswith(warmed)
    assert "THE DOCUMENT" in warmed and "What" not in warmed
    ids = tokenizer.encode(warmed, add_special_tokens=False)
    full = tokenizer.encode(request, add_special_tokens=False)
    assert full[: len(ids)] == ids


def test_a_template_that_does_not_copy_the_message_is_refused(tokenizer: Any) -> None:
    style = PromptStyle(
        chat=True, chat_template="{% for m in messages %}[{{ m['role'] }}]{% endfor %}"
    )
    with pytest.raises(ValueError, match="verbatim"):
        render(style, "doc", tokenizer)


def test_a_chat_template_file_replaces_the_models(tokenizer: Any) -> None:
    tpl = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    warmed, _ = render(PromptStyle(chat=True, chat_template=tpl), "doc", tokenizer)
    assert warmed == "<<doc"


# ------------------------------------------------------------------------------ store calls
CHAINS = [chain_hashes(list(range(s, s + BLOCK * n)), BLOCK) for s, n in ((0, 4), (500, 3))]


def test_longest_prefixes_of_many_chains_at_once(fake_client: Any) -> None:
    fps = ["rank0", "rank1"]
    bufs = [LookupBuffer(fake_client, namespace="w", fingerprint=fp) for fp in fps]
    for buf in bufs:
        buf.insert_many([(h, small_block(i)) for i, h in enumerate(CHAINS[0][:3])])
        buf.insert_many([(h, small_block(i)) for i, h in enumerate(CHAINS[1])])
    bufs[1].delete([CHAINS[0][1]])  # one rank lost block 1 of the first chain
    assert bufs[0].longest_prefixes(CHAINS, fps) == [1, 3]
    assert bufs[0].longest_prefixes(CHAINS) == [3, 3]
    assert bufs[0].longest_prefixes([[], CHAINS[1]]) == [0, 3]
    # each block's presence, past the first gap too (a sliding window at a chain's end)
    assert bufs[0].presences(CHAINS, fps) == [[True, False, True, False], [True] * 3]
    bufs[0].publish_handoff("h", 3)
    bufs[1].publish_handoff("h", 3)
    (state,) = bufs[0].read_handoffs([("h", CHAINS[0])], fps)
    assert state.present == 1 and state.blocks == (True, False, True, False)


def test_block_info_says_present_size_and_ttl(
    fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fakeredis's clock stands still: a tail's TTL is 2 ms shorter than its head's, and on a
    # busy machine more than 2 ms passed between the two SETs (the tail then expired later)
    frozen = time.time()
    monkeypatch.setattr(time, "time", lambda: frozen)
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=100)
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(CHAINS[0][:2])])
    info = buf.block_info(CHAINS[0][:3])
    assert [i.present for i in info] == [True, True, False]
    assert info[0].size == fake_client.strlen(buf.redis_key(CHAINS[0][0])) > 0
    assert info[2].size == 0 and info[2].ttl_s is None
    assert 99 < (info[0].ttl_s or 0) <= 100
    assert (info[1].ttl_s or 0) <= (info[0].ttl_s or 0)  # a tail expires first


def test_renew_restores_the_ttl_schedule_and_persist_without_ttl(fake_client: Any) -> None:
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=3600)
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(CHAINS[0])])
    for h in CHAINS[0]:
        fake_client.pexpire(buf.redis_key(h), 5_000)
    assert buf.renew(CHAINS[0] + ["0" * 32]) == len(CHAINS[0])  # a missing key is not renewed
    ttls = [fake_client.pttl(buf.redis_key(h)) for h in CHAINS[0]]
    assert all(3_599_000 < t <= 3_600_000 for t in ttls)
    assert ttls == sorted(ttls, reverse=True)
    forever = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=None)
    assert forever.renew(CHAINS[0][:2]) == 2
    assert fake_client.pttl(buf.redis_key(CHAINS[0][0])) == -1


def _record(name: str, chain: list[str], fps: list[str], model: str = "m") -> DocumentRecord:
    return DocumentRecord(name, len(chain) * BLOCK, chain, fps, model, text_hash="t")


def test_document_records_round_trip_and_outlive_their_blocks(fake_client: Any) -> None:
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=600)
    save_record(buf, _record("b.txt", CHAINS[0], ["f"]))
    save_record(buf, _record("a.txt", CHAINS[1], ["f", "g"], model="other"))
    key = buf.keys.document(CHAINS[0][-1], "f")
    assert parse_key(key) is not None and parse_key(key).kind == "document"  # type: ignore[union-attr]
    assert fake_client.pttl(key) > 600_000  # blocks get 600 s: volatile-ttl evicts them first
    fake_client.set("kv:w:f:doc:" + "1" * 32, b"{broken")
    records, unreadable = load_records(buf)
    assert [r.name for r in records] == ["a.txt", "b.txt"] and unreadable == 1
    assert records[1].chain == CHAINS[0] and records[0].fingerprints == ["f", "g"]
    assert [r.name for r in load_records(buf, model="other")[0]] == ["a.txt"]


def test_presence_counts_holes_and_the_usable_prefix(fake_client: Any) -> None:
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=60)
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(CHAINS[0])])
    buf.delete([CHAINS[0][1]])
    now = presence(buf, CHAINS[0], ["f"])
    assert (now.blocks, now.present, now.usable) == (4, 3, 1)
    assert now.fraction == 0.75 and now.bytes > 0 and 0 < (now.ttl_s or 0) <= 60


def test_presences_of_many_documents_batch_round_trips_and_agree_with_one_by_one(
    fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--check used one round trip per document; now bounded batches of keys."""
    import connector.warm.records

    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=60)
    docs = [chain_hashes(list(range(1000 * d, 1000 * d + 16 * 5)), 16) for d in range(6)]
    for d, chain in enumerate(docs):
        buf.insert_many([(h, small_block(i)) for i, h in enumerate(chain[: d % 5 + 1])])
    one_by_one = [presence(buf, chain, ["f"]) for chain in docs]
    monkeypatch.setattr(connector.warm.records, "PRESENCE_BATCH_KEYS", 12)
    calls: list[int] = []
    real = buf.block_info
    monkeypatch.setattr(buf, "block_info", lambda h, f=None: calls.append(len(h)) or real(h, f))
    batched = connector.warm.records.presences(buf, [(chain, ["f"]) for chain in docs])
    assert [(p.present, p.usable, p.bytes) for p in batched] == [
        (p.present, p.usable, p.bytes) for p in one_by_one
    ]
    assert len(calls) == 2 and max(calls) <= 12 + 5  # 30 keys in 2 trips, not 6


# ------------------------------------------------------------------------------ --check
def _check(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = cli.main(["--url", url, "--namespace", "w", "--check", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.redis
def test_check_reports_each_warmed_document_and_what_is_missing(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    buf = LookupBuffer.from_url(redis_url, namespace="w", fingerprint="f", ttl_s=600)
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    for name, chain in zip(("a.txt", "b.txt"), CHAINS, strict=True):
        buf.insert_many([(h, small_block(i)) for i, h in enumerate(chain)])
        rec = _record(str(tmp_path / name), chain, ["f"])
        rec.text_hash = Document(rec.name, (tmp_path / name).read_text()).text_hash
        save_record(buf, rec)
    rc, doc = _check(redis_url, capsys=capsys)
    assert rc == 0
    assert [(r["status"], r["present"], r["blocks"]) for r in doc["documents"]] == [
        ("complete", 4, 4),
        ("complete", 3, 3),
    ]
    assert all(0 < r["ttl_s"] <= 600 for r in doc["documents"])

    buf.delete([CHAINS[0][2]])  # a block of a.txt evicted
    (tmp_path / "b.txt").write_text("beta, edited")
    (tmp_path / "c.txt").write_text("never warmed")
    names = [str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt")]
    rc, doc = _check(redis_url, *names, capsys=capsys)
    rows = {Path(r["document"]).name: r for r in doc["documents"]}
    assert rc == 1
    assert rows["a.txt"]["status"] == "incomplete" and rows["a.txt"]["present"] == 3
    assert "usable prefix 2/4" in rows["a.txt"]["message"]
    assert "changed since it was warmed" in rows["b.txt"]["message"]
    assert rows["c.txt"]["status"] == "not warmed" and rows["c.txt"]["present"] == 0
    buf.close()


@pytest.mark.redis
def test_check_prints_a_table_people_can_read(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # piped, as a script reads it (pytest-xdist's workers set COLUMNS=80, which it honours)
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = LookupBuffer.from_url(redis_url, namespace="w", fingerprint="f", ttl_s=600)
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(CHAINS[0])])
    save_record(buf, _record("manual.txt", CHAINS[0], ["f"]))
    buf.close()
    # (the URL from the environment, as kvstore's: a password stays out of the process list)
    monkeypatch.setenv("KVSTORE_URL", redis_url)
    assert cli.main(["--namespace", "w", "--check"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "manual.txt" in ln)
    assert "100%" in line and "complete" in line and "KiB" in line and "4" in line


@pytest.mark.redis
def test_check_with_nothing_warmed_fails_and_says_so(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--url", redis_url, "--namespace", "w", "--check"]) == 1
    assert "no warmed documents in namespace 'w'" in capsys.readouterr().out


def test_check_on_a_store_that_is_down_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--url", "redis://127.0.0.1:1/0", "--check"]) == 2
    assert "connector.warm: " in capsys.readouterr().err


# ------------------------------------------------------------------------------ the warm loop
class StandInEngine:
    """Does what the warm engine's connector does, without vLLM: writes a prompt's blocks and
    a commit record counting the leading blocks it wrote. ``short_first``: documents whose
    first attempt writes only half their blocks (saves shed); ``never``: documents whose saves
    always fail; ``crash_after``: the engine dies after this many documents."""

    def __init__(self, store: LookupBuffer, short_first=(), never=(), crash_after=None) -> None:
        self.layout = StoreLayout("w", BLOCK, ["f"], "stand-in")
        self.store, self.short_first, self.never = store, set(short_first), set(never)
        self.crash_after = crash_after
        self.attempts: dict[tuple[int, ...], int] = {}
        self.done = 0

    def prefill(self, prompts, in_flight) -> Iterator[list[Finished]]:
        for key, tokens in prompts:
            if self.crash_after is not None and self.done >= self.crash_after:
                raise RuntimeError("engine core died")
            chain = chain_hashes(tokens, BLOCK)
            n = self.attempts[tuple(tokens)] = self.attempts.get(tuple(tokens), 0) + 1
            first = tokens[0]
            upto = 0 if first in self.never else len(chain)
            if first in self.short_first and n == 1:
                upto = len(chain) // 2
            if upto:
                self.store.insert_many([(h, small_block(i)) for i, h in enumerate(chain[:upto])])
            handoff = f"h{first}x{n}"
            self.store.publish_handoff(handoff, upto)
            self.done += 1
            yield [Finished(key, {"handoff": handoff, "num_blocks": upto})]


def _rows(buf: LookupBuffer, docs: dict[int, int]) -> list[cli.Row]:
    rows = []
    for first, n in docs.items():
        tokens = [first, *range(1000, 1000 + BLOCK * n - 1)]
        row = cli.Row(f"doc{first}", "todo", tokens=len(tokens), doc=Document(f"doc{first}", "t"))
        row.token_ids, row.chain = tokens, chain_hashes(tokens, BLOCK)
        row.blocks = len(row.chain)
        rows.append(row)
    return rows


def test_short_writes_are_prefilled_again_and_persistent_failures_reported(
    fake_client: Any,
) -> None:
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=600)
    engine = StandInEngine(buf, short_first={2}, never={3})
    rows = _rows(buf, {1: 3, 2: 4, 3: 2})
    cli._run(engine, buf, rows, in_flight=2, quiet=True)  # type: ignore[arg-type]
    by = {r.document: r for r in rows}
    assert (by["doc1"].status, by["doc1"].stored, by["doc1"].attempts) == ("stored", 3, 1)
    assert (by["doc2"].status, by["doc2"].stored, by["doc2"].attempts) == ("stored", 4, 2)
    assert by["doc3"].status == "partial" and by["doc3"].stored == 0
    assert "2 of 2 blocks could not be written" in by["doc3"].message
    assert by["doc3"].attempts == cli.RETRIES + 1
    assert all(r.bytes > 0 for r in (by["doc1"], by["doc2"]))
    # every document tried has a record, so --check shows the partial one as incomplete
    records = {r.name: r for r in load_records(buf)[0]}
    assert sorted(records) == ["doc1", "doc2", "doc3"]
    assert presence(buf, records["doc3"].chain, ["f"]).present == 0


def test_an_engine_crash_leaves_no_document_unaccounted(fake_client: Any) -> None:
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=600)
    rows = _rows(buf, {1: 2, 2: 2, 3: 2})
    with pytest.raises(RuntimeError, match="engine core died"):
        cli._run(StandInEngine(buf, crash_after=1), buf, rows, in_flight=1, quiet=True)  # type: ignore[arg-type]
    assert [r.status for r in rows] == ["stored", "failed", "failed"]
    assert "the engine failed: RuntimeError" in rows[1].message


def test_a_commit_record_that_never_comes_falls_back_to_what_is_present(
    fake_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = LookupBuffer(fake_client, namespace="w", fingerprint="f", ttl_s=600)
    rows = _rows(buf, {1: 3})
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(rows[0].chain)])
    rows[0].handoff, rows[0].finished = "neverwritten", time.perf_counter() - 1
    monkeypatch.setattr(cli, "COMMIT_WAIT_S", 0.5)
    assert cli._confirmed(buf, StoreLayout("w", BLOCK, ["f"], "m"), [rows[0]]) == [rows[0]]
    assert rows[0].status == "stored" and rows[0].stored == 3


# ------------------------------------------------------------------------------ warm's arguments
@pytest.fixture
def engine_options() -> None:
    """vLLM builds its engine options for the platform it runs on; a CUDA build on a machine
    without a GPU (vLLM 0.33 in CI) cannot name one, and a warm engine could not run there."""
    try:
        cli.parse_args(["--model", "/m"])
    except RuntimeError as exc:
        if "infer device type" not in str(exc):
            raise
        pytest.skip(f"vLLM cannot build its engine options here: {exc}")


@pytest.mark.vllm
@pytest.mark.usefixtures("engine_options")
def test_engine_options_pass_through_and_the_servers_connector_config_is_the_base() -> None:
    served = {
        "kv_connector": "RedisConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "url": "redis://served:6379/0",
            "namespace": "team",
            "model_id": "llama-3-8b",
            "mode": "consume",
        },
    }
    args, engine = cli.parse_args(
        ["--model", "/m", "--dtype", "float16", "--tensor-parallel-size", "2", "doc.txt",
         "--kv-transfer-config", json.dumps(served), "--ttl", "0"]
    )  # fmt: skip
    assert args.documents == ["doc.txt"]
    assert (engine["model"], engine["dtype"], engine["tensor_parallel_size"]) == (
        "/m",
        "float16",
        2,
    )
    config = cli.connector_config(args, engine)
    assert "kv_transfer_config" not in engine  # the warm engine sets its own
    # the URL: --url, else the servers' config (as here), else $KVSTORE_URL
    args_alone, _ = cli.parse_args(["--model", "/m", "doc.txt"])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVSTORE_URL", "redis://from-env:6379/0")
        assert cli.connector_config(args_alone, {})["url"] == "redis://from-env:6379/0"
    assert config == {
        "url": "redis://served:6379/0",
        "namespace": "team",
        "model_id": "llama-3-8b",
        "ttl_s": None,
    }


@pytest.mark.vllm
@pytest.mark.usefixtures("engine_options")
def test_a_store_that_is_down_stops_the_warm_before_any_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from connector.warm import engine

    def no_engine(*a: object, **k: object) -> None:
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine.WarmEngine, "__init__", no_engine)
    (tmp_path / "d.txt").write_text("text")
    rc = cli.main(["--model", "/m", "--url", "redis://127.0.0.1:1/0", str(tmp_path / "d.txt")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "127.0.0.1:1" in err and "Nothing was warmed" in err


@pytest.mark.vllm
@pytest.mark.redis
@pytest.mark.usefixtures("engine_options")
def test_a_wrong_password_stops_the_warm_before_any_engine_starts(
    private_redis: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from connector.warm import engine

    monkeypatch.setattr(engine.WarmEngine, "__init__", lambda *a, **k: pytest.fail("started"))
    redis.Redis.from_url(private_redis.url).config_set("requirepass", "right")
    url = private_redis.url.replace("redis://", "redis://:wrong@")
    (tmp_path / "d.txt").write_text("text")
    assert cli.main(["--model", "/m", "--url", url, str(tmp_path / "d.txt")]) == 2
    err = capsys.readouterr().err
    assert "password" in err and "Nothing was warmed" in err
    assert "wrong" not in err  # the password never reaches the message


def test_the_documented_acl_rule_for_the_warm_command_covers_what_it_checks() -> None:
    from kvstore.fleet.access import acl_rule

    readme = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("| `connector.warm` |"))
    needed = acl_rule(cli.OPERATIONS).split(" ~")[0].split()
    assert needed and all(f"{perm} " in line for perm in needed), (needed, line)


def test_the_warm_report_table_shows_each_document_and_the_total(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rich.console import Console

    rows = [
        cli.Row("a.txt", "stored", tokens=1222, blocks=9, stored=9, bytes=1_153_434, seconds=1.1),
        cli.Row("b.txt", "short", tokens=4, message="shorter than one block"),
    ]
    cli._print(Console(width=120), rows, False, "vllm", ["f"], "m", "warm")
    lines = capsys.readouterr().out.splitlines()
    a = next(ln for ln in lines if "a.txt" in ln)
    assert "1,222" in a and "1.1 MiB" in a and "stored" in a
    assert "short: shorter than one block" in next(ln for ln in lines if "b.txt" in ln)
    assert "1,226" in next(ln for ln in lines if "total" in ln)


@pytest.mark.redis
def test_warm_and_check_name_blocks_in_the_namespaces_generation(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a reset the connector loads only the new generation's blocks. --check reported
    the old ones as present, and warm skipped the prefill of a document stored only there, or
    found 0 of the blocks it had just stored."""
    from types import SimpleNamespace

    from kvstore.values.keys import block_name

    buf = LookupBuffer.from_url(redis_url, namespace="w", fingerprint="f", ttl_s=600)
    (tmp_path / "a.txt").write_text("alpha")
    chain = CHAINS[0]
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(chain)])
    rec = _record(str(tmp_path / "a.txt"), chain, ["f"])
    rec.text_hash = Document(rec.name, "alpha").text_hash
    save_record(buf, rec)
    assert _check(redis_url, capsys=capsys)[1]["documents"][0]["status"] == "complete"
    assert buf.reset() == 1
    rc, doc = _check(redis_url, capsys=capsys)
    assert rc == 1 and doc["documents"][0]["status"] == "incomplete"
    assert doc["documents"][0]["present"] == 0  # the old blocks are still there, unloadable

    tokens = list(range(0, BLOCK * 4))  # CHAINS[0]'s tokens
    eng = SimpleNamespace(
        layout=StoreLayout("w", BLOCK, ["f"], "m"),
        tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens: tokens),
        max_model_len=10_000,
    )
    (row,) = cli._plan(eng, buf, [Document("a", "alpha")], PromptStyle())  # type: ignore[arg-type]
    assert row.status == "todo" and row.chain == [block_name(h, 1) for h in chain]
    buf.insert_many([(h, small_block(i)) for i, h in enumerate(row.chain)])  # as the engine saves
    (row,) = cli._plan(eng, buf, [Document("a", "alpha")], PromptStyle())  # type: ignore[arg-type]
    assert row.status == "present" and row.present == 4
    assert _check(redis_url, capsys=capsys)[1]["documents"][0]["status"] == "complete"
    buf.close()


@pytest.mark.redis
def test_a_record_larger_than_a_control_reply_is_a_problem_not_the_end_of_the_check(
    redis_url: str,
) -> None:
    """A planted 5 MiB record on a real server: kvstore bounds the replies redis-py parses at
    4 MiB, so reading it whole dropped the connection and ended the whole check. A record is
    refused by its size first, below that bound, and listed."""
    from connector.warm.records import MAX_RECORD_BYTES, read_records

    with LookupBuffer.from_url(redis_url, namespace="w", fingerprint="fp") as buf:
        buf.client.set("kv:w:fp:doc:planted", b"{" * (5 << 20))
        buf.client.set("kv:w:fp:doc:small", b"[]")
        records, problems = read_records(buf)
    assert records == []
    named = {p.key: p.problem for p in problems}
    assert "more than a record holds" in named["kv:w:fp:doc:planted"]
    assert "kv:w:fp:doc:small" in named  # the others are still checked
    assert MAX_RECORD_BYTES < 4 << 20
