#!/usr/bin/env python3
"""Load (and save) throughput against a standalone server and Clusters of 1, 2 and 3 masters,
in one run: does bandwidth grow with the number of shards?

Each topology gets the same batch of blocks. Per topology, in the same run:

- kvstore ``insert_parts`` / ``select_into`` (what the connector's data mover calls), the
  batch fanned out over the masters and ``--connections`` connections per master;
- plain redis-py on the same servers (``RedisCluster`` pipelines for a Cluster), ``SET`` /
  ``GET`` of ready-made bytes plus the copy into a buffer: the baseline for the ratio.

GB/s counts value bytes. Shards are separate redis-server processes on this machine; on a
2-core machine they share two cores with the client, so the scaling measured here is a floor.

    python -m scripts.bench_shards [--size 2M] [--blocks 48] [--rounds 5] [--json F] [--plot F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore import LookupBuffer, chain_hashes
from kvstore.values.codec import frame_parts, plan_entries
from testing.redis_server import ClusterServers, RedisServer

from .bench_paths import median_seconds, parse_size, pipelined_get_into, pipelined_set


def bench(url: str, size: int, blocks: int, rounds: int, connections: int) -> dict[str, float]:
    store = LookupBuffer.from_url(url, namespace="shards", io_threads=8)
    client = store.client
    hashes = chain_hashes(list(range(blocks * 4)), 4)[:blocks]
    payloads = [torch.full((size // 2,), float(i), dtype=torch.bfloat16) for i in range(blocks)]
    entries, _ = plan_entries(["kv"], torch.bfloat16, [size // 2])
    pieces = [memoryview(p.view(torch.uint8).numpy()) for p in payloads]  # type: ignore[arg-type]
    dests = [torch.empty(size + 4096, dtype=torch.uint8) for _ in range(blocks)]
    plain_keys = [f"plain:{h}" for h in hashes]
    plain_values = [bytes(p) for p in pieces]

    def kv_save() -> None:
        items = [
            (h, frame_parts(entries, [p], fingerprint=store.fingerprint, block_hash=h))
            for h, p in zip(hashes, pieces, strict=True)
        ]
        store.insert_parts(items, connections=connections)

    def kv_load() -> None:
        got = store.select_into(hashes, dests, connections=connections)
        assert all(g is not None for g in got), "kvstore missed a block"

    def plain_save() -> None:
        pipelined_set(client, plain_keys, plain_values)

    def plain_load() -> None:
        pipelined_get_into(client, plain_keys, dests)

    paths: dict[str, Callable[[], None]] = {
        "redis-py save": plain_save,
        "kvstore save": kv_save,
        "redis-py load": plain_load,
        "kvstore load": kv_load,
    }
    for fn in paths.values():
        fn()
    seconds = median_seconds(paths, rounds)
    store.close()
    return {k: size * blocks / t / 1e9 for k, t in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="2M", help="bytes per block value")
    ap.add_argument("--blocks", type=int, default=48, help="blocks per batch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=2, help="per master")
    ap.add_argument("--masters", default="1,2,3")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    results: dict[str, dict[str, float]] = {}
    with RedisServer() as server:
        results["standalone"] = bench(server.url, size, args.blocks, args.rounds, args.connections)
    for masters in [int(m) for m in args.masters.split(",")]:
        with ClusterServers(masters=masters, replicas=0) as cluster:
            results[f"cluster x{masters}"] = bench(
                cluster.url, size, args.blocks, args.rounds, args.connections
            )
    machine = f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or 'cpu'})"
    print(
        f"GB/s, median of {args.rounds} rounds, {args.blocks} blocks of {size >> 10} KiB, "
        f"{args.connections} connection(s) per master; {machine}"
    )
    print("| topology | redis-py save | kvstore save | redis-py load | kvstore load | "
          "load / redis-py | load / 1 master |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    one = results.get("cluster x1", results["standalone"])["kvstore load"]
    for name, r in results.items():
        print(
            f"| {name} | {r['redis-py save']:.2f} | {r['kvstore save']:.2f} | "
            f"{r['redis-py load']:.2f} | {r['kvstore load']:.2f} | "
            f"{r['kvstore load'] / r['redis-py load']:.2f}x | {r['kvstore load'] / one:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "gbps": results}, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(results)
        fig, ax = plt.subplots(figsize=(7, 4.2))
        width = 0.2
        for j, path in enumerate(
            ["redis-py load", "kvstore load", "redis-py save", "kvstore save"]
        ):
            xs = [i + (j - 1.5) * width for i in range(len(names))]
            ax.bar(xs, [results[n][path] for n in names], width, label=path)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("GB/s")
        ax.set_title(f"throughput by topology; {machine}", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
