#!/usr/bin/env python3
"""Throughput of kvstore's insert / select / drop_select beside plain redis-py, in one run.

Starts its own redis-server (free port, no persistence) and measures, for block values from
64 KiB to 8 MiB, over loopback TCP and a unix socket:

- plain redis-py, pipelined: ``SET`` / ``GET`` / ``GETDEL`` of ready-made bytes of the same size;
- kvstore: ``insert_many`` (tensor -> framed value, checksum, pipelined SET), ``select`` and
  ``drop_select`` (claim script + GETDEL, header and checksum verified), each returning tensors
  that are views on the received bytes (``copy=False``, what the connector uses) and, in the
  ``(copy)`` columns, freshly allocated tensors (``copy=True``, the default).

GB/s counts tensor payload bytes only. Ratios are kvstore / plain redis-py in the same run.

    python scripts/bench_store.py [--sizes 64K,256K,1M,2M,8M] [--total 256M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import redis
import torch

from kvstore import LookupBuffer, chain_hashes
from testing.redis_server import RedisServer


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def timed(fn: Callable[[], None], setup: Callable[[], None] | None = None) -> float:
    if setup:
        setup()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(url: str, size: int, total: int, batch: int, repeats: int, compression: str) -> dict:
    n = max(batch, total // size)
    n -= n % batch
    client = redis.Redis.from_url(url)
    client.flushdb()
    # distinct buffers per value on both sides: one object sent 8 times would sit in the CPU
    # cache and flatter the baseline
    payloads = [os.urandom(size) for _ in range(batch)]
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.bfloat16) for p in payloads]
    hashes = chain_hashes(list(range(n * 16)), 16)
    plain_keys = [f"plain:{h}" for h in hashes]
    buf = LookupBuffer.from_url(url, namespace="bench", compression=compression)

    def batches(seq: list) -> list[list]:
        return [seq[i : i + batch] for i in range(0, len(seq), batch)]

    def plain_set() -> None:
        for keys in batches(plain_keys):
            pipe = client.pipeline(transaction=False)
            for k, payload in zip(keys, payloads, strict=False):
                pipe.set(k, payload)
            pipe.execute()

    def plain_read(cmd: str) -> Callable[[], None]:
        def run() -> None:
            for keys in batches(plain_keys):
                pipe = client.pipeline(transaction=False)
                for k in keys:
                    getattr(pipe, cmd)(k)
                assert all(v is not None for v in pipe.execute())

        return run

    def kv_insert() -> None:
        for hs in batches(hashes):
            buf.insert_many(list(zip(hs, ({"kv": t} for t in tensors), strict=False)))

    def kv_read(op: str, copy: bool) -> Callable[[], None]:
        def run() -> None:
            for hs in batches(hashes):
                assert all(v is not None for v in getattr(buf, op)(hs, copy=copy))

        return run

    # Interleave the six measurements round by round (ABAB...) and take medians, so that drift
    # on a shared machine hits baseline and kvstore alike.
    ops: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
        "plain_set": (plain_set, None),
        "plain_get": (plain_read("get"), plain_set),
        "plain_getdel": (plain_read("getdel"), plain_set),
        "kv_insert": (kv_insert, None),
        "kv_select": (kv_read("select", False), kv_insert),
        "kv_drop_select": (kv_read("drop_select", False), kv_insert),
        "kv_select_copy": (kv_read("select", True), kv_insert),
        "kv_drop_select_copy": (kv_read("drop_select", True), kv_insert),
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(repeats):
        for name, (fn, setup) in ops.items():
            times[name].append(timed(fn, setup))
    res = {k: statistics.median(v) for k, v in times.items()}
    client.flushdb()
    buf.close()
    client.close()
    gbps = {k: n * size / v / 1e9 for k, v in res.items()}
    return {
        "size": size,
        "values": n,
        "gbps": gbps,
        "ratio": {
            "insert": gbps["kv_insert"] / gbps["plain_set"],
            "select": gbps["kv_select"] / gbps["plain_get"],
            "drop_select": gbps["kv_drop_select"] / gbps["plain_getdel"],
            "select_copy": gbps["kv_select_copy"] / gbps["plain_get"],
            "drop_select_copy": gbps["kv_drop_select_copy"] / gbps["plain_getdel"],
        },
    }


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,256K,1M,2M,8M")
    ap.add_argument("--total", default="256M", help="bytes moved per measurement")
    ap.add_argument("--batch", type=int, default=8, help="values per pipeline / lookup")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compression", default="none", choices=["none", "lz4"])
    ap.add_argument("--transports", default="tcp,unix")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total = parse_size(args.total)
    rows = []
    print(
        "| transport | value | SET GB/s | insert GB/s | insert/SET | GET GB/s | select GB/s "
        "| select/GET | select(copy)/GET | GETDEL GB/s | drop_select GB/s | drop_select/GETDEL "
        "| drop_select(copy)/GETDEL |\n|" + " --- |" * 13
    )
    with RedisServer(extra_args=["--maxmemory", "0"]) as server:
        urls = {"tcp": server.url, "unix": server.unix_url}
        for transport in args.transports.split(","):
            for size in sizes:
                r = bench_size(
                    urls[transport], size, total, args.batch, args.repeats, args.compression
                )
                r["transport"] = transport
                rows.append(r)
                g, q = r["gbps"], r["ratio"]
                print(
                    f"| {transport} | {human(size)} | {g['plain_set']:.2f} | {g['kv_insert']:.2f} "
                    f"| **{q['insert']:.2f}x** | {g['plain_get']:.2f} | {g['kv_select']:.2f} "
                    f"| **{q['select']:.2f}x** | {q['select_copy']:.2f}x | {g['plain_getdel']:.2f} "
                    f"| {g['kv_drop_select']:.2f} | **{q['drop_select']:.2f}x** "
                    f"| {q['drop_select_copy']:.2f}x |",
                    flush=True,
                )
    info = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "redis_py": redis.__version__,
        "compression": args.compression,
        "batch": args.batch,
    }
    print(json.dumps(info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
