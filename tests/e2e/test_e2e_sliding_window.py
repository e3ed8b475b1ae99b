"""A model mixing full-attention and sliding-window layers, with vLLM's hybrid KV-cache manager
on (the connector declares ``SupportsHMA``): each layer kind has a KV-cache group of its own,
and a sliding-window group keeps blocks only for its window.

Engines on a tiny Llama whose odd layers see only their last 192 tokens, each its own process
pinned to one core (two run at a time):
- ``plain``: no connector; a 700-token prompt, then prompts sharing its first 640 tokens (five
  128-token blocks), which vLLM's local prefix cache serves; then all of them again, warm;
- ``saver``: the same prompts, a share-mode connector against an empty Redis: it saves every
  group's blocks, each under its own key (``<hash>.g0``, ``<hash>.g1``);
- ``loader``: a fresh share-mode instance given only the prompts sharing the prefix: it loads
  all five blocks of the full-attention group, and of the sliding-window group only the blocks
  vLLM allocates for the window before the hit's end (the rest hold vLLM's null block);
- ``prod`` and ``cons``: disaggregated prefill in consume mode: the producer hands each prompt
  off, the consumer loads every group's handed-off blocks and deletes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testing.e2e import assert_loaded_like_plain, family_runs, make_model, tokens

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm]

BLOCK = 128  # the CPU backend's block size
WINDOW = 192
PREFIX = tokens(640, 1)
FIRST = {"first": PREFIX + tokens(60, 2)}
SHARING = {f"share{i}": PREFIX + tokens(60, 10 + i) for i in range(3)}
RUN = {"max_tokens": 16, "core": 0}
HMA_OFF_WARNING = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(
        tmp_path_factory, "tiny-sliding", "--layers", "4", "--sliding-window", str(WINDOW)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, sliding_model: Path) -> dict[str, Any]:
    return family_runs(tmp_path_factory.mktemp("sliding"), sliding_model, FIRST, SHARING, **RUN)


def test_the_hybrid_kv_cache_manager_stays_on(runs: dict[str, Any]) -> None:
    assert "RedisConnector" in runs["saver_log"]
    assert HMA_OFF_WARNING not in runs["saver_log"]


def test_each_group_block_is_its_own_key(runs: dict[str, Any]) -> None:
    blocks = [k for k in runs["keys"] if k.startswith("kv:vllm:") and ".g" in k]
    full = [k for k in blocks if k.endswith(".g0")]
    window = [k for k in blocks if k.endswith(".g1")]
    # 5 full blocks of the shared prefix, none of the 60-token tails; every group saved them all
    assert len(full) == 5 and len(window) == 5, runs["keys"]
    assert {k[: -len(".g0")] for k in full} == {k[: -len(".g1")] for k in window}


def test_outputs_with_the_connector_match_a_connector_less_server(runs: dict[str, Any]) -> None:
    for pid in FIRST | SHARING:
        want = runs["plain"]["prompts"][pid]
        got = runs["saver"]["prompts"][pid]
        assert got["token_ids"] == want["token_ids"], pid
        assert got["logprobs"] == want["logprobs"], pid


def test_a_server_loading_the_prefix_from_redis_answers_the_same(runs: dict[str, Any]) -> None:
    distinct = {tuple(runs["plain"]["prompts"][p]["token_ids"]) for p in FIRST | SHARING}
    assert len(distinct) == len(FIRST | SHARING)  # the model tells prompts apart
    assert_loaded_like_plain(runs, SHARING, len(PREFIX))


def test_the_sliding_window_group_loads_only_its_window(runs: dict[str, Any]) -> None:
    metrics = runs["loader"]["metrics"]
    saver = runs["saver"]["metrics"]
    value_bytes = saver["vllm:redis_kv_bytes_saved"] / saver["vllm:redis_kv_blocks_saved"]
    # the first sharing prompt loads the prefix: 5 full-attention blocks, and the blocks of the
    # window before token 640 (tokens 449..639: blocks 3 and 4); the others hit locally
    loaded_values = metrics["vllm:redis_kv_bytes_loaded"] / value_bytes
    assert metrics["vllm:redis_kv_blocks_loaded"] == 5
    # (values differ by a few header bytes: round, not 10 values of every group)
    assert round(loaded_values) == 5 + 2


def test_a_consumer_answers_every_handoff_as_a_warm_connector_less_server(
    runs: dict[str, Any],
) -> None:
    for pid in FIRST | SHARING:
        want = runs["plain"]["prompts"][pid + "#2"]  # its prefix from vLLM's local cache
        got = runs["cons"]["prompts"][pid]
        assert got["num_cached_tokens"] >= len(PREFIX), pid
        assert got["token_ids"] == want["token_ids"], pid
        assert got["logprobs"] == want["logprobs"], pid
    # the first prompt's prefix came through Redis; the others then hit it in the consumer's own
    # prefix cache, and their handoffs were dropped unloaded
    assert runs["cons"]["metrics"]["vllm:redis_kv_blocks_loaded"] == 5
    # consume mode leaves nothing: every group's handed-off blocks were deleted, loaded or not
    assert not [k for k in runs["pd_keys_after_decode"] if ".g" in k]
