#!/usr/bin/env python3
"""What verifying a read value costs the client, per GB, and whether hashing it as it arrives
would cost less (issue 51: at 2 MiB kvstore's reads spend more client CPU per GB than
LMCache's, which verifies nothing).

A value's bytes are copied into a destination buffer as a socket receive lands them, from
sources larger than the last-level cache (as the kernel's copy reads socket buffers), then:
- ``after landing``: the payload's xxh3_64 over the whole value once it has landed (what the
  read path does: ``codec.checksum_ok`` on a receiving thread);
- ``fused, per chunk``: a streaming xxh3_64 updated with each chunk right after it lands, while
  it is hot (what a receive core that hashed as it received would do);
- ``decode_value``: the whole check of a landed value (header, fingerprint, name, checksum,
  tensor views), the read path's per-value cost;
- ``hash cold``: the checksum of a value no copy has touched (the upper bound).

Only the hashing and decoding are timed, the copies are not. Prints ms per GB of value bytes,
the best of ``--rounds``.

    python -m scripts.bench_read_checks [--size 2M] [--chunk 128K] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvstore.values.codec import decode_value, encode_value
from scripts.bench_paths import last_level_cache_bytes, parse_size


def landed_values(size: int) -> tuple[list[bytes], list[str]]:
    """Enough encoded values of ``size`` payload bytes to overflow the last-level cache
    twice, and their block names."""
    count = max(8, 2 * last_level_cache_bytes() // size + 1)
    rng = np.random.default_rng(0)
    names = [f"block{i}" for i in range(count)]
    values = []
    for name in names:
        payload = torch.from_numpy(rng.integers(0, 255, size, dtype=np.uint8)).view(torch.bfloat16)
        values.append(bytes(encode_value({"kv": payload}, fingerprint="f", block_hash=name)))
    return values, names


def timed(fn: Callable[[], float], rounds: int, nbytes: int) -> float:
    """The best of ``rounds`` calls of ``fn`` (which returns the seconds it timed), in ms/GB."""
    return min(fn() for _ in range(rounds)) / (nbytes / 1e9) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2M", help="payload bytes a value (K/M suffixes)")
    parser.add_argument("--chunk", default="128K", help="bytes a receive lands at a time")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    values, names = landed_values(size)
    dests = [np.empty(len(v), dtype=np.uint8) for v in values]
    sources = [np.frombuffer(v, dtype=np.uint8) for v in values]
    header = len(values[0]) - size  # every value's header is as long (same layout)
    nbytes = size * len(values)

    def after_landing() -> float:
        spent = 0.0
        for src, dest in zip(sources, dests, strict=True):
            np.copyto(dest, src)
            start = time.perf_counter()
            xxhash.xxh3_64_hexdigest(dest.data[header:])
            spent += time.perf_counter() - start
        return spent

    def fused() -> float:
        spent = 0.0
        for src, dest in zip(sources, dests, strict=True):
            digest = xxhash.xxh3_64()
            for at in range(0, len(dest), chunk):
                np.copyto(dest[at : at + chunk], src[at : at + chunk])
                start = time.perf_counter()
                digest.update(dest.data[max(at, header) : at + chunk])
                spent += time.perf_counter() - start
            digest.hexdigest()
        return spent

    def decoded() -> float:
        spent = 0.0
        for src, dest, name in zip(sources, dests, names, strict=True):
            np.copyto(dest, src)
            start = time.perf_counter()
            decode_value(dest.data, fingerprint="f", block_hash=name, copy=False)
            spent += time.perf_counter() - start
        return spent

    def cold() -> float:
        start = time.perf_counter()
        for value in values:
            xxhash.xxh3_64_hexdigest(memoryview(value)[header:])
        return time.perf_counter() - start

    print(
        f"{len(values)} values of {size} bytes, chunks of {chunk}; client ms per GB, best of "
        f"{args.rounds}"
    )
    for name, fn in (
        ("after landing", after_landing),
        ("fused, per chunk", fused),
        ("decode_value", decoded),
        ("hash cold", cold),
    ):
        print(f"  {name:18} {timed(fn, args.rounds, nbytes):6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
