#!/usr/bin/env python3
"""A short tour of kvstore against a real Redis: hash a prompt, insert its blocks, find the
longest cached prefix, select (keep) and drop_select (take) blocks, and show the keys.

Starts a throwaway redis-server on a free port unless --url is given.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvstore import LookupBuffer, chain_hashes
from testing.redis_server import RedisServer


def tour(url: str) -> None:
    tokens = list(range(1000, 1000 + 16 * 6 + 5))  # 6 full blocks and a partial one
    hashes = chain_hashes(tokens, block_size=16, salt="")
    print(f"{len(tokens)} tokens -> {len(hashes)} full blocks of 16; block 0 hash {hashes[0]}")
    with LookupBuffer.from_url(url, namespace="demo", ttl_s=600, layout={"model": "demo"}) as buf:
        gen = torch.Generator().manual_seed(0)
        blocks = {
            h: {"kv": torch.randn(2, 16, 8, 64, generator=gen).to(torch.bfloat16)} for h in hashes
        }
        buf.insert_many([(h, blocks[h]) for h in hashes[:4]], metadata={"tokens": "16"})
        print(f"inserted 4 blocks; longest cached prefix: {buf.longest_prefix(hashes)} blocks")
        kept = buf.select(hashes[:2])
        print("select(blocks 0-1):", [tuple(v["kv"].shape) if v else None for v in kept])
        taken = buf.drop_select(hashes[:5], timeout_s=0.0)
        pairs = zip(hashes, taken, strict=False)
        exact = all(torch.equal(v["kv"], blocks[h]["kv"]) for h, v in pairs if v)
        print(
            "drop_select(blocks 0-4):", ["hit" if v else "miss" for v in taken], "bit-exact:", exact
        )
        print(f"after drop_select the longest prefix is {buf.longest_prefix(hashes)} blocks")
        buf.insert(hashes[0], blocks[hashes[0]])
        key = buf.redis_key(hashes[0])
        print(
            f"\nkey of block 0: {key}\nlook inside with:\n  redis-cli -u {url} GETRANGE {key} 0 400"
        )
        print(f"  redis-cli -u {url} --scan --pattern '{buf.key_pattern()}'")
        header = bytes(buf.client.getrange(key, 0, 400))  # type: ignore[arg-type]
        print("header:", header[8:].decode("utf-8", "replace")[:300], "...")
        print("counters:", buf.stats().as_dict())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an existing Redis/Valkey URL (default: start one)")
    args = ap.parse_args(argv)
    if args.url:
        tour(args.url)
        return 0
    with RedisServer() as server:
        print(f"started redis-server on {server.url}")
        tour(server.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
