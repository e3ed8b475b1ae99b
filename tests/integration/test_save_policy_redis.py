"""Each save policy on a real redis-server: two simulated instances share the pool, as two
share-mode servers do (vLLM's real Scheduler, the real connector on both sides; the unit tests,
tests/unit/test_save_policy.py, cover the same rules on fakeredis)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from connector.save_policy import SAVE_MARK_KEY
from kvstore import chain_hashes
from testing.scheduler_harness import BS, prompt
from testing.sim_engine import SimEngine

# (the policy has no per-release code: its unit tests run on every release)
pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.default_vllm_only]

TOKENS = prompt(6 * BS + 3, seed=41)  # six full blocks


@pytest.fixture
def pool(tiny_model: Path, redis_url: str) -> Iterator[Any]:
    """Instances on one real server: ``pool(save_policy=...)``, loading whatever they find."""
    made: list[SimEngine] = []

    def make(**kw: Any) -> SimEngine:
        e = SimEngine(tiny_model, "kv_both", redis_url, deadline_s=30, lookup_wait_s=0.02,
                      load_policy="async", **kw)  # fmt: skip
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()
    for e in made:
        e.assert_clean()


def served(engine: SimEngine, rid: str, tokens: list[int], **kw: Any) -> dict[str, int]:
    engine.add(rid, tokens, **kw)
    engine.run_until_idle()
    engine.settle()
    return engine.take_stats()


def stored(engine: SimEngine, tokens: list[int]) -> list[bool]:
    return list(engine.worker.store.contains(chain_hashes(tokens, BS)))


def test_all_writes_every_block_and_the_other_instance_loads_them(pool: Any) -> None:
    writer, reader = pool(), pool()
    assert served(writer, "w", TOKENS)["blocks_saved"] == 6
    assert served(reader, "r", TOKENS)["blocks_loaded"] == 6


def test_second_sight_writes_the_head_then_the_whole_prompt_where_it_is_seen_again(
    pool: Any,
) -> None:
    writer, reader = pool(save_policy="second_sight"), pool(save_policy="second_sight")
    stats = served(writer, "w", TOKENS)
    assert stored(writer, TOKENS) == [True] + [False] * 5 and stats["blocks_save_skipped"] == 5
    stats = served(reader, "r", TOKENS)  # its head in Redis: seen before, by the fleet
    assert stats["blocks_loaded"] == 1 and stored(reader, TOKENS) == [True] * 6


def test_marked_writes_only_what_its_caller_marks(pool: Any) -> None:
    writer = pool(save_policy="marked")
    served(writer, "plain", TOKENS)
    assert stored(writer, TOKENS) == [False] * 6
    other = prompt(6 * BS + 3, seed=43)
    served(writer, "marked", other, params={SAVE_MARK_KEY: True})
    assert stored(writer, other) == [True] * 6
