"""Mamba / gated delta-net state groups, in vLLM's align cache mode, through vLLM's real
Scheduler and KV-cache specs (a 2-layer attention group and gated delta-net layers with a group
each) and worker-role connectors on real CPU caches (a state layer's cache is a padded int8
page per block, as vLLM's model runner presents it), the store on fakeredis.

What must hold: a state block at chain position p holds the state after (p + 1) blocks, and is
saved only from the exact block vLLM offers at a chunk end (a state table is rewritten in
place: never read by position); a hit of n blocks needs every attention block before n and
each state group's state at n - 1, nothing else; a load writes the state bytes of that one
block (not its page's padding, never the null block) and fails the whole request when any
value is missing; a loaded state offered again is not saved again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import RequestStatus

from connector.chains import handoff_salt
from connector.layout import NO_BLOCK, KVLayout, UnsupportedModelError
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.redis_connector import RedisConnector, SupportsHMA
from kvstore import LookupBuffer, chain_hashes
from kvstore.values.keys import BlockName
from testing.scheduler_harness import (
    BS,
    LAYERS,
    STATE_BYTES,
    STATE_LAYERS,
    STATE_PAGE,
    committed_blocks,
    make_configs,
    make_request,
    make_scheduler,
    make_worker_connector,
    model_output,
    prompt,
    run_worker_step,
    runner_output,
    state_spec,
    transfer_results,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        SupportsHMA is None or not issubclass(RedisConnector, SupportsHMA),
        reason="this vLLM cannot take a load failure per request",
    ),
]

URL = "redis://fake:6379/0"
NULL = 0
STATES = 2  # gated delta-net layers, a group each


def meta_of(out: Any) -> RedisConnectorMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, RedisConnectorMetadata)
    return meta


def names(layout: KVLayout, chain: list[str]) -> list[list[BlockName]]:
    """Every group's block names of ``chain`` (generation 0), as load and save specs carry
    them."""
    return layout.chain_names(chain, 0).names


def layout_for(tiny_model: Path, **kw: Any) -> KVLayout:
    vllm_config, config = make_configs(tiny_model, "kv_both", url=URL, **kw)
    return KVLayout.from_vllm(vllm_config, config, None)


def scheduler(tiny_model: Path, role: str = "kv_both", **kw: Any) -> Any:
    return make_scheduler(tiny_model, role, url=URL, state_layers=STATES, **kw)  # type: ignore[arg-type]


def run_steps(sched: Any, req: Any, steps: int = 8) -> list[SaveSpec]:
    """Schedule ``req`` until it is done computing its prompt (or ``steps`` run out); every
    save planned, in order."""
    saves: list[SaveSpec] = []
    for _ in range(steps):
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            break
        saves += meta_of(out).saves
        sched.update_from_output(out, model_output([req]))
    return saves


def state_saves(saves: list[SaveSpec]) -> list[tuple[int, list[list[int]]]]:
    """(position, block ids per group) of the saves that carry a state."""
    return [
        (s.first_position, s.block_ids)
        for s in saves
        if any(ids != [NO_BLOCK] * len(ids) for ids in s.block_ids[1:])
    ]


# ---------------------------------------------------------------------------------- layout


def test_state_groups_get_keys_and_a_fingerprint_that_names_their_states(
    tiny_model: Path,
) -> None:
    layout = layout_for(tiny_model, state_layers=STATES)
    assert [str(g.kind) for g in layout.groups] == ["full"] + ["state=GDN_ATTN"] * STATES
    assert [g.layer_names for g in layout.groups[1:]] == [(n,) for n in STATE_LAYERS[:STATES]]
    assert layout.chain_names(["ab"], 0).by_position() == ["ab.g0", "ab.g1", "ab.g2"]
    state = layout.groups[1]
    assert (state.num_kv_heads, state.head_size, state.dtype) == (1, STATE_BYTES, "int8")
    assert state.holds(5) and not state.holds(NULL) and not state.holds(NO_BLOCK)
    # another state geometry (e.g. a conv state in the other orientation) is another layout
    vllm_config, config = make_configs(tiny_model, "kv_both", url=URL, state_layers=STATES)
    spec = state_spec()
    flipped = type(spec)(**{**spec.__dict__, "shapes": ((24, 3), (2, 8, 8))})
    other = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[
            *config.kv_cache_groups[:-1],
            KVCacheGroupSpec(config.kv_cache_groups[-1].layer_names, flipped),
        ],
    )
    assert KVLayout.from_vllm(vllm_config, other, None).fingerprint(0) != layout.fingerprint(0)
    # and the attention-only model keeps its own
    assert layout_for(tiny_model).fingerprint(0) != layout.fingerprint(0)


def test_a_mamba2_hybrid_is_stored_as_a_gated_delta_net_is_under_its_own_fingerprint(
    tiny_model: Path,
) -> None:
    """vLLM's CPU build cannot run a Mamba2 hybrid with prefix caching (an IndexError in its
    mamba_mixer2): the spec is checked here, the code path is the gated delta-net's."""
    vllm_config, config = make_configs(tiny_model, "kv_both", url=URL)
    mamba2 = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[
            *config.kv_cache_groups,
            KVCacheGroupSpec(["mixer"], state_spec(mamba_type="MAMBA2")),
        ],
    )
    layout = KVLayout.from_vllm(vllm_config, mamba2, None)
    assert [str(g.kind) for g in layout.groups] == ["full", "state=MAMBA2"]
    assert layout.fails_per_request and layout.groups[1].first_needed(4, BS) == 3
    assert layout.fingerprint(0) != layout_for(tiny_model, state_layers=1).fingerprint(0)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"mode": "none"}, "'align' Mamba cache mode"),
        ({"speculative_blocks": 2}, "speculative decoding"),
    ],
)
def test_state_groups_vllm_cannot_hand_over_are_refused_at_startup_saying_what_to_change(
    tiny_model: Path, spec: dict, match: str
) -> None:
    vllm_config, config = make_configs(tiny_model, "kv_both", url=URL)
    with_state = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[*config.kv_cache_groups, KVCacheGroupSpec(["mixer"], state_spec(**spec))],
    )
    with pytest.raises(UnsupportedModelError, match=match):
        KVLayout.from_vllm(vllm_config, with_state, None)


def test_state_groups_are_refused_on_a_vllm_that_does_not_name_committed_states(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without vLLM's offers no state would ever be saved (and no hit ever made): refused."""
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = dict(SchedulerOutput.__dataclass_fields__)
    fields.pop("kv_connector_block_state")
    monkeypatch.setattr(SchedulerOutput, "__dataclass_fields__", fields)
    with pytest.raises(UnsupportedModelError, match="kv_connector_block_state"):
        layout_for(tiny_model, state_layers=STATES)


def test_a_state_model_is_stored_rank_by_rank(tiny_model: Path) -> None:
    vllm_config, config = make_configs(tiny_model, "kv_both", url=URL, state_layers=STATES)
    with pytest.raises(UnsupportedModelError, match="rank by rank"):
        KVLayout.from_vllm(vllm_config, config, None, store_tp_size=2)


def test_a_hit_needs_every_attention_block_and_each_state_at_its_end(tiny_model: Path) -> None:
    layout = layout_for(tiny_model, state_layers=STATES)
    states = {1, 3}  # the chunk ends a producer committed

    def present(missing: set[tuple[int, int]] = frozenset()) -> Any:  # type: ignore[assignment]
        return lambda g, p: (g, p) not in missing and (g == 0 or p in states)

    assert layout.usable_prefix(present(), 0, 6) == 4  # the state after block 3
    assert layout.usable_prefix(present({(2, 3)}), 0, 6) == 2  # one group lacks it
    assert layout.usable_prefix(present({(0, 2)}), 0, 6) == 2  # an attention block is missing
    assert layout.usable_prefix(present(), 0, 1) == 0  # no state after block 0
    assert layout.usable_prefix(present(), 2, 6) == 4  # before 2: vLLM's own, never asked


# ---------------------------------------------------------------------------------- scheduler


def test_a_producer_saves_attention_by_position_and_states_only_from_vllms_offers(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Chunks of two blocks end at tokens 32, 64, then 80 (align mode stops the last chunk at
    the prompt's last whole block): vLLM offers the states there, and each is saved from the
    exact block offered, at position 1, 3 and 4."""
    sched = scheduler(tiny_model, "kv_producer", max_batched=2 * BS)
    req = make_request("p", prompt(5 * BS + 3))
    sched.add_request(req)
    saves = run_steps(sched, req)
    attention = [
        (s.first_position, s.block_ids[0]) for s in saves if NO_BLOCK not in s.block_ids[0]
    ]
    assert [p for p, _ in attention] == [0, 2, 4]
    assert all(ids == [NO_BLOCK] * len(s.names[0]) for s in saves if s.block_ids[0][0] != NO_BLOCK
               for ids in s.block_ids[1:])  # fmt: skip
    got = state_saves(saves)
    assert sorted({p for p, _ in got}) == [1, 3, 4]
    for p, ids in got:  # one real block of one state group per save, at its position
        real = [(g, b) for g, group_ids in enumerate(ids) for b in group_ids if b != NO_BLOCK]
        assert len(real) == 1 and real[0][0] >= 1 and real[0][1] != NULL, (p, ids)
    # each offered block is the one vLLM keeps the state in: the blocks differ across states
    offered = [b for _, ids in got for group_ids in ids[1:] for b in group_ids if b != NO_BLOCK]
    assert len(set(offered)) == len(offered) == 3 * STATES
    sched.connector.shutdown()


def seed(layout: KVLayout, hashes: list[str], blocks: int, states: set[int]) -> None:
    """Attention values of the first ``blocks`` positions and states at ``states``."""
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    items = []
    named = names(layout, hashes[:blocks])
    for p in range(len(named[0])):
        items.append((named[0][p], {n: torch.zeros(2, BS, 128) for n in LAYERS}))
        if p in states:
            for g, group in enumerate(layout.groups[1:], 1):
                state = {group.layer_names[0]: torch.zeros(1, 1, STATE_BYTES, dtype=torch.int8)}
                items.append((named[g][p], state))
    store.insert_many(items)
    store.close()


def seeded(tiny_model: Path, tokens: list[int], blocks: int, states: set[int]) -> Any:
    """A share-mode scheduler with a prompt's first ``blocks`` attention blocks and the states
    at ``states`` in the store, that prompt added as request "r"; its chain too."""
    sched = scheduler(tiny_model)
    hashes = chain_hashes(tokens, BS)
    seed(sched.connector.layout, hashes, blocks, states)
    req = make_request("r", tokens)
    sched.add_request(req)
    return sched, req, hashes


def test_a_consumer_loads_the_attention_blocks_and_the_one_state_at_the_hits_end(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched, _, hashes = seeded(tiny_model, prompt(6 * BS + 1), 6, states={1, 3})
    (load,) = meta_of(sched.schedule()).loads
    assert load.names == names(sched.connector.layout, hashes[:4])
    attention, *states = load.block_ids
    assert NULL not in attention and len(attention) == 4
    for ids in states:  # vLLM allocated the state at the hit's end alone
        assert ids[:3] == [NULL] * 3 and ids[3] != NULL
    sched.connector.shutdown()


def test_a_loaded_state_offered_again_is_not_saved_again(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched, req, hashes = seeded(tiny_model, prompt(5 * BS + 3), 2, states={1})
    out = sched.schedule()
    (load,) = meta_of(out).loads
    assert load.names == names(sched.connector.layout, hashes[:2])
    sched.update_from_output(out, runner_output([], recving={"r"}))
    saves = run_steps(sched, req)
    assert [s.first_position for s in saves if s.block_ids[0][0] != NO_BLOCK] == [2]
    # the loaded state at position 1 is cached by vLLM and offered again: only the state at
    # the prompt's last whole block (position 4) is new
    assert sorted({p for p, _ in state_saves(saves)}) == [4]
    sched.connector.shutdown()


# ---------------------------------------------------------------------------------- worker


def state_worker(
    tiny_model: Path, num_blocks: int = 8, state_type: str = "GDN_ATTN"
) -> tuple[RedisConnector, dict]:
    return make_worker_connector(
        tiny_model, URL, num_blocks, state_layers=STATES, state_type=state_type
    )


def pages(cache: torch.Tensor) -> torch.Tensor:
    """A state layer's whole pages, padding included: ``[blocks, page]`` of int8."""
    return cache.as_strided((cache.shape[0], STATE_PAGE), (STATE_PAGE, 1))


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        if t.dtype == torch.int8:
            pages(t).copy_(torch.randint(-128, 128, pages(t).shape, generator=gen).to(torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=gen))


@pytest.mark.parametrize("state_type", ["GDN_ATTN", "MAMBA2"])
def test_states_round_trip_bit_exact_writing_only_their_bytes(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, state_type: str
) -> None:
    """Gated delta-net (Qwen3-Next) and Mamba2 (Granite-4, Nemotron-H) layers' states: a
    conv state and a recurrent state in one page each, as vLLM lays them out."""
    src, src_kv = state_worker(tiny_model, state_type=state_type)
    fill(src_kv, 1)
    hashes = chain_hashes(list(range(3 * BS)), BS)
    named = src.layout.chain_names(hashes, 0)
    saves = [
        SaveSpec("p", [[1, 2, 3], [NO_BLOCK] * 3, [NO_BLOCK] * 3], named.span(0, 3), 0, "hp"),
        SaveSpec("p", [[NO_BLOCK], [5], [6]], named.span(2, 3), 2, "hp"),  # the offered states
    ]
    run_worker_step(src, RedisConnectorMetadata(saves=saves))
    run_worker_step(src, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 3, 0)]))
    assert src.worker.shutdown_pending(timeout_s=60) == 0
    stored = {k.decode().rsplit(":", 1)[-1] for k in fake_redis.scan_iter("kv:vllm:*.g*")}
    assert {f"{h}.g0" for h in hashes} <= stored
    assert {k for k in stored if not k.endswith(".g0")} == {f"{hashes[2]}.g1", f"{hashes[2]}.g2"}

    dst, dst_kv = state_worker(tiny_model, state_type=state_type)
    fill(dst_kv, 2)
    before = {
        name: pages(t).clone() if t.dtype == torch.int8 else t.clone() for name, t in dst_kv.items()
    }
    ids = [[4, 5, 6], [NULL, NULL, 7], [NULL, NULL, 1]]
    load = LoadSpec("d", ids, names(dst.layout, hashes), timeout_s=30)
    run_worker_step(dst, RedisConnectorMetadata(loads=[load]))
    assert transfer_results(dst, "d").failed_recving == set()
    attention = dst_kv[LAYERS[0]]
    assert torch.equal(attention[[4, 5, 6]], src_kv[LAYERS[0]][[1, 2, 3]])
    for name, (dst_block, src_block) in zip(STATE_LAYERS, [(7, 5), (1, 6)], strict=False):
        assert torch.equal(dst_kv[name][dst_block], src_kv[name][src_block]), name
        now = pages(dst_kv[name])
        # the page's padding, and every other block (the null block least of all), untouched
        assert torch.equal(now[dst_block, STATE_BYTES:], before[name][dst_block, STATE_BYTES:])
        others = [b for b in range(now.shape[0]) if b != dst_block]
        assert torch.equal(now[others], before[name][others]), name
    # the commit record: a consumer can load all 3 blocks (the states after block 2 are there)
    assert committed_blocks(src, URL, "hp", hashes) == 3
    src.shutdown()
    dst.shutdown()


def test_a_commit_record_ends_at_the_last_state_saved(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Attention blocks were saved up to position 4 but the last state at position 1: a
    consumer can load 2 blocks, not 5."""
    src, _ = state_worker(tiny_model)
    hashes = chain_hashes(list(range(5 * BS)), BS)
    named = src.layout.chain_names(hashes, 0)
    saves = [
        SaveSpec("p", [[1, 2, 3, 4, 5], [NO_BLOCK] * 5, [NO_BLOCK] * 5], named.span(0, 5), 0, "hp"),
        SaveSpec("p", [[NO_BLOCK], [6], [7]], named.span(1, 2), 1, "hp"),
    ]
    run_worker_step(src, RedisConnectorMetadata(saves=saves))
    run_worker_step(src, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 5, 0)]))
    assert src.worker.shutdown_pending(timeout_s=60) == 0
    assert committed_blocks(src, URL, "hp", hashes) == 2
    src.shutdown()


def test_events_announce_each_state_only_where_a_load_can_end(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Issue 38, item 4: events named every attention block up to the last saved state as one
    chain, with no group, so a router took prompts sharing 1 to 5 blocks for hits that loaded
    nothing. Now the ranks report where a load can end, and the events name each group as
    vLLM's own events of a hybrid model do: the attention blocks, and each state group's block
    only where a state was saved."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from connector.events import KVEventsEmitter, event_groups

    if "group_idx" not in BlockStored.__struct_fields__:
        pytest.skip("this vLLM's events name no KV-cache group")
    conn, _ = make_worker_connector(
        tiny_model, URL, 8, state_layers=STATES, state_type="GDN_ATTN", kv_events=True
    )
    tokens = prompt(6 * BS)
    hashes = chain_hashes(tokens, BS)
    named = conn.layout.chain_names(hashes, 0)
    saves = [
        SaveSpec("p", [[1, 2, 3, 4, 5], [NO_BLOCK] * 5, [NO_BLOCK] * 5], named.span(0, 5), 0, "hp"),
        SaveSpec("p", [[NO_BLOCK], [6], [7]], named.span(1, 2), 1, "hp"),  # states after 2 blocks
        SaveSpec("p", [[NO_BLOCK], [6], [7]], named.span(3, 4), 3, "hp"),  # and after 4
    ]
    run_worker_step(conn, RedisConnectorMetadata(saves=saves))
    run_worker_step(conn, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 5, 0)]))
    assert conn.worker.shutdown_pending(timeout_s=60) == 0
    conn.get_finished(set())
    reports = conn.get_kv_connector_kv_cache_events()
    assert reports is not None and reports.get_all_events() == [("p", 4, [2, 4])]
    _, kv_cache_config = make_configs(
        tiny_model, "kv_both", url=URL, num_blocks=8, state_layers=STATES
    )
    layout = conn.layout
    emitter = KVEventsEmitter(
        BS, BS, ranks=1, namespace="vllm", groups=event_groups(layout, kv_cache_config)
    )
    request = make_request("p", tokens)
    emitter.watch(request, 0, 5)
    emitter.reported(reports)
    events = emitter.take()
    vllm_hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    by_group = {
        g: [(e.block_hashes, e.parent_block_hash) for e in events if e.group_idx == g]
        for g in range(len(layout.groups))
    }
    assert by_group[0] == [(vllm_hashes[:4], None)]  # attention: the blocks confirmed
    for g in range(1, len(layout.groups)):  # each state group: where a load can end only
        assert by_group[g] == [
            ([vllm_hashes[1]], vllm_hashes[0]),
            ([vllm_hashes[3]], vllm_hashes[2]),
        ]
    assert {e.kv_cache_spec_kind for e in events if e.group_idx != 0} != {None}
    conn.shutdown()


def test_a_missing_state_fails_the_whole_request(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    conn, kv = state_worker(tiny_model)
    fill(kv, 3)
    before = {name: t.clone() for name, t in kv.items()}
    layout = conn.layout
    hashes = chain_hashes(list(range(2 * BS)), BS)
    seed(layout, hashes, 2, states=set())  # attention there, the states not
    load = LoadSpec("d", [[1, 2], [NULL, 3], [NULL, 4]], names(layout, hashes), timeout_s=30)
    run_worker_step(conn, RedisConnectorMetadata(loads=[load]))
    assert transfer_results(conn, "d").failed_recving == {"d"}
    assert conn.get_block_ids_with_load_errors() == set()  # vLLM takes it per request
    for name in STATE_LAYERS[:STATES]:
        assert torch.equal(kv[name], before[name])
    conn.shutdown()


def test_each_tensor_parallel_rank_stores_and_loads_its_own_state(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    """A state is cut by rank (its heads are the rank's share of the layer's), not by KV head:
    at TP 2 each rank writes its state under its own fingerprint and reads back its own."""
    from connector.config import RedisConnectorConfig
    from connector.group_kinds import GroupKind
    from connector.layout import KVGroup
    from connector.worker import RedisConnectorWorker
    from testing.scheduler_harness import state_pages

    state_layer = STATE_LAYERS[0]
    groups = (
        KVGroup(0, GroupKind.parse("full"), tuple(LAYERS), 1, 128, "float32"),
        KVGroup(
            1, GroupKind.parse("state=GDN_ATTN"), (state_layer,), 1, STATE_BYTES, "int8", state="{}"
        ),
    )
    layout = KVLayout("m", BS, 1, 128, "float32", (*LAYERS, state_layer), 2, groups=groups)
    assert layout.store_tp_size == 2 and len(set(layout.all_fingerprints())) == 2
    cfg = RedisConnectorConfig(url=URL, role="kv_both", mode="share")
    hashes = chain_hashes(list(range(2 * BS)), BS)

    def rank(r: int, seed_: int) -> tuple[RedisConnectorWorker, dict[str, torch.Tensor]]:
        (head_slice,) = layout.slices_read(r)
        store = LookupBuffer(
            fake_redis, namespace="vllm", fingerprint=layout.fingerprint(head_slice.index)
        )
        worker = RedisConnectorWorker(cfg, layout, store, tp_rank=r)
        kv = {name: torch.zeros(8, 1, BS, 128) for name in LAYERS}
        kv[state_layer] = state_pages(8)
        fill(kv, seed_)
        worker.register_kv_caches(kv)
        return worker, kv

    saved = []
    for r in range(2):
        worker, kv = rank(r, seed_=10 + r)
        worker.start_load_kv(RedisConnectorMetadata())
        worker.wait_for_save(
            RedisConnectorMetadata(
                saves=[
                    SaveSpec("p", [[1, 2], [NO_BLOCK] * 2], names(layout, hashes), 0, "hp"),
                    SaveSpec("p", [[NO_BLOCK], [3]], names(layout, hashes[1:]), 1, "hp"),
                ]
            )
        )
        assert worker.shutdown_pending(timeout_s=60) == 0
        stats = worker.take_stats()  # (on failure: shed, failed or never staged)
        assert stats.get("blocks_saved") == 3 and not stats.get("blocks_shed"), stats
        saved.append(kv)
    assert len(fake_redis.keys("kv:vllm:*.g1")) == 2, fake_redis.keys("*")  # a state per rank
    for r in range(2):
        worker, kv = rank(r, seed_=20 + r)
        worker.start_load_kv(
            RedisConnectorMetadata(
                loads=[LoadSpec("d", [[4, 5], [NULL, 6]], names(layout, hashes), 30.0)]
            )
        )
        deadline = time.monotonic() + 30
        while "d" not in worker.get_finished()[1]:
            assert time.monotonic() < deadline, "the load never finished"
            time.sleep(0.01)
        assert worker.get_block_ids_with_load_errors() == set()
        assert torch.equal(kv[state_layer][6], saved[r][state_layer][3]), r
        assert torch.equal(kv[LAYERS[0]][[4, 5]], saved[r][LAYERS[0]][[1, 2]]), r
        worker.shutdown()


def finish_request(sched: Any, worker: RedisConnector, req: Any) -> dict | None:
    """Run ``req`` through vLLM's scheduler and the worker until it finishes and its commit
    has reached the worker; its kv_transfer_params."""
    params = None
    for _ in range(20):
        out = sched.schedule()
        run_worker_step(worker, meta_of(out))
        for eco in sched.update_from_output(out, model_output([req])).values():
            for o in eco.outputs:
                if o.finished:
                    params = o.kv_transfer_params
        if not sched.has_requests():
            break
    run_worker_step(worker, meta_of(sched.schedule()))  # carries the commit
    assert worker.connector_worker is not None
    assert worker.connector_worker.shutdown_pending(timeout_s=60) == 0
    return params


def test_a_model_of_states_alone_hands_off_its_states(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """A Mamba model (no attention layer): its chain is its states'. A producer's commit and
    params cover the states it saved, its worker forgets the request, and a consumer loads the
    state at the hit's end alone."""
    pure = {"state_layers": STATES, "attention": False, "max_batched": 2 * BS}
    sched = make_scheduler(tiny_model, "kv_producer", url=URL, **pure)
    producer, kv = make_worker_connector(tiny_model, URL, 64, role="kv_producer", **pure)
    fill(kv, 4)
    req = make_request("p", prompt(5 * BS + 3), max_tokens=1)
    sched.add_request(req)
    params = finish_request(sched, producer, req)
    assert params is not None and params["redis_kv"]["num_blocks"] == 5  # states at 1, 3, 4
    assert producer.connector_worker.tracked_requests() == set()  # type: ignore[union-attr]
    records = [k for k in fake_redis.scan_iter("kv:vllm:*:handoff:*")]
    assert [fake_redis.get(k) for k in records] == [b"5"]  # committed, not left "pending"

    consumer = make_scheduler(tiny_model, "kv_consumer", url=URL, **pure)
    consumer.add_request(make_request("c", prompt(5 * BS + 3), params))
    for _ in range(50):
        loads = meta_of(consumer.schedule()).loads
        if loads:
            break
        time.sleep(0.01)
    (load,) = loads
    assert len(load.names[0]) == 5
    for ids in load.block_ids:
        assert ids[:4] == [NULL] * 4 and ids[4] != NULL
    for s in (sched, consumer):
        s.connector.shutdown()
    producer.shutdown()


def test_a_state_saved_before_any_attention_block_is_committed_when_its_request_ends(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """A kv_both instance in consume mode loads a producer's handoff; when vLLM takes the
    finished load it caches the loaded state and offers it again, in a step that schedules
    nothing of the request (20 decoding requests leave 12 tokens of a 32-token budget, and the
    align split ends a prefill chunk only on a block boundary). The connector saves that state
    under the request's own chain; the request is then aborted. Its saves must still be
    committed: the worker forgets it, and no "pending" record is left behind."""
    cfg: dict[str, Any] = {
        "state_layers": STATES,
        "mode": "consume",
        "max_batched": 2 * BS,
        "max_num_seqs": 32,
    }
    sched = make_scheduler(tiny_model, "kv_both", url=URL, **cfg)
    worker, _ = make_worker_connector(tiny_model, URL, 1000, role="kv_both", **cfg)
    layout = sched.connector.layout
    decoding = [make_request(f"d{i}", [3 + i] * 5, max_tokens=500) for i in range(20)]
    for r in decoding:
        sched.add_request(r)

    def step(recving: set[str] | None = None) -> Any:
        out = sched.schedule()
        run_worker_step(worker, meta_of(out))
        ran = [r for r in decoding if r.request_id in out.num_scheduled_tokens]
        sched.update_from_output(out, runner_output(ran, recving=recving))
        return out

    for _ in range(3):
        step()
    # a producer's handoff of 3 blocks: attention, and the states after block 2
    tokens = prompt(3 * BS + 20)
    chain = chain_hashes(tokens, BS, handoff_salt("", "feed1234"))
    seed(layout, chain, 3, states={2})
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    store.publish_handoff("feed1234", 3)
    store.close()
    params = {
        "redis_kv": {
            "handoff": "feed1234",
            "scope": "handoff",
            "num_blocks": 3,
            "last_hash": chain[2],
            "namespace": "vllm",
            "block_size": BS,
        }
    }
    sched.add_request(make_request("b", tokens, params=params))
    loading = offered = False
    for _ in range(100):
        out = sched.schedule()
        meta = meta_of(out)
        offered = any(s.req_id == "b" for s in meta.saves) and "b" not in out.num_scheduled_tokens
        run_worker_step(worker, meta)
        recving = {"b"} if any(s.req_id == "b" for s in meta.loads) else None
        loading = loading or bool(recving)
        ran = [r for r in decoding if r.request_id in out.num_scheduled_tokens]
        sched.update_from_output(out, runner_output(ran, recving=recving))
        if offered:
            break
        time.sleep(0.01)
    assert loading and offered, "the loaded state was saved in a step that ran nothing of b"
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):  # the next steps carry the commit to the worker
        step()
    assert worker.connector_worker is not None
    assert worker.connector_worker.shutdown_pending(timeout_s=60) == 0
    assert "b" not in worker.connector_worker.tracked_requests()
    records = [fake_redis.get(k) for k in fake_redis.scan_iter("kv:vllm:*:handoff:*")]
    assert b"pending" not in records
    worker.shutdown()
    sched.connector.shutdown()
