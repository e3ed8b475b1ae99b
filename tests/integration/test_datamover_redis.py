"""The data mover (``datamover``) against a real redis-server: a save and a load through it, on
the CPU and, in the GPU suite (``pytest -m cuda``, scripts/gpu_suite.sh), on a GPU. Its tests
on fakeredis are in tests/unit/test_datamover.py."""

from __future__ import annotations

import pytest
import redis
import torch

from datamover import BlockMover
from kvstore import chain_hashes
from testing.kv_caches import DEVICES, caches, load_all, save_all, store_on


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
