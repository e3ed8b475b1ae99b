#!/usr/bin/env python3
"""The serving stack on this machine, in one command: Redis, a prefill and a decode vLLM CPU
server with RedisConnector, and the proxy; then a few real requests through the proxy.

For each request it prints the time to first token and how many prompt tokens the decode server
took from Redis, and it shows the keys of one prompt in Redis between prefill and decode, with
the redis-cli / kvstore commands to look at them. Everything it started stops on exit or Ctrl-C;
--keep-running leaves the stack up for your own requests.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstore import KVStoreError
from kvstore.values.keys import parse_key
from testing import stack
from testing.redis_server import RedisServer
from testing.tiny_model import make_model

console = Console()
DOC = (
    "Redis is an in-memory data store. vLLM splits serving into prefill, which reads the prompt "
    "and builds its KV cache, and decode, which generates tokens from that cache. "
) * 8  # ~1,300 characters: a long shared prefix (the tiny model's tokenizer is byte-level)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local model directory (default: make a tiny Llama)")
    ap.add_argument("--proxy-port", type=int, default=8000)
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--redis-port", type=int, default=6380)
    ap.add_argument("--workdir", type=Path, default=Path(".run"), help="logs and the tiny model")
    ap.add_argument("--keep-running", action="store_true", help="leave the stack up until Ctrl-C")
    return ap.parse_args(argv)


def show_progress(procs: list[stack.Proc]) -> None:
    with console.status("starting vLLM servers (about a minute on a CPU)...") as status:

        def tick(p: stack.Proc, elapsed: float) -> None:
            status.update(f"[{elapsed:4.0f}s] waiting for {p.name}: {p.last_line()}")

        stack.wait_healthy(procs, timeout_s=900, on_tick=tick)


def stream_completion(url: str, model: str, prompt: str, max_tokens: int = 16) -> dict[str, Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    ttft = None
    text = ""
    usage = None
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].text and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "total_s": time.perf_counter() - t0,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": cached,
        "text": text,
    }


def kvstore_ls(redis_url: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "--url", redis_url, "ls"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def walkthrough(
    redis: RedisServer, pre: stack.Proc, dec: stack.Proc, prx: stack.Proc, model: str
) -> None:
    rcli = f"redis-cli -p {redis.port}"
    console.rule("1. one prompt's KV: prefill server -> Redis -> decode server")
    prompt = DOC + "Question: what does prefill build?"
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    r = httpx.post(pre.url + "/v1/completions", json=body, timeout=600).json()
    params = r.get("kv_transfer_params") or {}
    info = params.get("redis_kv", {})
    console.print(f"prefill saved {info.get('num_blocks')} blocks; kv_transfer_params = {params}")
    console.print(kvstore_ls(redis.url))
    client = redis_client(redis)
    handoff = next(
        (k.decode() for k in client.scan_iter(match=f"kv:*:handoff:{{{info.get('handoff')}}}")),
        None,
    )
    if handoff:
        console.print(
            f"the producer's commit record {handoff} = {client.get(handoff)!r}: the blocks it "
            "really wrote; the decode server waits for it, then takes the handoff once"
        )
    key = None
    for k in client.scan_iter(match="kv:*"):
        if k.decode().endswith(str(info.get("last_hash"))):
            key = k.decode()
    console.print("look at them yourself (while the stack runs):")
    console.print(f"  {rcli} --scan --pattern 'kv:vllm:*'")
    if key:
        console.print(f"  {rcli} GETRANGE {key} 0 400")
        console.print(f"  {rcli} TTL {key}")
        console.print(f"  {rcli} MEMORY USAGE {key}")
        console.print(f"  {sys.executable} -m kvstore --url {redis.url} inspect {key}")
        head = client.getrange(key, 8, 300).decode("utf-8", "replace")
        console.print(f"  header: {head}...")
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "kv_transfer_params": params}
    t0 = time.perf_counter()
    d = httpx.post(dec.url + "/v1/completions", json=body, timeout=600).json()
    cached = (d.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    console.print(
        f"decode server answered in {time.perf_counter() - t0:.2f}s with "
        f"{cached} of {d['usage']['prompt_tokens']} prompt tokens from Redis: "
        f"{d['choices'][0]['text']!r}"
    )
    kinds = [parse_key(k.decode()) for k in client.scan_iter(match="kv:*")]
    blocks = sum(1 for k in kinds if k is not None and k.kind == "block")
    console.print(
        f"blocks left in Redis after decode (consume mode takes them): {blocks}; the commit "
        f"record now says {client.get(handoff) if handoff else None!r} and expires within a minute"
    )

    console.rule(f"2. requests through the proxy (OpenAI API at {prx.url})")
    table = Table("request", "via", "prompt tokens", "from Redis", "TTFT", "total", "answer")
    other_doc = DOC[::-1]  # a long prompt neither server has seen
    requests = [
        ("short prompt", prx.url, "Hello, Redis!"),
        ("long doc + question A", prx.url, DOC + "Question: what is Redis?"),
        ("same doc + question B", prx.url, DOC + "Question: what does decode do?"),
        ("new long doc, no prefill", dec.url, other_doc + "Question: recompute?"),
    ]
    for name, url, p in requests:
        res = stream_completion(url, model, p)
        table.add_row(
            name,
            "proxy" if url == prx.url else "decode only",
            str(res["prompt_tokens"]),
            str(res["cached_tokens"]),
            f"{res['ttft_s'] * 1000:.0f} ms",
            f"{res['total_s'] * 1000:.0f} ms",
            repr(res["text"][:24]),
        )
    console.print(table)
    console.print(
        "'from Redis' counts prompt tokens the decode server loaded instead of computing "
        "(the last partial block and the last token are always computed). The last row skips "
        "the prefill server: the decode server computes the whole prompt, for comparison. The "
        "tiny model's weights are random, so its answers are gibberish by design."
    )
    metrics = httpx.get(dec.url + "/metrics", timeout=10).text
    loaded = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:redis_kv_blocks_loaded_total")
    ]
    console.print("decode server /metrics: " + "; ".join(loaded))


def redis_client(server: RedisServer) -> Any:
    import redis

    return redis.Redis.from_url(server.url)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir.resolve()
    logs = workdir / "logs"
    s = stack.Stack()
    redis = None

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.require_free_ports(
            {
                "proxy": args.proxy_port,
                "prefill": args.prefill_port,
                "decode": args.decode_port,
                "redis": args.redis_port,
            }
        )
        if args.model:
            model_dir = Path(args.model).resolve()
            if not (model_dir / "config.json").exists():
                raise stack.StackError(f"--model {model_dir} has no config.json")
        else:
            model_dir = workdir / "models" / "tiny-llama"
            if not (model_dir / "config.json").exists():
                console.print(
                    f"making a tiny Llama model in {model_dir} (scripts/make_tiny_model.py)"
                )
                make_model(model_dir)
        served = "tiny-llama" if not args.model else model_dir.name
        try:
            redis = RedisServer(port=args.redis_port).start()
        except KVStoreError as exc:
            raise stack.StackError(f"Redis could not start: {exc}") from None
        console.print(f"redis-server on {redis.url} (logs and data in {redis.dir})")
        common = {"model": str(model_dir), "redis_url": redis.url, "log_dir": logs}
        pre = s.add(stack.vllm_server("prefill", port=args.prefill_port, role="kv_producer",
                                      served_name=served, core=1, **common))  # fmt: skip
        dec = s.add(stack.vllm_server("decode", port=args.decode_port, role="kv_consumer",
                                      served_name=served, core=0, **common))  # fmt: skip
        console.print(f"vLLM prefill server {pre.url} (kv_producer), decode server {dec.url} "
                      f"(kv_consumer); logs in {logs}")  # fmt: skip
        show_progress([pre, dec])
        prx = s.add(stack.proxy([pre.url], [dec.url], args.proxy_port, logs))
        stack.wait_healthy([prx], timeout_s=60)
        console.print(f"proxy on {prx.url}")
        walkthrough(redis, pre, dec, prx, served)
        if args.keep_running:
            console.rule("the stack is running; Ctrl-C stops it")
            console.print(
                f"curl {prx.url}/v1/completions -H 'Content-Type: application/json' "
                f"-d '{json.dumps({'model': served, 'prompt': 'Hello', 'max_tokens': 8})}'"
            )
            console.print(f"{sys.executable} -m kvstore --url {redis.url} ls")
            while all(p.alive() for p in s.procs):
                time.sleep(1)
            dead = [p.name for p in s.procs if not p.alive()]
            raise stack.StackError(f"{', '.join(dead)} stopped; logs in {logs}")
        return 0
    except stack.StackError as exc:
        # soft_wrap: an error line is never broken at the console width (paths are long), and
        # escape: a path with [brackets] is not read as rich markup
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("stopping...")
        return 130
    finally:
        s.stop()
        if redis is not None:
            redis.cleanup()


if __name__ == "__main__":
    sys.exit(main())
