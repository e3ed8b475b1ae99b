"""Models with several KV-cache groups (vLLM's hybrid allocator): a full-attention layer and a
sliding-window layer with block tables of their own, driven through vLLM's real Scheduler and a
worker-role connector on a real CPU cache, the store on fakeredis.

What must hold: each group's block at a position is its own value (``<hash>.g<index>``); a load
reads only the blocks vLLM allocated (a sliding window's past holds vLLM's null block, which is
never read or written); a load that fails in any group fails its request as a whole (block ids
are unique only within a group, so vLLM takes a hybrid model's failures per request); a model
with one group keeps its keys and fingerprint. (State groups: test_state_groups.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler

from connector.layout import KVLayout
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.redis_connector import RedisConnector, SupportsHMA
from kvstore import LookupBuffer, chain_hashes
from testing.scheduler_harness import (
    BS,
    LAYERS,
    committed_blocks,
    make_configs,
    make_request,
    make_scheduler,
    make_worker_connector,
    prompt,
    run_worker_step,
    runner_output,
    transfer_results,
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
    for group, names in zip(layout.groups, layout.chain_names(hashes[:n], 0).names, strict=True):
        for key in names:
            if key not in skip:
                items.append((key, {name: values[name] for name in group.layer_names}))
    store.insert_many(items)
    store.close()
    return hashes


def schedule_seeded(tiny_model: Path, blocks: int) -> tuple[Scheduler, list[str], Any]:
    """A share-mode hybrid scheduler with every group's first ``blocks`` blocks of a prompt in
    the store, and that prompt's first scheduling step."""
    sched = hybrid_scheduler(tiny_model)
    tokens = prompt(blocks * BS + 1)
    hashes = seed_groups(layout_of(sched), tokens, blocks)
    sched.add_request(make_request("r", tokens))
    return sched, hashes, sched.schedule()


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
    assert not dense.hybrid and dense.chain_names(["ab"], 0).names == [["ab"]]
    # the fingerprint a one-group model always had (a layout built without groups)
    legacy = KVLayout(
        dense.model_id, BS, 2, 64, "float32", tuple(LAYERS), 1, kv_cache_dtype=dense.kv_cache_dtype
    )
    assert dense.fingerprint(0) == legacy.fingerprint(0)
    kinds = [str(g.kind) for g in hybrid.groups]
    assert hybrid.hybrid and kinds == ["full", f"sliding_window={WINDOW}"]
    assert hybrid.chain_names(["ab"], 0).names == [["ab.g0"], ["ab.g1"]]
    assert hybrid.chain_names(["a", "b"], 0).by_position() == ["a.g0", "a.g1", "b.g0", "b.g1"]
    assert hybrid.fingerprint(0) != dense.fingerprint(0)


# ---------------------------------------------------------------------------------- scheduler


def test_a_load_reads_every_full_block_and_only_the_window_of_the_sliding_group(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched, hashes, out = schedule_seeded(tiny_model, 6)
    (load,) = meta_of(out).loads
    full, window = load.block_ids
    assert load.names == layout_of(sched).chain_names(hashes[:6], 0).names
    assert len(full) == len(window) == 6 and NULL not in full
    # the window before token 96 is tokens 65..95: blocks 4 and 5; the others are null
    assert window[:4] == [NULL] * 4 and NULL not in window[4:]
    assert sched.connector.get_loaded_kv_cache_group_ids(sched.requests["r"]) == (0, 1)  # type: ignore[union-attr]
    sched.connector.shutdown()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("missing", "hit"),
    [
        ((3, 1), 6),  # the window of a 6-block hit is blocks 4 and 5: block 3 is not needed
        ((5, 1), 5),  # a 5-block hit's window is blocks 3 and 4
        ((3, 0), 3),  # the full-attention group needs every block
        ((0, 1), 6),
    ],
)
def test_a_hit_needs_every_full_block_and_only_the_window_of_a_sliding_group(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, missing: tuple[int, int], hit: int
) -> None:
    sched = hybrid_scheduler(tiny_model)
    layout = layout_of(sched)
    tokens = prompt(6 * BS + 1)
    hashes = chain_hashes(tokens, BS)
    position, group = missing
    seed_groups(layout, tokens, 6, skip={layout.chain_names(hashes, 0).names[group][position]})
    sched.add_request(make_request("r", tokens))
    (load,) = meta_of(sched.schedule()).loads
    assert load.names == layout.chain_names(hashes[:hit], 0).names
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_the_usable_prefix_rule(tiny_model: Path) -> None:
    vllm_config, two = make_configs(tiny_model, "kv_both", url=URL, sliding_window=WINDOW)
    layout = KVLayout.from_vllm(vllm_config, two, None)
    assert [layout.groups[1].first_needed(n, BS) for n in range(5)] == [0, 0, 0, 1, 2]
    everything = layout.usable_prefix(lambda g, p: True, 0, 10)
    assert everything == 10
    # the sliding group has only blocks 7..9: any hit whose window starts there
    assert layout.usable_prefix(lambda g, p: g == 0 or p >= 7, 0, 10) == 10
    assert layout.usable_prefix(lambda g, p: g == 0 or p >= 9, 0, 10) == 0
    # positions before ``start`` are vLLM's own: never asked about
    assert layout.usable_prefix(lambda g, p: p >= 4, 4, 10) == 10


def test_a_failed_load_makes_the_whole_request_recompute_and_share_mode_saves_it_again(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched, hashes, out = schedule_seeded(tiny_model, 4)
    assert meta_of(out).loads
    sched.update_from_output(out, runner_output([], failed={"r"}))
    out = sched.schedule()
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0]
    assert out.num_scheduled_tokens == {"r": 4 * BS + 1}
    saves = meta_of(out).saves
    named = layout_of(sched).chain_names(hashes[:4], 0)
    assert [h for s in saves for h in s.names[0]] == named.names[0]
    assert all(len(ids) == len(s.names[0]) for s in saves for ids in s.block_ids)
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_saves_carry_each_groups_blocks(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    sched = hybrid_scheduler(tiny_model, "kv_producer")
    sched.add_request(make_request("p", prompt(3 * BS + 5)))
    (save,) = meta_of(sched.schedule()).saves
    full, window = save.block_ids
    assert len(full) == len(window) == len(save.names[0]) == 3
    assert NULL not in full and NULL not in window  # computed this step: every block is real
    assert set(full).isdisjoint(window)
    sched.connector.shutdown()  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------- worker


def hybrid_worker(tiny_model: Path, num_blocks: int = 8) -> tuple[RedisConnector, dict]:
    return make_worker_connector(tiny_model, URL, num_blocks, sliding_window=WINDOW)


def test_each_group_saves_and_loads_its_own_blocks_and_null_blocks_are_never_touched(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    src, src_kv = hybrid_worker(tiny_model)
    for name, cache in src_kv.items():
        for b in range(cache.shape[0]):
            cache[b] = float(b) + (0.5 if name == LAYERS[1] else 0.0)
    hashes = chain_hashes(list(range(3 * BS)), BS)
    # the sliding group's first block is null (its window has passed)
    save = SaveSpec(
        "p", [[1, 2, 3], [NULL, 5, 6]], src.layout.chain_names(hashes, 0).names, 0, "hp"
    )
    run_worker_step(src, RedisConnectorMetadata(saves=[save]))
    run_worker_step(src, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 3, 0)]))
    assert src.worker.shutdown_pending(timeout_s=60) == 0
    keys = {k.decode().rsplit(":", 1)[-1] for k in fake_redis.scan_iter("*:*:*:*")}
    assert {f"{h}.g0" for h in hashes} <= keys
    assert {f"{h}.g1" for h in hashes[1:]} <= keys and f"{hashes[0]}.g1" not in keys

    dst, dst_kv = hybrid_worker(tiny_model)
    before = {name: cache.clone() for name, cache in dst_kv.items()}
    load = LoadSpec("d", [[4, 5, 6], [NULL, NULL, 7]], save.names, timeout_s=30)
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
    # the commit record covers all three: a 3-block hit needs the window's blocks 1 and 2 only
    assert committed_blocks(src, URL, "hp", hashes) == 3
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
    names = layout.chain_names(hashes, 0).names
    store.insert_many([(name, value) for name in names[0]])
    store.close()  # the sliding group's values are missing
    load = LoadSpec("d", [[1, 2], [3, 4]], names, timeout_s=30)
    run_worker_step(conn, RedisConnectorMetadata(loads=[load]))
    results = transfer_results(conn, "d")
    assert results.failed_recving == {"d"}
    assert conn.get_block_ids_with_load_errors() == set()  # vLLM refuses these for >1 group
    conn.shutdown()


def test_a_failed_load_is_reported_once_finished_and_failed_together(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    conn, _kv = hybrid_worker(tiny_model)
    hashes = chain_hashes(list(range(2 * BS)), BS)  # nothing stored: the load fails
    names = conn.layout.chain_names(hashes, 0).names
    run_worker_step(
        conn, RedisConnectorMetadata(loads=[LoadSpec("d", [[1, 2], [3, 4]], names, timeout_s=30)])
    )
    first = transfer_results(conn, "d")
    assert first.failed_recving == {"d"} and "d" in first.finished_recving
    again = conn.get_transfer_results(set())
    assert "d" not in again.finished_recving and "d" not in again.failed_recving
    conn.shutdown()


def test_one_sliding_window_group_fails_loads_per_request_too(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Cut short at a failed block, a sliding-window hit would attend to null blocks before it
    (never loaded): the whole request recomputes instead."""
    conn, _kv = make_worker_connector(tiny_model, URL, 16, sliding_window=WINDOW, sliding_only=True)
    layout = conn.layout
    assert not layout.hybrid and layout.fails_per_request
    hashes = chain_hashes(list(range(6 * BS)), BS)
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    store.insert_many([(h, {n: torch.ones(2, BS, 128) for n in LAYERS}) for h in hashes[4:5]])
    store.close()  # block 5 is missing
    load = LoadSpec("d", [[NULL, NULL, NULL, NULL, 7, 8]], [hashes], timeout_s=30)
    run_worker_step(conn, RedisConnectorMetadata(loads=[load]))
    results = transfer_results(conn, "d")
    assert results.failed_recving == {"d"}
    assert conn.get_block_ids_with_load_errors() == set()
    conn.shutdown()


def test_a_producer_with_a_local_hit_commits_what_a_consumer_can_load(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Request b reuses a's prefix from vLLM's local cache: its sliding-window blocks before
    the window are null and not saved; its commit record still covers every block, since a
    consumer's hit needs only the window."""
    sched = make_scheduler(tiny_model, "kv_producer", url=URL, sliding_window=WINDOW)
    a = make_request("a", prompt(6 * BS + 1))
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), runner_output([a]))
    b = make_request("b", prompt(6 * BS + 1)[: 6 * BS] + [9] * (BS + 3))
    sched.add_request(b)
    (save,) = [s for s in meta_of(sched.schedule()).saves if s.req_id == "b"]
    assert save.first_position == 0 and save.block_ids[1][0] == NULL  # a's window has passed
    conn, _kv = hybrid_worker(tiny_model, num_blocks=64)
    run_worker_step(conn, RedisConnectorMetadata(saves=[save]))
    _, params = sched.connector.request_finished_all_groups(b, ())  # type: ignore[union-attr]
    n = params["redis_kv"]["num_blocks"]  # type: ignore[index]
    run_worker_step(conn, RedisConnectorMetadata(commits=[CommitSpec("b", save.handoff, n, 0)]))
    assert conn.worker.shutdown_pending(timeout_s=30) == 0
    layout = conn.layout
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    state = store.read_handoff(
        save.handoff, [name for at in zip(*save.names, strict=True) for name in at]
    )
    assert n == 7 and state.committed == 7
    store.close()
    sched.connector.shutdown()  # type: ignore[union-attr]
    conn.shutdown()


@pytest.mark.parametrize("table", ["vLLM's own", "the window's rule"])
def test_a_late_save_never_reads_a_window_block_vllm_gave_to_another_request(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch, table: str
) -> None:
    """Found by a review. A prompt that is a local hit up to its last block has its saves held
    until its presence lookup answers (here: never, Redis is slow) or its last prompt step.
    Meanwhile vLLM frees the sliding-window block that left the window and gives it to a new
    request in the same step; the connector's copy of the block table only grows, so the late
    save gathered that request's KV under this one's key. A save reads only blocks the request
    still holds: vLLM's table where it offers it (``kv_connector_block_state``), else the
    window's rule."""
    import threading

    from vllm.v1.core.sched import output as sched_output
    from vllm.v1.outputs import KVConnectorOutput

    from testing.scheduler_harness import model_output

    offer = getattr(sched_output, "KVConnectorBlockState", None)  # (vLLM >= 0.32)
    if table == "vLLM's own" and offer is None:
        pytest.skip("this vLLM offers connectors no block table")
    if table != "vLLM's own" and offer is not None:  # as releases without the offer
        monkeypatch.setattr(offer, "get_block_ids", lambda *a: None)
    url, window = "redis://fake:6379/0", 40  # at 48 tokens computed block 0 is in the window
    sched = make_scheduler(tiny_model, "kv_both", url=url, sliding_window=window, max_batched=8,
                           max_num_seqs=8, num_blocks=22, lookup_wait_s=0.01)  # fmt: skip
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    tokens = prompt(4 * BS, seed=3)
    first = make_request("a", tokens, max_tokens=1)  # its blocks land in vLLM's prefix cache
    sched.add_request(first)
    while not first.is_finished():
        out = sched.schedule()
        sched.update_from_output(out, model_output([first]))
    out = sched.schedule()
    staged = model_output([])
    staged.kv_connector_output = KVConnectorOutput(finished_sending={"a"})
    sched.update_from_output(out, staged)
    slow = threading.Event()  # Redis is slow from now on: a presence lookup never answers
    survey = conn.store.survey
    monkeypatch.setattr(conn.store, "survey", lambda *a, **k: (slow.wait(30), survey(*a, **k))[1])
    try:
        r = make_request("r", tokens, max_tokens=1)  # 48 tokens a local hit, 16 to compute
        sched.add_request(r)
        out = sched.schedule()  # 8 of them; its saves wait for the lookup
        assert out.num_scheduled_tokens == {"r": 8}
        sched.update_from_output(out, model_output([r]))
        sched.scheduler_config.long_prefill_token_threshold = 8  # more come, 8 tokens a step
        sched.max_num_scheduled_tokens = sched.scheduler_config.max_num_batched_tokens = 64
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        others = [make_request(f"q{i}", prompt(8, seed=20 + i), max_tokens=1) for i in range(free)]
        for q in others:
            sched.add_request(q)
        out = sched.schedule()  # r's last 8 tokens: its held saves are planned now
        (save,) = [s for s in out.kv_connector_metadata.saves if s.req_id == "r"]
        now = sched.kv_cache_manager.get_block_ids("r")
        taken = {b for q in others if q.request_id in out.num_scheduled_tokens
                 for b in sched.kv_cache_manager.get_block_ids(q.request_id)[1]}  # fmt: skip
        assert taken & set(sched.connector.scheduler._reqs["r"].block_ids[1])  # type: ignore[union-attr]
        for g, ids in enumerate(save.block_ids):
            for i, b in enumerate(ids):
                assert b in (0, now[g][save.first_position + i]), (g, i, b, now[g])
        # the worker runs the step: the others' forward pass writes their window blocks, then
        # the save is gathered -- none of their KV goes under r's names
        worker, caches = make_worker_connector(tiny_model, url, 22, sliding_window=window)
        for b in taken:
            caches[LAYERS[1]][b].fill_(6.0)
        run_worker_step(worker, RedisConnectorMetadata(saves=[save]))
        assert worker.worker.shutdown_pending(timeout_s=30) == 0
        store = LookupBuffer.from_url(
            url, namespace="vllm", fingerprint=worker.layout.fingerprint(0)
        )
        for value in store.select([n for names in save.names for n in names]):
            assert value is None or not any(bool((t == 6.0).all()) for t in value.values())
        store.close()
        worker.shutdown()
    finally:
        slow.set()
        sched.connector.shutdown()  # type: ignore[union-attr]
