"""Block presence for routers (``connector.presence``): the Python function, the ``kvstore
present`` command and the proxy's ``POST /kv/presence``, against a real redis-server. That the
answer matches what a real vLLM engine saved is checked in test_e2e_presence.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from connector.presence import StoredLayout, prompt_presence
from connector.proxy.server import ProxyConfig, build_app
from kvstore import LookupBuffer, chain_hashes
from kvstore.values.keys import block_name
from testing.proxy_servers import run_server
from testing.redis_server import free_port

pytestmark = pytest.mark.redis
BS = 16
TOKENS = list(range(7 * BS + 5))  # 7 full blocks


def value() -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(4)}


def layout_doc(groups: list[dict] | None = None, fps: tuple[str, ...] = ("fp0",)) -> dict:
    doc: dict = {"namespace": "ns", "block_size": BS, "fingerprints": list(fps)}
    if groups is not None:
        doc["groups"] = groups
    return doc


@pytest.fixture
def layout_file(tmp_path: Path) -> Path:
    """The one-group layout, as the connector writes it to $REDIS_KV_CONNECTOR_LAYOUT_FILE."""
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(layout_doc()))
    return path


@pytest.fixture
def store(redis_url: str) -> Iterator[LookupBuffer]:
    with LookupBuffer.from_url(redis_url, namespace="ns", fingerprint="fp0") as buf:
        yield buf


def test_leading_blocks_every_tp_slice_holds_are_loadable(store: LookupBuffer) -> None:
    hashes = chain_hashes(TOKENS, BS)
    other = store.for_fingerprint("fp1")
    store.insert_many([(h, value()) for h in hashes[:5]])
    other.insert_many([(h, value()) for h in hashes[:3]])  # the second slice has fewer
    one = prompt_presence(store, StoredLayout.from_dict(layout_doc()), TOKENS)
    assert one.blocks == [True] * 5 + [False] * 2 and one.loadable_blocks == 5
    two = StoredLayout.from_dict(layout_doc(fps=("fp0", "fp1")))
    assert prompt_presence(store, two, TOKENS).loadable_blocks == 3
    # never the prompt's last token: a prompt of exactly 5 blocks loads 4
    assert (
        prompt_presence(store, StoredLayout.from_dict(layout_doc()), TOKENS[: 5 * BS]).as_dict()[
            "loadable_tokens"
        ]
        == 4 * BS
    )


def test_a_hybrid_models_hit_needs_what_its_groups_need(store: LookupBuffer) -> None:
    """A full-attention group needs every block, a 2-block sliding window only the last two, a
    state group only the state at the hit's end."""
    hashes = chain_hashes(TOKENS, BS)
    groups = [
        {"index": 0, "kind": "full"},
        {"index": 1, "kind": f"sliding_window={2 * BS}"},
        {"index": 2, "kind": "state=GDN_ATTN"},
    ]
    layout = StoredLayout.from_dict(layout_doc(groups))
    store.insert_many([(f"{h}.g0", value()) for h in hashes[:6]])
    store.insert_many([(f"{hashes[p]}.g1", value()) for p in (3, 4)])  # window of a 5-block hit
    store.insert(f"{hashes[4]}.g2", value())  # the state after 5 blocks
    found = prompt_presence(store, layout, TOKENS)
    assert found.loadable_blocks == 5
    assert found.blocks == [False] * 4 + [True] + [False] * 2  # every group only at 4


def test_a_reset_empties_the_answer_within_one_question(
    store: LookupBuffer, redis_url: str
) -> None:
    layout = StoredLayout.from_dict(layout_doc())
    store.insert_many([(h, value()) for h in chain_hashes(TOKENS, BS)[:4]])
    asker = LookupBuffer.from_url(redis_url, namespace="ns", fingerprint="fp0")
    assert prompt_presence(asker, layout, TOKENS).loadable_blocks == 4
    store.reset()
    found = prompt_presence(asker, layout, TOKENS)  # asker has not heard of the reset before
    assert (found.loadable_blocks, found.generation) == (0, 1)
    store.insert(block_name(chain_hashes(TOKENS, BS)[0], 1), value())
    assert prompt_presence(asker, layout, TOKENS).loadable_blocks == 1
    asker.close()


def test_the_kvstore_command_answers_and_rejects_bad_input(
    store: LookupBuffer, redis_url: str, layout_file: Path
) -> None:
    store.insert_many([(h, value()) for h in chain_hashes(TOKENS, BS)[:2]])
    kvstore = [sys.executable, "-m", "kvstore", "--url", redis_url]
    presence = [sys.executable, "-m", "connector.presence_cli", "--url", redis_url]
    ids = ",".join(map(str, TOKENS))
    out = subprocess.run(
        [*presence, "--layout", str(layout_file), "--tokens", ids, "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout)["loadable_blocks"] == 2
    bad = subprocess.run(
        [*presence, "--layout", str(layout_file), "--tokens", "1,x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "token ids must be a list of integers" in bad.stderr
    moved = subprocess.run(
        [*kvstore, "present", "--layout", str(layout_file), "--tokens", ids],
        capture_output=True, text=True,
    )  # fmt: skip
    assert moved.returncode == 2 and "vllm-redis-presence" in moved.stderr
    reset = subprocess.run(
        [*kvstore, "reset", "--namespace", "ns", "--json"], capture_output=True, text=True
    )
    assert json.loads(reset.stdout) == {"namespace": "ns", "generation": 1, "unlinked": 2}


def test_the_proxy_answers_presence_and_says_what_is_missing(
    store: LookupBuffer, redis_url: str, layout_file: Path, tmp_path: Path
) -> None:
    store.insert_many([(h, value()) for h in chain_hashes(TOKENS, BS)[:3]])
    cfg = ProxyConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], redis_url=redis_url,
                      layout_file=str(layout_file), enable_kv_presence=True)  # fmt: skip
    gen = run_server(build_app(cfg))
    url = next(gen)
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/kv/presence", json={"token_ids": TOKENS})
            assert r.status_code == 200 and r.json()["loadable_blocks"] == 3
            bad = c.post("/kv/presence", json={"token_ids": "nope"})
            assert bad.status_code == 400
            down = c.post("/kv/presence", json={"prompt": "hello"})  # no decode server to tokenize
            assert down.status_code == 502
    finally:
        next(gen, None)
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    r = presence_through_a_proxy(redis_url, str(broken))
    assert r.status_code == 500 and "not a connector layout" in r.json()["error"]["message"]
    # Redis down: the caller is told so, not where Redis is or as whom the proxy logs in
    gone = f"redis://router:pw@127.0.0.1:{free_port()}/0"
    r = presence_through_a_proxy(gone, str(layout_file))
    assert r.status_code == 503 and "log" in r.json()["error"]["message"]
    assert "127.0.0.1" not in r.text and "router" not in r.text
    r = presence_through_a_proxy(None, None)
    assert r.status_code == 501 and "--redis-url" in r.json()["error"]["message"]


def presence_through_a_proxy(redis_url: str | None, layout_file: str | None) -> httpx.Response:
    """``POST /kv/presence`` of TOKENS to a proxy of that store and layout (backends down)."""
    cfg = ProxyConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], redis_url=redis_url,
                      layout_file=layout_file, enable_kv_presence=True)  # fmt: skip
    gen = run_server(build_app(cfg))
    try:
        with httpx.Client(base_url=next(gen), timeout=30) as c:
            return c.post("/kv/presence", json={"token_ids": TOKENS})
    finally:
        next(gen, None)


def test_a_salted_prompt_is_found_with_the_salt_the_connector_gives_its_request(
    store: LookupBuffer, redis_url: str, layout_file: Path
) -> None:
    """A request with a cache_salt and a LoRA adapter is chained under a salt: a router asking
    for it passes the same fields (CLI, HTTP) and gets what the connector would load."""
    from types import SimpleNamespace

    from connector.chains import request_salt
    from connector.presence import prompt_salt

    request = SimpleNamespace(
        lora_request=SimpleNamespace(lora_name="sql", lora_path="/adapters/sql"),
        cache_salt="tenant-a",
        mm_features=[],
    )
    salt = request_salt(request)  # type: ignore[arg-type]
    assert salt == prompt_salt(lora_name="sql", lora_path="/adapters/sql", cache_salt="tenant-a")
    store.insert_many([(h, value()) for h in chain_hashes(TOKENS, BS, salt)[:4]])
    layout = StoredLayout.from_file(layout_file)
    assert prompt_presence(store, layout, TOKENS).loadable_blocks == 0  # unsalted: other keys
    assert prompt_presence(store, layout, TOKENS, salt).loadable_blocks == 4
    presence = [sys.executable, "-m", "connector.presence_cli", "--url", redis_url]
    out = subprocess.run(
        [*presence, "--layout", str(layout_file), "--tokens", ",".join(map(str, TOKENS)),
         "--cache-salt", "tenant-a", "--lora-name", "sql", "--lora-path", "/adapters/sql",
         "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout)["loadable_blocks"] == 4
    path_only = subprocess.run(
        [*presence, "--layout", str(layout_file), "--tokens", "1,2", "--lora-path", "/x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert path_only.returncode == 2 and "lora_name" in path_only.stderr
    cfg = ProxyConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], redis_url=redis_url,
                      layout_file=str(layout_file), enable_kv_presence=True)  # fmt: skip
    gen = run_server(build_app(cfg))
    try:
        with httpx.Client(base_url=next(gen), timeout=30) as c:
            body = {"token_ids": TOKENS, "cache_salt": "tenant-a", "lora_name": "sql",
                    "lora_path": "/adapters/sql"}  # fmt: skip
            assert c.post("/kv/presence", json=body).json()["loadable_blocks"] == 4
            assert c.post("/kv/presence", json={"token_ids": TOKENS}).json()["loadable_blocks"] == 0
            bad = c.post("/kv/presence", json={"token_ids": TOKENS, "cache_salt": 7})
            assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
            path_only = c.post("/kv/presence", json={"token_ids": TOKENS, "lora_path": "/x"})
            assert path_only.status_code == 400 and "lora_name" in path_only.text
    finally:
        next(gen, None)
