#!/usr/bin/env python3
"""The data mover end to end on this machine's CPU, against LMCache's Redis client in the same
run: a paged KV cache of Llama-3-8B geometry (32 layers, 8 KV heads, head size 128, 16-token
blocks, bf16: 2 MiB per block) saved to one ``redis-server`` and loaded back into other blocks.

Paths (``--blocks`` blocks per round, the median of ``--rounds`` interleaved rounds):
- ``datamover save``: ``BlockMover.stage_saves`` (gather from the cache into staging) then
  ``write`` of every chunk on ``--writers`` threads, as the worker does: cache -> staging ->
  Redis, framing and checksums included;
- ``datamover load``: ``BlockMover.receive`` (values received into staging, verified) and each
  chunk's ``copy_in`` (scatter into the cache): Redis -> staging -> cache;
- ``kvstore insert_parts`` / ``select_into``: the store's part alone, on the same staged bytes
  (what the gathers and scatters cost is the difference);
- ``LMCache resp:// put`` / ``get``: LMCache 0.5.6's C++ client, ``batched_put`` /
  ``batched_get`` of the same number of 2 MiB values from and into its own CPU buffers, when
  it is importable (``../shared/anchors/lmcache.md``: run this with ``/tmp/lmc/bin/python``);
- ``LMCache gather + put`` / ``get + scatter``: the same, with the copies a connector needs
  between those buffers and the paged cache (LMCache's own need its CUDA kernels, so these
  are ``copy_`` per block and layer, done on the calling thread): the like-for-like figures.

GB/s counts the blocks' KV bytes. Prints a table with ratios against LMCache and writes
``--json``.

    python -m scripts.bench_datamover [--blocks 64] [--rounds 7] [--connections 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from connector.config import default_connections
from datamover import BlockMover, SaveItem
from kvstore import LookupBuffer, chain_hashes
from kvstore.values.codec import frame_parts
from scripts.bench_paths import CacheEvictor, LMCacheResp, median_seconds
from testing.redis_server import RedisServer

LAYERS, HEADS, TOKENS, CONTENT = 32, 8, 16, 256  # content: K and V of head size 128


def make_cache(blocks: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.self_attn": torch.randn(
            blocks, HEADS, TOKENS, CONTENT, generator=gen
        ).to(torch.bfloat16)
        for i in range(LAYERS)
    }


def bench(
    url: str,
    blocks: int,
    rounds: int,
    writers: int,
    lmc: bool,
    connections: int,
    warm: bool = False,
) -> dict[str, Any]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    cache = make_cache(2 * blocks)  # saved from the first half, loaded into the second
    store = LookupBuffer.from_url(url, namespace="bench", fingerprint="llama3-8b")
    prefetch = ThreadPoolExecutor(2)  # as the worker gives its movers
    mover = BlockMover(
        cache,
        store,
        max_inflight_bytes=4 * blocks * (2 << 20),
        connections=connections,
        prefetch=prefetch,
    )
    hashes = chain_hashes(list(range(blocks * TOKENS)), TOKENS)
    items = [SaveItem(i, h, i, "bench") for i, h in enumerate(hashes)]
    targets = list(range(blocks, 2 * blocks))
    pool = ThreadPoolExecutor(writers)
    block_bytes = mover.raw_bytes

    def save() -> None:
        chunks, shed = mover.stage_saves(items)
        assert not shed, "staging too small for one round"
        for f in [pool.submit(mover.write, c) for c in chunks]:
            f.result()

    def load() -> None:
        n = 0
        for chunk in mover.receive(targets, hashes):
            copied, _ = chunk.copy_in()
            n += len(copied)
        assert n == blocks, f"loaded {n} of {blocks} blocks"

    # the store alone: the same blocks' bytes, framed and sent / received and verified
    payloads = [
        torch.randn(block_bytes // 2).to(torch.bfloat16).view(torch.uint8).numpy()
        for _ in range(blocks)
    ]
    rows = [torch.empty(mover.slot_bytes, dtype=torch.uint8) for _ in range(blocks)]

    def insert_parts() -> None:
        values = [
            (h, frame_parts(mover.entries, [p], fingerprint=store.fingerprint, block_hash=h))
            for h, p in zip(hashes, payloads, strict=True)
        ]
        store.insert_parts(values, connections=mover.connections)

    def select_into() -> None:
        got = store.select_into(hashes, rows, connections=mover.connections)
        assert all(v is not None for v in got)

    paths = {
        "datamover save": save,
        "kvstore insert_parts": insert_parts,
        "datamover load": load,
        "kvstore select_into": select_into,
    }
    if lmc:
        resp = LMCacheResp(host, int(port), block_bytes, blocks)
        layers = [t.view(torch.uint8).view(2 * blocks, -1) for t in cache.values()]

        def copy_blocks(values: list[torch.Tensor], ids: list[int], into_cache: bool) -> None:
            """Each value's bytes from (or into) its block of every layer."""
            for block, value in zip(ids, values, strict=True):
                pieces = value[:block_bytes].view(len(layers), -1)
                for layer, piece in zip(layers, pieces, strict=True):
                    dst, src = (layer[block], piece) if into_cache else (piece, layer[block])
                    dst.copy_(src)

        sources = list(range(blocks))
        paths["LMCache resp:// put"] = resp.put
        paths["LMCache gather + put"] = lambda: resp.put(
            before=lambda values: copy_blocks(values, sources, into_cache=False)
        )
        paths["LMCache resp:// get"] = resp.get
        paths["LMCache get + scatter"] = lambda: resp.get(
            then=lambda values: copy_blocks(values, targets, into_cache=True)
        )
    save()
    load()
    assert all(torch.equal(t[blocks:], t[:blocks]) for t in cache.values()), (
        "a loaded block differs from the saved one"
    )
    seconds = median_seconds(paths, rounds, before=None if warm else CacheEvictor())
    store.close()
    pool.shutdown()
    prefetch.shutdown()
    return {name: blocks * block_bytes / s / 1e9 for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--writers", type=int, default=4, help="writer threads (the worker's io_threads)"
    )
    ap.add_argument(
        "--connections",
        type=int,
        default=default_connections(),
        help="connections per batch (the connector's `connections`)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--warm",
        action="store_true",
        help="do not evict the CPU caches before each sample (bench_paths.CacheEvictor)",
    )
    args = ap.parse_args(argv)
    try:
        import lmcache.v1.storage_backend.connector.redis_connector  # noqa: F401

        lmc = True
    except ImportError:
        lmc = False
        print("LMCache is not importable here: its columns are left out (see lmcache.md)")
    with RedisServer() as server:
        gbps = bench(
            server.url,
            args.blocks,
            args.rounds,
            args.writers,
            lmc,
            args.connections,
            args.warm,
        )
    caches = "warm caches" if args.warm else "caches evicted before each sample"
    print(
        f"{args.blocks} blocks of Llama-3-8B geometry (2 MiB), median of {args.rounds}, "
        f"{caches}, GB/s"
    )
    for name, v in gbps.items():
        reads = "load" in name or "select" in name
        bases = ["LMCache resp:// get"] if reads else ["LMCache resp:// put"]
        if name.startswith("datamover"):  # and like for like: LMCache with the copies
            bases.append("LMCache get + scatter" if reads else "LMCache gather + put")
        ours = not name.startswith("LMCache")
        ratio = "".join(f"  {v / gbps[b]:.2f}x {b}" for b in bases if ours and b in gbps)
        print(f"  {name:24s} {v:6.2f}{ratio}")
    if args.json:
        doc = {
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
            "blocks": args.blocks,
            "rounds": args.rounds,
            "connections": args.connections,
            "caches_evicted": not args.warm,
            "gbps": gbps,
        }
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
