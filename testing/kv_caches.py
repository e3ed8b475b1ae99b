"""Paged KV caches for the data mover's tests, and their round trips through a store: used by
tests/unit/test_datamover.py and test_layered_loads.py (fakeredis) and
tests/integration/test_datamover_redis.py (a real redis-server), CPU and CUDA (the GPU suite,
scripts/gpu_suite.sh)."""

from __future__ import annotations

import fakeredis
import pytest
import redis
import torch

from datamover import BlockMover, SaveItem
from kvstore import LookupBuffer

# the devices the tests parametrize over: the ``cuda`` variants run in the GPU suite
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def own_fake_client() -> fakeredis.FakeRedis:
    """A fakeredis client on a server of its own, given explicitly. ``FakeRedis()`` alone finds
    its server by name when each connection is made; with the writes' and loads' fan-out over
    connections tests/unit/test_datamover.py failed 3 to 7 runs in 10 (values SET, then not
    found by GETs on other connections) and 0 in 22 with explicit servers. The interleaving
    inside fakeredis 2.40 is not pinned down."""
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def caches(
    device: str,
    *,
    layers: int = 4,
    blocks: int = 64,
    heads: int = 8,
    block_size: int = 16,
    content: int = 256,
    token_major: bool = False,
    seed: int | None = 0,
) -> dict[str, torch.Tensor]:
    """Per-layer logical views [blocks, heads, block_size, content] (Llama-3-8B geometry per
    layer by default: 8 KV heads, head size 128, K and V); ``token_major`` stores each block
    as [block_size, heads, content] underneath, like a different attention backend."""
    gen = torch.Generator().manual_seed(seed or 0)
    out = {}
    for i in range(layers):
        shape = (
            (blocks, block_size, heads, content)
            if token_major
            else (blocks, heads, block_size, content)
        )
        t = torch.zeros(shape, dtype=torch.bfloat16)
        if seed is not None:
            t.copy_(torch.randn(shape, generator=gen))
        t = t.to(device)
        out[f"model.layers.{i}.self_attn"] = t.permute(0, 2, 1, 3) if token_major else t
    return out


def store_on(client: redis.Redis, compression: str = "none") -> LookupBuffer:
    return LookupBuffer(
        client, namespace="mover", layout={"m": "datamover"}, compression=compression
    )


def save_all(mover: BlockMover, block_ids: list[int], hashes: list[str]) -> None:
    items = [SaveItem(b, h, i, "r") for i, (b, h) in enumerate(zip(block_ids, hashes, strict=True))]
    chunks, shed = mover.stage_saves(items)
    assert shed == []
    for chunk in chunks:
        mover.write(chunk)


def load_all(mover: BlockMover, block_ids: list[int], hashes: list[str]) -> list[int]:
    copied: list[int] = []
    for chunk in mover.receive(block_ids, hashes, timeout_s=5):
        ids, _ = chunk.copy_in()
        copied += ids
    return copied


def staging_all_free(mover: BlockMover) -> bool:
    """Take every load staging buffer (waiting for those still in use), then give them back."""
    pool = mover._load_pool
    taken = [pool.acquire(timeout_s=60) for _ in range(pool.count)]
    for buf in taken:
        if buf is not None:
            pool.release(buf)
    return all(buf is not None for buf in taken)
