#!/usr/bin/env python3
"""What a full Redis evicts, per maxmemory-policy: heads or tails of the cached chains.

A chain is only usable up to its first missing block, so the blocks behind a hole are dead
weight. kvstore gives each block a TTL 1/36,000 shorter than the block before it (0.1 s at a
1 h TTL), so under ``volatile-ttl`` the oldest chains go first, tails before heads. This
writes chains (spread over a few seconds, as prompts arrive) into a redis-server with room
for about half of them and reports, per policy, how much of what survived is usable.

    python -m scripts.eviction [--chains 40] [--blocks 16] [--value-kib 32]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import redis
import torch

from kvstore import LookupBuffer, chain_hashes
from testing.redis_server import RedisServer

# (policy, maxmemory-samples): Redis' defaults, then what docs/operations.md recommends
SETUPS = [
    ("volatile-ttl", 5),
    ("allkeys-lru", 5),
    ("allkeys-lfu", 5),
    ("volatile-lru", 5),
    ("volatile-ttl", 10),
]


@dataclass
class EvictionResult:
    policy: str
    samples: int
    blocks_written: int
    blocks_kept: int
    usable_blocks: int  # kept blocks before their chain's first hole
    dead_blocks: int  # kept blocks behind a hole: memory that can never be used
    chains_with_dead_blocks: int

    @property
    def usable_fraction(self) -> float:
        return self.usable_blocks / max(1, self.blocks_kept)


def measure(
    policy: str,
    samples: int = 5,
    *,
    chains: int = 40,
    blocks: int = 16,
    value_kib: int = 32,
    spread_s: float = 4.0,
) -> EvictionResult:
    value = {"kv": torch.zeros(value_kib * 256)}  # float32: value_kib KiB
    with RedisServer(extra_args=["--maxmemory-samples", str(samples)]) as server:
        admin = redis.Redis.from_url(server.url)
        used = int(admin.info("memory")["used_memory"])
        room = chains * blocks * value_kib * 1024 // 2  # about half of what will be written
        admin.config_set("maxmemory-policy", policy)
        admin.config_set("maxmemory", str(used + room))
        all_hashes = []
        with LookupBuffer.from_url(server.url, namespace="ev", ttl_s=3600) as buf:
            for c in range(chains):
                hashes = chain_hashes(list(range(c * 10_000, c * 10_000 + 16 * blocks)), 16)
                buf.insert_many([(h, value) for h in hashes])
                all_hashes.append(hashes)
                time.sleep(spread_s / chains)
            kept = usable = dead = broken = 0
            for hashes in all_hashes:
                present = buf.contains(hashes)
                lead = present.index(False) if False in present else len(present)
                kept += sum(present)
                usable += lead
                dead += sum(present) - lead
                broken += sum(present) > lead
        admin.close()
    return EvictionResult(policy, samples, chains * blocks, kept, usable, dead, broken)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--value-kib", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = [
        measure(p, n, chains=args.chains, blocks=args.blocks, value_kib=args.value_kib)
        for p, n in SETUPS
    ]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
        return 0
    print("| maxmemory-policy | maxmemory-samples | blocks written | kept "
          "| usable (before a hole) | dead weight | chains with dead blocks |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r.policy} | {r.samples} | {r.blocks_written} | {r.blocks_kept} "
            f"| {r.usable_blocks} ({100 * r.usable_fraction:.0f}%) | {r.dead_blocks} "
            f"| {r.chains_with_dead_blocks} of {args.chains} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
