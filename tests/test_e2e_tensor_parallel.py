"""Tensor parallelism on real vLLM CPU engines: two ranks, each holding one of the tiny model's
two KV heads, each saving and loading its own half of every block under its own fingerprint.

Three engines at TP 2, one after another, each rank pinned to a core of its own:
- ``plain``: no connector; a 700-token prompt, then prompts sharing its first 640 tokens (five
  128-token blocks), which vLLM's local prefix cache serves;
- ``saver``: the same prompts, a share-mode connector against an empty Redis;
- ``loader``: a fresh instance given only the prompts sharing the prefix: both ranks load the
  prefix's blocks from Redis, and vLLM reports the load finished only once both have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .e2e_helpers import plain_saver_loader, tokens

# the ranks' side of vLLM is what every other end-to-end test checks on each release
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

PREFIX = tokens(640, 1)
FIRST = {"first": PREFIX + tokens(60, 2)}
SHARING = {f"share{i}": PREFIX + tokens(60, 10 + i) for i in range(2)}
RUN = {"max_tokens": 12, "core": "0|1", "tp": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp2")
    return plain_saver_loader(tmp, tiny_model, FIRST, SHARING, **RUN)


def test_each_rank_saves_its_half_of_every_block(runs: dict[str, Any]) -> None:
    blocks = [
        k for k in runs["keys"] if k.startswith("kv:vllm:") and k.count(":") == 3
    ]  # not the handoff records
    fingerprints = {k.split(":")[2] for k in blocks}
    hashes = {k.split(":")[3] for k in blocks}
    assert len(fingerprints) == 2  # one per rank
    assert len(hashes) == 5 and len(blocks) == 10  # the prefix's 5 blocks, on each rank


def test_a_tp2_server_loading_the_prefix_answers_as_without_the_connector(
    runs: dict[str, Any],
) -> None:
    for pid in FIRST | SHARING:
        want, got = runs["plain"]["prompts"][pid], runs["saver"]["prompts"][pid]
        assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"], pid
    for pid in SHARING:
        want, got = runs["plain"]["prompts"][pid], runs["loader"]["prompts"][pid]
        assert got["num_cached_tokens"] >= len(PREFIX), pid  # the prefix came from Redis
        assert got["token_ids"] == want["token_ids"], pid
        assert got["logprobs"] == want["logprobs"], pid
    assert runs["loader"]["metrics"].get("vllm:redis_kv_blocks_loaded", 0) >= 5
