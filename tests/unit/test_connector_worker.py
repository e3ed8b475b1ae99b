"""Worker-side transfers between paged KV caches and the store (fakeredis, CPU tensors; the same
tests run on a GPU with ``-m cuda``)."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import fakeredis
import pytest
import redis.exceptions as rex
import torch

pytest.importorskip("vllm")

from connector.config import RedisConnectorConfig
from connector.figures import StepShape
from connector.layout import KVLayout
from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.probes import ProbeKind, ProbeSpec
from connector.worker import RedisConnectorWorker
from kvstore import Claim, LookupBuffer, StoreUnavailableError, chain_hashes

pytestmark = pytest.mark.vllm

LAYERS = ("layer.0", "layer.1")
H, N, C, BLOCKS = 2, 16, 128, 32


def layout(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout("m", N, H, 64, str(dtype).replace("torch.", ""), LAYERS, 1)


def shared_kv_buffer(
    physical: str, device: str, dtype: torch.dtype, kernel_split: int = 1
) -> dict[str, torch.Tensor]:
    """Every layer's logical ``[B, H, N, C]`` view into one buffer whose dimensions lie in the
    ``physical`` order (a permutation of L, B, H, N, C), as vLLM 0.33's KV-cache layouts can
    present them: ``LBHNC`` is one plain tensor per layer, ``BLHNC`` is block-first. With
    ``kernel_split`` r, each block is r kernel blocks of N / r tokens, as vLLM presents a cache
    whose attention kernel takes smaller blocks: ``[B * r, H, N / r, C]``."""
    r = kernel_split
    sizes = {"L": len(LAYERS), "B": BLOCKS * r, "H": H, "N": N // r, "C": C}
    buffer = torch.zeros([sizes[d] for d in physical], device=device, dtype=dtype)
    logical = buffer.permute([physical.index(d) for d in "LBHNC"])
    return {name: logical[i] for i, name in enumerate(LAYERS)}


def blocks_of(caches: dict[str, torch.Tensor], ids: list[int]) -> dict[str, torch.Tensor]:
    """Blocks ``ids`` of each layer as ``[len(ids), H, N, C]``, from unsplit or kernel-split
    caches (block b is kernel blocks ``[b * r, (b + 1) * r)``)."""
    out = {}
    for name, t in caches.items():
        r = N // t.shape[2]
        raw = t.view(torch.uint8) if t.element_size() == 1 else t  # (no fp8 indexing kernels)
        kernel = raw.unflatten(0, (t.shape[0] // r, r))[ids]  # [n, r, H, N / r, C]
        out[name] = kernel.transpose(1, 2).reshape(len(ids), H, N, C).view(t.dtype)
    return out


def make_worker(
    client: fakeredis.FakeRedis,
    *,
    physical: str = "LBHNC",
    kernel_split: int = 1,
    device: str = "cpu",
    max_inflight_bytes: int = 64 << 20,
    mode: str = "share",
    compression: str = "none",
    dtype: torch.dtype = torch.float32,
    secret: bytes | None = None,
) -> tuple[RedisConnectorWorker, dict[str, torch.Tensor]]:
    cfg = RedisConnectorConfig(
        url="redis://x",
        role="kv_both",
        mode=mode,
        max_inflight_bytes=max_inflight_bytes,
        compression=compression,
    )
    store = LookupBuffer(
        client,
        namespace="w",
        fingerprint=layout(dtype).fingerprint(0),
        compression=compression,
        secret=secret,
    )
    worker = RedisConnectorWorker(cfg, layout(dtype), store)
    caches = shared_kv_buffer(physical, device, dtype, kernel_split)
    worker.register_kv_caches(caches)
    return worker, caches


def fill_random(caches: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Normal values; for one-byte (fp8) caches every bit pattern, NaNs included: compare
    those with ``same_bytes``."""
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        if t.element_size() == 1:
            raw = torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8)
            t.copy_(raw.view(t.dtype).to(t.device))
        else:
            t.copy_(torch.randn(t.shape, generator=gen))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads included), whatever the dtype and strides."""
    as_bytes = [x.contiguous().cpu().view(torch.uint8) for x in (a, b)]
    return a.dtype == b.dtype and torch.equal(*as_bytes)


def wait_loaded(worker: RedisConnectorWorker, req_id: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if req_id in worker.get_finished()[1]:
            return
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished loading")


def load(req: str, block_ids: list[int], hashes: list[str], **kw: object) -> RedisConnectorMetadata:
    spec = LoadSpec(req, [block_ids], [hashes], timeout_s=kw.pop("timeout_s", 10.0), **kw)  # type: ignore[arg-type]
    return RedisConnectorMetadata(loads=[spec])


def settle(worker: RedisConnectorWorker) -> None:
    """Wait until the worker's transfers are done (an event: a generous bound, for a busy
    machine; a save still running when a test reads Redis failed once on CI)."""
    assert worker.shutdown_pending(timeout_s=120) == 0, "transfers still running after 120 s"


def step(worker: RedisConnectorWorker, meta: RedisConnectorMetadata) -> None:
    """What vLLM's model runner does in a step with a forward pass."""
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)


def save(
    worker: RedisConnectorWorker,
    req: str,
    block_ids: list[int],
    hashes: list[str],
    commit: int | None = None,
) -> None:
    """Save a request's blocks (chain positions 0..) and, with ``commit``, finish it."""
    meta = RedisConnectorMetadata(saves=[SaveSpec(req, [block_ids], [hashes], 0, f"h{req}")])
    step(worker, meta)
    if commit is not None:  # the next step: the request finished
        step(worker, RedisConnectorMetadata(commits=[CommitSpec(req, f"h{req}", commit, 0)]))
    settle(worker)


# Every order of the layer, block, head and token dimensions with the content innermost: one
# tensor per layer (L first), block-first buffers shared by every layer (B first), token-major
# and head-major block interiors. Each is saved from and loaded into the plain layout.
PHYSICAL = ["".join(p) + "C" for p in itertools.permutations("LBHN")]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def move_and_check(
    src_physical: str,
    dst_physical: str,
    dtype: torch.dtype,
    src_split: int = 1,
    dst_split: int = 1,
) -> None:
    """Save blocks 5, 9, 2 from one worker's cache and load them into blocks 1, 2, 3 of
    another's: the same bytes arrive (fp8 NaNs included), and nothing else is written."""
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, physical=src_physical, dtype=dtype, kernel_split=src_split)
    dst, dst_kv = make_worker(client, physical=dst_physical, dtype=dtype, kernel_split=dst_split)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(3 * N)), N)
    save(src, "p", [5, 9, 2], hashes)
    dst.start_load_kv(load("d", [1, 2, 3], hashes))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == set()
    want, got = blocks_of(src_kv, [5, 9, 2]), blocks_of(dst_kv, [1, 2, 3])
    # nothing else was written, in a shared buffer too
    others = blocks_of(dst_kv, [b for b in range(BLOCKS) if b not in (1, 2, 3)])
    for name in LAYERS:
        assert same_bytes(got[name], want[name]), name
        assert int(others[name].contiguous().view(torch.uint8).count_nonzero()) == 0


@pytest.mark.parametrize("physical", PHYSICAL)
@pytest.mark.parametrize("direction", ["save from it", "load into it"])
def test_blocks_move_bit_exact_between_every_kv_layout_and_the_plain_one(
    physical: str, direction: str
) -> None:
    if direction == "save from it":
        move_and_check(physical, "LBHNC", torch.float32)
    else:
        move_and_check("LBHNC", physical, torch.float32)


@pytest.mark.parametrize("physical", ["LBHNC", "LBNHC", "BLHNC"])
@pytest.mark.parametrize(("src_split", "dst_split"), [(4, 1), (1, 2), (2, 4)])
def test_blocks_move_bit_exact_between_caches_split_into_kernel_blocks(
    physical: str, src_split: int, dst_split: int
) -> None:
    """vLLM splits a block into kernel blocks where its attention kernel takes smaller ones
    (``[blocks * r, H, N / r, C]``, block b in kernel blocks ``[b * r, (b + 1) * r)``): the
    stored value is the block's logical ``[H, N, C]`` either way, so split and unsplit
    instances share blocks, and a load writes the block's kernel blocks and nothing else."""
    move_and_check("LBHNC", physical, torch.float32, src_split, dst_split)


def test_a_cache_whose_blocks_do_not_split_evenly_is_refused_at_registration() -> None:
    client = fakeredis.FakeRedis()
    worker, _ = make_worker(client)
    odd = {name: torch.zeros(BLOCKS, H, N - 4, C) for name in LAYERS}  # 12 of 16 tokens
    with pytest.raises(ValueError, match="unexpected per-layer KV view"):
        worker.register_kv_caches(odd)


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize(("src", "dst"), [("LBHNC", "BLNHC"), ("BLNHC", "LBHNC")])
def test_fp8_kv_caches_move_bit_exact(dtype: torch.dtype, src: str, dst: str) -> None:
    """Every fp8 bit pattern (NaNs included) arrives unchanged: blocks move as bytes."""
    move_and_check(src, dst, dtype)


def test_fp8_blocks_are_never_loaded_into_a_cache_of_another_dtype() -> None:
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, dtype=torch.float8_e4m3fn)
    dst, dst_kv = make_worker(client, dtype=torch.bfloat16)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    save(src, "p", [4, 5], hashes)
    dst.start_load_kv(load("d", [1, 2], hashes))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {1, 2}  # recomputed, not mixed
    assert all(int(t.count_nonzero()) == 0 for t in dst_kv.values())


def test_missing_and_corrupt_blocks_are_reported_and_the_request_still_finishes() -> None:
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client)
    dst, _ = make_worker(client)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(4 * N)), N)
    save(src, "p", [0, 1, 2], hashes[:3])
    key = src.store.redis_key(hashes[1])
    client.setrange(key, client.strlen(key) - 4, b"XXXX")
    dst.start_load_kv(load("d", [10, 11, 12, 13], hashes))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {11, 13}
    # what the request got is the scheduler side's to count (once for all TP ranks): the
    # worker counts only its own bytes
    stats = dst.take_stats()
    assert "blocks_loaded" not in stats and 0 < stats["bytes_loaded"] < 4 * dst.movers[0].raw_bytes
    assert stats["values_invalid"] == 1 and stats.get("values_unauthenticated", 0) == 0
    assert "values_invalid" not in dst.take_stats()  # reported once


def test_blocks_saved_without_the_namespace_secret_are_never_loaded_and_are_counted() -> None:
    client = fakeredis.FakeRedis()
    secret = b"the namespace's secret, 32 bytes"
    plain, plain_kv = make_worker(client)
    signed, signed_kv = make_worker(client, secret=secret)
    dst, dst_kv = make_worker(client, secret=secret)
    fill_random(plain_kv)
    fill_random(signed_kv, seed=1)
    hashes = chain_hashes(list(range(4 * N)), N)
    save(plain, "p", [0, 1], hashes[:2])
    save(signed, "s", [2, 3], hashes[2:4])
    dst.start_load_kv(load("d", [10, 11], hashes[:2]))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {10, 11}
    assert all(int(t[[10, 11]].count_nonzero()) == 0 for t in dst_kv.values())
    stats = dst.take_stats()
    assert stats["values_invalid"] == stats["values_unauthenticated"] == 2
    dst.start_load_kv(load("e", [12, 13], hashes[2:4]))
    wait_loaded(dst, "e")
    assert dst.get_block_ids_with_load_errors() == set()
    for name, t in dst_kv.items():
        assert same_bytes(t[[12, 13]], signed_kv[name][[2, 3]])


def test_redis_down_fails_the_blocks_not_the_engine() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    dst, _ = make_worker(client)
    server.connected = False
    hashes = chain_hashes(list(range(2 * N)), N)
    dst.start_load_kv(load("d", [3, 4], hashes))
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
    save(worker, "p", [0, 1, 2, 3, 4], hashes, commit=5)
    stats = worker.take_stats()
    assert stats["blocks_shed"] == 3 and stats["blocks_saved"] == 2
    assert worker.store.contains(hashes) == [True, True, False, False, False]
    # the commit record tells the truth: 2 blocks, not the 5 the scheduler planned
    assert worker.store.read_handoff("hp", hashes).committed == 2
    assert worker.get_finished()[0] == {"p"}


def test_steady_state_reuses_staging_buffers() -> None:
    client = fakeredis.FakeRedis()
    worker, _kv = make_worker(client)
    assert worker.movers
    pool = worker.movers[0]._save_pool
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
    dst.start_load_kv(load("d", [7], hashes))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {7}
    assert dst_kv[LAYERS[0]][7].abs().sum() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dst_layout", ["LBHNC", "LBNHC"])
def test_cuda_pinned_staging_round_trip(dst_layout: str) -> None:
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, device="cuda")
    dst, dst_kv = make_worker(client, device="cuda", physical=dst_layout)
    assert src.movers[0]._save_pool.pinned
    fill_random(src_kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    save(src, "p", [3, 4], hashes)
    dst.start_load_kv(load("d", [0, 1], hashes))
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
            dst.start_load_kv(load(f"d{i}", [i], hashes))
            wait_loaded(dst, f"d{i}")
    assert dst.take_stats()["redis_errors"] == 8
    logged = [r.args["total"] for r in caplog.records if "loading from Redis" in r.msg]  # type: ignore[call-overload,index]
    # a line at the 1st, 2nd, 4th, ... failure of each cause (refused; then circuit open)
    assert 2 <= len(logged) <= 6 and all(t & (t - 1) == 0 for t in logged)


def test_failure_counts_log_when_a_total_crosses_a_power_of_two() -> None:
    from connector.logs import FailureCounts

    f = FailureCounts()
    logged = [f.add("shed", n) for n in (3, 1, 1, 1, 1, 4)]
    assert logged == [3, 4, None, None, None, 11]
    assert f["shed"] == 11 and f["other"] == 0


@pytest.mark.parametrize(
    "error",
    [rex.InvalidResponse("Protocol error"), rex.DataError("bad"), ValueError("x"), KeyError("y")],
)
def test_any_exception_while_loading_still_finishes_the_request(error: Exception) -> None:
    client = fakeredis.FakeRedis()
    dst, _ = make_worker(client)

    def broken(*a: object, **k: object) -> None:
        raise error

    dst.store.select_into = broken  # type: ignore[method-assign]
    hashes = chain_hashes(list(range(2 * N)), N)
    dst.start_load_kv(load("d", [3, 4], hashes))
    wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == {3, 4}


def saved_and_a_fresh_worker() -> tuple[RedisConnectorWorker, dict[str, torch.Tensor], list[str]]:
    """A worker that saved prompt "p" (blocks 0 and 1) and a fresh one on the same store: the
    fresh one, its KV and the prompt's chain hashes."""
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client)
    dst, dst_kv = make_worker(client)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    save(src, "p", [0, 1], hashes)
    return dst, dst_kv, hashes


def test_a_load_past_its_deadline_is_reported_and_the_late_thread_writes_nothing() -> None:
    dst, dst_kv, hashes = saved_and_a_fresh_worker()
    release, answered = threading.Event(), threading.Event()
    real_select = dst.store.select_into

    def hung_select(*a: object, **k: object) -> object:
        release.wait(10)  # Redis stops answering mid-load
        answered.set()
        return real_select(*a, **k)  # type: ignore[arg-type]

    dst.store.select_into = hung_select  # type: ignore[method-assign]
    t0 = time.monotonic()
    dst.start_load_kv(load("d", [5, 6], hashes, timeout_s=0.3))
    wait_loaded(dst, "d")
    assert time.monotonic() - t0 > 0.25  # its timeout ...
    assert not answered.is_set()  # ... not Redis's reply: Redis still hangs
    assert dst.get_block_ids_with_load_errors() == {5, 6}
    release.set()  # the reply arrives late: the blocks may belong to another request now
    settle(dst)
    assert dst_kv[LAYERS[0]][5].abs().sum() == 0 and dst_kv[LAYERS[0]][6].abs().sum() == 0
    assert dst.take_stats()["loads_expired"] == 1


def test_a_load_whose_thread_starts_after_its_deadline_counts_as_expired() -> None:
    """On a busy machine the load thread may start only after the deadline passed (CI: the
    test above then saw no ``loads_expired``, the load counted as a plain failure)."""
    dst, dst_kv, hashes = saved_and_a_fresh_worker()
    dst.start_load_kv(load("d", [5, 6], hashes, timeout_s=0.0))  # past it when the thread runs
    settle(dst)  # (no get_finished before: the thread itself finds the deadline passed)
    assert "d" in dst.get_finished()[1]
    assert dst.get_block_ids_with_load_errors() == {5, 6}
    assert dst_kv[LAYERS[0]][5].abs().sum() == 0
    assert dst.take_stats()["loads_expired"] == 1


def test_a_load_whose_thread_is_still_reporting_at_its_deadline_is_reported_then() -> None:
    """The load thread was preempted right after marking its load reported (a busy machine):
    get_finished at the deadline must still return the load, or vLLM waits a step more than
    the deadline allows (the likely cause of a fuzzer failure under load on CI)."""
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client)
    dst, _ = make_worker(client)
    fill_random(src_kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    save(src, "p", [0, 1], hashes)
    inside, release = threading.Event(), threading.Event()
    real_add = dst.stats.add

    def stalled_add(**counts: int) -> None:
        if "bytes_loaded" in counts and threading.current_thread() is not threading.main_thread():
            inside.set()
            release.wait(10)  # the load thread, descheduled mid-report
        real_add(**counts)

    dst.stats.add = stalled_add  # type: ignore[method-assign]
    t0 = time.monotonic()
    dst.start_load_kv(load("d", [5, 6], hashes, timeout_s=0.2))
    try:
        assert inside.wait(10)
        while time.monotonic() < t0 + 0.2:  # the deadline itself is the event here
            time.sleep(0.01)
        assert "d" in dst.get_finished()[1]
        assert dst.get_block_ids_with_load_errors() == set()  # it had copied everything
    finally:
        release.set()
    settle(dst)


def test_lz4_staging_is_sized_from_the_uncompressed_value_and_round_trips() -> None:
    client = fakeredis.FakeRedis()
    worker, kv = make_worker(client, compression="lz4", max_inflight_bytes=1 << 20)
    assert worker.movers
    # formerly sized from a compressed all-zero block: thousands of buffers, far over the bound
    assert worker.movers[0].staging_bytes <= 1 << 20
    fill_random(kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    save(worker, "p", [0, 1], hashes)
    head = client.getrange(worker.store.redis_key(hashes[0]), 0, 300)
    assert head.find(b'"lz4"') > 0, (head[:80], worker.take_stats())
    other, other_kv = make_worker(client, compression="lz4")
    other.start_load_kv(load("d", [7, 8], hashes))
    wait_loaded(other, "d")
    assert torch.equal(other_kv[LAYERS[1]][8], kv[LAYERS[1]][1])


def test_a_failed_write_ends_the_committed_chain_there() -> None:
    client = fakeredis.FakeRedis()
    worker, _ = make_worker(client)
    hashes = chain_hashes(list(range(4 * N)), N)
    real = worker.store.insert_parts
    calls = []

    def second_write_fails(items, **kw):  # type: ignore[no-untyped-def]
        # by position, not by call order: writer threads may send the two steps either way
        calls.append(kw["positions"])
        if kw["positions"][0] == 2:
            raise StoreUnavailableError("connection reset")
        return real(items, **kw)

    worker.store.insert_parts = second_write_fails  # type: ignore[method-assign]
    step(worker, RedisConnectorMetadata(saves=[SaveSpec("p", [[0, 1]], [hashes[:2]], 0, "hp")]))
    step(worker, RedisConnectorMetadata(saves=[SaveSpec("p", [[2, 3]], [hashes[2:]], 2, "hp")]))
    step(worker, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 4, 0)]))
    settle(worker)
    assert worker.store.read_handoff("hp", hashes).committed == 2
    assert worker.get_finished()[0] == {"p"}


def test_a_consume_load_survives_a_dropped_reply_and_leaves_deleting_to_the_scheduler() -> None:
    """The values are still there after a dropped reply (read again), and still there after
    the load: another rank may read the same value (the scheduler side deletes the chain once
    every rank has reported)."""
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, mode="consume")
    dst, dst_kv = make_worker(client, mode="consume")
    fill_random(src_kv)
    hashes = chain_hashes(list(range(3 * N)), N)
    save(src, "p", [0, 1, 2], hashes, commit=3)
    real_select = dst.store.select_into
    drops = []

    def select_losing_first_reply(*a: object, **k: object) -> object:
        got = real_select(*a, **k)  # type: ignore[arg-type]
        if not drops:
            drops.append(1)
            raise StoreUnavailableError("connection reset by peer")
        return got

    dst.store.select_into = select_losing_first_reply  # type: ignore[method-assign]
    dst.start_load_kv(load("d", [4, 5], hashes[:2], claim="hp", owner="me"))
    wait_loaded(dst, "d")
    settle(dst)
    assert dst.get_block_ids_with_load_errors() == set()
    assert torch.equal(dst_kv[LAYERS[0]][5], src_kv[LAYERS[0]][1])
    assert dst.store.contains(hashes) == [True, True, True]
    assert dst.store.claim_handoff("hp", owner="other") is Claim.TAKEN  # claimed for "me"


def test_a_handoff_whose_load_starts_past_its_deadline_copies_nothing() -> None:
    """The load waited in the queue until its deadline: nothing is copied and the request
    recomputes (the scheduler side deletes the chain when the load is reported)."""
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client, mode="consume")
    dst, dst_kv = make_worker(client, mode="consume")
    fill_random(src_kv)
    hashes = chain_hashes(list(range(3 * N)), N)
    save(src, "p", [0, 1, 2], hashes, commit=3)
    assert client.get(src.store.keys.handoff("hp")) == b"3"
    dst.start_load_kv(load("d", [4, 5, 6], hashes, timeout_s=0.0, claim="hp", owner="me"))
    wait_loaded(dst, "d")
    settle(dst)
    assert dst.get_block_ids_with_load_errors() == {4, 5, 6}
    assert not dst_kv[LAYERS[0]][4:7].any()


def test_a_foreign_layout_is_warned_about_per_cause_not_per_block(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = fakeredis.FakeRedis()
    dst, _ = make_worker(client)
    hashes = chain_hashes(list(range(8 * N)), N)
    for h in hashes:
        dst.store.insert(h, {name: torch.ones(H, N, 64) for name in LAYERS})
    with caplog.at_level(logging.WARNING, logger="connector.worker"):
        dst.start_load_kv(load("d", list(range(8)), hashes))
        wait_loaded(dst, "d")
    assert dst.get_block_ids_with_load_errors() == set(range(8))
    warned = [r.getMessage() for r in caplog.records if "KV layout" in r.msg]
    assert 1 <= len(warned) <= 4 and "(8 so far)" in warned[-1]  # at most at 1st, 2nd, 4th, 8th


def test_a_finished_requests_blocks_are_released_soon_even_if_redis_hangs() -> None:
    client = fakeredis.FakeRedis()
    worker, _ = make_worker(client)
    release, answered = threading.Event(), threading.Event()
    real = worker.store.insert_parts

    def hung_write(*a, **k):  # type: ignore[no-untyped-def]
        release.wait(10)
        answered.set()
        return real(*a, **k)

    worker.store.insert_parts = hung_write  # type: ignore[method-assign]
    hashes = chain_hashes(list(range(2 * N)), N)
    step(worker, RedisConnectorMetadata(saves=[SaveSpec("p", [[0, 1]], [hashes], 0, "hp")]))
    step(worker, RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 2, 0)]))
    finished: set[str] = set()
    while "p" not in finished and not answered.is_set():  # the write hangs 10 s
        finished |= worker.get_finished()[0]
        time.sleep(0.01)
    assert "p" in finished and not answered.is_set()  # not after the write
    release.set()
    settle(worker)
    assert worker.get_finished()[0] == set()  # reported once
    assert worker.store.read_handoff("hp", hashes).committed == 2  # the record still comes


def test_shutting_down_with_queued_work_logs_no_callback_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancelled futures raised CancelledError inside their done-callbacks at shutdown."""
    client = fakeredis.FakeRedis()
    worker, _ = make_worker(client)
    release = threading.Event()
    worker.store.select_into = lambda *a, **k: release.wait(10) or []  # type: ignore[method-assign,assignment]
    hashes = chain_hashes(list(range(N)), N)
    for i in range(4):  # two run (and wait), two stay queued and are cancelled
        worker.start_load_kv(load(f"d{i}", [i], hashes))
    with caplog.at_level(logging.ERROR):
        worker.shutdown(timeout_s=0.1)
        release.set()
    assert not [r for r in caplog.records if "CancelledError" in r.getMessage() + str(r.exc_info)]


def test_a_commit_in_a_step_without_a_forward_pass_is_published() -> None:
    """vLLM 0.30 calls only start_load_kv and get_finished in a step with nothing to compute --
    the step that tells the worker a request finished."""
    client = fakeredis.FakeRedis()
    worker, kv = make_worker(client)
    fill_random(kv)
    hashes = chain_hashes(list(range(2 * N)), N)
    step(worker, RedisConnectorMetadata(saves=[SaveSpec("p", [[0, 1]], [hashes], 0, "hp")]))
    worker.start_load_kv(RedisConnectorMetadata(commits=[CommitSpec("p", "hp", 2, 0)]))
    assert worker.get_finished()[0] == {"p"}
    settle(worker)
    assert worker.store.read_handoff("hp", hashes).committed == 2


def test_a_failed_copy_out_sheds_the_blocks_and_the_commit_still_comes() -> None:
    """An exception while copying blocks out (a CUDA error, pinned memory exhausted) used to
    escape ``wait_for_save`` into vLLM's step."""
    client = fakeredis.FakeRedis()
    worker, _ = make_worker(client)
    assert worker.movers

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("injected: copy failed")

    worker.movers[0].kv.gather = broken  # type: ignore[method-assign]
    hashes = chain_hashes(list(range(2 * N)), N)
    save(worker, "p", [0, 1], hashes, commit=2)  # must not raise
    stats = worker.take_stats()
    assert stats["blocks_shed"] == 2 and stats.get("blocks_saved", 0) == 0
    assert worker.store.contains(hashes) == [False, False]
    # the consumer learns at once that nothing was written: it recomputes, never waits
    assert worker.store.read_handoff("hp", hashes).committed == 0
    assert worker.get_finished()[0] == {"p"}


# ---------------------------------------------------------------------- the load policy's figures
def test_a_load_queued_behind_others_is_timed_from_its_first_request() -> None:
    """A worker runs two loads at a time: a third waits for a thread. Its sample is its own
    time at the store, else a busy worker looks like a slow store. Its lag is from its step to
    vLLM's call that started it: the queue is the policy's to model (``LoadsInFlight``);
    counted in the lag too, it said an idle store's load starts seconds late."""
    client = fakeredis.FakeRedis()
    src, src_kv = make_worker(client)
    dst, _ = make_worker(client)
    fill_random(src_kv)
    chains = [chain_hashes([i] * (2 * N), N) for i in range(3)]
    for i, chain in enumerate(chains):
        save(src, f"p{i}", [2 * i, 2 * i + 1], chain)
    release = threading.Event()
    real_select = dst.store.select_into

    def held(hashes: list[str], *a: object, **k: object) -> object:
        if hashes[0] != chains[2][0]:
            release.wait(10)  # the first two loads hold both threads
        return real_select(hashes, *a, **k)  # type: ignore[arg-type]

    dst.store.select_into = held  # type: ignore[method-assign]
    specs = [LoadSpec(f"d{i}", [[10 + 2 * i, 11 + 2 * i]], [c], 30.0) for i, c in enumerate(chains)]
    meta = RedisConnectorMetadata(loads=specs)
    t0 = time.perf_counter()
    dst.forward_started(meta)
    dst.start_load_kv(meta)
    called_s = time.perf_counter() - t0
    time.sleep(0.3)  # the third load waits for a thread all this while
    release.set()
    settle(dst)
    assert dst.get_finished()[1] == {"d0", "d1", "d2"}
    samples = dst.take_stats()["load_samples"]
    assert len(samples) == 3 and {s[0] for s in samples} == {0}  # rank, bytes, seconds, lag
    third, *held_two = sorted(samples, key=lambda s: s[2])
    assert min(s[2] for s in held_two) >= 0.3  # held at the store
    # its lag is no longer than vLLM's calls took, not the 0.3 s it queued, and its time at
    # the store leaves the queue out too
    assert 0 <= third[3] <= called_s and third[2] < min(s[2] for s in held_two)


def test_loads_that_expire_or_fail_bound_the_bandwidth() -> None:
    dst, _, hashes = saved_and_a_fresh_worker()
    release = threading.Event()
    real_select = dst.store.select_into
    asked: list[float] = []

    def hung_select(*a: object, **k: object) -> object:
        asked.append(time.perf_counter())
        release.wait(10)
        return real_select(*a, **k)  # type: ignore[arg-type]

    dst.store.select_into = hung_select  # type: ignore[method-assign]
    received = time.perf_counter()  # (the 0.3 s count from no earlier than this)
    dst.start_load_kv(load("d", [5, 6], hashes, timeout_s=0.3))
    wait_loaded(dst, "d")
    release.set()
    settle(dst)
    stats = dst.take_stats()
    assert "load_samples" not in stats
    ((rank, landed, seconds, _age),) = stats["load_bounds"]  # nothing landed in ~0.3 s
    # the bound covers the store's time: from the load's first request (no later than the
    # hung read's entry) to its expiry (no earlier than 0.3 s after the worker received it).
    # On a busy machine the load's thread may start late, so a fixed 0.25 s failed in CI
    # beside the other lane (0.19 s). (perf_counter and the deadline's monotonic clock are
    # one clock on Linux; 1 ms for rounding between them.)
    assert (rank, landed) == (0, 0) and asked
    assert seconds >= received + 0.3 - asked[0] - 1e-3


def test_the_compute_fence_of_a_steps_loads_is_the_one_recorded_when_it_was_bound() -> None:
    """vLLM launches a step's forward pass before it starts the step's asynchronous loads: a
    fence recorded then orders the loads' writes after the whole pass. The worker records it
    when the step's metadata is bound, before the pass."""
    dst, _, hashes = saved_and_a_fresh_worker()
    fences: list[str] = []
    waited: list[str] = []

    class Fence:
        def __init__(self, when: str) -> None:
            self.when = when

        def synchronize(self) -> None:
            waited.append(self.when)

    phase = "bound"

    def compute_fence() -> Fence:
        fences.append(phase)
        return Fence(phase)

    for mover in dst.movers:
        mover.compute_fence = compute_fence  # type: ignore[method-assign]
    meta = load("d", [5, 6], hashes)
    dst.forward_started(meta)
    phase = "after the forward pass was launched"  # what vLLM does next
    dst.start_load_kv(meta)
    wait_loaded(dst, "d")
    assert fences == ["bound"] and set(waited) == {"bound"}


def test_a_probe_reads_stored_blocks_into_staging_and_writes_nothing() -> None:
    dst, dst_kv, hashes = saved_and_a_fresh_worker()
    dst.start_load_kv(RedisConnectorMetadata(probes=[ProbeSpec(ProbeKind.WHOLE, hashes)]))
    settle(dst)
    stats = dst.take_stats()
    assert stats["load_probes"] == 1
    ((rank, nbytes, seconds, lag, _age),) = stats["load_samples"]
    block = dst.movers[0].header_bytes + dst.movers[0].raw_bytes
    assert (rank, lag) == (0, -1.0) and nbytes >= 2 * block and seconds > 0
    assert all(int(t.count_nonzero()) == 0 for t in dst_kv.values())  # nothing written
    # by bands, as a split reads: a split figure's sample
    dst.start_load_kv(RedisConnectorMetadata(probes=[ProbeSpec(ProbeKind.BANDS, hashes)]))
    settle(dst)
    ((rank, band_bytes, first, _, bands, _age),) = dst.take_stats()["split_samples"]
    assert bands == 1 and band_bytes >= 2 * dst.movers[0].raw_bytes and first > 0
    # a block not there: no sample (its time says little of the store)
    missing = chain_hashes(list(range(100, 100 + 2 * N)), N)
    dst.start_load_kv(RedisConnectorMetadata(probes=[ProbeSpec(ProbeKind.WHOLE, missing)]))
    settle(dst)
    assert "load_samples" not in dst.take_stats()


def test_a_probe_that_runs_out_of_time_bounds_the_bandwidth() -> None:
    dst, _, hashes = saved_and_a_fresh_worker()
    real_select = dst.store.select_into

    def slow_select(*a: object, **k: object) -> object:
        time.sleep(0.3)
        return real_select(*a, **k)  # type: ignore[arg-type]

    dst.store.select_into = slow_select  # type: ignore[method-assign]
    spec = ProbeSpec(ProbeKind.WHOLE, hashes, timeout_s=0.1)
    dst.start_load_kv(RedisConnectorMetadata(probes=[spec]))
    settle(dst)
    ((rank, _, seconds, _age),) = dst.take_stats()["load_bounds"]
    assert rank == 0 and seconds >= 0.1


def test_a_probe_without_staging_blames_no_store_and_one_of_gone_blocks_says_so() -> None:
    """Found by a review: a probe that found every staging buffer held by users' loads
    recorded an upper bound of 0 bytes over its time -- the store "at most 0 B/s", every hit
    recomputed. The worker's own congestion says nothing of the store. A probe of blocks no
    longer there (evicted; a consume-mode handoff deleted after its load) is no sample either,
    and tells the scheduler side to stop probing them."""
    from datamover import StagingBusyError

    dst, _, hashes = saved_and_a_fresh_worker()
    real_receive = type(dst.movers[0]).receive

    def busy(*a: object, **k: object) -> object:
        raise StagingBusyError("every staging buffer is in use")

    for mover in dst.movers:
        mover.receive = busy  # type: ignore[method-assign]
    dst.start_load_kv(RedisConnectorMetadata(probes=[ProbeSpec(ProbeKind.WHOLE, hashes)]))
    settle(dst)
    stats = dst.take_stats()
    assert stats["load_probes"] == 1 and "load_bounds" not in stats and "load_samples" not in stats
    for mover in dst.movers:
        mover.receive = real_receive.__get__(mover)  # type: ignore[method-assign]
    dst.store.client.flushall()  # the blocks are gone
    probe = ProbeSpec(ProbeKind.WHOLE, hashes, probe_id=7)
    dst.start_load_kv(RedisConnectorMetadata(probes=[probe]))
    settle(dst)
    stats = dst.take_stats()
    assert stats["probe_missing"] == [[7]] and "load_samples" not in stats


def test_forward_passes_are_sampled_with_their_shape_less_their_split_waits() -> None:
    dst, _, _ = saved_and_a_fresh_worker()
    shape = StepShape(
        prefill_tokens=100, prefill_attention=5000.0, decode_rows=3, decode_context=900
    )
    meta = RedisConnectorMetadata(step=shape)
    dst.forward_started(meta)
    time.sleep(0.02)
    dst.wait_for_save(meta)
    ((tokens, attention, rows, context, seconds),) = dst.take_stats()["compute_samples"]
    assert (tokens, attention, rows, context) == (100, 5000.0, 3, 900) and seconds >= 0.02
    dst.forward_started(RedisConnectorMetadata())  # nothing computed: no sample
    dst.wait_for_save(RedisConnectorMetadata())
    assert "compute_samples" not in dst.take_stats()
