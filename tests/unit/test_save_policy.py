"""The save policy (``connector/save_policy.py``): which prompts share mode writes to the pool,
on simulated engines (vLLM's real Scheduler, the real connector on both sides, fakeredis)."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

pytest.importorskip("vllm")

from connector.config import RedisConnectorConfig
from connector.save_policy import SAVE_MARK_KEY, SaveAllowance, SavePolicy
from kvstore import InvalidArgumentError, chain_hashes
from testing.scheduler_harness import BS, prompt
from testing.sim_engine import SimEngine

pytestmark = pytest.mark.vllm

TOKENS = prompt(6 * BS + 3, seed=31)  # six full blocks


def in_redis(engine: SimEngine, tokens: list[int]) -> list[bool]:
    """Which of the prompt's full blocks the pool holds."""
    chain = chain_hashes(tokens, BS)
    return list(engine.worker.store.contains(chain))


def served(engine: SimEngine, rid: str, tokens: list[int], **kw: Any) -> dict[str, int]:
    """Run one request to the end (its saves landed); the instance's counters meanwhile."""
    engine.add(rid, tokens, **kw)
    engine.run_until_idle()
    engine.settle()
    return engine.take_stats()


def test_second_sight_writes_a_prompts_head_then_all_of_it_once_seen_again(
    engines: Any,
) -> None:
    """Seen once, only its first block is written (the fleet's mark that it was seen, and data
    a repeat loads); seen again by another instance, which finds the head in Redis, the rest is
    written; a third instance then loads every block."""
    first = engines(save_policy="second_sight")
    stats = served(first, "r1", TOKENS)
    assert in_redis(first, TOKENS) == [True] + [False] * 5
    assert stats["blocks_saved"] == 1 and stats["blocks_save_skipped"] == 5
    second = engines(save_policy="second_sight")
    stats = served(second, "r2", TOKENS)
    assert stats.get("blocks_loaded") == 1  # its head, from the pool
    assert in_redis(second, TOKENS) == [True] * 6
    assert "blocks_save_skipped" not in stats
    third = engines(save_policy="second_sight")
    assert served(third, "r3", TOKENS).get("blocks_loaded") == 6


def test_second_sight_remembers_heads_an_instance_saw_itself(
    engines: Any, fake_redis: fakeredis.FakeRedis
) -> None:
    """The head's presence in Redis is one sign of a repeat; the instance's own memory is the
    other: here the head was evicted before the prompt came again, to the same instance."""
    engine = engines(save_policy="second_sight")
    served(engine, "r1", TOKENS)
    fake_redis.delete(*fake_redis.keys("kv:*:*:*"))  # (the head's block, and its records)
    with engine.world:
        engine.sched.reset_prefix_cache()  # so it computes and saves again
        engine._refresh_owners()
    stats = served(engine, "r2", TOKENS)
    assert in_redis(engine, TOKENS) == [True] * 6
    assert stats["blocks_saved"] == 6


def test_a_prompt_seen_once_costs_one_block_and_another_prompt_is_not_helped_by_it(
    engines: Any,
) -> None:
    engine = engines(save_policy="second_sight")
    other = prompt(6 * BS + 3, seed=32)
    served(engine, "a", TOKENS)
    stats = served(engine, "b", other)
    assert in_redis(engine, other) == [True] + [False] * 5
    assert stats["blocks_save_skipped"] == 5


def test_marked_writes_only_the_requests_their_callers_mark(engines: Any) -> None:
    engine = engines(save_policy="marked")
    stats = served(engine, "plain", TOKENS)
    assert in_redis(engine, TOKENS) == [False] * 6 and "blocks_saved" not in stats
    assert stats["blocks_save_skipped"] == 6
    other = prompt(6 * BS + 3, seed=33)
    served(engine, "marked", other, params={SAVE_MARK_KEY: True})
    assert in_redis(engine, other) == [True] * 6


def test_all_writes_every_block_as_before(engines: Any) -> None:
    engine = engines()  # the default
    stats = served(engine, "r1", TOKENS)
    assert in_redis(engine, TOKENS) == [True] * 6
    assert stats["blocks_saved"] == 6 and "blocks_save_skipped" not in stats


def test_a_producer_writes_its_whole_handoff_whatever_the_policy(engines: Any) -> None:
    producer = engines("kv_producer", save_policy="second_sight")
    stats = served(producer, "p", TOKENS, max_tokens=1)
    assert stats["blocks_saved"] == 6 and "blocks_save_skipped" not in stats


def test_the_policy_is_a_type_parsed_at_the_edge() -> None:
    url = {"url": "redis://localhost:6379/0"}
    config = RedisConnectorConfig.from_extra({**url, "save_policy": "second_sight"}, "kv_both")
    assert config.save_policy is SavePolicy.SECOND_SIGHT
    assert RedisConnectorConfig.from_extra(dict(url), "kv_both").save_policy is SavePolicy.ALL
    with pytest.raises(InvalidArgumentError, match="save_policy must be one of"):
        RedisConnectorConfig.from_extra({**url, "save_policy": "sometimes"}, "kv_both")


def test_the_memory_of_heads_is_bounded() -> None:
    allowance = SaveAllowance(SavePolicy.SECOND_SIGHT, seen_heads=2)
    assert allowance.blocks("a", False, False) == 1
    assert allowance.blocks("b", False, False) == 1
    assert allowance.blocks("c", False, False) == 1  # "a" forgotten
    assert allowance.blocks("a", False, False) == 1
    assert allowance.blocks("c", False, False) > 1
    assert allowance.blocks(None, True, False) == 0  # no full block: nothing to write
