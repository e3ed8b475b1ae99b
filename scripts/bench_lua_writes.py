"""What it would cost to send block writes through a function that enforces a TTL and a size
bound (the only way an ACL role could be kept from ``SET`` without a TTL), against a plain
``SET ... PX``: wall MB/s and the server's CPU seconds per GB, on a throwaway ``redis-server``.

    python -m scripts.bench_lua_writes [--mib 1 4] [--count 200] [--json out.json]

The server's CPU is read from ``INFO cpu`` before and after each run (user + sys of the server
process), so it counts the server's work alone; the client's is the same in both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import redis

from testing.redis_server import RedisServer

BOUNDED_SET = """#!lua name=bench_bounded_set
redis.register_function('bench_bounded_set', function(keys, args)
  if #args[1] > tonumber(args[3]) then return redis.error_reply('ERR value too large') end
  local ttl = tonumber(args[2])
  if not ttl or ttl <= 0 or ttl > 86400000 then return redis.error_reply('ERR bad TTL') end
  return redis.call('SET', keys[1], args[1], 'PX', ttl)
end)
"""


def server_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(r: redis.Redis, how: str, value: bytes, count: int) -> dict[str, float]:
    r.flushall()
    cpu0, t0 = server_cpu_s(r), time.perf_counter()
    for i in range(count):
        if how == "set":
            r.set(f"k{i}", value, px=600_000)
        else:
            r.fcall("bench_bounded_set", 1, f"k{i}", value, 600_000, len(value))
    wall = time.perf_counter() - t0
    gb = count * len(value) / 1e9
    return {"mb_per_s": gb * 1e3 / wall, "server_cpu_s_per_gb": (server_cpu_s(r) - cpu0) / gb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with RedisServer() as srv:
        r = redis.Redis.from_url(srv.url)
        r.config_set("maxmemory", "0")
        r.function_load(BOUNDED_SET)
        for mib in args.mib:
            value = os.urandom(int(mib * (1 << 20)))
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.rounds):  # interleaved, the best of each kept (least noise)
                for how in ("set", "fcall"):
                    got = run(r, how, value, args.count)
                    old = best.get(how)
                    if old is None or got["server_cpu_s_per_gb"] < old["server_cpu_s_per_gb"]:
                        best[how] = got
            row = {
                "mib": mib,
                **{f"{how}_{k}": round(v, 3) for how, m in best.items() for k, v in m.items()},
                "cpu_ratio": round(
                    best["fcall"]["server_cpu_s_per_gb"] / best["set"]["server_cpu_s_per_gb"], 2
                ),
            }
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
