"""Models with several KV-cache groups (vLLM's hybrid allocator): a full-attention layer and a
sliding-window layer with block tables of their own, driven through vLLM's real Scheduler and a
worker-role connector on a real CPU cache, the store on fakeredis.

What must hold: each group's block at a position is its own value (``<hash>.g<index>``); a load
reads only the blocks vLLM allocated (a sliding window's past holds vLLM's null block, which is
never read or written); a load that fails in any group fails its request as a whole (block ids
are unique only within a group, so vLLM takes a hybrid model's failures per request); a model
with one group keeps its keys and fingerprint; a group the connector cannot store is refused at
startup, naming it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

from connector.layout import KVLayout, UnsupportedModelError
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.redis_connector import RedisConnector, SupportsHMA
from kvstore import LookupBuffer, chain_hashes
from testing.scheduler_harness import (
    BS,
    LAYERS,
    make_configs,
    make_request,
    make_scheduler,
    make_worker_connector,
    run_worker_step,
    runner_output,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        SupportsHMA is None or not issubclass(RedisConnector, SupportsHMA),
        reason="this vLLM cannot take a load failure per request: the connector leaves the "
        "hybrid allocator off, and vLLM gives it one group",
    ),
]

URL = "redis://fake:6379/0"
WINDOW = 2 * BS  # the sliding-window layer sees its last two blocks' worth of tokens
NULL = 0  # vLLM's null block


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(i * 7 + seed * 13) % 250 + 3 for i in range(n)]


def hybrid_scheduler(tiny_model: Path, role: str = "kv_both") -> Scheduler:
    return make_scheduler(tiny_model, role, url=URL, sliding_window=WINDOW)  # type: ignore[arg-type]


def layout_of(sched: Scheduler) -> KVLayout:
    return sched.connector.layout  # type: ignore[union-attr]


def seed_groups(
    layout: KVLayout, tokens: list[int], n: int, skip: set[str] = frozenset()
) -> list[str]:  # type: ignore[assignment]
    """Put every group's value of the first ``n`` blocks in the store (keys in ``skip`` not)."""
    hashes = chain_hashes(tokens, BS)
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    values = {name: torch.zeros(2, BS, 128) for name in LAYERS}
    items = []
    for h in hashes[:n]:
        for group in layout.groups:
            key = layout.group_key(h, group)
            if key not in skip:
                items.append((key, {name: values[name] for name in group.layer_names}))
    store.insert_many(items)
    store.close()
    return hashes


def meta_of(out: Any) -> RedisConnectorMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, RedisConnectorMetadata)
    return meta


# ---------------------------------------------------------------------------------- layout


def test_groups_are_named_in_keys_and_fingerprint_and_one_group_keeps_its_own(
    tiny_model: Path,
) -> None:
    vllm_config, one = make_configs(tiny_model, "kv_both", url=URL)
    _, two = make_configs(tiny_model, "kv_both", url=URL, sliding_window=WINDOW)
    dense = KVLayout.from_vllm(vllm_config, one, None)
    hybrid = KVLayout.from_vllm(vllm_config, two, None)
    assert not dense.hybrid and dense.group_key("ab", dense.groups[0]) == "ab"
    # the fingerprint a one-group model always had (a layout built without groups)
    legacy = KVLayout(
        dense.model_id, BS, 2, 64, "float32", tuple(LAYERS), 1, kv_cache_dtype=dense.kv_cache_dtype
    )
    assert dense.fingerprint(0) == legacy.fingerprint(0)
    assert hybrid.hybrid and [g.kind for g in hybrid.groups] == ["full", f"sliding_window={WINDOW}"]
    assert [hybrid.group_key("ab", g) for g in hybrid.groups] == ["ab.g0", "ab.g1"]
    assert hybrid.keys_of(["a", "b"]) == ["a.g0", "a.g1", "b.g0", "b.g1"]
    assert hybrid.fingerprint(0) != dense.fingerprint(0)


def test_a_state_group_is_refused_at_startup_naming_it(tiny_model: Path) -> None:
    vllm_config, config = make_configs(tiny_model, "kv_both", url=URL)
    mamba = MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,))
    with_state = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[*config.kv_cache_groups, KVCacheGroupSpec(["mixer"], mamba)],
    )
    with pytest.raises(UnsupportedModelError, match=r"MambaSpec.*without --kv-transfer-config"):
        KVLayout.from_vllm(vllm_config, with_state, None)


# ---------------------------------------------------------------------------------- scheduler


def test_a_load_reads_every_full_block_and_only_the_window_of_the_sliding_group(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = hybrid_scheduler(tiny_model)
    tokens = prompt(6 * BS + 1)
    hashes = seed_groups(layout_of(sched), tokens, 6)
    sched.add_request(make_request("r", tokens))
    out = sched.schedule()
    (load,) = meta_of(out).loads
    full, window = load.block_ids
    assert load.hashes == hashes[:6]
    assert len(full) == len(window) == 6 and NULL not in full
    # the window before token 96 is tokens 65..95: blocks 4 and 5; the others are null
    assert window[:4] == [NULL] * 4 and NULL not in window[4:]
    assert sched.connector.get_loaded_kv_cache_group_ids(sched.requests["r"]) == (0, 1)  # type: ignore[union-attr]
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_position_counts_as_present_only_when_every_group_has_it(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = hybrid_scheduler(tiny_model)
    layout = layout_of(sched)
    tokens = prompt(6 * BS + 1)
    hashes = chain_hashes(tokens, BS)
    seed_groups(layout, tokens, 6, skip={layout.group_key(hashes[3], layout.groups[1])})
    sched.add_request(make_request("r", tokens))
    (load,) = meta_of(sched.schedule()).loads
    assert load.hashes == hashes[:3]
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_failed_load_makes_the_whole_request_recompute_and_share_mode_saves_it_again(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = hybrid_scheduler(tiny_model)
    tokens = prompt(4 * BS + 1)
    hashes = seed_groups(layout_of(sched), tokens, 4)
    sched.add_request(make_request("r", tokens))
    out = sched.schedule()
    assert meta_of(out).loads
    sched.update_from_output(out, runner_output([], failed={"r"}))
    out = sched.schedule()
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0]
    assert out.num_scheduled_tokens == {"r": 4 * BS + 1}
    saves = meta_of(out).saves
    assert [h for s in saves for h in s.hashes] == hashes[:4]
    assert all(len(ids) == len(s.hashes) for s in saves for ids in s.block_ids)
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_saves_carry_each_groups_blocks(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    sched = hybrid_scheduler(tiny_model, "kv_producer")
    sched.add_request(make_request("p", prompt(3 * BS + 5)))
    (save,) = meta_of(sched.schedule()).saves
    full, window = save.block_ids
    assert len(full) == len(window) == len(save.hashes) == 3
    assert NULL not in full and NULL not in window  # computed this step: every block is real
    assert set(full).isdisjoint(window)
    sched.connector.shutdown()  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------- worker


def hybrid_worker(tiny_model: Path, num_blocks: int = 8) -> tuple[RedisConnector, dict]:
    return make_worker_connector(tiny_model, URL, num_blocks, sliding_window=WINDOW)


def transfer_results(conn: RedisConnector, req: str, timeout_s: float = 10) -> Any:
    """The worker's report once ``req`` has finished loading."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = conn.get_transfer_results(set())
        if req in results.finished_recving:
            return results
        time.sleep(0.01)
    raise AssertionError(f"{req} never finished loading")


def test_each_group_saves_and_loads_its_own_blocks_and_null_blocks_are_never_touched(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    src, src_kv = hybrid_worker(tiny_model)
    for name, cache in src_kv.items():
        for b in range(cache.shape[0]):
            cache[b] = float(b) + (0.5 if name == LAYERS[1] else 0.0)
    hashes = chain_hashes(list(range(3 * BS)), BS)
    # the sliding group's first block is null (its window has passed)
    save = SaveSpec("p", [[1, 2, 3], [NULL, 5, 6]], hashes, 0, "hp")
    run_worker_step(src, RedisConnectorMetadata(saves=[save]))
    run_worker_step(src, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 3, 0)]))
    assert src.worker.shutdown_pending(timeout_s=60) == 0
    keys = {k.decode().rsplit(":", 1)[-1] for k in fake_redis.scan_iter("*:*:*:*")}
    assert {f"{h}.g0" for h in hashes} <= keys
    assert {f"{h}.g1" for h in hashes[1:]} <= keys and f"{hashes[0]}.g1" not in keys

    dst, dst_kv = hybrid_worker(tiny_model)
    before = {name: cache.clone() for name, cache in dst_kv.items()}
    load = LoadSpec("d", [[4, 5, 6], [NULL, NULL, 7]], hashes, timeout_s=30)
    run_worker_step(dst, RedisConnectorMetadata(loads=[load]))
    results = transfer_results(dst, "d")
    assert results.failed_recving == set() and dst.get_block_ids_with_load_errors() == set()
    full, window = dst_kv[LAYERS[0]], dst_kv[LAYERS[1]]
    assert [full[b].unique().tolist() for b in (4, 5, 6)] == [[1.0], [2.0], [3.0]]
    assert window[7].unique().tolist() == [6.5]
    for name, cache in dst_kv.items():  # nothing else written: the null block least of all
        written = {4, 5, 6} if name == LAYERS[0] else {7}
        for b in set(range(cache.shape[0])) - written:
            assert torch.equal(cache[b], before[name][b]), (name, b)
    src.shutdown()
    dst.shutdown()


def test_a_block_missing_in_one_group_fails_the_request_not_blocks(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    conn, _kv = hybrid_worker(tiny_model)
    layout = conn.layout
    hashes = chain_hashes(list(range(2 * BS)), BS)
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    value = {LAYERS[0]: torch.ones(2, BS, 128)}
    store.insert_many([(layout.group_key(h, layout.groups[0]), value) for h in hashes])
    store.close()  # the sliding group's values are missing
    load = LoadSpec("d", [[1, 2], [3, 4]], hashes, timeout_s=30)
    run_worker_step(conn, RedisConnectorMetadata(loads=[load]))
    results = transfer_results(conn, "d")
    assert results.failed_recving == {"d"}
    assert conn.get_block_ids_with_load_errors() == set()  # vLLM refuses these for >1 group
    conn.shutdown()
