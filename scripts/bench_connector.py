#!/usr/bin/env python3
"""Decode-side time to first token for long prompts: RedisConnector vs recompute vs vLLM's
ExampleConnector (safetensors files on local disk), measured in one run on real vLLM engines.

For each setup a producer engine first processes the prompts (saving their KV), then a fresh
consumer engine -- a separate process, like a decode instance -- answers the same prompts with
max_tokens=1; its per-prompt wall time is the time to first token. The recompute baseline is an
engine without a connector seeing the prompts for the first time. Every engine is pinned to the
same single core, and a warm-up prompt runs first in each.

    python scripts/bench_connector.py [--layers 8 --q-heads 16 --kv-heads 4 --head-size 64]
        [--prompt-tokens 2048] [--prompts 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

from testing import stack
from testing.redis_server import RedisServer
from testing.tiny_model import make_model

ROOT = Path(__file__).resolve().parents[1]


def run_engine(tmp: Path, name: str, model: Path, phases: list, args: list[str]) -> dict:
    prompts = tmp / f"{name}.prompts.json"
    prompts.write_text(json.dumps(phases))
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "testing" / "engine_runner.py"), "--model", str(model),
           "--prompts", str(prompts), "--out", str(out), "--max-tokens", "1", *args]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    print(f"  running {name} ...", flush=True)
    proc = stack.spawn(name, cmd, tmp, env=env)
    rc = proc.popen.wait()
    proc.kill()  # vLLM's engine and worker processes
    if rc != 0 or not out.exists():
        raise SystemExit(f"{name} failed (rc={rc}); log: {proc.log}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-connector-"))
    model = make_model(tmp / "model", layers=args.layers, kv_heads=args.kv_heads,
                       q_heads=args.q_heads, head_size=args.head_size)  # fmt: skip
    rnd = random.Random(0)
    ids = [f"p{i}" for i in range(args.prompts)]
    prompts = {i: [rnd.randrange(3, 259) for _ in range(args.prompt_tokens)] for i in ids}
    warm = [{"id": "warmup", "prompt_token_ids": [rnd.randrange(3, 259) for _ in range(300)]}]
    phases = [warm] + [[{"id": i, "prompt_token_ids": prompts[i]}] for i in ids]
    disk = tmp / "example-connector-store"
    results: dict[str, dict] = {}
    with RedisServer() as redis:
        print(
            f"model: {args.layers} layers, {args.q_heads}/{args.kv_heads} heads x "
            f"{args.head_size}, fp32; {args.prompts} prompts of {args.prompt_tokens} tokens"
        )
        results["recompute"] = run_engine(tmp, "recompute", model, phases, [])
        prod = run_engine(tmp, "redis-producer", model, phases,
                          ["--role", "kv_producer", "--url", redis.url])  # fmt: skip
        params = {k: v["kv_transfer_params"] for k, v in prod["prompts"].items()
                  if v["kv_transfer_params"]}  # fmt: skip
        (tmp / "params.json").write_text(json.dumps(params))
        results["redis"] = run_engine(tmp, "redis-consumer", model, phases,
                                      ["--role", "kv_consumer", "--url", redis.url,
                                       "--params", str(tmp / "params.json")])  # fmt: skip
        example = ["--connector", "ExampleConnector", "--role", "kv_both",
                   "--extra", json.dumps({"shared_storage_path": str(disk)})]  # fmt: skip
        run_engine(tmp, "example-producer", model, phases, example)
        results["example"] = run_engine(tmp, "example-consumer", model, phases, example)

    def ttft(setup: str) -> float:
        return statistics.median(results[setup]["prompts"][i]["elapsed_s"] for i in ids)

    base = ttft("recompute")
    ref_tokens = {i: results["recompute"]["prompts"][i]["token_ids"] for i in ids}
    rows = []
    header = f"{'setup':<34} {'TTFT (median)':>14} {'vs recompute':>13} {'cached tokens':>14}"
    print(f"\n{header} same tokens")
    for setup, label in (("recompute", "recompute (no connector)"),
                         ("redis", "RedisConnector (consume)"),
                         ("example", "ExampleConnector (local disk)")):  # fmt: skip
        t = ttft(setup)
        cached = statistics.median(results[setup]["prompts"][i]["num_cached_tokens"] for i in ids)
        same = all(results[setup]["prompts"][i]["token_ids"] == ref_tokens[i] for i in ids)
        rows.append({"setup": setup, "ttft_s": t, "speedup": base / t, "cached_tokens": cached,
                     "same_tokens": same})  # fmt: skip
        print(f"{label:<34} {t * 1000:>11.0f} ms {base / t:>12.2f}x {cached:>14.0f} {same}")
    block_bytes = 2 * args.kv_heads * args.head_size * 128 * 4 * args.layers
    info = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "engines": "one pinned core each (VLLM_CPU_OMP_THREADS_BIND=0), vLLM CPU 0.32.0",
        "kv_bytes_per_prompt": block_bytes * (args.prompt_tokens // 128),
        "redis_metrics": results["redis"]["metrics"],
    }
    print(json.dumps(info))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "info": info},
                                              indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
