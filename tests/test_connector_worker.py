"""Worker-side transfers between paged KV caches and the store (fakeredis, CPU tensors; the same
tests run on a GPU with ``-m cuda``)."""

from __future__ import annotations

import logging
import time

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from connector.config import KVLayout, RedisConnectorConfig
from connector.metadata import LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.worker import RedisConnectorWorker
from kvstore import LookupBuffer, chain_hashes

LAYERS = ("layer.0", "layer.1")
H, N, C, BLOCKS = 2, 16, 128, 32


def layout() -> KVLayout:
    return KVLayout("m", N, H, 64, "float32", LAYERS, 1)


def make_worker(
    client: fakeredis.FakeRedis,
    *,
    physical: str = "LBHNC",
    device: str = "cpu",
    max_inflight_bytes: int = 64 << 20,
    mode: str = "share",
) -> tuple[RedisConnectorWorker, dict[str, torch.Tensor]]:
    cfg = RedisConnectorConfig(
        url="redis://x", role="kv_both", mode=mode, max_inflight_bytes=max_inflight_bytes
    )
    store = LookupBuffer(client, namespace="w", fingerprint=layout().fingerprint(0))
    worker = RedisConnectorWorker(cfg, layout(), store)
    caches = {}
    for name in LAYERS:
        if physical == "LBHNC":
            t = torch.zeros(BLOCKS, H, N, C, device=device)
        else:  # block-interior token-major: the logical view [B, H, N, C] is a permutation
            t = torch.zeros(BLOCKS, N, H, C, device=device).permute(0, 2, 1, 3)
        caches[name] = t
    worker.register_kv_caches(caches)
    return worker, caches


def fill_random(caches: dict[str, torch.Tensor], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen))


def wait_loaded(worker: RedisConnectorWorker, req_id: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if req_id in worker.get_finished():
            return
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished loading")


def save(worker: RedisConnectorWorker, req: str, block_ids: list[int], hashes: list[str]) -> None:
    worker.wait_for_save(RedisConnectorMetadata(saves=[SaveSpec(req, block_ids, hashes)]))
    worker.shutdown_pending(timeout_s=10)


@pytest.mark.parametrize(("src_layout", "dst_layout"), [("LBHNC", "LBNHC"), ("LBNHC", "LBHNC")])
def test_blocks_move_between_instances_with_different_physical_layouts(
    src_layout: str, dst_layout: str
) -> None:
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, physical=src_layout)
    dst, dst_kv = make_worker(client, physical=dst_layout)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(3 * N)), N)
    save(src, "p", [5, 9, 2], hashes)
    dst.start_load_kv(RedisConnectorMetadata(loads=[LoadSpec("d", [1, 2, 3], hashes, False)]))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        for s, d in zip([5, 9, 2], [1, 2, 3], strict=True):
            assert torch.equal(dst_kv[name][d], src_kv[name][s])
        assert dst_kv[name][0].abs().sum() == 0  # nothing else was written


def test_missing_and_corrupt_blocks_are_reported_and_the_request_still_finishes() -> None:
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client)
    dst, _ = make_worker(client)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(4 * N)), N)
    save(src, "p", [0, 1, 2], hashes[:3])
    key = src.store.redis_key(hashes[1])
    client.setrange(key, client.strlen(key) - 4, b"XXXX")
    dst.start_load_kv(RedisConnectorMetadata(loads=[LoadSpec("d", [10, 11, 12, 13], hashes, True)]))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {11, 13}
    stats = dst.take_stats()
    assert stats["blocks_loaded"] == 2 and stats["blocks_load_failed"] == 2


def test_redis_down_fails_the_blocks_not_the_engine() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    dst, _ = make_worker(client)
    server.connected = False
    hashes = chain_hashes(list(range(2 * N)), N)
    dst.start_load_kv(RedisConnectorMetadata(loads=[LoadSpec("d", [3, 4], hashes, True)]))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {3, 4}
    # saving while Redis is down is counted, never raised into the forward pass
    save(dst, "p", [0, 1], hashes)
    stats = dst.take_stats()
    assert stats["blocks_save_failed"] == 2 and stats["redis_errors"] == 2


def test_saves_are_shed_and_counted_when_staging_is_full() -> None:
    client = fakeredis.FakeRedis()
    worker, _kv = make_worker(client, max_inflight_bytes=1)  # the minimum: 2 staging buffers
    hashes = chain_hashes(list(range(5 * N)), N)
    worker.wait_for_save(RedisConnectorMetadata(saves=[SaveSpec("p", [0, 1, 2, 3, 4], hashes)]))
    worker.shutdown_pending(timeout_s=10)
    stats = worker.take_stats()
    assert stats["blocks_shed"] == 3 and stats["blocks_saved"] == 2
    assert worker.store.contains(hashes) == [True, True, False, False, False]


def test_steady_state_reuses_staging_buffers() -> None:
    client = fakeredis.FakeRedis()
    worker, _kv = make_worker(client)
    pool = worker._save_pool
    assert pool is not None
    before = {b.data_ptr() for b in pool._free}
    for step in range(5):
        hashes = chain_hashes(list(range(step, step + 2 * N)), N)
        save(worker, f"r{step}", [0, 1], hashes)
    assert {b.data_ptr() for b in pool._free} == before


def test_foreign_layout_block_is_refused() -> None:
    client = fakeredis.FakeRedis()
    dst, dst_kv = make_worker(client)
    hashes = chain_hashes(list(range(N)), N)
    # same fingerprint, but tensors of another geometry (e.g. a bug or a hand-written value)
    dst.store.insert(hashes[0], {name: torch.ones(H, N, 64) for name in LAYERS})
    dst.start_load_kv(RedisConnectorMetadata(loads=[LoadSpec("d", [7], hashes, False)]))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {7}
    assert dst_kv[LAYERS[0]][7].abs().sum() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dst_layout", ["LBHNC", "LBNHC"])
def test_cuda_pinned_staging_round_trip(dst_layout: str) -> None:
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, device="cuda")
    dst, dst_kv = make_worker(client, device="cuda", physical=dst_layout)
    assert src._save_pool is not None and src._save_pool.pinned
    fill_random(src_kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    save(src, "p", [3, 4], hashes)
    dst.start_load_kv(RedisConnectorMetadata(loads=[LoadSpec("d", [0, 1], hashes, True)]))
    wait_loaded(dst, "d")
    for name in LAYERS:
        assert torch.equal(dst_kv[name][0], src_kv[name][3])
        assert torch.equal(dst_kv[name][1], src_kv[name][4])


def test_redis_outage_is_logged_sparsely(caplog: pytest.LogCaptureFixture) -> None:
    server = fakeredis.FakeServer()
    dst, _ = make_worker(fakeredis.FakeRedis(server=server))
    server.connected = False
    hashes = chain_hashes(list(range(N)), N)
    with caplog.at_level(logging.WARNING, logger="connector.worker"):
        for i in range(8):
            dst.start_load_kv(RedisConnectorMetadata(loads=[LoadSpec(f"d{i}", [i], hashes, True)]))
            wait_loaded(dst, f"d{i}")
    assert dst.take_stats()["redis_errors"] == 8
    assert len([r for r in caplog.records if "loading from Redis failed" in r.getMessage()]) == 4


def test_failure_counts_log_when_a_total_crosses_a_power_of_two() -> None:
    from connector.stats import FailureCounts

    f = FailureCounts()
    logged = [f.add("shed", n) for n in (3, 1, 1, 1, 1, 4)]
    assert logged == [3, 4, None, None, None, 11]
    assert f["shed"] == 11 and f["other"] == 0
