"""KV events for routers, through vLLM's real Scheduler and the real worker side on fakeredis
(``testing.sim_engine``): what vLLM's publisher would send is recorded and checked against
what is in Redis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from connector.events import KVEventsEmitter, StoredPrefixReports
from connector.presence import StoredLayout, prompt_presence
from connector.redis_connector import write_layout_file
from kvstore import LookupBuffer, StoreUnavailableError, chain_hashes
from testing.scheduler_harness import BS, make_request, prompt
from testing.sim_engine import SimEngine

pytestmark = pytest.mark.vllm

URL = "redis://fake:6379/0"


@pytest.fixture
def engine_defaults(engine_defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``engines`` fixture's (tests/unit/conftest.py), for engines that publish KV events."""
    return {**engine_defaults, "lookup_wait_s": 0.05, "kv_events": True}


def stored(engine: SimEngine) -> list[BlockStored]:
    """The connector's BlockStored events (vLLM's own GPU-cache events are there too)."""
    return [e for e in engine.published if isinstance(e, BlockStored) and e.medium == "CPU"]


def run(engine: SimEngine, rid: str, tokens: list[int]) -> list[Any]:
    """Run one request to its end; vLLM's hashes of its full blocks."""
    req = engine.add(rid, tokens)
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    engine.run_until_idle()
    return hashes


def test_saved_blocks_are_announced_with_vllm_hashes_by_the_step_that_frees_them(
    engines: Any, tmp_path: Path
) -> None:
    engine = engines()
    tokens = prompt(5 * BS + 3)
    hashes = run(engine, "a", tokens)
    # announced by the time the engine has nothing left to run: no later step would carry it
    (event,) = stored(engine)
    assert event.block_hashes == hashes[:5]
    assert event.parent_block_hash is None
    assert event.token_ids == tokens[: 5 * BS]
    assert event.block_size == BS
    assert getattr(event, "locality", "REMOTE") == "REMOTE"
    assert getattr(event, "ownership", "redis:vllm") == "redis:vllm"
    # the presence API (what a router asks for an exact answer) agrees: all 5 are loadable
    layout_file = tmp_path / "layout.json"
    write_layout_file(str(layout_file), engine.connector.rc, engine.connector.layout)
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint="")
    presence = prompt_presence(store, StoredLayout.from_file(layout_file), tokens)
    store.close()
    assert presence.loadable_blocks == 5


def test_another_instance_announces_only_the_blocks_it_added(engines: Any) -> None:
    first, second = engines(), engines()
    shared = prompt(3 * BS)
    run(first, "a", shared + prompt(BS + 1, seed=2))
    hashes = run(second, "b", shared + prompt(2 * BS + 1, seed=3))  # loads 3, adds 2
    (event,) = stored(second)
    assert event.block_hashes == hashes[3:5]
    assert event.parent_block_hash == hashes[2]


def test_blocks_whose_writes_failed_are_not_announced(engines: Any) -> None:
    engine = engines(max_batched=2 * BS)  # two blocks per step
    real = engine.worker.store.insert_parts

    def third_block_fails(items: Any, **kw: Any) -> Any:
        if 2 in kw["positions"]:
            raise StoreUnavailableError("connection reset")
        return real(items, **kw)

    engine.worker.store.insert_parts = third_block_fails  # type: ignore[method-assign]
    hashes = run(engine, "a", prompt(5 * BS + 3))
    (event,) = stored(engine)
    assert event.block_hashes == hashes[:2]  # the chain breaks at the failed block


def lose_blocks(engine: SimEngine, tokens: list[int], n: int) -> None:
    """The first ``n`` blocks of the shared chain leave Redis (TTL, eviction, a failed save)."""
    store = engine.worker.store
    assert store.client.delete(*[store.redis_key(h) for h in chain_hashes(tokens, BS)[:n]]) == n


def blocks_saved(engine: SimEngine) -> int:
    engine.settle()
    return int(engine.take_stats().get("blocks_saved", 0))


def test_a_local_hit_that_redis_lost_is_written_back_and_announced_from_its_head(
    engines: Any,
) -> None:
    """Issue 38, item 1: share mode wrote only the blocks after vLLM's local hit, under a
    chain whose head Redis no longer had -- nobody could load any of it -- and announced them
    as if the whole chain were there."""
    engine = engines()
    head = prompt(4 * BS)
    run(engine, "a", [*head, 7])
    lose_blocks(engine, head, 4)  # vLLM still holds them in its prefix cache
    tokens = head + prompt(4 * BS + 1, seed=2)
    hashes = run(engine, "b", tokens)  # a local hit of 4 blocks
    event = stored(engine)[-1]
    assert event.block_hashes == hashes[:8] and event.parent_block_hash is None
    other = engines()
    run(other, "c", tokens)
    assert int(other.take_stats().get("blocks_loaded", 0)) == 8


def test_a_whole_local_hit_writes_back_only_what_redis_lacks(engines: Any) -> None:
    engine = engines()
    tokens = prompt(4 * BS + 1, seed=6)
    run(engine, "a", tokens)
    assert blocks_saved(engine) == 4
    run(engine, "b", tokens)  # all of it a local hit, all of it in Redis: nothing written
    assert blocks_saved(engine) == 0
    lose_blocks(engine, tokens, 2)
    run(engine, "c", tokens)  # a local hit Redis lost part of: written back, from its head
    assert blocks_saved(engine) == 4
    assert stored(engine)[-1].parent_block_hash is None
    other = engines()
    run(other, "d", tokens)
    assert int(other.take_stats().get("blocks_loaded", 0)) == 4


def slow_lookups(engine: SimEngine, delay_s: float) -> None:
    store = engine.connector.scheduler._lookups.store
    real = store.survey

    def survey(*a: Any, **k: Any) -> Any:
        time.sleep(delay_s)
        return real(*a, **k)

    store.survey = survey  # type: ignore[method-assign]


def test_a_whole_local_hit_is_written_back_even_when_its_lookup_answers_after_it_ends(
    engines: Any,
) -> None:
    """Found by a fresh-eyes review: the saves of a whole local hit waited for its lookup, and
    a request that finished first (a few tokens, a slow Redis) wrote nothing back."""
    engine = engines(lookup_wait_s=0.01)
    tokens = prompt(4 * BS + 1, seed=7)
    run(engine, "a", tokens)
    assert blocks_saved(engine) == 4
    lose_blocks(engine, tokens, 4)
    slow_lookups(engine, 0.3)
    run(engine, "b", tokens)
    assert blocks_saved(engine) == 4  # not known in time: all of it, not nothing


def test_a_lookup_that_raises_anything_still_lets_a_whole_local_hit_save(engines: Any) -> None:
    """Found by a fresh-eyes review: an error other than the store's own, from the lookup a
    whole local hit's saves waited for, was raised out of vLLM's schedule()."""
    engine = engines()
    tokens = prompt(4 * BS + 1, seed=8)
    run(engine, "a", tokens)
    assert blocks_saved(engine) == 4

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("an unexpected reply shape")

    engine.connector.scheduler._lookups.store.survey = broken  # type: ignore[method-assign]
    run(engine, "b", tokens)
    assert blocks_saved(engine) == 4


def test_a_share_mode_reader_loads_past_its_local_hit_whatever_redis_lost_before_it(
    engines: Any,
) -> None:
    """An instance that only loads cannot write anything back: it still asks Redis from its
    local hit on (found by a fresh-eyes review: it lost the load of a chain with a hole)."""
    head = prompt(4 * BS, seed=9)
    tokens = head + prompt(4 * BS + 1, seed=10)
    writer = engines()
    run(writer, "w", tokens)
    writer.settle()
    reader = engines("kv_consumer", mode="share")
    run(reader, "a", [*head, 7])  # its prefix cache: the head (loaded)
    reader.settle()
    reader.take_stats()
    store = writer.worker.store
    assert store.client.delete(store.redis_key(chain_hashes(tokens, BS)[1])) == 1
    run(reader, "b", tokens)
    reader.settle()
    assert int(reader.take_stats().get("blocks_loaded", 0)) == 4  # blocks 4-7


def test_a_reset_publishes_all_blocks_cleared_and_nothing_saved_before_it(
    engines: Any,
) -> None:
    engine = engines()
    run(engine, "a", prompt(3 * BS + 1))
    assert engine.sched.reset_prefix_cache(reset_connector=True)
    run(engine, "b", prompt(2 * BS + 1, seed=4))
    cpu = [e for e in engine.published if isinstance(e, AllBlocksCleared) or e in stored(engine)]
    assert [type(e).__name__ for e in cpu][-2:] == ["AllBlocksCleared", "BlockStored"]


def test_consume_mode_and_disabled_events_announce_nothing(engines: Any) -> None:
    producer = engines("kv_producer")
    run(producer, "p", prompt(3 * BS + 1))  # a handoff chain: one request's, never routable
    assert stored(producer) == []
    quiet = engines(kv_events=False)
    run(quiet, "q", prompt(3 * BS + 1, seed=5))
    assert stored(quiet) == [] and quiet.worker_conn.get_kv_connector_kv_cache_events() is None


def test_every_rank_must_confirm_a_block_before_it_is_announced(tiny_model: Path) -> None:
    emitter = KVEventsEmitter(BS, BS, ranks=2, namespace="ns")
    tokens = prompt(4 * BS)
    request = make_request("r", tokens)
    emitter.watch(request, 1, 4)
    emitter.reported(StoredPrefixReports([("r", 4)]))
    assert emitter.take() == []  # rank 1 has not reported yet
    emitter.reported(StoredPrefixReports([("r", 3)]))
    (event,) = emitter.take()
    assert isinstance(event, BlockStored)
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    assert event.block_hashes == hashes[1:3]  # the least any rank confirmed
    assert event.parent_block_hash == hashes[0]
    assert event.token_ids == tokens[BS : 3 * BS]


def test_blocks_are_named_by_vllm_hashes_at_a_finer_hash_block_size(tiny_model: Path) -> None:
    # models of several KV-cache groups: vLLM hashes every BS/2 tokens, our blocks are BS
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    request = make_request("r", prompt(3 * BS))
    fine = Request(
        request_id="r",
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS // 2, sha256),
    )
    emitter = KVEventsEmitter(BS, BS // 2, ranks=1, namespace="ns")
    emitter.watch(fine, 0, 3)
    emitter.reported(StoredPrefixReports([("r", 3)]))
    (event,) = emitter.take()
    assert event.block_hashes == [maybe_convert_block_hash(fine.block_hashes[i]) for i in (1, 3, 5)]


def test_a_slow_write_holds_a_finished_request_briefly_and_its_event_comes_later(
    engines: Any,
) -> None:
    engine = engines()
    real = engine.worker.store.insert_parts

    def slow(items: Any, **kw: Any) -> Any:
        time.sleep(1.5)  # far beyond the 0.2 s a finished request is held for its event
        return real(items, **kw)

    engine.worker.store.insert_parts = slow  # type: ignore[method-assign]
    hashes = run(engine, "a", prompt(3 * BS + 1))  # freed (and idle) before the write ended
    assert stored(engine) == []
    engine.step()  # the engine's next step (its next request) carries the event
    (event,) = stored(engine)
    assert event.block_hashes == hashes[:3]
