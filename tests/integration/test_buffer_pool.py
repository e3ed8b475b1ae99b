"""Recycled receive buffers (``kvstore.net.buffer_pool``): a block is reused only once nothing can
read it any more, and ``select`` results stay intact while later reads recycle memory."""

from __future__ import annotations

import gc

import pytest
import torch

from kvstore import LookupBuffer, chain_hashes
from kvstore.net.buffer_pool import BufferPool, size_class

MIB = 1 << 20


def test_a_block_is_reused_only_after_every_tensor_on_it_is_gone() -> None:
    pool = BufferPool(max_idle_bytes=8 * MIB)
    first = pool.take(MIB + 1000)
    tensor = torch.frombuffer(first, dtype=torch.uint8)[10:20]  # a view, as decode makes
    tensor.fill_(7)
    del first
    gc.collect()
    second = pool.take(MIB + 1000)  # the first block is still viewed: a new one
    torch.frombuffer(second, dtype=torch.uint8).fill_(9)
    assert pool.reused == 0
    assert tensor.tolist() == [7] * 10
    del tensor
    gc.collect()
    third = pool.take(MIB + 1000)
    assert pool.reused == 1
    assert len(third) == MIB + 1000 and not third.readonly


def test_idle_blocks_are_capped_and_sizes_do_not_mix() -> None:
    pool = BufferPool(max_idle_bytes=4 * MIB, max_idle_ceiling_bytes=4 * MIB)  # two 2 MiB blocks
    taken = [pool.take(2 * MIB - 100) for _ in range(3)]
    del taken
    gc.collect()
    assert pool.idle_bytes == 4 * MIB  # the third block was freed, not kept
    big = pool.take(4 * MIB)  # another size class: not served from the smaller blocks
    assert pool.reused == 0 and len(big) == 4 * MIB
    same_class = [pool.take(2 * MIB - 60_000), pool.take(2 * MIB)]  # both round up to 2 MiB
    assert pool.reused == 2 and [len(s) for s in same_class] == [2 * MIB - 60_000, 2 * MIB]


def test_a_whole_batch_in_use_at_once_is_kept_for_the_next_up_to_the_ceiling() -> None:
    pool = BufferPool(max_idle_bytes=4 * MIB, max_idle_ceiling_bytes=20 * MIB)
    batch = [pool.take(2 * MIB) for _ in range(6)]  # 12 MiB in use: above the floor
    del batch
    gc.collect()
    assert pool.idle_bytes == 12 * MIB  # all kept: the next batch the same size reuses them
    again = [pool.take(2 * MIB) for _ in range(6)]
    assert pool.reused == 6
    bigger = [pool.take(2 * MIB) for _ in range(8)]  # 28 MiB in use: above the ceiling
    del again, bigger
    gc.collect()
    assert pool.idle_bytes == 20 * MIB  # kept up to the ceiling, the rest freed


def test_the_limit_follows_the_last_batch_not_the_ceiling() -> None:
    pool = BufferPool(max_idle_bytes=4 * MIB, max_idle_ceiling_bytes=20 * MIB)
    batch = [pool.take(2 * MIB - 100) for _ in range(3)]  # 6 MiB in use at once
    del batch
    gc.collect()
    assert (pool.idle_bytes, pool.in_use_bytes) == (6 * MIB, 0)
    single = pool.take(4 * MIB)  # the next batch: one 4 MiB value
    del single
    gc.collect()
    # that batch's peak (4 MiB, the floor) is the limit now: the 2 MiB blocks, of a size no
    # longer read, made room for the 4 MiB one
    assert (pool.idle_bytes, pool.in_use_bytes) == (4 * MIB, 0)
    again = pool.take(4 * MIB)
    assert pool.reused == 1 and len(again) == 4 * MIB


def test_blocks_of_a_new_size_displace_idle_blocks_of_an_old_one() -> None:
    pool = BufferPool(max_idle_bytes=4 * MIB, max_idle_ceiling_bytes=32 * MIB)
    burst = [pool.take(2 * MIB) for _ in range(32)]  # 64 MiB: idle fills to the ceiling
    del burst
    gc.collect()
    assert pool.idle_bytes == 32 * MIB
    for _ in range(3):  # then batches of 2 values of 8 MiB
        batch = [pool.take(8 * MIB) for _ in range(2)]
        del batch
        gc.collect()
    assert pool.reused == 4  # the second and third batches came from the pool
    assert pool.idle_bytes == 16 * MIB  # the last batch's peak, all of it 8 MiB blocks


def test_an_allocation_that_fails_counts_nothing() -> None:
    pool = BufferPool(max_idle_bytes=4 * MIB, max_idle_ceiling_bytes=20 * MIB)
    with pytest.raises(MemoryError):
        pool.take(1 << 50)  # a petabyte: more than any machine lets numpy have
    assert pool.in_use_bytes == 0 and pool.idle_limit == 4 * MIB


@pytest.mark.parametrize("nbytes", [64 << 10, 65537, 100_000, 196 << 10, 2 * MIB + 1, 5 * MIB])
def test_a_size_class_wastes_at_most_a_sixteenth(nbytes: int) -> None:
    capacity = size_class(nbytes)
    assert nbytes <= capacity <= nbytes + nbytes // 16


def test_small_buffers_are_not_pooled_so_a_kept_one_pins_only_its_size() -> None:
    pool = BufferPool(max_idle_bytes=8 * MIB)
    small = pool.take(1000)
    assert len(small) == 1000 and small.obj.base is None  # type: ignore[union-attr]
    del small
    gc.collect()
    assert pool.idle_bytes == 0


def test_a_closed_pool_keeps_nothing() -> None:
    pool = BufferPool(max_idle_bytes=8 * MIB)
    kept = pool.take(2 * MIB)
    returned = pool.take(2 * MIB)
    del returned
    gc.collect()
    assert pool.idle_bytes == 2 * MIB
    pool.close()
    assert pool.idle_bytes == 0
    del kept  # returned after close: freed, not kept
    gc.collect()
    assert pool.idle_bytes == 0


@pytest.mark.redis
def test_select_results_survive_later_reads_that_recycle_buffers(redis_url: str) -> None:
    store = LookupBuffer.from_url(redis_url, namespace="recycle")
    hashes = chain_hashes(list(range(8 * 16)), 16)
    blocks = [{"kv": torch.full((512, 1024), i, dtype=torch.int32)} for i in range(len(hashes))]
    store.insert_many(list(zip(hashes, blocks, strict=True)))
    kept = store.select(hashes[:4], copy=False)
    for _ in range(3):  # later reads, of other blocks and of the same ones, dropped at once
        store.select(hashes[4:])
        store.select(hashes[:4])
        gc.collect()
    for got, want in zip(kept, blocks[:4], strict=True):
        assert got is not None and torch.equal(got["kv"], want["kv"])
    assert store.stats().recycled_buffers > 0  # the dropped ones were recycled
    consumed = store.drop_select(hashes[:4])
    for got, want in zip(consumed, blocks[:4], strict=True):
        assert got is not None and torch.equal(got["kv"], want["kv"])


@pytest.mark.redis
def test_a_lookup_buffer_recycles_a_whole_batch_above_the_floor(redis_url: str) -> None:
    # 16 values of ~5 MiB: 84 MiB of receive buffers, above the 64 MiB kept before any batch
    store = LookupBuffer.from_url(redis_url, namespace="recycle-batch")
    hashes = chain_hashes(list(range(16 * 16)), 16)
    blocks = [{"kv": torch.full((5 * MIB // 4,), i, dtype=torch.int32)} for i in range(16)]
    store.insert_many(list(zip(hashes, blocks, strict=True)))
    for _ in range(2):
        got = store.select(hashes, copy=False)
        assert all(g is not None for g in got)
        del got
        gc.collect()
    assert store.stats().recycled_buffers == 16  # every value of the second read
    store.close()
