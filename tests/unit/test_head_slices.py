"""Blocks stored as KV-head slices, so instances of different tensor-parallel sizes share them
and heads that several ranks hold (GQA with more ranks than KV heads, MLA's latent) are stored
once. Layout arithmetic, then real workers (each rank its own cache, fakeredis)."""

from __future__ import annotations

import time

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from connector.config import RedisConnectorConfig
from connector.layout import KVLayout, UnsupportedModelError
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.worker import RedisConnectorWorker
from kvstore import LookupBuffer, chain_hashes, layout_fingerprint

pytestmark = pytest.mark.vllm

LAYERS = ("layer.0", "layer.1")
HEADS, N, C, BLOCKS = 4, 16, 32, 12


def layout(tp: int, store_tp: int = 0, heads: int = HEADS) -> KVLayout:
    per_rank = max(1, heads // tp)
    return KVLayout(
        "m", N, per_rank, C, "float32", LAYERS, tp, total_kv_heads=heads, store_tp_size=store_tp
    )


def slices(lay: KVLayout, rank: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    return [(s.index, s.value_range, s.cache_heads) for s in lay.slices_read(rank)]


def test_by_default_each_rank_stores_its_own_heads_as_it_always_did() -> None:
    lay = layout(tp=2)
    assert lay.store_tp_size == 2
    assert [slices(lay, r) for r in range(2)] == [[(0, (0, 2), (0, 2))], [(1, (0, 2), (0, 2))]]
    assert [[s.index for s in lay.slices_written(r)] for r in range(2)] == [[0], [1]]
    # the fingerprint a rank had before slices: keys stored then are still found
    for rank in range(2):
        assert lay.fingerprint(rank) == layout_fingerprint(
            {
                "layout": "logical-HNC/1",
                "model": "m",
                "revision": None,
                "quantization": None,
                "hf_overrides": None,
                "block_size": N,
                "num_kv_heads": 2,
                "head_size": C,
                "dtype": "float32",
                "kv_cache_dtype": "auto",
                "layers": list(LAYERS),
                "tp_rank": rank,
                "tp_size": 2,
            }
        )


def test_the_same_store_tp_size_gives_every_tp_size_the_same_keys() -> None:
    tp1, tp2, tp4 = layout(1, 2), layout(2, 2), layout(4, 2)
    assert tp1.all_fingerprints() == tp2.all_fingerprints() == tp4.all_fingerprints()
    # TP 1 writes both slices and reads both into its halves
    assert slices(tp1, 0) == [(0, (0, 2), (0, 2)), (1, (0, 2), (2, 4))]
    assert [s.index for s in tp1.slices_written(0)] == [0, 1]
    # TP 4 reads the half of a slice its heads are, and cannot write (no rank holds a slice)
    assert [slices(tp4, r) for r in range(4)] == [
        [(0, (0, 1), (0, 1))],
        [(0, (1, 2), (0, 1))],
        [(1, (0, 1), (0, 1))],
        [(1, (1, 2), (0, 1))],
    ]
    assert not tp4.can_write_slices and tp4.slices_written(0) == []


def test_heads_several_ranks_hold_are_written_once() -> None:
    gqa = layout(tp=8, heads=4)  # ranks 2k and 2k+1 hold head k
    assert gqa.store_tp_size == 4
    assert [[s.index for s in gqa.slices_written(r)] for r in range(8)] == [
        [0],
        [],
        [1],
        [],
        [2],
        [],
        [3],
        [],
    ]
    assert [slices(gqa, r)[0][0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    mla = layout(tp=4, heads=1)  # one latent, on every rank
    assert len(mla.all_fingerprints()) == 1
    assert [[s.index for s in mla.slices_written(r)] for r in range(4)] == [[0], [], [], []]
    assert all(slices(mla, r) == [(0, (0, 1), (0, 1))] for r in range(4))


@pytest.mark.parametrize(("heads", "tp_a", "tp_b"), [(2, 2, 4), (8, 8, 16), (1, 1, 8), (4, 1, 2)])
def test_tp_sizes_share_blocks_only_when_store_tp_size_is_set(
    heads: int, tp_a: int, tp_b: int
) -> None:
    """KV computed at another TP size is not bit-identical (other partial sums): left at its
    default, store_tp_size keeps each TP size's blocks apart, even where the slices would match
    (GQA at TP >= heads, MLA's one latent); set alike, it shares them."""
    a, b = layout(tp_a, heads=heads), layout(tp_b, heads=heads)
    assert not set(a.all_fingerprints()) & set(b.all_fingerprints())
    s = min(tp_a, heads)
    a, b = layout(tp_a, s, heads=heads), layout(tp_b, s, heads=heads)
    assert a.all_fingerprints() == b.all_fingerprints()


@pytest.mark.parametrize(("heads", "tp", "store_tp"), [(2, 1, 2), (4, 2, 4), (1, 2, 1), (8, 4, 8)])
def test_only_instances_that_both_set_store_tp_size_share_blocks(
    heads: int, tp: int, store_tp: int
) -> None:
    """Issue 38, item 5: an instance at TP ``store_tp`` that left store_tp_size unset wrote and
    read the very keys an opted-in instance of another TP size writes, so it loaded KV
    computed at another TP size (not bit-identical) though it never asked to."""
    opted = layout(tp, store_tp, heads=heads)
    unset = layout(store_tp, heads=heads)  # the slices match: TP store_tp's own keys
    assert not set(opted.all_fingerprints()) & set(unset.all_fingerprints())
    assert opted.all_fingerprints() == layout(store_tp, store_tp, heads=heads).all_fingerprints()


def test_a_store_tp_size_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="must divide the model's 4 KV heads"):
        layout(tp=1, store_tp=3)
    with pytest.raises(UnsupportedModelError, match="latent is one"):
        layout(tp=2, heads=1, store_tp=2)


def make_rank(
    client: fakeredis.FakeRedis,
    tp: int,
    rank: int,
    store_tp: int = 0,
    heads: int = HEADS,
    role: str = "kv_both",
) -> tuple[RedisConnectorWorker, dict[str, torch.Tensor]]:
    lay = layout(tp, store_tp, heads)
    cfg = RedisConnectorConfig(url="redis://x", role=role, mode="share")
    first = lay.slices_read(rank)[0].index
    store = LookupBuffer(client, namespace="w", fingerprint=lay.fingerprint(first))
    worker = RedisConnectorWorker(cfg, lay, store, tp_rank=rank)
    caches = {name: torch.zeros(BLOCKS, lay.num_kv_heads, N, C) for name in LAYERS}
    worker.register_kv_caches(caches)
    return worker, caches


def whole_model_kv(seed: int = 0, heads: int = HEADS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(BLOCKS, heads, N, C, generator=gen) for name in LAYERS}


def rank_heads(tp: int, rank: int, heads: int = HEADS) -> slice:
    per = max(1, heads // tp)
    first = rank // max(1, tp // heads) * per
    return slice(first, first + per)


def settle(worker: RedisConnectorWorker) -> None:
    assert worker.shutdown_pending(timeout_s=120) == 0


def save(worker: RedisConnectorWorker, block_ids: list[int], hashes: list[str]) -> None:
    worker.start_load_kv(RedisConnectorMetadata())
    worker.wait_for_save(
        RedisConnectorMetadata(saves=[SaveSpec("p", [block_ids], [hashes], 0, "hp")])
    )
    worker.start_load_kv(RedisConnectorMetadata(commits=[CommitSpec("p", "hp", len(hashes), 0)]))
    worker.wait_for_save(RedisConnectorMetadata())
    settle(worker)


def load(worker: RedisConnectorWorker, block_ids: list[int], hashes: list[str]) -> set[int]:
    """Load and wait; returns the failed block ids."""
    worker.start_load_kv(
        RedisConnectorMetadata(loads=[LoadSpec("d", [block_ids], [hashes], timeout_s=30.0)])
    )
    deadline = time.monotonic() + 60
    while "d" not in worker.get_finished()[1]:
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.01)
    return worker.get_block_ids_with_load_errors()


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "store_tp"),
    [(1, 2, 2), (2, 1, 2), (1, 4, 4), (4, 1, 4), (2, 4, 4), (1, 2, 1), (1, 4, 2)],
    ids=lambda v: str(v),
)
def test_blocks_saved_at_one_tp_size_load_bit_exact_at_another(
    src_tp: int, dst_tp: int, store_tp: int
) -> None:
    client = fakeredis.FakeRedis()
    model = whole_model_kv()
    hashes = chain_hashes(list(range(3 * N)), N)
    for rank in range(src_tp):
        src, kv = make_rank(client, src_tp, rank, store_tp)
        for name in LAYERS:
            kv[name].copy_(model[name][:, rank_heads(src_tp, rank)])
        save(src, [2, 7, 9], hashes)
    # a writer of whole slices writes each value once
    assert len(client.keys("kv:w:*:[0-9a-f]*")) == 3 * store_tp
    role = "kv_both" if layout(dst_tp, store_tp).can_write_slices else "kv_consumer"
    for rank in range(dst_tp):
        dst, kv = make_rank(client, dst_tp, rank, store_tp, role=role)
        assert load(dst, [0, 1, 5], hashes) == set()
        heads = rank_heads(dst_tp, rank)
        for name in LAYERS:
            assert torch.equal(kv[name][[0, 1, 5]], model[name][[2, 7, 9]][:, heads])
            others = [b for b in range(BLOCKS) if b not in (0, 1, 5)]
            assert int(kv[name][others].count_nonzero()) == 0


def test_mla_latent_is_stored_once_at_any_tp_size_and_read_by_every_rank() -> None:
    client = fakeredis.FakeRedis()
    model = whole_model_kv(heads=1)
    hashes = chain_hashes(list(range(2 * N)), N)
    for rank in range(4):  # every rank holds the same latent (shared with other TP sizes)
        src, kv = make_rank(client, 4, rank, store_tp=1, heads=1)
        for name in LAYERS:
            kv[name].copy_(model[name])
        save(src, [3, 4], hashes)
    assert len(client.keys("kv:w:*:[0-9a-f]*")) == 2  # once, not once per rank
    for tp in (1, 2):
        for rank in range(tp):
            dst, kv = make_rank(client, tp, rank, store_tp=1, heads=1)
            assert load(dst, [0, 1], hashes) == set()
            for name in LAYERS:
                assert torch.equal(kv[name][[0, 1]], model[name][[3, 4]])


def test_a_block_missing_one_of_its_slices_fails_and_its_commit_record_says_so() -> None:
    client = fakeredis.FakeRedis()
    model = whole_model_kv()
    hashes = chain_hashes(list(range(3 * N)), N)
    src, kv = make_rank(client, 1, 0, store_tp=2)
    for name in LAYERS:
        kv[name].copy_(model[name])
    save(src, [2, 7, 9], hashes)
    lay = layout(1, 2)
    assert src.store.read_handoff("hp", hashes, lay.all_fingerprints()).committed == 3
    src.store.delete(hashes[1:2], [lay.fingerprint(1)])  # slice 1 of the second block is gone
    assert src.store.longest_prefix(hashes, lay.all_fingerprints()) == 1
    dst, _ = make_rank(client, 2, 0, store_tp=2)  # reads slice 0 only: all there
    assert load(dst, [0, 1, 5], hashes) == set()
    dst, _ = make_rank(client, 2, 1, store_tp=2)  # reads slice 1: the second block fails
    assert load(dst, [0, 1, 5], hashes) == {1}
    whole, _ = make_rank(client, 1, 0, store_tp=2)  # reads both: the second block fails
    assert load(whole, [0, 1, 5], hashes) == {1}
