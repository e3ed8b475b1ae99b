"""The data mover: paged KV cache <-> staging <-> store, with torch and kvstore only (no vLLM).

Every test runs on the CPU; the ``cuda`` variants run the same checks on a GPU, where saves go
through device scratch and side streams (``pytest -m cuda``: the GPU suite, which needs only
PyTorch with CUDA, redis-py and a ``redis-server``). The round trip through a real
redis-server is tests/integration/test_datamover_redis.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import fakeredis
import pytest
import redis
import torch

from datamover import BlockMover, PagedKV, SaveItem, StagingBusyError
from datamover.staging import StagingPool
from kvstore import LookupBuffer, StoreUnavailableError, chain_hashes
from testing.kv_caches import (
    DEVICES,
    caches,
    load_all,
    own_fake_client,
    save_all,
    staging_all_free,
    store_on,
)


@pytest.mark.parametrize("device", DEVICES)
def test_stored_values_are_ordinary_kvstore_values(device: str) -> None:
    """What the mover writes, ``LookupBuffer.select`` reads back: same bytes, same format."""
    src = caches(device)
    store = store_on(own_fake_client())
    mover = BlockMover(src, store, max_inflight_bytes=16 << 20)
    hashes = chain_hashes(list(range(3 * 16)), 16)
    save_all(mover, [7, 8, 9], hashes)
    for block_id, value in zip([7, 8, 9], store.select(hashes), strict=True):
        assert value is not None
        for name, t in src.items():
            assert torch.equal(value[name], t[block_id].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_lz4_values_round_trip(device: str) -> None:
    pytest.importorskip("lz4")
    client = own_fake_client()
    src, dst = caches(device), caches(device, seed=None)
    hashes = chain_hashes(list(range(4 * 16)), 16)
    save_all(
        BlockMover(src, store_on(client, "lz4"), max_inflight_bytes=16 << 20), [0, 1, 2, 3], hashes
    )
    loader = BlockMover(dst, store_on(client, "lz4"), max_inflight_bytes=16 << 20)
    assert load_all(loader, [4, 5, 6, 7], hashes) == [4, 5, 6, 7]
    for name in src:
        assert torch.equal(dst[name][4:8], src[name][0:4])


def test_a_long_prompt_streams_through_bounded_staging() -> None:
    """Ten times more blocks than staging holds load in full; staging never grows."""
    client = own_fake_client()
    src, dst = caches("cpu", blocks=128), caches("cpu", blocks=128, seed=None)
    budget = 4 << 20
    saver = BlockMover(src, store_on(client), max_inflight_bytes=64 << 20)
    loader = BlockMover(dst, store_on(client), max_inflight_bytes=budget)
    assert loader.staging_bytes <= budget
    n = 120
    assert n * loader.raw_bytes > 10 * budget // 2
    hashes = chain_hashes(list(range(n * 16)), 16)
    save_all(saver, list(range(n)), hashes)
    assert load_all(loader, list(range(n)), hashes) == list(range(n))
    for name in src:
        assert torch.equal(dst[name][:n], src[name][:n])
    assert loader.staging_bytes <= budget


def test_saves_beyond_staging_are_shed_tail_first_and_staging_is_reused() -> None:
    store = store_on(own_fake_client())
    mover = BlockMover(caches("cpu"), store, max_inflight_bytes=1)  # the minimum
    assert mover.chunk_blocks == 1
    hashes = chain_hashes(list(range(5 * 16)), 16)
    items = [SaveItem(i, h, i, "r") for i, h in enumerate(hashes)]
    chunks, shed = mover.stage_saves(items)
    assert [c.items[0].position for c in chunks] == [0, 1]
    assert [s.position for s in shed] == [2, 3, 4]
    buffers = {c.host.data_ptr() for c in chunks}
    for chunk in chunks:
        mover.write(chunk)
    again, shed = mover.stage_saves(items[2:4])
    assert shed == [] and {c.host.data_ptr() for c in again} == buffers
    for chunk in again:
        mover.write(chunk)
    assert store.longest_prefix(hashes) == 4


def test_a_failed_write_still_releases_its_staging() -> None:
    client = own_fake_client()
    mover = BlockMover(caches("cpu"), store_on(client), max_inflight_bytes=1)
    hashes = chain_hashes(list(range(2 * 16)), 16)
    items = [SaveItem(i, h, i, "r") for i, h in enumerate(hashes)]
    chunks, _ = mover.stage_saves(items)

    def refused() -> None:
        raise redis.ConnectionError("Connection refused")

    client.connection_pool.get_connection = refused  # type: ignore[method-assign]
    for chunk in chunks:
        with pytest.raises(StoreUnavailableError):
            mover.write(chunk)
    del client.connection_pool.get_connection
    chunks, shed = mover.stage_saves(items)
    assert len(chunks) == 2 and shed == []


def test_blocks_of_another_layout_are_counted_not_copied() -> None:
    client = own_fake_client()
    hashes = chain_hashes(list(range(2 * 16)), 16)
    other = caches("cpu", heads=4)  # same namespace and fingerprint, other geometry
    save_all(BlockMover(other, store_on(client), max_inflight_bytes=16 << 20), [0, 1], hashes)
    dst = caches("cpu", seed=None)
    loader = BlockMover(dst, store_on(client), max_inflight_bytes=16 << 20)
    chunks = list(loader.receive([5, 6], hashes, timeout_s=1))
    misfits = 0
    for chunk in loader.receive([5, 6], hashes, timeout_s=1):
        assert chunk.copy_in() == ([], 0)
        misfits += chunk.misfits
    assert misfits == 2 and len(chunks) >= 1
    assert not any(t.any() for t in dst.values())


def test_missing_blocks_are_skipped_and_the_rest_land() -> None:
    client = own_fake_client()
    src, dst = caches("cpu"), caches("cpu", seed=None)
    hashes = chain_hashes(list(range(4 * 16)), 16)
    saver = BlockMover(src, store_on(client), max_inflight_bytes=16 << 20)
    save_all(saver, [0, 1, 2, 3], hashes)
    store_on(client).delete([hashes[1]])
    loader = BlockMover(dst, store_on(client), max_inflight_bytes=16 << 20)
    assert load_all(loader, [10, 11, 12, 13], hashes) == [10, 12, 13]
    assert not any(t[11].any() for t in dst.values())
    for name in src:
        assert torch.equal(dst[name][12], src[name][2])


def test_loads_wait_for_staging_only_until_their_timeout() -> None:
    client = own_fake_client()
    hashes = chain_hashes(list(range(3 * 16)), 16)
    save_all(
        BlockMover(caches("cpu"), store_on(client), max_inflight_bytes=16 << 20), [0, 1, 2], hashes
    )
    loader = BlockMover(caches("cpu", seed=None), store_on(client), max_inflight_bytes=1)
    held = [loader.receive([i], [hashes[i]], timeout_s=1) for i in range(2)]
    for gen in held:
        next(gen)  # each holds one of the two staging buffers
    with pytest.raises(StagingBusyError, match="max_inflight_bytes"):
        next(loader.receive([2], [hashes[2]], timeout_s=0.05))
    held[0].close()  # released: the next load proceeds
    assert load_all(loader, [2], [hashes[2]]) == [2]


def test_paged_kv_refuses_mixed_layers() -> None:
    kv = caches("cpu")
    kv["odd"] = torch.zeros(64, 8, 16, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="every layer must be"):
        PagedKV(kv)


@pytest.mark.cuda
def test_saves_return_before_the_copy_while_the_gpu_is_busy() -> None:
    """``stage_saves`` enqueues; it does not wait for the forward pass nor for the copy."""
    src = caches("cuda", layers=32)
    mover = BlockMover(src, store_on(own_fake_client()), max_inflight_bytes=256 << 20)
    hashes = chain_hashes(list(range(16 * 16)), 16)
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # a stand-in forward pass, hundreds of milliseconds of GPU work
        a = a @ a
        a /= a.norm()
    chunks, shed = mover.stage_saves([SaveItem(i, h, i, "r") for i, h in enumerate(hashes)])
    assert shed == [] and chunks
    assert not chunks[-1].ready.query()  # the copy has not happened yet: we did not wait
    for chunk in chunks:
        mover.write(chunk)  # waits for it on this (writer) thread
    got = mover.store.select(hashes)
    for i, value in enumerate(got):
        assert value is not None
        for name, t in src.items():
            assert torch.equal(value[name], t[i].cpu())


def busy_gpu(stream: torch.cuda.Stream | None = None) -> None:
    """Hundreds of milliseconds of GPU work queued on ``stream`` (the current one if None)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        a = torch.randn(8192, 8192, device="cuda")
        for _ in range(15):
            a = a @ a
            a /= a.norm()


@pytest.mark.cuda
@pytest.mark.parametrize("shed", [False, True])
def test_the_next_forward_pass_overwrites_saved_blocks_only_after_they_were_gathered(
    shed: bool,
) -> None:
    # one-block chunks and two staging buffers; with ``shed`` a writer still holds one, so the
    # second block is shed: the gathers already queued must still hold the forward pass back
    src = caches("cuda", layers=2, blocks=16)
    mover = BlockMover(src, store_on(own_fake_client()), max_inflight_bytes=1)
    assert mover.chunk_blocks == 1
    hashes = chain_hashes(list(range(2 * 16)), 16)
    want = {name: t[3].cpu().clone() for name, t in src.items()}
    held = mover._save_pool.try_acquire() if shed else None
    torch.cuda.synchronize()
    busy_gpu(mover._gather_stream)  # a gather queued behind an earlier chunk's copy
    chunks, shed_items = mover.stage_saves(
        [SaveItem(3, hashes[0], 0, "r"), SaveItem(4, hashes[1], 1, "r")]
    )
    assert (len(chunks), len(shed_items)) == ((1, 1) if shed else (2, 0))
    for t in src.values():  # the next forward pass writes block 3 (reused at once)
        t[3].fill_(7)
    for chunk in chunks:
        mover.write(chunk)
    got = mover.store.select([hashes[0]])[0]
    assert got is not None
    for name in src:
        assert torch.equal(got[name], want[name]), "stored what the next step wrote"
    if held is not None:
        mover._save_pool.release(held)


@pytest.mark.cuda
def test_a_load_writes_after_what_the_compute_stream_had_queued_when_it_started() -> None:
    # vLLM freed block 5 and gave it to this load while the step before, still running on the
    # GPU, ends by writing the block's previous owner's KV into it (or zeroing it)
    dst = caches("cuda", layers=2, blocks=16, seed=None)
    store = store_on(own_fake_client())
    hashes = chain_hashes(list(range(2 * 16)), 16)
    value = {name: torch.full(t.shape[1:], 1.0, dtype=t.dtype) for name, t in dst.items()}
    store.insert_many([(h, value) for h in hashes])
    loader = BlockMover(dst, store, max_inflight_bytes=16 << 20)
    # a first load, so the next one finds pinned memory cached: allocating it anew makes the
    # host wait for the whole device, which would hide what this test looks for
    for chunk in loader.receive([4], [hashes[1]], timeout_s=5):
        chunk.copy_in(loader.compute_fence())
    compute = torch.cuda.Stream()  # vLLM's forward passes run on a stream of its own
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        busy_gpu()
        for t in dst.values():
            t[5].fill_(7)
        fence = loader.compute_fence()  # the load starts, on the thread launching the steps
    for chunk in loader.receive([5], [hashes[0]], timeout_s=5):
        assert chunk.copy_in(fence)[0] == [5]
    torch.cuda.synchronize()
    for name, t in dst.items():
        assert torch.equal(t[5].cpu(), value[name]), "an earlier write landed on the load"


def test_compute_fence_is_none_on_the_cpu() -> None:
    loader = BlockMover(caches("cpu"), store_on(own_fake_client()), max_inflight_bytes=1 << 20)
    assert loader.compute_fence() is None  # the CPU's writes are done when their calls return


@pytest.mark.parametrize("ids", [[5, 6, 7, 1, 2, 9], [3], [0, 2, 4], [10, 11, 12, 13], [4, 3, 2]])
def test_scatter_writes_each_block_where_index_copy_would(ids: list[int]) -> None:
    kv = PagedKV(caches("cpu", blocks=16, seed=None))
    src = torch.randn(len(ids), 4, 8, 16, 256).to(torch.bfloat16)
    kv.scatter(torch.tensor(ids), src)
    for layer, cache in enumerate(kv.caches.values()):
        want = torch.zeros_like(cache).index_copy_(0, torch.tensor(ids), src[:, layer])
        assert torch.equal(cache, want)


@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("ids", [[5, 6, 7, 1, 2, 9], [3], [0, 2, 4], [4, 3, 2], [7, 7]])
def test_gather_reads_each_block_as_index_select_would(ids: list[int], token_major: bool) -> None:
    kv = PagedKV(caches("cpu", blocks=16, token_major=token_major))
    out = torch.full((4, len(ids), 8, 16, 256), -1.0).to(torch.bfloat16)
    kv.gather(torch.tensor(ids), out)
    for layer, cache in enumerate(kv.caches.values()):
        assert torch.equal(out[layer], cache.index_select(0, torch.tensor(ids)))


@pytest.mark.parametrize("ids", [[9, 10], [-3, -2], [10], [-1], [[1, 2]]])
def test_block_ids_outside_the_cache_are_refused_and_nothing_is_written(ids: list[int]) -> None:
    kv = PagedKV(caches("cpu", blocks=10))
    before = {name: t.clone() for name, t in kv.caches.items()}
    n = len(ids)
    with pytest.raises(IndexError, match="block ids"):
        kv.gather(torch.tensor(ids), torch.zeros(4, n, 8, 16, 256, dtype=torch.bfloat16))
    with pytest.raises(IndexError, match="block ids"):
        kv.scatter(torch.tensor(ids), torch.ones(n, 4, 8, 16, 256, dtype=torch.bfloat16))
    for name, t in kv.caches.items():
        assert torch.equal(t, before[name])


def test_a_buffer_of_another_element_size_is_refused_not_converted() -> None:
    kv = PagedKV(caches("cpu", blocks=4, seed=None))  # zeros
    with pytest.raises(TypeError, match="2-byte"):
        kv.scatter(torch.tensor([1]), torch.full((1, 4, 8, 16, 256), 3.0))  # float32
    assert not any(t.any() for t in kv.caches.values())
    with pytest.raises(TypeError, match="2-byte"):
        kv.gather(torch.tensor([1]), torch.zeros(4, 1, 8, 16, 256))


def test_a_cache_on_an_unsupported_device_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="meta"):
        PagedKV({"layer": torch.empty(4, 8, 16, 256, dtype=torch.bfloat16, device="meta")})


def test_a_failed_gather_releases_every_buffer_it_took_and_raises() -> None:
    store = store_on(own_fake_client())
    mover = BlockMover(caches("cpu"), store, max_inflight_bytes=1)  # two one-block chunks
    hashes = chain_hashes(list(range(2 * 16)), 16)
    items = [SaveItem(i, h, i, "r") for i, h in enumerate(hashes)]
    real, calls = mover.kv.gather, []

    def second_gather_fails(ids: torch.Tensor, out: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: copy failed")
        real(ids, out)

    mover.kv.gather = second_gather_fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        mover.stage_saves(items)
    mover.kv.gather = real  # type: ignore[method-assign]
    chunks, shed = mover.stage_saves(items)  # both buffers are free again
    assert len(chunks) == 2 and shed == []
    for chunk in chunks:
        mover.write(chunk)
    assert store.longest_prefix(hashes) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_caches_move_bit_exact_and_are_stored_as_fp8(device: str, dtype: torch.dtype) -> None:
    """An fp8 KV cache (``--kv-cache-dtype fp8``) moves every bit pattern unchanged (CUDA's
    scatter has no fp8 kernel everywhere: blocks move as bytes), and its values say fp8."""
    gen = torch.Generator().manual_seed(3)

    def fp8_cache(fill: bool) -> dict[str, torch.Tensor]:
        shape = (16, 2, 16, 64)
        out = {}
        for i in range(3):
            raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            out[f"l{i}"] = (raw if fill else torch.zeros_like(raw)).view(dtype).to(device)
        return out

    src, dst = fp8_cache(True), fp8_cache(False)
    client = own_fake_client()
    saver = BlockMover(src, store_on(client), max_inflight_bytes=8 << 20)
    loader = BlockMover(dst, store_on(client), max_inflight_bytes=8 << 20)
    hashes = chain_hashes(list(range(4 * 16)), 16)
    save_all(saver, [9, 1, 4, 7], hashes)
    assert sorted(load_all(loader, [2, 3, 5, 6], hashes)) == [2, 3, 5, 6]
    for name in src:
        want = src[name][[9, 1, 4, 7]].cpu().view(torch.uint8)
        assert torch.equal(dst[name][[2, 3, 5, 6]].cpu().view(torch.uint8), want)
    stored = store_on(client).select(hashes[:1])[0]
    assert stored is not None and {t.dtype for t in stored.values()} == {dtype}


class GatedStore:
    """A store whose ``select_into`` calls after the first ``free`` wait until ``gate`` opens
    (and raise ``error`` then, if set): holds a prefetch in flight."""

    def __init__(self, store: LookupBuffer, free: int = 1) -> None:
        self._store = store
        self._free = free
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.error: Exception | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def select_into(self, *args: object, **kwargs: object) -> object:
        if self._free > 0:
            self._free -= 1
        else:
            self.entered.set()
            self.gate.wait()
            if self.error is not None:
                raise self.error
        return self._store.select_into(*args, **kwargs)  # type: ignore[arg-type]


def saved_blocks(client: fakeredis.FakeRedis, n: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    src = caches("cpu")
    hashes = chain_hashes(list(range(n * 16)), 16)
    save_all(BlockMover(src, store_on(client), max_inflight_bytes=64 << 20), list(range(n)), hashes)
    return src, hashes


def test_a_prefetching_load_lands_every_chunk_and_returns_its_staging() -> None:
    client = own_fake_client()
    src, hashes = saved_blocks(client, 12)
    dst = caches("cpu", seed=None)
    with ThreadPoolExecutor(2) as prefetch:
        loader = BlockMover(
            dst, store_on(client), max_inflight_bytes=16 << 20, chunk_bytes=1, prefetch=prefetch
        )
        assert loader.chunk_blocks == 1  # twelve chunks, each received ahead of its copy
        assert load_all(loader, list(range(20, 32)), hashes) == list(range(20, 32))
    for name in src:
        assert torch.equal(dst[name][20:32], src[name][:12])
    assert staging_all_free(loader)


class CountingStore:
    """A store whose ``select_into`` calls after the first wait until ``gate`` opens, counting
    how many are in flight at once: how many chunks a load keeps arriving together."""

    def __init__(self, store: LookupBuffer) -> None:
        self._store = store
        self._first = True
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def select_into(self, *args: object, **kwargs: object) -> object:
        with self._lock:
            self.calls += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            first, self._first = self._first, False
        try:
            if not first:
                self.gate.wait()
            return self._store.select_into(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with self._lock:
                self.in_flight -= 1


def read_ahead_loader(
    cache: dict[str, torch.Tensor],
    store: CountingStore,
    prefetch: ThreadPoolExecutor,
    read_ahead: int,
) -> BlockMover:
    """A loader of one-block chunks reading ``read_ahead`` of them ahead from ``store``."""
    return BlockMover(
        cache,
        store,  # type: ignore[arg-type]
        max_inflight_bytes=64 << 20,
        chunk_bytes=1,
        prefetch=prefetch,
        read_ahead=read_ahead,
    )


@pytest.mark.parametrize("read_ahead", [1, 3])
def test_a_load_keeps_read_ahead_chunks_arriving_and_lands_every_one(read_ahead: int) -> None:
    # a load reads ``read_ahead`` chunks ahead, so several masters and connections stay busy
    # across chunk boundaries; every chunk still lands, in order, and every buffer comes back
    client = own_fake_client()
    src, hashes = saved_blocks(client, 9)
    dst = caches("cpu", seed=None)
    counting = CountingStore(store_on(client))
    with ThreadPoolExecutor(4) as prefetch:
        loader = read_ahead_loader(dst, counting, prefetch, read_ahead)
        chunks = loader.receive(list(range(20, 29)), hashes, timeout_s=60)
        assert next(chunks).copy_in()[0] == [20]  # the chunks read ahead wait at the gate
        wait_until(lambda: counting.in_flight == read_ahead, f"{read_ahead} chunks in flight")
        counting.gate.set()
        assert [c.copy_in()[0] for c in chunks] == [[i] for i in range(21, 29)]
    assert counting.most_in_flight == read_ahead
    for name in src:
        assert torch.equal(dst[name][20:29], src[name][:9])
    assert staging_all_free(loader)


def test_a_load_abandoned_with_chunks_read_ahead_gives_every_buffer_back() -> None:
    client = own_fake_client()
    _, hashes = saved_blocks(client, 6)
    dst = caches("cpu", seed=None)
    counting = CountingStore(store_on(client))
    with ThreadPoolExecutor(4) as prefetch:
        loader = read_ahead_loader(dst, counting, prefetch, 3)
        chunks = loader.receive(list(range(40, 46)), hashes, timeout_s=60)
        assert next(chunks).copy_in()[0] == [40]
        wait_until(lambda: counting.in_flight == 3, "three chunks read ahead")
        chunks.close()  # the load is over: three chunks still arriving
        counting.gate.set()
    assert staging_all_free(loader)
    assert not any(t[41:46].any() for t in dst.values())


def test_a_load_abandoned_with_chunks_queued_never_fetches_them() -> None:
    # one prefetch thread, three chunks read ahead: one is being received, two wait in the
    # queue. A load that ends (its deadline passed) must not go on reading the queued ones
    client = own_fake_client()
    _, hashes = saved_blocks(client, 6)
    counting = CountingStore(store_on(client))
    with ThreadPoolExecutor(1) as prefetch:
        loader = read_ahead_loader(caches("cpu", seed=None), counting, prefetch, 3)
        chunks = loader.receive(list(range(40, 46)), hashes, timeout_s=60)
        assert next(chunks).copy_in()[0] == [40]
        wait_until(lambda: counting.in_flight == 1, "the first chunk read ahead")
        chunks.close()
        counting.gate.set()
    assert counting.calls == 2  # the first chunk, and the one already under way
    assert staging_all_free(loader)


def test_an_abandoned_prefetch_writes_no_block_and_gives_its_staging_back() -> None:
    # the caller stops after the first chunk (its deadline passed) while the second is being
    # received ahead: that chunk must never reach the cache, and its buffer comes back
    client = own_fake_client()
    _, hashes = saved_blocks(client, 2)
    dst = caches("cpu", seed=None)
    gated = GatedStore(store_on(client))
    with ThreadPoolExecutor(1) as prefetch:
        loader = BlockMover(
            dst,
            gated,
            max_inflight_bytes=16 << 20,
            chunk_bytes=1,
            prefetch=prefetch,  # type: ignore[arg-type]
        )
        chunks = loader.receive([40, 41], hashes, timeout_s=5)
        first = next(chunks)
        assert first.copy_in()[0] == [40]
        assert gated.entered.wait(60)  # the second chunk is being received ahead
        chunks.close()  # the load is over
        gated.gate.set()
    assert staging_all_free(loader)
    assert not any(t[41].any() for t in dst.values())


def test_a_failed_prefetch_raises_at_its_chunk_and_gives_its_staging_back() -> None:
    client = own_fake_client()
    _, hashes = saved_blocks(client, 2)
    gated = GatedStore(store_on(client))
    gated.error = StoreUnavailableError("Redis went away")
    gated.gate.set()
    with ThreadPoolExecutor(1) as prefetch:
        loader = BlockMover(
            caches("cpu", seed=None),
            gated,
            max_inflight_bytes=16 << 20,
            chunk_bytes=1,
            prefetch=prefetch,  # type: ignore[arg-type]
        )
        chunks = loader.receive([40, 41], hashes, timeout_s=5)
        assert next(chunks).copy_in()[0] == [40]
        with pytest.raises(StoreUnavailableError, match="went away"):
            next(chunks)
    assert staging_all_free(loader)


def test_a_load_after_its_prefetch_threads_stopped_still_lands() -> None:
    client = own_fake_client()
    src, hashes = saved_blocks(client, 3)
    dst = caches("cpu", seed=None)
    prefetch = ThreadPoolExecutor(1)
    prefetch.shutdown()  # the worker shutting down while a load runs
    loader = BlockMover(
        dst, store_on(client), max_inflight_bytes=16 << 20, chunk_bytes=1, prefetch=prefetch
    )
    assert load_all(loader, [50, 51, 52], hashes) == [50, 51, 52]
    for name in src:
        assert torch.equal(dst[name][50:53], src[name][:3])
    assert staging_all_free(loader)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition`` (a state another thread reaches), failing after a minute."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_a_prefetch_cancelled_by_shutdown_gives_its_staging_back() -> None:
    # the worker shuts its prefetch threads down with cancel_futures=True: a read-ahead still
    # queued never runs, and its buffer must still come back, whether the load goes on or not
    client = own_fake_client()
    src, hashes = saved_blocks(client, 4)
    dst = caches("cpu", seed=None)
    for load_goes_on in (True, False):
        prefetch = ThreadPoolExecutor(1)
        busy = threading.Event()
        prefetch.submit(busy.wait)  # its one thread is busy: read-aheads queue
        loader = BlockMover(
            dst, store_on(client), max_inflight_bytes=16 << 20, chunk_bytes=1, prefetch=prefetch
        )
        chunks = loader.receive([60, 61], hashes[:2], timeout_s=5)
        assert next(chunks).copy_in()[0] == [60]  # the second chunk is queued behind `busy`
        prefetch.shutdown(wait=False, cancel_futures=True)
        busy.set()
        if load_goes_on:
            assert [c.copy_in()[0] for c in chunks] == [[61]]  # received without reading ahead
            assert torch.equal(
                dst["model.layers.0.self_attn"][61], src["model.layers.0.self_attn"][1]
            )
        else:
            chunks.close()
        assert staging_all_free(loader)


def test_a_spare_buffer_is_never_one_a_caller_waits_for() -> None:
    pool = StagingPool(16, 1)
    held = pool.try_acquire()
    assert held is not None and pool.try_acquire_spare() is None
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(60)))
    waiter.start()
    wait_until(lambda: pool.waiting == 1, "the waiter")
    pool.release(held)
    assert pool.try_acquire_spare() is None  # the waiter's, whether it woke yet or not
    waiter.join(60)
    assert got and got[0] is not None and pool.waiting == 0
    pool.release(got[0])  # type: ignore[arg-type]
    assert pool.try_acquire_spare() is not None  # nobody waits: a spare is a spare
