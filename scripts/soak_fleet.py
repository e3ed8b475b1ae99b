#!/usr/bin/env python3
"""A fleet soak on real vLLM CPU engines: three share-mode servers on one Redis behind the proxy
with cache-aware routing, and a connector-less server answering the same prompts for reference.
Over the run, in order:

1. every document's questions, shuffled, through the proxy;
2. a third of the pool's blocks expire (``PEXPIRE`` 1 ms: what a TTL or an eviction does), then
   the first documents are asked again with long new tails (they stay hot in the servers' GPU
   caches: the document is a local hit, the tail is computed);
3. the namespace is reset (``kvstore reset``), and everything is asked again;
4. one server is killed (SIGKILL) while questions keep coming, then started again;
5. another document set is warmed (``python -m connector.warm``) and asked about.

Then it checks what issue 38 asks of a fleet:
- every answer equals the connector-less server's (greedy, the same text);
- no log has a traceback (servers, the restarted one, warm; the proxy's records in this process);
- presence (``POST /kv/presence``) equals what a server with an empty prefix cache then loads;
- the prefixes that stayed hot are loadable again after the expiry;
- the proxy sent the dead server one request (its first failure) and nothing more until it was
  back.

    python -m scripts.soak_fleet [--docs 6 --questions 3 --doc-tokens 640 --warm-docs 3]
        [--json docs/results/soak_fleet/<date>.json]

Takes 10-15 minutes on a 2-core VM (five engine start-ups). Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import signal
import string
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from connector.proxy.server import ProxyConfig, build_app
from connector.redis_connector import LAYOUT_FILE_ENV
from kvstore.cli import reset_namespace
from testing import stack
from testing.redis_server import RedisServer, free_port
from testing.tiny_model import make_model

MODEL_NAME = "tiny-llama"
LOADED = "vllm:redis_kv_blocks_loaded_total"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--questions", type=int, default=3, help="questions per document")
    ap.add_argument("--doc-tokens", type=int, default=640, help="a document's length")
    ap.add_argument("--warm-docs", type=int, default=3, help="documents warmed in phase 5")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def documents(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = string.ascii_lowercase + " "
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(n)]


def question(doc: str, q: int) -> str:
    return f"{doc}\nQuestion {q}: what does it say?"


def complete(url: str, prompt: str, max_tokens: int) -> str:
    return complete_counted(url, prompt, max_tokens)[0]


def complete_counted(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """The greedy answer, and the prompt's token count."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    doc = r.json()
    return str(doc["choices"][0]["text"]), int(doc["usage"]["prompt_tokens"])


def ask_all(url: str, prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    return list(zip(prompts, answers, strict=True))


def proxy_metric(proxy_url: str, name: str, server: str, outcome: str | None = None) -> float:
    want = f'server="{server}"'
    for line in httpx.get(proxy_url + "/metrics", timeout=10).text.splitlines():
        wanted = outcome is None or f'outcome="{outcome}"' in line
        if line.startswith(name + "{") and want in line and wanted:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class ProxyLog(logging.Handler):
    """The proxy's log records in this process: any with a traceback is a finding."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.tracebacks.append(self.format(record))


def start_server(
    name: str, model: Path, port: int, store_url: str | None, tmp: Path, core: int, events: str
) -> stack.Proc:
    if store_url is None:
        return stack.vllm_server(name, model=str(model), port=port, role=None, redis_url=None,
                                 log_dir=tmp, core=core)  # fmt: skip
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": events.replace("127.0.0.1", "*")}  # fmt: skip
    return stack.vllm_server(
        name, model=str(model), port=port, role="kv_both", redis_url=store_url, log_dir=tmp,
        core=core,
        # loads pinned (auto would rightly recompute a tiny model's prefixes on a CPU): the
        # soak checks what a load finds
        extra_config={"mode": "share", "load_policy": "async"},
        extra_args=["--kv-events-config", json.dumps(kv_events)],
    )  # fmt: skip


def warm(model: Path, store_url: str, docs: list[str], tmp: Path) -> dict[str, Any]:
    corpus = tmp / "corpus"
    corpus.mkdir(exist_ok=True)
    paths = []
    for i, doc in enumerate(docs):
        path = corpus / f"doc{i}.txt"
        path.write_text(doc)
        paths.append(str(path))
    cmd = [sys.executable, "-m", "connector.warm", "--model", str(model), "--url", store_url,
           "--enforce-eager", "--max-model-len", "4096", "--in-flight", "1", "--json",
           "--suffix", "\n", *paths]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp / "warm.log"
    with log.open("wb") as err:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, env=env, timeout=900,
                             cwd=stack.ROOT)  # fmt: skip
    return {"rc": res.returncode, "report": json.loads(res.stdout or b"{}"), "log": str(log)}


def tracebacks(logs: list[Path]) -> dict[str, list[str]]:
    """Per log, each traceback's first and last lines."""
    found: dict[str, list[str]] = {}
    for log in logs:
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                end = next((j for j in range(i + 1, len(lines))
                            if lines[j] and not lines[j].startswith(" ")), i)  # fmt: skip
                found.setdefault(log.name, []).append(
                    "\n".join([*lines[max(0, i - 2) : i + 1], "...", *lines[end : end + 2]])
                )
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache for the presence check
    docs = documents(args.docs, args.doc_tokens, seed=0)
    warm_docs = documents(args.warm_docs, args.doc_tokens, seed=1)
    prompts = [question(d, q) for d in docs for q in range(args.questions)]
    random.Random(2).shuffle(prompts)
    # the hot documents asked again with a long new tail: vLLM's local hit is the document,
    # and what Redis lost of it must be written back (not only the tail after it)
    tails = documents(args.questions, 3 * args.doc_tokens // 4, seed=4)
    hot = [question(d, 9) + t for d in docs[: max(1, args.docs // 3)] for t in tails]
    warm_prompts = [question(d, q) for d in warm_docs for q in range(args.questions)]
    proxy_log = ProxyLog()
    logging.getLogger("vllm_redis_proxy").addHandler(proxy_log)
    stk = stack.Stack()
    out: dict[str, Any] = {"machine": f"{platform.node()} ({os.cpu_count()} cores, CPU)"}
    answers: list[tuple[str, str, str]] = []  # (phase, prompt, answer through the proxy)
    with tempfile.TemporaryDirectory() as tmp_dir, RedisServer() as store:
        tmp = Path(tmp_dir)
        model = make_model(tmp / "model", layers=4, q_heads=8, kv_heads=2, head_size=64)
        layout_file = tmp / "layout.json"
        os.environ[LAYOUT_FILE_ENV] = str(layout_file)
        client = redis.Redis.from_url(store.url)
        ports = {n: free_port() for n in ("plain", "a", "b", "c")}
        endpoints = {n: f"tcp://127.0.0.1:{free_port()}" for n in ("a", "b", "c")}
        try:
            plain = stk.add(start_server("plain", model, ports["plain"], None, tmp, 0, ""))
            fleet = {
                n: stk.add(
                    start_server(f"vllm-{n}", model, ports[n], store.url, tmp, i, endpoints[n])
                )
                for i, n in enumerate(("a", "b", "c"))
            }
            stack.wait_healthy([plain, *fleet.values()])
            urls = {n: p.url for n, p in fleet.items()}
            cfg = ProxyConfig(
                [], list(urls.values()), policy="cache_aware",
                events={urls[n]: endpoints[n] for n in urls}, redis_url=store.url,
                layout_file=str(layout_file), enable_kv_presence=True, kv_presence_rate=0,
                probe_interval_s=1.0,
            )  # fmt: skip
            proxy_url, stop_proxy = stack.serve_in_thread(build_app(cfg))
            time.sleep(1.0)  # the event feeds connect
            try:
                phase_s: dict[str, float] = {}

                def phase(name: str, ps: list[str]) -> None:
                    t0 = time.monotonic()
                    answers.extend((name, p, a) for p, a in ask_all(proxy_url, ps, args.max_tokens))
                    phase_s[name] = round(time.monotonic() - t0, 1)

                phase("1 all", prompts)
                blocks = [k for k in client.scan_iter("kv:vllm:*", count=1000)
                          if k.count(b":") == 3]  # fmt: skip
                random.Random(3).shuffle(blocks)
                expired = blocks[: len(blocks) // 3]
                for k in expired:
                    client.pexpire(k, 1)
                time.sleep(0.05)
                out["pool_blocks"], out["expired_blocks"] = len(blocks), len(expired)
                phase("2 hot after expiry", hot)

                def presence(prompt: str) -> dict[str, int]:
                    r = httpx.post(proxy_url + "/kv/presence", json={"prompt": prompt}, timeout=60)
                    r.raise_for_status()
                    doc = r.json()
                    return {
                        "loadable_blocks": int(doc["loadable_blocks"]),
                        "blocks": len(doc["blocks"]),
                        "block_size": int(doc["block_size"]),
                    }

                # (loadable blocks, the prompt's whole blocks)
                out["hot_loadable_after_expiry"] = [
                    (found["loadable_blocks"], found["blocks"])
                    for found in (presence(question(d, 0)) for d in docs[: max(1, args.docs // 3)])
                ]
                out["reset"] = reset_namespace(store.url, "kv", "vllm")
                phase("3 all after reset", prompts)
                # 4: a server dies mid-stream; the proxy marks it down at its first failure
                dead = fleet["b"]
                sent_before = proxy_metric(proxy_url, "vllm_redis_proxy_requests_total",
                                           dead.url, "answered")  # fmt: skip
                os.killpg(dead.popen.pid, signal.SIGKILL)
                dead.popen.wait()
                phase("4 one server dead", prompts[: len(prompts) // 2])
                out["dead_server"] = {
                    "unreachable": proxy_metric(proxy_url, "vllm_redis_proxy_requests_total",
                                                dead.url, "unreachable"),
                    "answered_while_down": proxy_metric(
                        proxy_url, "vllm_redis_proxy_requests_total", dead.url, "answered"
                    ) - sent_before,
                    "marked_down": proxy_metric(proxy_url, "vllm_redis_proxy_server_down",
                                                dead.url),
                }  # fmt: skip
                fleet["b"] = stk.add(start_server("vllm-b-again", model, ports["b"], store.url,
                                                  tmp, 1, endpoints["b"]))  # fmt: skip
                stack.wait_healthy([fleet["b"]])
                deadline = time.monotonic() + 60  # the event: the proxy's probe takes it back
                while proxy_metric(proxy_url, "vllm_redis_proxy_server_down", dead.url) > 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the proxy never took the restarted server back")
                    time.sleep(0.2)
                phase("4 server back", prompts[len(prompts) // 2 :])
                out["warm"] = warm(model, store.url, warm_docs, tmp)
                phase("5 warmed documents", warm_prompts)
                # presence against what a server with an empty prefix cache loads
                presence_checks = []
                probe = fleet["c"].url
                for d in [*docs, *warm_docs]:
                    p = question(d, 0)
                    httpx.post(probe + "/reset_prefix_cache", timeout=30).raise_for_status()
                    found = presence(p)
                    before = stack.metric_totals(probe, (LOADED,))[LOADED]
                    text, tokens = complete_counted(probe, p, args.max_tokens)
                    answers.append(("6 presence check", p, text))
                    loaded = stack.metric_totals(probe, (LOADED,))[LOADED] - before
                    presence_checks.append({
                        "presence": found["loadable_blocks"], "loaded": int(loaded),
                        # a load never covers the last prompt token
                        "loadable_max": (tokens - 1) // found["block_size"],
                    })  # fmt: skip
                out["presence_vs_loaded"] = presence_checks
                out["phase_seconds"] = phase_s
            finally:
                stop_proxy()
            # the reference: the connector-less server's answer to every prompt asked
            unique = list(dict.fromkeys(p for _, p, _ in answers))
            reference = {p: complete(plain.url, p, args.max_tokens) for p in unique}
            # read before the servers are stopped: what a shutdown prints is not the run's
            out["tracebacks"] = tracebacks(sorted(tmp.glob("*.log")))
        finally:
            stk.stop()
    out["proxy_tracebacks"] = proxy_log.tracebacks
    wrong = [(ph, p[-40:], a, reference[p]) for ph, p, a in answers if a != reference[p]]
    out["answers"] = len(answers)
    out["answers_differing"] = wrong
    out["seconds"] = round(time.monotonic() - t_start)
    checks = {
        "every answer equals the connector-less server's": not wrong,
        "no traceback in any log": not any(out["tracebacks"].values())
        and not out["proxy_tracebacks"],
        "presence equals what a fresh server loads": all(
            c["loaded"] == min(c["presence"], c["loadable_max"]) for c in out["presence_vs_loaded"]
        ),
        "hot prefixes loadable again after the expiry": all(
            have == whole for have, whole in out["hot_loadable_after_expiry"]
        ),
        "the dead server got one request, then nothing until back": out["dead_server"][
            "unreachable"
        ]
        == 1
        and out["dead_server"]["answered_while_down"] == 0,
        "warm finished": out["warm"]["rc"] == 0,
    }
    out["checks"] = checks
    print(json.dumps(out, indent=2, default=str))
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
