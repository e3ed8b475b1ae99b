#!/usr/bin/env python3
"""Time to first token of each way to serve a hit in Redis -- ``recompute``, ``async`` (load it
all, then compute), ``split`` (load its first part layer by layer while the forward pass
computes the rest) and ``auto`` (the load policy's choice from what the instance measured) --
on the same kind of prompts, in one run, with the store at three bandwidths: far below the
break-even of the benchmark model, near it, and far above it.

Two real vLLM CPU servers and one ``redis-server``: ``saver`` (share mode, on core 0) computes
each document first, so its blocks are in Redis; ``loader`` (share mode, on core 1, with
``request_load_policy``) then answers the document plus a question, each request pinning its
way in ``kv_transfer_params`` (``auto`` leaves it to the policy). The loader reaches Redis
through a relay that caps the bytes per second it forwards (``testing.relay``), changed between
phases without restarting anything. Every request is a document the loader has never seen, so
its prefix comes from Redis or is computed. Within a phase the ways take turns, so drift hits
each alike, and ``auto`` learns the bandwidth from the loads the others make, as an instance
learns it from its own.

The break-even is measured first (unthrottled): the document's KV bytes over the time the
loader takes to compute it; the phases run at ``--below`` and ``--near`` times that, and
unthrottled. Prints a table (TTFT p50 and p90 per way; ``auto`` and ``split`` against the
better of ``recompute`` and ``async``; what ``auto`` chose) and writes ``--json`` and a plot.

``--instances``: one fresh server per way instead (``recompute``, ``async``, ``auto``: each its
instance's ``load_policy``, nothing pinned per request), each reading Redis through a relay of
its own at the same cap, so ``auto`` learns only from its own requests and probes. Phases:
``--slow`` bytes per second first, on servers that have measured nothing of the store (a cold
start with a slow store), then the break-even (``--near`` times it) and unthrottled, then the
same three again (after learning on a fast store). Every answer (``--answer-tokens`` greedy
tokens) of ``async`` and ``auto`` is checked against the recomputing server's; TTFT is the
first streamed token's.

    python -m scripts.bench_load_policy [--docs 8] [--doc-tokens 1500] [--layers 8]
        [--json docs/results/bench_load_policy/bench_load_policy.json]
        [--plot docs/plots/load_policy.png]
    python -m scripts.bench_load_policy --instances [--docs 6] [--slow 0.5e6] [--json ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from testing import stack
from testing.redis_server import RedisServer, free_port
from testing.relay import DelayRelay
from testing.tiny_model import make_model

WAYS = ("recompute", "async", "split", "auto")
CHOICES = ("chose_async", "chose_split", "chose_recompute")
# a request's Redis deadline generous enough that no way is cut short on a busy 2-core host
PATIENT = {"deadline_s": 60.0, "deadline_max_s": 120.0, "socket_timeout_s": 60.0}


@dataclass
class Phase:
    name: str
    bytes_per_s: float | None  # None: not throttled
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    cached_tokens: dict[str, list[int]] = field(default_factory=dict)
    auto_chose: dict[str, int] = field(default_factory=dict)

    def p(self, way: str, q: float) -> float:
        values = sorted(self.ttft_s[way])
        return values[min(len(values) - 1, int(q * len(values)))]

    def p50(self, way: str) -> float:
        return statistics.median(self.ttft_s[way])


def documents(n: int, tokens: int, seed: int) -> list[str]:
    """``n`` documents of ``tokens`` characters (one token each with the byte tokenizer)
    that share no block."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + "     .,"
    return ["".join(rng.choice(alphabet) for _ in range(tokens)) for _ in range(n)]


def complete(url: str, name: str, prompt: str, way: str | None = None) -> tuple[float, int]:
    """One request answered with one token: (seconds, prompt tokens served from a cache)."""
    body: dict[str, Any] = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if way is not None and way != "auto":
        body["kv_transfer_params"] = {"redis_kv_load": way}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    took = time.perf_counter() - t0
    r.raise_for_status()
    details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
    return took, int(details.get("cached_tokens") or 0)


def settle(client: redis.Redis, timeout_s: float = 60) -> int:
    """Wait until Redis stops gaining keys (the saver's writes land after its answers)."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        n = int(client.dbsize())
        if n == last:
            return n
        last = n
        time.sleep(0.3)
    return last


def choices(url: str) -> dict[str, float]:
    totals = stack.metric_totals(url, tuple(f"vllm:redis_kv_{c}_total" for c in CHOICES))
    return {c: totals[f"vllm:redis_kv_{c}_total"] for c in CHOICES}


def run_phase(
    phase: Phase,
    relay: DelayRelay,
    saver: str,
    loader: str,
    name: str,
    client: redis.Redis,
    docs: list[str],
    questions: list[str],
    warm: int,
) -> None:
    relay.rate_bytes_per_s = phase.bytes_per_s
    for doc in docs:  # every document in Redis first
        complete(saver, name, doc)
    settle(client)
    phase.ttft_s = {w: [] for w in WAYS}
    phase.cached_tokens = {w: [] for w in WAYS}
    chose: dict[str, float] = dict.fromkeys(CHOICES, 0.0)
    rounds = len(docs) // len(WAYS)
    for r in range(rounds):
        order = WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]  # each way in each place
        for i, way in enumerate(order):
            doc = docs[r * len(WAYS) + i]
            before = choices(loader) if way == "auto" else {}
            took, cached = complete(loader, name, doc + questions[r], way)
            if r < warm:
                continue  # the phase's first round: the bandwidth just changed
            phase.ttft_s[way].append(took)
            phase.cached_tokens[way].append(cached)
            if way == "auto":
                after = choices(loader)
                for c in CHOICES:
                    chose[c] += after[c] - before[c]
    phase.auto_chose = {c.removeprefix("chose_"): int(v) for c, v in chose.items() if v}


def break_even(loader: str, saver: str, name: str, client: redis.Redis, docs: list[str]) -> float:
    """The bandwidth at which loading a document takes as long as computing it: its KV bytes
    in Redis over the loader's time to compute it (median)."""
    before = _stored_bytes(client)
    for doc in docs:
        complete(saver, name, doc)
    settle(client)
    per_doc = (_stored_bytes(client) - before) / len(docs)
    times = [complete(loader, name, doc, "recompute")[0] for doc in docs]
    return per_doc / statistics.median(times)


def _stored_bytes(client: redis.Redis) -> int:
    return sum(int(client.strlen(k)) for k in client.scan_iter(match="kv:*", count=1000))


def table(phases: list[Phase]) -> str:
    head = (
        "| store bandwidth | recompute | async | split | auto | auto / better of recompute "
        "and async | split / better | auto chose |\n| --- | --- | --- | --- | --- | --- | --- "
        "| --- |"
    )
    lines = [head]
    for ph in phases:
        best = min(ph.p50("recompute"), ph.p50("async"))
        cells = [f"{1000 * ph.p50(w):.0f} ms (p90 {1000 * ph.p(w, 0.9):.0f})" for w in WAYS]
        chose = ", ".join(f"{k} {v}" for k, v in sorted(ph.auto_chose.items())) or "-"
        lines.append(
            f"| {ph.name} | {' | '.join(cells)} | **{ph.p50('auto') / best:.2f}x** | "
            f"**{ph.p50('split') / best:.2f}x** | {chose} |"
        )
    return "\n".join(lines)


def plot(phases: list[Phase], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(phases))
    for way in WAYS:
        ax.plot(xs, [1000 * ph.p50(way) for ph in phases], marker="o", label=way)
    ax.set_xticks(list(xs), [ph.name for ph in phases])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_xlabel("store bandwidth to the loading server")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


# ---------------------------------------------------------------------- one instance per way
INSTANCE_WAYS = ("recompute", "async", "auto")
# what the auto server decided from, read off its /metrics after each phase
FIGURES = (
    "policy_load_bytes_per_second",
    "policy_load_overhead_seconds",
    "policy_split_bytes_per_second",
    "policy_step_seconds",
    "policy_token_seconds",
    "policy_attention_seconds",
    "load_probes_total",
)
# After its last step a vLLM worker keeps polling for the next one for a second (vLLM 0.32's
# shm_broadcast busy loop, ``sched_yield`` in a loop) before it sleeps. The three servers
# share one core here, so a request started right after two others ran beside two spinning
# workers: on 2026-12-01 its prompt pass took 490 ms where 280-330 ms was usual, and the
# rotation put ``auto`` there every third request (always right after ``async``, and
# ``recompute`` after ``auto``), 1.09x behind ``async`` on the same choice. Each request
# starts once the others' workers are idle.
WORKERS_IDLE_AFTER_S = 1.2
# float32 on every server: a prompt computed in one pass and one whose prefix a store gave
# differ in bf16's last bits, enough to change a greedy token at a near tie (docs/design.md,
# Correctness); in float32 every way's answer must be the recomputing server's
FLOAT32 = ["--dtype", "float32"]


def stream(url: str, name: str, prompt: str, tokens: int) -> tuple[float, str, int]:
    """One request, streamed: (seconds to its first token, its answer, prompt tokens served
    from a cache; -1 if the server did not say)."""
    body: dict[str, Any] = {
        "model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first, text, cached = None, [], -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or ():
                if first is None:
                    first = time.perf_counter() - t0
                text.append(choice.get("text") or "")
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if "cached_tokens" in details:
                cached = int(details["cached_tokens"] or 0)
    return (first if first is not None else time.perf_counter() - t0), "".join(text), cached


@dataclass
class InstancePhase:
    name: str
    bytes_per_s: float | None
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    cached_tokens: dict[str, list[int]] = field(default_factory=dict)
    answers_differ: dict[str, int] = field(default_factory=dict)  # against recompute's
    auto_chose: dict[str, int] = field(default_factory=dict)
    auto_figures: dict[str, float] = field(default_factory=dict)  # its gauges at the end

    def p50(self, way: str) -> float:
        return statistics.median(self.ttft_s[way])

    def auto_ratio(self) -> float:
        return self.p50("auto") / min(self.p50("recompute"), self.p50("async"))


def instance_table(phases: list[InstancePhase]) -> str:
    lines = [
        "| store bandwidth | recompute | async | auto | auto / better of recompute and async "
        "| auto chose | answers unlike recompute's |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ph in phases:
        cells = [f"{1000 * ph.p50(w):.0f} ms" for w in INSTANCE_WAYS]
        chose = ", ".join(f"{k} {v}" for k, v in sorted(ph.auto_chose.items())) or "-"
        differ = sum(ph.answers_differ.values())
        lines.append(
            f"| {ph.name} | {' | '.join(cells)} | **{ph.auto_ratio():.2f}x** | {chose} | {differ} |"
        )
    return "\n".join(lines)


def run_instances(args: argparse.Namespace) -> int:
    """One fresh server per way, phases from a cold start (see the module docstring)."""
    from testing.zygote import Zygote

    name = "tiny-llama"
    with tempfile.TemporaryDirectory() as tmp_dir, contextlib.ExitStack() as stack_:
        tmp = Path(tmp_dir)
        log_dir = args.log_dir or tmp / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        model = str(make_model(tmp / "model", layers=args.layers, q_heads=8, kv_heads=2))
        docs = documents(7 * args.docs + 4, args.doc_tokens, seed=2)
        questions = [f" Question {i}: what does it say?" for i in range(args.docs)]
        t0 = time.monotonic()
        store = stack_.enter_context(RedisServer())
        relays = {
            w: stack_.enter_context(DelayRelay("127.0.0.1", store.port, 0.0)) for w in INSTANCE_WAYS
        }
        client = redis.Redis.from_url(store.url)
        zygote = Zygote(tmp)
        stack_.callback(zygote.stop)
        stk = stack.Stack()
        stack_.callback(stk.stop)
        saver = stk.add(stack.vllm_server(
            "saver", model=model, role="kv_both", log_dir=log_dir, port=free_port(),
            redis_url=store.url, core=0, extra_config={"mode": "share", **PATIENT},
            fork_from=zygote, extra_args=FLOAT32,
        ))  # fmt: skip
        servers = {
            w: stk.add(
                stack.vllm_server(
                    w,
                    model=model,
                    role="kv_both",
                    log_dir=log_dir,
                    port=free_port(),
                    redis_url=relays[w].url,
                    core=1,
                    fork_from=zygote,
                    extra_config={"mode": "share", **PATIENT, "load_policy": w},
                    extra_args=FLOAT32,
                )
            )
            for w in INSTANCE_WAYS
        }
        stack.wait_healthy([saver, *servers.values()])
        print(f"servers up in {time.monotonic() - t0:.0f}s", flush=True)
        # first passes are slow: not measured (each its own prompt, so the saver's warm-up
        # puts nothing in Redis that the others would find: they start cold)
        for i, proc in enumerate((saver, *servers.values())):
            complete(proc.url, name, f"warm up {i} " * 60)
        # the break-even, on the recomputing server (its figures are not the auto server's)
        bstar = break_even(servers["recompute"].url, saver.url, name, client, docs[:4])
        print(f"break-even: {bstar / 1e6:.1f} MB/s", flush=True)
        # (``--near``: that many times the measured break-even, where a load's own costs make
        # the measured one no break-even)
        near = args.near * bstar
        near_label = "break-even" if args.near == 1.0 else f"{args.near:g}x break-even"
        plan = [
            (f"{args.slow / 1e6:g} MB/s, cold", args.slow),
            (f"{near_label} ({near / 1e6:.1f} MB/s)", near),
            ("unthrottled", None),
            (f"{args.slow / 1e6:g} MB/s, after the fast store", args.slow),
            (f"{near_label} ({near / 1e6:.1f} MB/s), after", near),
            ("unthrottled, after", None),
        ]
        phases = []
        for k, (label, rate) in enumerate(plan):
            phase = InstancePhase(label, rate)
            batch = docs[4 + k * args.docs : 4 + (k + 1) * args.docs]
            run_instance_phase(phase, relays, saver.url, servers, name, client, batch,
                               questions, args.answer_tokens)  # fmt: skip
            phases.append(phase)
            print(instance_table([phase]).splitlines()[-1], flush=True)
        elapsed = time.monotonic() - t0
        client.close()
    where = f"{os.uname().nodename}: {os.cpu_count()} cores, no GPU"
    print(f"\n{where}; {args.docs} requests per way and phase, {args.doc_tokens}-token "
          f"documents, {args.layers}-layer tiny Llama, one server per way; break-even "
          f"{bstar / 1e6:.1f} MB/s; {elapsed:.0f}s")  # fmt: skip
    print(instance_table(phases))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": where, "mode": "instances",
            "args": {k: str(v) for k, v in vars(args).items()},
            "break_even_bytes_per_s": bstar, "seconds": elapsed,
            "phases": [{**asdict(ph), "auto_vs_better": ph.auto_ratio()} for ph in phases],
        }, indent=1))  # fmt: skip
    differ = sum(sum(ph.answers_differ.values()) for ph in phases)
    return 1 if differ else 0


def run_instance_phase(
    phase: InstancePhase,
    relays: dict[str, DelayRelay],
    saver: str,
    servers: dict[str, Any],
    name: str,
    client: redis.Redis,
    docs: list[str],
    questions: list[str],
    answer_tokens: int,
) -> None:
    for relay in relays.values():
        relay.rate_bytes_per_s = phase.bytes_per_s
    for doc in docs:  # every document in Redis first
        complete(saver, name, doc)
    settle(client)
    phase.ttft_s = {w: [] for w in INSTANCE_WAYS}
    phase.cached_tokens = {w: [] for w in INSTANCE_WAYS}
    phase.answers_differ = dict.fromkeys(INSTANCE_WAYS, 0)
    before = choices(servers["auto"].url)
    last_end = time.monotonic()
    for i, doc in enumerate(docs):
        k = i % len(INSTANCE_WAYS)
        order = INSTANCE_WAYS[k:] + INSTANCE_WAYS[:k]  # each in each place: drift hits alike
        answers = {}
        for way in order:
            time.sleep(max(0.0, last_end + WORKERS_IDLE_AFTER_S - time.monotonic()))
            took, text, cached = stream(servers[way].url, name, doc + questions[i], answer_tokens)
            last_end = time.monotonic()
            phase.ttft_s[way].append(took)
            phase.cached_tokens[way].append(cached)
            answers[way] = text
        for way in ("async", "auto"):
            phase.answers_differ[way] += int(answers[way] != answers["recompute"])
    after = choices(servers["auto"].url)
    phase.auto_chose = {
        c.removeprefix("chose_"): int(after[c] - before[c]) for c in CHOICES if after[c] > before[c]
    }
    gauges = tuple(f"vllm:redis_kv_{g}" for g in FIGURES)
    totals = stack.metric_totals(servers["auto"].url, gauges)
    phase.auto_figures = {g.removeprefix("vllm:redis_kv_"): v for g, v in totals.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8, help="measured requests per way and phase")
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--layers", type=int, default=8, help="of the tiny model")
    ap.add_argument("--below", type=float, default=0.1, help="x the break-even bandwidth")
    ap.add_argument("--near", type=float, default=1.0, help="x the break-even bandwidth")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--log-dir", type=Path)
    ap.add_argument("--instances", action="store_true", help="one fresh server per way")
    ap.add_argument("--slow", type=float, default=0.5e6, help="--instances: bytes/s, slow store")
    ap.add_argument("--answer-tokens", type=int, default=4, help="--instances: tokens compared")
    args = ap.parse_args(argv)
    if args.instances:
        return run_instances(args)
    name = "tiny-llama"
    warm = 1
    per_phase = (args.docs + warm) * len(WAYS)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        log_dir = args.log_dir or tmp / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        model = str(make_model(tmp / "model", layers=args.layers, q_heads=8, kv_heads=2))
        all_docs = documents(3 * per_phase + 4, args.doc_tokens, seed=1)
        questions = [f" Question {i}: what does it say?" for i in range(args.docs + warm)]
        t0 = time.monotonic()
        with RedisServer() as store, DelayRelay("127.0.0.1", store.port, 0.0) as relay:
            client = redis.Redis.from_url(store.url)
            stk = stack.Stack()
            try:
                saver = stk.add(stack.vllm_server(
                    "saver", model=model, role="kv_both", log_dir=log_dir, port=free_port(),
                    redis_url=store.url, core=0, extra_config={"mode": "share", **PATIENT},
                ))  # fmt: skip
                loader = stk.add(stack.vllm_server(
                    "loader", model=model, role="kv_both", log_dir=log_dir, port=free_port(),
                    redis_url=relay.url, core=1,
                    extra_config={"mode": "share", "request_load_policy": True, **PATIENT},
                ))  # fmt: skip
                stack.wait_healthy([saver, loader])
                print(f"servers up in {time.monotonic() - t0:.0f}s", flush=True)
                for url in (saver.url, loader.url):  # first passes are slow: not measured
                    complete(url, name, "warm up " * 60)
                bstar = break_even(loader.url, saver.url, name, client, all_docs[:4])
                print(f"break-even: {bstar / 1e6:.1f} MB/s", flush=True)
                phases = [
                    Phase(f"{args.below:g}x break-even ({args.below * bstar / 1e6:.1f} MB/s)",
                          args.below * bstar),
                    Phase(f"{args.near:g}x break-even ({args.near * bstar / 1e6:.1f} MB/s)",
                          args.near * bstar),
                    Phase("unthrottled", None),
                ]  # fmt: skip
                for k, phase in enumerate(phases):
                    docs = all_docs[4 + k * per_phase : 4 + (k + 1) * per_phase]
                    run_phase(phase, relay, saver.url, loader.url, name, client, docs,
                              questions, warm)  # fmt: skip
                    print(table([phase]).splitlines()[-1], flush=True)
            finally:
                stk.stop()
        elapsed = time.monotonic() - t0
    where = f"{os.uname().nodename}: {os.cpu_count()} cores, no GPU"
    print(f"\n{where}; {args.docs} requests per way and phase, {args.doc_tokens}-token "
          f"documents, {args.layers}-layer tiny Llama; break-even {bstar / 1e6:.1f} MB/s; "
          f"{elapsed:.0f}s")  # fmt: skip
    print(table(phases))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": where, "args": {k: str(v) for k, v in vars(args).items()},
            "break_even_bytes_per_s": bstar, "seconds": elapsed,
            "phases": [asdict(ph) for ph in phases],
        }, indent=1))  # fmt: skip
    if args.plot:
        plot(phases, args.plot, f"{where}; {args.doc_tokens}-token documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
