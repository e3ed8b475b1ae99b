#!/usr/bin/env python3
"""Would valkey-glide read large values faster than kvstore? GET of ``--size`` values with
valkey-glide's sync client (Rust core, replies handed to Python as ``bytes``, then copied into
the destination as a caller must), on 1, 2 and 4 clients in threads, against kvstore's
``select_into`` (received straight into the destination, verified) and redis-py's ``GET`` + copy,
interleaved in one run against one ``redis-server``.

valkey-glide is not a dependency: install it beside the project to run this
(``pip install valkey-glide-sync``).

    python -m scripts.bench_glide [--size 2M] [--values 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis
import torch

from kvstore import LookupBuffer, chain_hashes
from scripts.bench_paths import median_seconds, parse_size
from testing.redis_server import RedisServer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=parse_size, default=2 << 20)
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        from glide_sync import GlideClient, GlideClientConfiguration, NodeAddress
    except ImportError:
        print("valkey-glide is not installed: pip install valkey-glide-sync", file=sys.stderr)
        return 2
    n, size = args.values, args.size
    with RedisServer() as server:
        host, port = "127.0.0.1", server.port
        store = LookupBuffer.from_url(server.url, namespace="glide")
        hashes = chain_hashes(list(range(n * 16)), 16)
        store.insert_many([(h, {"kv": torch.randn(size // 2).to(torch.bfloat16)}) for h in hashes])
        keys = store.keys.blocks(hashes)
        rows = [torch.empty(size + 4096, dtype=torch.uint8) for _ in hashes]
        dests = [r.numpy() for r in rows]
        config = GlideClientConfiguration([NodeAddress(host, port)], request_timeout=10_000)
        clients = [GlideClient.create(config) for _ in range(4)]
        plain = redis.Redis(host=host, port=port)
        pool = ThreadPoolExecutor(4)

        def glide(conns: int) -> None:
            def part(c: int) -> None:
                for i in range(c, n, conns):
                    got = clients[c].get(keys[i])
                    assert got is not None
                    dests[i][: len(got)] = memoryview(got)  # into the destination

            list(pool.map(part, range(conns)))

        def redis_py() -> None:
            for i, k in enumerate(keys):
                got = plain.get(k)
                assert isinstance(got, bytes)
                dests[i][: len(got)] = memoryview(got)

        def select_into() -> None:
            assert all(v is not None for v in store.select_into(hashes, rows, connections=2))

        paths: dict[str, Callable[[], None]] = {
            "kvstore select_into x2": select_into,
            "redis-py GET + copy": redis_py,
            **{f"valkey-glide GET + copy x{c}": functools.partial(glide, c) for c in (1, 2, 4)},
        }
        seconds = median_seconds(paths, args.rounds)
        store.close()
    print(f"{n} values of {size} bytes, median of {args.rounds} interleaved rounds, GB/s")
    for name, s in seconds.items():
        print(f"  {name:28s} {n * size / s / 1e9:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
