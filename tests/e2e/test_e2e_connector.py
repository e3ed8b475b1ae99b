"""End to end on real vLLM CPU engines: prefill (kv_producer) -> Redis -> decode (kv_consumer),
and prefix sharing between two kv_both instances. Each engine is its own process, and each
connector engine runs its engine core and worker in processes of their own, as a server does
(the other offline tests run them in one: faster to start).

Reference outputs come from one engine without any connector, run twice over the same prompts:
the cold pass computes everything, the warm pass reuses vLLM's own local prefix cache. A
consumer that loads KV from Redis must produce the same greedy tokens as the cold pass, and
logprobs bit-identical to the warm pass (the same tokens are computed from the same cached KV);
against the cold pass, logprobs of long prompts differ in the last float bits because vLLM
computes the tail of a cached prompt in a different order, with or without this connector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from connector.chains import handoff_salt
from kvstore import LookupBuffer, chain_hashes
from kvstore.values.keys import parse_key
from testing.e2e import PATIENT, count_blocks, finish, one_per_phase, start_engine, tokens
from testing.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm]

BLOCK = 128  # vLLM's default block size on CPU
SHARED = tokens(1000, 99)
PROMPTS = {
    "short": tokens(50, 1),  # shorter than one block
    "few": tokens(300, 2),  # a few blocks
    "long": tokens(1200, 3),  # over 1,000 tokens
    "exact": tokens(3 * BLOCK, 4),  # a multiple of the block size
    "shareA": SHARED + tokens(40, 5),  # two prompts sharing a long prefix
    "shareB": SHARED + tokens(70, 6),
    "corrupt": tokens(1100, 7),  # a stored block gets a flipped byte before decode
    "deleted": tokens(1100, 8),  # a stored block is deleted before decode
}
CLEAN = ["short", "few", "long", "exact", "shareA", "shareB"]
LONG = ["long", "shareA", "corrupt", "deleted"]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("e2e")
    with RedisServer() as server:
        url = server.url
        ids = list(PROMPTS)
        phases = one_per_phase(PROMPTS, ids)
        # (the reference runs as the connector engines do: an in-process engine's logprobs
        # differ from theirs in the last float bits)
        base = start_engine(tmp, "base", tiny_model, phases * 2, core=0, separate_processes=True)
        # selected by name: the package's vLLM plugin entry point registers it
        prod = start_engine(
            tmp, "prod", tiny_model, phases, core=1, role="kv_producer", url=url,
            extra={"namespace": "pd"},
            separate_processes=True,
        )  # fmt: skip
        res: dict[str, Any] = {"base": finish(base), "prod": finish(prod)}
        params = {k: v["kv_transfer_params"] for k, v in res["prod"]["prompts"].items()}
        res["keys_after_prefill"] = redis.Redis.from_url(url).dbsize()

        # Damage two prompts' stored blocks between prefill and decode.
        client = redis.Redis.from_url(url)
        pd_keys = {k.decode() for k in client.scan_iter(match="kv:pd:*")}
        store = LookupBuffer.from_url(url, namespace="pd", fingerprint=_fp(pd_keys))
        corrupt_key = store.redis_key(handoff_chain(params, "corrupt")[3])
        value = bytearray(client.get(corrupt_key))
        value[-100] ^= 0xFF
        client.set(corrupt_key, bytes(value))
        client.delete(store.redis_key(handoff_chain(params, "deleted")[2]))

        # selected by module path; share-mode instance 1 runs meanwhile on the other core
        # loads pinned: what loads do with damaged and missing blocks is under test here (the
        # policy's own choices are test_e2e_load_policy's): under auto, on a busy CI machine,
        # the consumer once served "deleted" without loading its two good blocks (the run kept
        # no metrics to say why; a bound from a slow probe or load is the likely cause)
        cons = start_engine(
            tmp, "cons", tiny_model, phases, core=0, role="kv_consumer", url=url,
            extra={"namespace": "pd", "deadline_s": 3, "load_policy": "async"}, params=params,
            by_module_path=True, separate_processes=True,
        )  # fmt: skip
        share_ids = ["few", "long", "shareA", "shareB"]
        # PATIENT (loads pinned, deadlines no busy machine reaches): the test asserts the second
        # instance loaded the first's prefixes; under auto and the defaults, on a busy CI
        # machine, it once served "long" without loading (2026-11-29)
        share_phases = one_per_phase(PROMPTS, share_ids)
        both1 = start_engine(
            tmp, "both1", tiny_model, share_phases, core=1, role="kv_both", url=url,
            extra={"namespace": "pool", **PATIENT},
            separate_processes=True,
        )  # fmt: skip
        res["cons"] = finish(cons)
        res["both1"] = finish(both1)
        res["pd_keys_after_decode"] = sorted(k.decode() for k in client.scan_iter(match="kv:pd:*"))
        res["pd_ttls_after_decode"] = [client.pttl(k) for k in res["pd_keys_after_decode"]]
        res["pool_keys_after_1"] = count_blocks(client, "pool")
        both2 = start_engine(
            tmp, "both2", tiny_model, share_phases, core=0, role="kv_both", url=url,
            extra={"namespace": "pool", **PATIENT},
            separate_processes=True,
        )  # fmt: skip
        res["both2"] = finish(both2)
        res["pool_keys_after_2"] = count_blocks(client, "pool")
        (tmp / "results.json").write_text(json.dumps(res, indent=1, default=str))
        return res


def handoff_chain(params: dict, prompt: str) -> list[str]:
    """The chain a consume-mode producer wrote for one prompt: salted with its handoff id."""
    handoff = params[prompt]["redis_kv"]["handoff"]
    return chain_hashes(PROMPTS[prompt], BLOCK, handoff_salt("", handoff))


def _fp(keys: set[str]) -> str:
    fps = {k.split(":")[2] for k in keys}
    assert len(fps) == 1, fps
    return fps.pop()


def cold(res: dict, i: str) -> dict:
    return res["base"]["prompts"][i]


def warm(res: dict, i: str) -> dict:
    return res["base"]["prompts"][i + "#2"]


def test_the_model_is_not_degenerate(e2e: dict) -> None:
    firsts = {tuple(cold(e2e, i)["token_ids"]) for i in PROMPTS}
    assert len(firsts) == len(PROMPTS)


def test_producer_output_is_bit_identical_to_no_connector(e2e: dict) -> None:
    for i in PROMPTS:
        got = e2e["prod"]["prompts"][i]
        assert got["token_ids"] == cold(e2e, i)["token_ids"], i
        assert got["logprobs"] == cold(e2e, i)["logprobs"], i


def test_producer_returns_transfer_params(e2e: dict) -> None:
    for i in PROMPTS:
        params = e2e["prod"]["prompts"][i]["kv_transfer_params"]
        full = len(PROMPTS[i]) // BLOCK
        if full == 0:
            assert params is None
        else:
            assert params["redis_kv"]["num_blocks"] == full, i
            assert params["redis_kv"]["scope"] == "handoff", i
    assert e2e["keys_after_prefill"] > 0


def test_the_producers_counters_include_its_last_saves(e2e: dict) -> None:
    """Formerly the last request's saves were still in flight when its counters were read."""
    m = e2e["prod"]["metrics"]
    full_blocks = sum(len(p) // BLOCK for p in PROMPTS.values())
    assert m["vllm:redis_kv_blocks_saved"] == full_blocks
    assert m["vllm:redis_kv_handoffs_published"] == sum(len(p) >= BLOCK for p in PROMPTS.values())


def test_decode_output_equals_a_single_instance(e2e: dict) -> None:
    for i in CLEAN:
        got = e2e["cons"]["prompts"][i]
        assert got["token_ids"] == cold(e2e, i)["token_ids"], i
        # same cached KV -> the very same floats as vLLM's own prefix cache
        assert got["logprobs"] == warm(e2e, i)["logprobs"], i
        assert got["logprobs"] == pytest.approx(cold(e2e, i)["logprobs"], abs=1e-4), i


def test_decode_loaded_long_prompts_from_redis(e2e: dict) -> None:
    for i in ["long", "shareA"]:
        got = e2e["cons"]["prompts"][i]
        assert got["num_cached_tokens"] >= 0.9 * len(PROMPTS[i]), (i, got["num_cached_tokens"])
    m = e2e["cons"]["metrics"]
    expected = sum((len(PROMPTS[i]) - 1) // BLOCK for i in ["few", "long", "exact", "shareA"])
    assert m["vllm:redis_kv_blocks_loaded"] >= expected
    assert m["vllm:external_prefix_cache_hits"] >= 0.9 * sum(len(PROMPTS[i]) for i in ["long"])
    # delivered hits: vLLM counts hits when it admits a request; we count what arrived
    assert m["vllm:redis_kv_tokens_loaded"] == m["vllm:redis_kv_blocks_loaded"] * BLOCK
    assert (
        m["vllm:redis_kv_tokens_loaded"] + m["vllm:redis_kv_tokens_load_failed"]
        == m["vllm:external_prefix_cache_hits"]
    )
    # latencies are histograms: their sums survive vLLM's integer counter reader
    assert (
        m["vllm:redis_kv_load_seconds"]["count"] >= 5 and m["vllm:redis_kv_load_seconds"]["sum"] > 0
    )
    # the no-connector run computed everything the first time
    assert cold(e2e, "long")["num_cached_tokens"] == 0


def test_corrupt_and_deleted_blocks_are_recomputed_with_correct_output(e2e: dict) -> None:
    for i in ["corrupt", "deleted"]:
        got = e2e["cons"]["prompts"][i]
        assert got["token_ids"] == cold(e2e, i)["token_ids"], i
        assert got["logprobs"] == pytest.approx(cold(e2e, i)["logprobs"], abs=1e-4), i
    # the deleted block ends the usable chain: only the blocks before it come from Redis
    assert e2e["cons"]["prompts"]["deleted"]["num_cached_tokens"] == 2 * BLOCK
    # the corrupt block was fetched, failed its checksum, was reported and recomputed
    assert e2e["cons"]["metrics"]["vllm:redis_kv_blocks_load_failed"] >= 1


def test_consume_mode_leaves_no_blocks_only_expiring_taken_markers(e2e: dict) -> None:
    kinds = {parse_key(k).kind for k in e2e["pd_keys_after_decode"]}  # type: ignore[union-attr]
    assert kinds <= {"handoff"}
    assert all(0 < ttl <= 60_000 for ttl in e2e["pd_ttls_after_decode"])


def test_share_mode_instances_reuse_each_others_prefixes(e2e: dict) -> None:
    first, second = e2e["both1"], e2e["both2"]
    for i in ["few", "long", "shareA", "shareB"]:
        assert first["prompts"][i]["token_ids"] == cold(e2e, i)["token_ids"], i
        assert second["prompts"][i]["token_ids"] == cold(e2e, i)["token_ids"], i
        assert second["prompts"][i]["logprobs"] == warm(e2e, i)["logprobs"], i
    assert second["prompts"]["long"]["num_cached_tokens"] >= 0.9 * len(PROMPTS["long"])
    assert first["prompts"]["long"]["num_cached_tokens"] == 0
    assert second["metrics"]["vllm:redis_kv_blocks_loaded"] > 0
    # share mode keeps the blocks for the next instance
    assert e2e["pool_keys_after_2"] == e2e["pool_keys_after_1"] > 0
