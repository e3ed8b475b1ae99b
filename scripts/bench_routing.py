#!/usr/bin/env python3
"""Cache-aware routing against least-loaded, in one run on real vLLM engines: two share-mode
servers on one Redis behind the proxy, a workload of documents each asked several questions in
a shuffled order (shared prefixes), once per policy. Reported per policy: the servers' own
GPU prefix-cache hit rate (vLLM's ``prefix_cache_hits`` / ``queries``), the tokens they loaded
from Redis instead, and time to first token through the proxy. Between policies Redis is
emptied and both servers' prefix caches reset, so each starts cold.

    python -m scripts.bench_routing [--docs 8 --questions 4 --doc-tokens 1024 --layers 8]
        [--json out.json --plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from connector.proxy.server import ProxyConfig, build_app
from scripts.serve_demo import stream_completion
from testing import stack
from testing.redis_server import RedisServer, free_port
from testing.tiny_model import make_model

POLICIES = ("least_loaded", "cache_aware")
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--questions", type=int, default=4, help="questions per document")
    ap.add_argument("--doc-tokens", type=int, default=1024, help="a document's length")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8, help="of the tiny model")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="draw the comparison here (PNG)")
    return ap.parse_args(argv)


def counters(url: str) -> dict[str, float]:
    return stack.metric_totals(url, COUNTERS)


def workload(args: argparse.Namespace) -> list[str]:
    rng = random.Random(0)  # the same prompts, in the same order, for every policy
    letters = string.ascii_lowercase + " "
    docs = ["".join(rng.choice(letters) for _ in range(args.doc_tokens)) for _ in range(args.docs)]
    prompts = [f"{d}\nQuestion {q}: what does it say?" for d in docs for q in range(args.questions)]
    rng.shuffle(prompts)
    return prompts


def measure(
    policy: str, servers: list[stack.Proc], events: dict[str, str], prompts: list[str], conc: int
) -> dict[str, Any]:
    urls = [s.url for s in servers]
    cfg = ProxyConfig(urls, urls, policy=policy, events=events if policy == "cache_aware" else {})
    proxy_url, stop_proxy = stack.serve_in_thread(build_app(cfg))
    before = {u: counters(u) for u in urls}
    try:
        if policy == "cache_aware":  # the feeds connect at startup: let them join
            time.sleep(1.0)
        with ThreadPoolExecutor(conc) as pool:
            results = list(
                pool.map(lambda p: stream_completion(proxy_url, "tiny-llama", p, 4), prompts)
            )
        routing = httpx.get(proxy_url + "/kv/routing", timeout=10).json()
    finally:
        stop_proxy()
    after = {u: counters(u) for u in urls}
    delta = {k: sum(after[u][k] - before[u][k] for u in urls) for k in COUNTERS}
    ttfts = sorted(r["ttft_s"] for r in results)
    queries = delta["vllm:prefix_cache_queries_total"]
    return {
        "policy": policy,
        "requests": len(results),
        "gpu_hit_rate": delta["vllm:prefix_cache_hits_total"] / queries if queries else 0.0,
        "redis_hit_rate": delta["vllm:external_prefix_cache_hits_total"] / queries
        if queries
        else 0.0,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "ttft_mean_s": statistics.fmean(ttfts),
        "routed_by_cache": routing.get("routed_by_cache", {}),
    }


def reset(servers: list[stack.Proc], client: redis.Redis) -> None:
    client.flushall()
    for s in servers:
        httpx.post(s.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["policy"] for r in rows]
    hit.bar(names, [100 * r["gpu_hit_rate"] for r in rows], label="GPU (local) cache")
    hit.bar(
        names,
        [100 * r["redis_hit_rate"] for r in rows],
        bottom=[100 * r["gpu_hit_rate"] for r in rows],
        label="loaded from Redis",
    )
    hit.set_ylabel("prompt tokens served from cache (%)")
    hit.legend(fontsize=8)
    ttft.bar(names, [1000 * r["ttft_p50_s"] for r in rows])
    ttft.set_ylabel("TTFT p50 through the proxy (ms)")
    fig.suptitle(f"cache-aware vs least-loaded routing ({platform.node()}, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = workload(args)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between policies
    stk = stack.Stack()
    with tempfile.TemporaryDirectory() as tmp_dir, RedisServer() as store:
        tmp = Path(tmp_dir)
        model = make_model(tmp / "model", layers=args.layers)
        servers, events = [], {}
        try:
            for i in range(2):
                port = free_port()
                endpoint = f"tcp://127.0.0.1:{free_port()}"
                kv_events = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": endpoint.replace("127.0.0.1", "*"),
                }
                server = stk.add(
                    stack.vllm_server(
                        f"vllm-{i}", model=str(model), port=port, role="kv_both",
                        redis_url=store.url, log_dir=tmp, core=i,
                        extra_config={"mode": "share"},
                        extra_args=["--kv-events-config", json.dumps(kv_events)],
                    )
                )  # fmt: skip
                servers.append(server)
                events[server.url] = endpoint
            stack.wait_healthy(servers)
            client = redis.Redis.from_url(store.url)
            rows = []
            for policy in POLICIES:
                reset(servers, client)
                rows.append(measure(policy, servers, events, prompts, args.concurrency))
        finally:
            stk.stop()
    base = rows[0]
    print(f"{len(prompts)} requests ({args.docs} documents x {args.questions} questions, "
          f"{args.doc_tokens} tokens each), concurrency {args.concurrency}, "
          f"{platform.node()} ({platform.machine()}, CPU)")  # fmt: skip
    print(f"{'policy':<14}{'GPU hits':>10}{'Redis hits':>12}{'TTFT p50':>11}{'p90':>9}{'ratio':>8}")
    for r in rows:
        ratio = r["ttft_p50_s"] / base["ttft_p50_s"]
        print(
            f"{r['policy']:<14}{100 * r['gpu_hit_rate']:>9.1f}%{100 * r['redis_hit_rate']:>11.1f}%"
            f"{1000 * r['ttft_p50_s']:>9.1f}ms{1000 * r['ttft_p90_s']:>7.1f}ms{ratio:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
