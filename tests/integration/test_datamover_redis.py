"""The data mover (``datamover``) against a real redis-server: a save and a load through it, on
the CPU and, in the GPU suite (``pytest -m cuda``, scripts/gpu_suite.sh), on a GPU; and the
read-ahead's staging hand-over between loads on several threads, which fakeredis could not
serve reliably (a value SET was, once in CI, not found by a read on another thread's
connection: ``testing.kv_caches.own_fake_client``). Its tests on fakeredis are in
tests/unit/test_datamover.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import torch

from datamover import BlockMover
from kvstore import DeadlinePassedError, chain_hashes
from testing.kv_caches import DEVICES, caches, load_all, save_all, staging_all_free, store_on
from testing.redis_server import RedisServer
from testing.relay import DelayRelay


@pytest.mark.redis
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("token_major", [False, True])
def test_save_then_load_into_another_cache_is_bit_exact(
    redis_url: str, device: str, token_major: bool
) -> None:
    layers = 32 if device == "cuda" else 4
    src = caches(device, layers=layers)
    dst = caches(device, layers=layers, seed=None, token_major=token_major)
    client = redis.Redis.from_url(redis_url)
    # small chunks, so one call spans several chunks and several connections; staging for
    # all 20 blocks (a block is 2 MiB at the GPU's 32 layers, 256 KiB at the CPU's 4)
    mib = 1 << 20
    kw = {
        "max_inflight_bytes": (256 if device == "cuda" else 64) * mib,
        "chunk_bytes": (8 if device == "cuda" else 4) * mib,
        "connections": 3,
    }
    saver = BlockMover(src, store_on(client), **kw)
    loader = BlockMover(dst, store_on(client), **kw)
    assert 1 < saver.chunk_blocks < 20
    hashes = chain_hashes(list(range(20 * 16)), 16)
    src_ids = [3 * i + 1 for i in range(20)]
    dst_ids = list(range(40, 60))
    save_all(saver, src_ids, hashes)
    assert sorted(load_all(loader, dst_ids, hashes)) == dst_ids
    for name in src:
        assert torch.equal(dst[name][dst_ids].cpu(), src[name][src_ids].cpu())
        untouched = [i for i in range(64) if i not in dst_ids]
        assert not dst[name][untouched].any()


@pytest.mark.redis
def test_reading_ahead_never_takes_a_buffer_a_waiting_load_needs(redis_url: str) -> None:
    # load A holds one buffer for its chunk and one for the chunk it reads ahead; load B waits.
    # When A moves on, the buffer it frees must go to B, not to A's next read-ahead
    client = redis.Redis.from_url(redis_url)
    hashes = chain_hashes(list(range(6 * 16)), 16)
    saver = BlockMover(caches("cpu"), store_on(client), max_inflight_bytes=64 << 20)
    save_all(saver, list(range(6)), hashes)
    with ThreadPoolExecutor(2) as prefetch:
        loader = BlockMover(
            caches("cpu", seed=None),
            store_on(client),
            max_inflight_bytes=1,  # two staging buffers of one block each
            chunk_bytes=1,
            prefetch=prefetch,
        )
        assert loader._load_pool.count == 2
        a = loader.receive(list(range(30, 34)), hashes[:4], timeout_s=60)
        assert next(a).copy_in()[0] == [30]  # A: a chunk, and the next one read ahead
        b_got: list[list[int]] = []
        b = threading.Thread(
            target=lambda: b_got.append(
                next(loader.receive([40], hashes[4:5], timeout_s=60)).copy_in()[0]
            )
        )
        b.start()
        deadline = time.monotonic() + 60
        while loader._load_pool.waiting != 1:  # load B waits for staging
            assert time.monotonic() < deadline, "load B never waited for staging"
            time.sleep(0.001)
        # A moves on while B cannot run yet (the test holds the pool's lock, which A may
        # take again: it is re-entrant): A's freed buffer must be left for B
        with loader._load_pool._cond:
            assert next(a).copy_in()[0] == [31]
        b.join(60)
        assert b_got == [[40]]
        assert list(chunk.copy_in()[0] for chunk in a) == [[32], [33]]
    assert staging_all_free(loader)


@pytest.mark.redis
@pytest.mark.parametrize("read", ["chunks", "one band", "bands"])
def test_a_load_from_a_store_too_slow_for_its_deadline_ends_there(
    redis_server: RedisServer, read: str
) -> None:
    """A store that answers every value well within the value's own deadline, but too slowly
    for the load's: the load ends at its deadline, typed, its staging back -- not after the
    chunk's 15 values had all come: a loader thread stayed in a chunk for up to 15 times a
    value's deadline, long after vLLM had given up on the load. Whole values (one chunk),
    a split's first band read whole (heads), and its bands of layers."""
    hashes = chain_hashes(list(range(15 * 16)), 16)
    saver = BlockMover(
        caches("cpu"), store_on(redis.Redis(port=redis_server.port)), max_inflight_bytes=16 << 20
    )
    save_all(saver, list(range(15)), hashes)
    # 1.2 MB/s: each 256 KiB value in 0.2 s (its own deadline: 60 s + 0.25 s), the chunk's 15
    # in 3.3 s, where the load has 0.5 s
    with DelayRelay("127.0.0.1", redis_server.port, 0.0, rate_bytes_per_s=1.2e6) as relay:
        loader = BlockMover(
            caches("cpu", seed=None),
            store_on(redis.Redis.from_url(relay.url)),
            max_inflight_bytes=16 << 20,
            chunk_bytes=4 << 20,
        )
        assert loader.chunk_blocks == 15  # (a value is its 256 KiB and a header)
        ids = list(range(40, 55))
        if read == "chunks":
            pieces: Any = loader.receive(ids, hashes, timeout_s=0.5)
        else:
            bands = loader.layer_bands(1 << 40 if read == "one band" else 0)
            assert len(bands) == (1 if read == "one band" else 4)
            pieces = loader.receive_bands(ids, hashes, bands, timeout_s=0.5)
        with pytest.raises(DeadlinePassedError):
            for piece in pieces:
                piece.copy_in()
        assert staging_all_free(loader)


@pytest.mark.redis
def test_a_loads_deadline_runs_from_its_call_not_from_its_first_chunk(redis_url: str) -> None:
    """Found by a review: the deadline was taken when the generator first ran, and a split
    over several head slices starts each slice's only once the slice before landed its first
    band -- each later slice's deadline moved out by that much."""
    client = redis.Redis.from_url(redis_url)
    hashes = chain_hashes(list(range(2 * 16)), 16)
    mover = BlockMover(caches("cpu"), store_on(client), max_inflight_bytes=16 << 20)
    save_all(mover, [0, 1], hashes)
    called = time.monotonic()
    chunks = mover.receive([40, 41], hashes, timeout_s=0.05)
    while time.monotonic() <= called + 0.05:  # its time runs out before it is first asked
        time.sleep(0.01)
    with pytest.raises(DeadlinePassedError):
        next(chunks)
    assert staging_all_free(mover)


@pytest.mark.redis
def test_a_read_ahead_queued_behind_other_loads_ends_at_this_loads_deadline(
    redis_url: str,
) -> None:
    """Found by a review: the prefetch threads are every load's, and a load waited for its
    chunk read ahead there -- queued behind another load's reads -- without its deadline."""
    client = redis.Redis.from_url(redis_url)
    hashes = chain_hashes(list(range(2 * 16)), 16)
    save_all(
        BlockMover(caches("cpu"), store_on(client), max_inflight_bytes=16 << 20), [0, 1], hashes
    )
    release = threading.Event()
    with ThreadPoolExecutor(1) as prefetch:
        busy = prefetch.submit(release.wait, 30)  # another load's reads, for 30 s
        loader = BlockMover(
            caches("cpu", seed=None),
            store_on(client),
            max_inflight_bytes=16 << 20,
            chunk_bytes=1,  # a block a chunk: the second is read ahead
            prefetch=prefetch,
        )
        outcome: list[BaseException | None] = []

        def load() -> None:
            try:
                for chunk in loader.receive([40, 41], hashes, timeout_s=0.3):
                    chunk.copy_in()
                outcome.append(None)
            except BaseException as exc:  # the outcome under test
                outcome.append(exc)

        runner = threading.Thread(target=load)
        runner.start()
        runner.join(10)  # (the busy thread holds for 30 s)
        ended = not runner.is_alive()
        release.set()
        busy.result(10)
        runner.join(10)
        assert ended and isinstance(outcome[0], DeadlinePassedError), outcome
    assert staging_all_free(loader)
