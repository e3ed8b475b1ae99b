#!/usr/bin/env python3
"""Reading blocks layer band by layer band (``GETRANGE``) against reading them whole (``GET``),
on one ``redis-server``, in one run: what a split load (``connector.load_policy``) pays for
having a model's first layers of every block before the rest.

Each value is one block of ``--layers`` layers (one tensor per layer, as the data mover stores
them) of ``--sizes`` bytes in all. Paths, each reading the same ``--blocks`` values (median of
``--rounds`` interleaved rounds, CPU caches evicted before each sample):

- ``whole``: ``select_into`` (one ``GET`` per value, received into staging, verified);
- ``bands of N``: ``select_head_into`` (header and the first N layers) then
  ``select_tensors_into`` for each next N layers, every block's band before the next band:
  the order a layer-by-layer load reads in (each band verified by its tensors' checksums).

GB/s counts the values' bytes; the ratio is against ``whole``. The smallest band that keeps
most of ``whole``'s speed sets the data mover's ``MIN_BAND_BYTES``.

    python -m scripts.bench_layer_reads [--sizes 64K,256K,2M,8M] [--layers 32] [--blocks 64]
        [--rounds 7] [--connections 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch

from kvstore import LookupBuffer, ValueHeader
from kvstore.values.codec import frame_parts, plan_entries
from scripts.bench_paths import CacheEvictor, median_seconds
from testing.redis_server import RedisServer


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def bench_size(
    store: LookupBuffer, size: int, layers: int, blocks: int, rounds: int, connections: int
) -> dict[str, float]:
    per_layer = size // layers
    names = [f"model.layers.{i}" for i in range(layers)]
    entries, raw = plan_entries(names, torch.uint8, (per_layer,))
    gen = torch.Generator().manual_seed(size)
    hashes = [f"{size:x}{i:08x}".ljust(32, "0") for i in range(blocks)]
    values = []
    for h in hashes:
        data = torch.randint(0, 255, (raw,), dtype=torch.uint8, generator=gen).numpy()
        pieces = [data[i * per_layer : (i + 1) * per_layer] for i in range(layers)]
        parts = frame_parts(entries, pieces, fingerprint=store.fingerprint, block_hash=h)
        values.append((h, parts))
    header = memoryview(values[0][1][0]).nbytes
    store.insert_parts(values, positions=list(range(blocks)), connections=connections)
    slot = header + raw
    staging = torch.empty(blocks, slot, dtype=torch.uint8)
    rows = list(staging)

    def whole() -> None:
        got = store.select_into(hashes, rows, connections=connections)
        assert all(v is not None for v in got)

    def bands_of(n: int) -> Any:
        def run() -> None:
            heads = store.select_head_into(
                hashes, rows, header_bytes=header, entries=entries, tensors=n,
                connections=connections,
            )  # fmt: skip
            assert all(isinstance(h, ValueHeader) for h in heads)
            for first in range(n, layers, n):
                ok = store.select_tensors_into(
                    hashes, heads, rows, first, min(layers, first + n),  # type: ignore[arg-type]
                    connections=connections,
                )  # fmt: skip
                assert all(ok)

        return run

    paths: dict[str, Any] = {"whole": whole}
    n = 1
    while n < layers:
        paths[f"bands of {n}"] = bands_of(n)
        n *= 4 if n < layers // 4 else 2
    times = median_seconds(paths, rounds, before=CacheEvictor())
    total = blocks * (header + raw)
    return {name: total / t / 1e9 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64K,256K,2M,8M")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with RedisServer() as server:
        store = LookupBuffer.from_url(server.url, namespace="bench", fingerprint="layers")
        for text in args.sizes.split(","):
            size = parse_size(text)
            gbps = bench_size(store, size, args.layers, args.blocks, args.rounds, args.connections)
            results[text] = gbps
            server_client = store.client
            server_client.flushall()
            base = gbps["whole"]
            cells = ", ".join(
                f"{name} {v:.2f} ({v / base:.2f}x, {size // args.layers // (1 << 10)} KiB a layer)"
                if name != "whole"
                else f"whole {v:.2f}"
                for name, v in gbps.items()
            )
            print(f"{text}: {cells}", flush=True)
        store.close()
    if args.json:
        doc = {
            "host": platform.node(),
            "machine": platform.processor() or platform.machine(),
            "layers": args.layers,
            "blocks": args.blocks,
            "rounds": args.rounds,
            "connections": args.connections,
            "gbps": results,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
