"""A gated delta-net hybrid (a tiny Qwen3-Next: three linear-attention layers, whose cache is a
recurrent state, and one full-attention layer) on real vLLM CPU engines, in vLLM's align cache
mode: one KV-cache group per layer, a state block holding the layer's state after a whole
number of 384-token blocks.

What must hold: a prefix's attention blocks and the states vLLM commits at its chunk ends are
saved (each state from the exact block vLLM offers); an instance that loads the prefix -- its
attention blocks and each state group's one state at the hit's end -- answers, token for token
and logprob for logprob, as a connector-less server that had the prefix in its local cache;
likewise a consumer loading a producer's handoff, which leaves nothing behind.

Engines (bf16, each pinned to a core, ``--block-size 384`` so prefill chunks end on state
boundaries), prompts of 913 to 930 tokens sharing their first 900 (a hit of 768 tokens: two
blocks):
- ``plain``: no connector; every prompt, then all of them again (their prefix from vLLM's local
  cache);
- ``saver``: share mode, an empty Redis; ``loader``: a fresh share-mode instance given only the
  prompts sharing the prefix;
- ``prod`` / ``cons``: disaggregated prefill in consume mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testing.e2e import family_runs, make_model, tokens

# vLLM's CPU gated delta-net kernels are checked on the default release; the other releases
# run the connector's state groups at the scheduler and worker level (test_state_groups.py)
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

BLOCK = 384  # vLLM raises the attention block until its page holds a state
PREFIX = tokens(900, 1)
FIRST = {"first": PREFIX + tokens(13, 2)}
SHARING = {f"share{i}": PREFIX + tokens(20 + 10 * i, 10 + i) for i in range(2)}
HIT = 2 * BLOCK  # the last state boundary before each prompt's last token
RUN = {"max_tokens": 12, "core": 0, "dtype": "bfloat16", "block_size": BLOCK}
STATE_GROUPS = 3


@pytest.fixture(scope="module")
def gdn_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    options = ("--family", "qwen3_next", "--layers", "4", "--dtype", "bfloat16")
    return make_model(tmp_path_factory, "tiny-qwen3-next", *options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gdn_model: Path) -> dict[str, Any]:
    return family_runs(tmp_path_factory.mktemp("state"), gdn_model, FIRST, SHARING, **RUN)


def same(got: dict, want: dict) -> bool:
    return got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]


def test_the_model_tells_prompts_apart(runs: dict[str, Any]) -> None:
    outputs = {tuple(runs["plain"]["prompts"][p]["token_ids"]) for p in FIRST | SHARING}
    assert len(outputs) == len(FIRST | SHARING)


def test_the_state_groups_are_stored_not_refused(runs: dict[str, Any]) -> None:
    assert "RedisConnector" in runs["saver_log"]
    assert "UnsupportedModelError" not in runs["saver_log"]
    assert "few states are committed" not in runs["saver_log"]  # --block-size matches


def test_the_prefix_is_saved_as_its_attention_blocks_and_one_state_per_group(
    runs: dict[str, Any],
) -> None:
    blocks = [k for k in runs["keys"] if k.startswith("kv:vllm:") and ".g" in k]
    by_group: dict[str, set[str]] = {}
    for k in blocks:
        position, group = k.rsplit(":", 1)[1].split(".")
        by_group.setdefault(group, set()).add(position)
    attention = [g for g, ps in by_group.items() if len(ps) == 2]
    states = [g for g, ps in by_group.items() if len(ps) == 1]
    # the two full blocks of the shared prefix; the states after 768 tokens, the chunk end
    # vLLM committed (never the states inside a chunk, which vLLM does not keep)
    assert len(attention) == 1 and len(states) == STATE_GROUPS, by_group
    assert all(by_group[g] <= by_group[attention[0]] for g in states)
    (last,) = {p for g in states for p in by_group[g]}
    assert last in by_group[attention[0]]


def test_a_saver_answers_as_without_the_connector(runs: dict[str, Any]) -> None:
    for pid in FIRST | SHARING:
        assert same(runs["saver"]["prompts"][pid], runs["plain"]["prompts"][pid]), pid


def test_a_server_loading_the_prefix_and_its_states_answers_the_same(
    runs: dict[str, Any],
) -> None:
    for pid in SHARING:
        got, want = runs["loader"]["prompts"][pid], runs["plain"]["prompts"][pid]
        assert got["num_cached_tokens"] == want["num_cached_tokens"] == HIT, pid
        assert same(got, want), pid
    metrics = runs["loader"]["metrics"]
    # the first sharing prompt loaded the prefix (2 positions: 2 attention blocks and the 3
    # states at the second); the next hit it in vLLM's own cache
    assert metrics["vllm:redis_kv_blocks_loaded"] == 2
    assert metrics["vllm:redis_kv_tokens_loaded"] == HIT


def test_a_consumer_answers_every_handoff_and_leaves_nothing(runs: dict[str, Any]) -> None:
    # the producer handed off each prompt's two attention blocks, and the first prompt's states
    # after 768 tokens; the others' prefix came from its local cache, whose states vLLM does not
    # offer (so their commit records say 0 blocks, and the consumer recomputes or hits locally)
    handed = [k for k in runs["pd_keys"] if ".g" in k]
    assert len(handed) == 2 * len(FIRST | SHARING) + STATE_GROUPS, handed
    for pid in FIRST | SHARING:
        got = runs["cons"]["prompts"][pid]
        want = runs["plain"]["prompts"][pid + "#2"]  # its prefix from vLLM's local cache
        assert got["num_cached_tokens"] == HIT, pid
        assert same(got, want), pid
    assert runs["cons"]["metrics"]["vllm:redis_kv_blocks_loaded"] == 2
    assert not [k for k in runs["pd_keys_after_decode"] if ".g" in k]
