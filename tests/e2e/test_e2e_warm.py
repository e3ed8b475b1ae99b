"""``python -m connector.warm`` on real vLLM CPU engines: a corpus is warmed into Redis, then a
share-mode server that has never seen it answers completion and chat requests that start with
its documents. Its answers equal a server without any connector, and nearly every loadable
block comes from Redis. A second warm run prefills nothing; ``--check`` reports what is left,
0% after ``kvstore flush``."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from testing import stack
from testing.e2e import ROOT, engine_env, zygote
from testing.redis_server import RedisServer, free_port
from testing.zygote import ZygoteChild

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

BLOCK = 128  # vLLM's default block size on CPU; the tiny model's tokenizer: 1 byte = 1 token
NAMESPACE = "docs"
SYSTEM = "Answer from the document."
WORDS = ["redis", "cache", "block", "token", "prefill", "decode", "layer", "head", "store", "key"]
QUESTION = "\n\nQuestion: which word comes most often?\nAnswer:"


def _text(n_words: int, seed: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n_words))


def _warm(tmp: Path, name: str, url: str, model: Path, args: list[str], core: int):
    """``python -m connector.warm``: forked from the zygote (and so are its engine core and
    worker), its JSON on stdout in NAME.json."""
    argv = ["-m", "connector.warm", "--model", str(model), "--url", url]
    argv += ["--namespace", NAMESPACE, "--enforce-eager", "--max-model-len", "2048"]
    argv += ["--in-flight", "1", "--json", *args]
    env = {**os.environ, **engine_env(core)}
    out, err = tmp / f"{name}.json", tmp / f"{name}.log"
    forks = zygote()
    if forks is not None:
        return forks.spawn(argv, env, tmp, err, stdout=out), tmp / name
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *argv], stdout=stdout, stderr=stderr, env=env, cwd=tmp,
            start_new_session=True,  # (its engine core and worker: stopped with it, by group)
        )  # fmt: skip
    return proc, tmp / name


def _stop_if_running(job: tuple[subprocess.Popen | ZygoteChild, Path]) -> None:
    """A warm run still going when the fixture ends (a run before it failed): it and the engine
    it started are killed, not left computing beside the next tests."""
    proc, _ = job
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # (the next runs are stopped too)
            proc.wait(timeout=60)


def _result(
    job: tuple[subprocess.Popen | ZygoteChild, Path], timeout_s: float = 600
) -> tuple[int, dict]:
    proc, base = job
    rc = proc.wait(timeout=timeout_s)
    out = Path(str(base) + ".json").read_text()
    try:
        return rc, json.loads(out)
    except ValueError:
        log = Path(str(base) + ".log").read_text()[-6000:]
        raise AssertionError(
            f"{base.name} (rc={rc}) printed no JSON:\n{out[-2000:]}\n{log}"
        ) from None


def _check(url: str, docs: list[str], cwd: Path) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "connector.warm", "--url", url, "--namespace", NAMESPACE]
    cmd += ["--check", "--json", *docs]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    return res.returncode, json.loads(res.stdout)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("warm")
    corpus = tmp / "corpus"
    corpus.mkdir()
    docs = {f"corpus/manual{i}.txt": _text(150 + 60 * i, i) for i in range(3)}
    for name, text in docs.items():
        (tmp / name).write_text(text)
    (tmp / "corpus" / "note.txt").write_text("too short")
    (tmp / "corpus" / "scan.txt").write_bytes(b"\xff\xfe not text")
    jsonl = {"faq": _text(200, 10), "huge": "x" * 3000}
    (tmp / "more.jsonl").write_text(
        "".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in jsonl.items())
    )
    docs["more.jsonl#faq"] = jsonl["faq"]
    s = stack.Stack()
    runs: list[tuple[subprocess.Popen | ZygoteChild, Path]] = []
    with RedisServer() as server:
        try:
            url = server.url
            common = {"model": str(tiny_model), "redis_url": url, "log_dir": tmp,
                      "fork_from": zygote()}  # fmt: skip
            ref = s.add(stack.vllm_server("reference", port=free_port(), role=None, core=1,
                                          **common))  # fmt: skip
            runs.append(_warm(tmp, "first", url, tiny_model, ["corpus", "more.jsonl"], 0))
            first = _result(runs[-1])
            again = _warm(tmp, "again", url, tiny_model, ["corpus", "more.jsonl"], 1)
            runs.append(again)
            chat = _warm(tmp, "chat", url, tiny_model, ["--system", SYSTEM, "corpus"], 0)
            runs.append(chat)
            res = {"first": first, "again": _result(again), "chat": _result(chat)}
            res["check_before"] = _check(url, ["corpus", "more.jsonl"], tmp)
            share = s.add(stack.vllm_server("share", port=free_port(), role="kv_both", core=0,
                                            extra_config={"namespace": NAMESPACE},
                                            **common))  # fmt: skip
            stack.wait_healthy([ref, share], timeout_s=600)
            res.update(url=url, docs=docs, share=share.url, reference=ref.url, tmp=tmp)
            yield res
        finally:
            for run in runs:
                _stop_if_running(run)
            s.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _rows(result: tuple[int, dict]) -> dict[str, dict]:
    return {row["document"]: row for row in result[1]["documents"]}


def test_warm_stores_every_readable_document_and_explains_the_rest(warmed: dict) -> None:
    rc, _ = warmed["first"]
    rows = _rows(warmed["first"])
    assert rc == 1  # some documents could not be warmed: the exit status says so
    for name, text in warmed["docs"].items():
        row = rows[name]
        assert row["status"] == "stored", row
        assert row["tokens"] == len(text)  # a byte-level tokenizer, no special tokens added
        assert row["blocks"] == len(text) // BLOCK == row["stored"] > 0
        assert row["bytes"] > 0
    assert rows["corpus/note.txt"]["status"] == "short"
    assert "shorter than one block" in rows["corpus/note.txt"]["message"]
    assert rows["corpus/scan.txt"]["status"] == "failed"
    assert "not UTF-8" in rows["corpus/scan.txt"]["message"]
    assert rows["more.jsonl#huge"]["status"] == "failed"
    assert "longer than the model's context (2048)" in rows["more.jsonl#huge"]["message"]


def test_a_second_run_prefills_nothing(warmed: dict) -> None:
    rc, doc = warmed["again"]
    rows = _rows(warmed["again"])
    assert rc == 1  # the unreadable documents are reported again
    assert doc["fingerprints"] == warmed["first"][1]["fingerprints"]
    for name in warmed["docs"]:
        assert rows[name]["status"] == "present", rows[name]
        assert rows[name]["stored"] == 0
        assert rows[name]["present"] == rows[name]["blocks"] > 0
    assert doc["totals"]["stored"] == 0


def _complete(url: str, prompt: str) -> tuple[str, int]:
    reply = _client(url).completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0
    )
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].text, (details.cached_tokens or 0) if details else 0


def _chat(url: str, document: str) -> tuple[str, int]:
    reply = _client(url).chat.completions.create(
        model="tiny-llama",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": document + QUESTION},
        ],
        max_tokens=8,
        temperature=0,
    )
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].message.content or "", (details.cached_tokens or 0) if details else 0


def test_a_share_server_answers_warmed_documents_from_redis(warmed: dict) -> None:
    """Completion requests that start with a warmed document: the same text as a server without
    the connector, and at least 90% of the blocks a request can load come from Redis (the share
    server has never seen the documents: every cached token it reports is a Redis hit). The
    server's first hit is not counted: a fresh instance knows nothing of the store yet, so its
    load policy recomputes that one while background probes measure the store."""
    loadable = loaded = 0
    for i, (name, text) in enumerate(warmed["docs"].items()):
        prompt = text + QUESTION
        _complete(warmed["reference"], prompt)  # the reference's warm run is compared with
        expected, _ = _complete(warmed["reference"], prompt)
        got, cached = _complete(warmed["share"], prompt)
        assert got == expected, name
        if i > 0:
            loadable += _rows(warmed["first"])[name]["blocks"] * BLOCK
            loaded += cached
    assert loaded >= 0.9 * loadable > 0, (loaded, loadable)


def test_chat_requests_hit_documents_warmed_with_the_chat_template(warmed: dict) -> None:
    rows = _rows(warmed["chat"])
    loadable = loaded = 0
    for name, text in warmed["docs"].items():
        if not name.startswith("corpus/"):
            continue
        assert rows[name]["status"] == "stored", rows[name]
        _chat(warmed["reference"], text)
        expected, _ = _chat(warmed["reference"], text)
        got, cached = _chat(warmed["share"], text)
        assert got == expected, name
        loadable += rows[name]["blocks"] * BLOCK
        loaded += cached
    assert loaded >= 0.9 * loadable > 0, (loaded, loadable)


def test_check_reports_what_is_left_and_zero_after_a_flush(warmed: dict) -> None:
    rc, doc = warmed["check_before"]
    rows = _rows(warmed["check_before"])
    assert rc == 1  # the unreadable and too-long documents were never warmed
    for name in warmed["docs"]:
        assert rows[name]["status"] == "complete", rows[name]
        assert rows[name]["present"] == rows[name]["blocks"] > 0
        assert 0 < rows[name]["ttl_s"] <= 86_400
    assert rows["corpus/scan.txt"]["status"] == "not warmed"

    flush = [sys.executable, "-m", "kvstore", "--url", warmed["url"], "flush"]
    subprocess.run([*flush, "--namespace", NAMESPACE, "--yes"], check=True, cwd=ROOT)
    rc, doc = _check(warmed["url"], ["corpus", "more.jsonl"], warmed["tmp"])
    rows = _rows((rc, doc))
    assert rc == 1
    assert [rows[name]["present"] for name in warmed["docs"]] == [0] * len(warmed["docs"])
    assert {r["status"] for r in doc["documents"]} == {"not warmed"}
