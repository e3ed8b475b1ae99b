"""Tensor parallelism on real vLLM CPU engines: instances at TP 1 and TP 2 share blocks.

The tiny model has two KV heads. With ``store_tp_size: 2`` a block is stored as two head slices
(one per head), whatever the instance's TP size: a TP 2 rank writes and reads its own slice, a
TP 1 instance writes and reads both. Five engines, one after another, each rank pinned to a core
of its own, two prefixes of 640 tokens (five 128-token blocks) each:

- ``plain1`` (TP 1) and ``plain2`` (TP 2): no connector; the outputs to match (run so that the
  prompts an instance loads a prefix for find it in the plain engine's local prefix cache);
- ``saver1`` (TP 1, an empty Redis) computes ``A + a1``: it saves prefix A as two slices;
- ``mid2`` (TP 2) runs ``A + a2``, loading prefix A saved at TP 1 (each rank its head), then
  computes ``B + b1`` and saves prefix B, each rank its own slice;
- ``last1`` (TP 1) runs ``B + b2``, loading prefix B saved at TP 2 (both slices).

TP 1 and TP 2 round differently, so each instance is compared with the plain one of its size:
what it computes itself bit for bit, a prefix computed at the other size within the two sizes'
own difference (the same tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from testing.e2e import PATIENT, finish, one_per_phase, start_engine, tokens
from testing.redis_server import RedisServer

# the ranks' side of vLLM is what every other end-to-end test checks on each release
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

A, B = tokens(640, 1), tokens(640, 3)
PROMPTS = {
    "A+a1": A + tokens(60, 2),
    "A+a2": A + tokens(60, 4),
    "B+b1": B + tokens(60, 5),
    "B+b2": B + tokens(60, 6),
}
TP1 = {"max_tokens": 12, "core": 0}
TP2 = {"max_tokens": 12, "core": "0|1", "tp": 2}


def block_keys(client: redis.Redis) -> list[str]:
    """``kv:vllm:<fingerprint>:<hash>`` keys: blocks, not handoff records."""
    return [k.decode() for k in client.scan_iter("kv:vllm:*", count=1000) if k.count(b":") == 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp")

    def engine(name: str, ids: list[str], run: dict[str, Any], **connector: Any) -> dict:
        phases = one_per_phase(PROMPTS, ids)
        return finish(start_engine(tmp, name, tiny_model, phases, **run, **connector))

    # a prompt whose prefix an instance loaded is compared with a plain run that had that
    # prefix in its local prefix cache (vLLM computes a cached prompt's tail in another order:
    # against a cold run the logprobs differ in the last bits, with or without a connector)
    out: dict[str, Any] = {
        "plain1": engine("plain1", ["A+a1", "B+b1", "B+b2"], TP1),
        "plain2": engine("plain2", ["A+a1", "A+a2", "B+b1"], TP2),
    }
    with RedisServer() as server:
        share = {
            "role": "kv_both",
            "url": server.url,
            "extra": {"mode": "share", "store_tp_size": 2, **PATIENT},
        }
        client = redis.Redis.from_url(server.url)
        out["saver1"] = engine("saver1", ["A+a1"], TP1, **share)
        out["keys_a"] = block_keys(client)
        out["mid2"] = engine("mid2", ["A+a2", "B+b1"], TP2, **share)
        out["keys_ab"] = block_keys(client)
        out["last1"] = engine("last1", ["B+b2"], TP1, **share)
        client.close()
    return out


def same(got: dict, want: dict) -> bool:
    return got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]


def logprob_gap(got: dict, want: dict) -> float:
    return max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))


def test_what_an_instance_computes_is_bit_identical_to_a_plain_one_of_its_size(
    runs: dict[str, Any],
) -> None:
    for name, pid, plain in (("saver1", "A+a1", "plain1"), ("mid2", "B+b1", "plain2")):
        assert same(runs[name]["prompts"][pid], runs[plain]["prompts"][pid]), (name, pid)


def test_a_prefix_loaded_from_another_tp_size_answers_within_the_tp_sizes_own_difference(
    runs: dict[str, Any],
) -> None:
    """KV computed at TP 1 is not bit-identical to TP 2's (the ranks' partial sums add up in
    another order), so an instance loading another TP size's prefix answers as that prefix
    computed there: the same greedy tokens, and logprobs no further from a plain instance of
    its size than plain TP 1 and TP 2 are from each other (measured: 6e-6 against 9e-6)."""
    p1, p2 = runs["plain1"]["prompts"], runs["plain2"]["prompts"]
    tp_gap = max(logprob_gap(p1[pid], p2[pid]) for pid in ("A+a1", "B+b1"))
    for name, pid, plain in (("mid2", "A+a2", "plain2"), ("last1", "B+b2", "plain1")):
        got, want = runs[name]["prompts"][pid], runs[plain]["prompts"][pid]
        assert got["token_ids"] == want["token_ids"], (name, pid)
        assert logprob_gap(got, want) <= 2 * tp_gap, (name, pid, logprob_gap(got, want), tp_gap)


def test_tp1_and_tp2_store_the_same_slices_under_the_same_keys(runs: dict[str, Any]) -> None:
    a, ab = set(runs["keys_a"]), set(runs["keys_ab"])
    fingerprints = {k.split(":")[2] for k in ab}
    assert len(fingerprints) == 2  # one per head slice, TP 1 and TP 2 alike
    assert len(a) == 10  # prefix A's 5 blocks, as 2 slices, written by one TP 1 rank
    assert {k.split(":")[2] for k in a} == fingerprints
    assert len(ab - a) == 10  # prefix B, one slice by each TP 2 rank; prefix A not rewritten


def test_a_tp2_instance_loads_what_tp1_saved_and_the_reverse(runs: dict[str, Any]) -> None:
    for name, pid in (("mid2", "A+a2"), ("last1", "B+b2")):
        assert runs[name]["prompts"][pid]["num_cached_tokens"] >= len(A), (name, pid)
    assert runs["mid2"]["metrics"].get("vllm:redis_kv_blocks_loaded", 0) >= 5
    assert runs["last1"]["metrics"].get("vllm:redis_kv_blocks_loaded", 0) >= 5
