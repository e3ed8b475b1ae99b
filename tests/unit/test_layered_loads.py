"""``datamover.LayeredLoad``: a load that lands band of layers by band while a forward pass
waits for each band (torch and kvstore only, no vLLM). The ``cuda`` variants run the same
checks on a GPU (``scripts/gpu_suite.sh``)."""

from __future__ import annotations

import math
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from datamover import BlockMover, LayeredLoad
from kvstore import DeadlinePassedError, LookupBuffer, StoreUnavailableError, chain_hashes
from kvstore.values.codec import read_header
from testing.blocks import without_tensor_checksums
from testing.kv_caches import DEVICES, caches, own_fake_client, save_all, store_on

LAYERS = 4
BANDS = [(0, 1), (1, 2), (2, 4)]


PREFETCH = ThreadPoolExecutor(2, thread_name_prefix="test-prefetch")


def saved(
    device: str, blocks: int = 10, prefetch: bool = False
) -> tuple[Any, Any, BlockMover, list[str], LookupBuffer]:
    src = caches(device, layers=LAYERS, blocks=32)
    dst = caches(device, layers=LAYERS, blocks=32, seed=None)
    store = store_on(own_fake_client())
    hashes = chain_hashes(list(range(blocks * 16)), 16)
    save_all(BlockMover(src, store, max_inflight_bytes=64 << 20), list(range(blocks)), hashes)
    # small staging: a band spans several pieces
    loader = BlockMover(
        dst, store, max_inflight_bytes=2 << 20, prefetch=PREFETCH if prefetch else None
    )
    return src, dst, loader, hashes, store


def held(store: LookupBuffer, method: str, seconds: float | None = None) -> threading.Event:
    """Hold every call of ``store.method`` until the returned event is set (or, with
    ``seconds``, that long): a store that hangs, or a slow one."""
    opened = threading.Event()
    real = getattr(store, method)

    def call(*a: Any, **k: Any) -> Any:
        if seconds is None:
            opened.wait(30)
        else:
            time.sleep(seconds)
        return real(*a, **k)

    setattr(store, method, call)
    return opened


def same(src: Any, dst: Any, layer: int, src_ids: list[int], dst_ids: list[int]) -> bool:
    name = f"model.layers.{layer}.self_attn"
    return bool(torch.equal(src[name][src_ids].cpu(), dst[name][dst_ids].cpu()))


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_each_band_lands_before_its_wait_returns(device: str, prefetch: bool) -> None:
    src, dst, mover, hashes, _ = saved(device, prefetch=prefetch)
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 30)
    runner = threading.Thread(target=load.run)
    runner.start()
    for layer in range(LAYERS):
        assert load.wait(layer)
        assert same(src, dst, layer, list(range(10)), dst_ids)  # there when the layer runs
    runner.join()
    assert load.finish() == []
    assert load.landed_s is not None and load.error is None
    assert load.nbytes == 10 * mover.raw_bytes
    assert len(load.band_landed_s) == len(BANDS)
    assert len(mover._load_pool._free) == mover._load_pool.count  # every buffer back


def test_a_load_ended_with_a_piece_read_ahead_gives_its_staging_back() -> None:
    _, dst, mover, hashes, store = saved("cpu", prefetch=True)
    opened = held(store, "select_tensors_into")
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 0.2)
    runner = threading.Thread(target=load.run)
    runner.start()
    assert load.wait(0)
    assert not load.wait(1)  # band 1's pieces are held (one of them read ahead)
    opened.set()
    runner.join(10)
    deadline = time.monotonic() + 10
    while len(mover._load_pool._free) != mover._load_pool.count:  # the read-ahead
        assert time.monotonic() < deadline, "a staging buffer was never given back"
        time.sleep(0.01)
    assert not dst["model.layers.1.self_attn"][dst_ids].any()


def test_a_band_late_past_the_deadline_ends_the_load_and_is_never_written() -> None:
    _, dst, mover, hashes, store = saved("cpu")
    opened = held(store, "select_tensors_into")
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 0.3)
    runner = threading.Thread(target=load.run)
    runner.start()
    assert load.wait(0)
    assert not load.wait(1)  # the deadline passed: the load ended
    assert load.ended
    assert load.wait(3) is False  # later layers do not wait again
    opened.set()
    runner.join(10)
    assert not runner.is_alive()
    assert sorted(load.finish()) == dst_ids
    name = "model.layers.1.self_attn"
    assert not dst[name][dst_ids].any()  # band 1 arrived after the end: never written


def test_layers_that_never_waited_fail_every_block() -> None:
    """A forward pass that ran a layer without waiting for it (an engine that starts loads
    after the pass) cannot have read the loaded bytes: nothing counts as loaded."""
    _, _, mover, hashes, _ = saved("cpu")
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 30)
    load.run()
    for layer in range(LAYERS - 1):
        assert load.wait(layer)
    assert sorted(load.finish()) == dst_ids  # layer 3 was never waited for
    assert load.skipped_waits  # (the scheduler side stops choosing splits after two)


def test_a_landed_load_gives_its_band_timeline() -> None:
    """When each band landed, for the split figure: the first band's time, the median time
    between bands, and the bytes of a band (every block's, every mover's)."""
    _, _, mover, hashes, _ = saved("cpu")
    load = LayeredLoad([mover], list(range(20, 30)), hashes, BANDS, time.monotonic() + 30)
    load.run()
    for layer in range(LAYERS):
        assert load.wait(layer)
    assert load.finish() == [] and not load.skipped_waits
    timeline = load.band_timeline()
    assert timeline is not None
    band_bytes, first, between, bands = timeline
    assert bands == len(BANDS) and band_bytes == 10 * mover.raw_bytes // len(BANDS)
    assert first == load.band_landed_s[0] and 0 <= between <= load.landed_s  # type: ignore[operator]
    # a load that ended first has none (its upper bound is transfer_sample's)
    ended = LayeredLoad([mover], list(range(20, 30)), hashes, BANDS, time.monotonic() + 30)
    ended.cancel()
    ended.run()
    assert ended.band_timeline() is None


def test_a_missing_block_fails_alone_and_old_values_are_read_whole() -> None:
    src, dst, mover, hashes, store = saved("cpu")
    store.client.delete(store.redis_key(hashes[4]))
    # block 6 as an older version wrote it: no per-tensor checksums, read whole
    key = store.redis_key(hashes[6])
    store.client.set(key, without_tensor_checksums(store.client.get(key)))
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 30)
    load.run()
    for layer in range(LAYERS):
        load.wait(layer)
    assert load.finish() == [24]
    for layer in range(LAYERS):
        kept = [i for i in range(10) if i != 4]
        assert same(src, dst, layer, kept, [20 + i for i in kept])


def test_a_store_that_fails_ends_the_load_with_its_error() -> None:
    _, _, mover, hashes, store = saved("cpu")
    store.client.connection_pool.get_connection = _refused  # type: ignore[method-assign]
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 30)
    load.run()
    assert isinstance(load.error, StoreUnavailableError)
    assert not load.wait(0)
    assert sorted(load.finish()) == dst_ids


def _refused(*a: Any, **k: Any) -> Any:
    import redis

    raise redis.ConnectionError("refused")


def test_a_cancelled_load_writes_nothing_more() -> None:
    _, dst, mover, hashes, store = saved("cpu")
    opened = held(store, "select_head_into")
    dst_ids = list(range(20, 30))
    load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 30)
    runner = threading.Thread(target=load.run)
    runner.start()
    load.cancel()  # the KV cache goes to sleep
    opened.set()
    runner.join(10)
    assert not any(t[dst_ids].any() for t in dst.values())
    assert sorted(load.finish()) == dst_ids


def _unpadded(value: bytes) -> bytes:
    """``value`` with its header not padded to 8 bytes: the payload at an odd offset. Valid
    (safetensors does not require the padding; a writer of another version may skip it)."""
    (n,) = struct.unpack_from("<Q", value)
    head = value[8 : 8 + n].rstrip(b" ")
    if (8 + len(head)) % 2 == 0:
        head += b" "
    return struct.pack("<Q", len(head)) + head + value[8 + n :]


@pytest.mark.parametrize("layered", [False, True])
def test_a_value_whose_payload_lies_at_an_odd_offset_loads(layered: bool) -> None:
    """Found by a review: viewing its bytes as bf16 in place raised, and failed every block
    of the load (a whole load's too); such values are stacked instead."""
    src, dst, mover, hashes, store = saved("cpu")
    key = store.redis_key(hashes[4])
    store.client.set(key, _unpadded(store.client.get(key)))
    assert read_header(store.client.get(key)).block_name == hashes[4]
    dst_ids = list(range(20, 30))
    if layered:
        load = LayeredLoad([mover], dst_ids, hashes, BANDS, time.monotonic() + 30)
        load.run()
        for layer in range(LAYERS):
            load.wait(layer)
        assert load.finish() == [] and load.error is None
    else:
        loaded = [b for chunk in mover.receive(dst_ids, hashes, timeout_s=5)
                  for b in chunk.copy_in()[0]]  # fmt: skip
        assert sorted(loaded) == dst_ids
    for layer in range(LAYERS):
        assert same(src, dst, layer, list(range(10)), dst_ids)


def test_a_load_ended_before_its_thread_runs_neither_claims_nor_reads() -> None:
    _, _, mover, hashes, store = saved("cpu")
    before = store.stats().bytes_in
    claims: list[bool] = []
    load = LayeredLoad([mover], list(range(20, 30)), hashes, BANDS, time.monotonic() + 30)
    load.cancel()
    load.run(before=lambda: claims.append(True) or True)
    assert claims == []
    assert store.stats().bytes_in == before
    assert sorted(load.finish()) == list(range(20, 30))


def test_a_failed_load_still_says_how_slow_the_store_was() -> None:
    """A load that ended waiting for a band gives an upper bound on the bandwidth (what landed
    and the band it waited for, over the time it ran): a store that got slower shows in the
    figures even when every split fails."""
    _, _, mover, hashes, store = saved("cpu")
    held(store, "select_tensors_into", seconds=0.3)
    load = LayeredLoad([mover], list(range(20, 30)), hashes, BANDS, time.monotonic() + 0.1)
    runner = threading.Thread(target=load.run)
    runner.start()
    assert load.wait(0)
    assert not load.wait(1)
    sample = load.transfer_sample()
    runner.join(10)
    assert sample is not None
    nbytes, seconds = sample
    assert nbytes == load.band_bytes(0) + load.band_bytes(1)
    assert seconds >= 0.1


def test_a_load_whose_reads_pass_its_deadline_is_ended_not_failed_and_still_says_how_slow() -> None:
    """Found by a review: a store's reads past the load's deadline now raise
    ``DeadlinePassedError``; kept as the load's error, the split was logged as an error once
    per request and gave no bound on the store's bandwidth. It ends the load as a wait past
    the deadline does."""
    _, _, mover, hashes, store = saved("cpu")
    real = store.select_tensors_into

    def past_its_deadline(*a: Any, deadline: float = math.inf, **k: Any) -> Any:
        while time.monotonic() < deadline:  # a store this slow: nothing came in time
            time.sleep(0.01)
        raise DeadlinePassedError("the batch's deadline passed")

    store.select_tensors_into = past_its_deadline  # type: ignore[method-assign]
    load = LayeredLoad([mover], list(range(20, 30)), hashes, BANDS, time.monotonic() + 0.1)
    runner = threading.Thread(target=load.run)
    runner.start()
    assert load.wait(0)
    runner.join(10)  # its reads ended, at the deadline
    assert not runner.is_alive() and load.error is None
    assert not load.wait(1)
    sample = load.transfer_sample()
    assert sample is not None and sample[0] == load.band_bytes(0) + load.band_bytes(1)
    store.select_tensors_into = real  # type: ignore[method-assign]
