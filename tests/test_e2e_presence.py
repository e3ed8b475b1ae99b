"""Resets and block presence on a real vLLM CPU engine: the presence API agrees with the blocks
the engine saved and the loader then loads; after ``reset_prefix_cache(reset_connector=True)``
the engine loads nothing saved before it, saves under the new generation, and a fresh instance
loads those."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstore import LookupBuffer
from kvstore.keys import parse_key
from kvstore.presence import StoredLayout, prompt_presence
from testing.redis_server import RedisServer

from .e2e_helpers import PATIENT, finish, release, start_engine, tokens, wait_at_gate

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm]

BLOCK = 128  # vLLM's default block size on CPU
PROMPT = tokens(5 * BLOCK + 40, 11)  # 5 full blocks: a loader may load all 5
SHARE = {"role": "kv_both", "extra": {"mode": "share", **PATIENT}}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("presence")
    out: dict[str, Any] = {}
    p = [{"id": "p", "prompt_token_ids": PROMPT}]
    q = [{"id": "q", "prompt_token_ids": PROMPT}]
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        layout_file = tmp / "layout.json"
        gate = tmp / "before-reset"
        saver = start_engine(
            tmp, "saver", tiny_model, [p, "reset", q], core=0, url=server.url, **SHARE,
            gates={1: gate}, layout_file=layout_file,
        )  # fmt: skip
        wait_at_gate(gate)
        layout = StoredLayout.from_file(layout_file)
        with LookupBuffer.from_url(server.url, namespace=layout.namespace) as store:
            out["before"] = prompt_presence(store, layout, PROMPT)
            out["keys_before"] = sorted(k.decode() for k in client.scan_iter("kv:*"))
            release(gate)
            out["saver"] = finish(saver)
            out["after"] = prompt_presence(store, layout, PROMPT)
        out["keys_after"] = sorted(k.decode() for k in client.scan_iter("kv:*"))
        loader = start_engine(tmp, "loader", tiny_model, [p], core=1, url=server.url, **SHARE)
        out["loader"] = finish(loader)
        out["layout"] = json.loads(layout_file.read_text())
    return out


def blocks_of(keys: list[str]) -> list[Any]:
    parsed = [parse_key(k) for k in keys]
    return [k for k in parsed if k is not None and k.kind == "block"]


def test_presence_agrees_with_what_the_engine_saved(run: dict[str, Any]) -> None:
    before = run["before"]
    assert before.blocks == [True] * 5 and before.loadable_blocks == 5
    assert len(blocks_of(run["keys_before"])) == 5  # the 5 blocks it says, no others
    assert before.generation == 0


def test_after_a_reset_the_engine_loads_nothing_from_before_and_saves_anew(
    run: dict[str, Any],
) -> None:
    saver = run["saver"]
    assert saver["resets"] == [True]
    # vLLM's own prefix cache was reset too: the prompt is computed in full, nothing loaded
    assert saver["prompts"]["q"]["num_cached_tokens"] == 0
    assert saver["prompts"]["q"]["token_ids"] == saver["prompts"]["p"]["token_ids"]
    blocks = blocks_of(run["keys_after"])
    assert sorted(b.generation for b in blocks) == [1] * 5  # the older ones were unlinked
    after = run["after"]
    assert (after.generation, after.loadable_blocks) == (1, 5)


def test_a_fresh_instance_loads_what_was_saved_after_the_reset(run: dict[str, Any]) -> None:
    loaded = run["loader"]["prompts"]["p"]
    assert loaded["num_cached_tokens"] == 5 * BLOCK
    assert loaded["token_ids"] == run["saver"]["prompts"]["p"]["token_ids"]
