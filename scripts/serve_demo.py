#!/usr/bin/env python3
"""The serving stack on this machine, in one command: Redis, a prefill and a decode vLLM CPU
server with RedisConnector, and the proxy; then a few real requests.

1. one prompt's KV from the prefill server through Redis to the decode server, with its keys in
   Redis and the redis-cli / kvstore commands to look at them;
2. like with like: one prompt asked of the decode server, its KV computed there or loaded from
   Redis, the time to first token of each, and what the connector's load policy chose and why
   (from the counters it exports on /metrics);
3. requests through the proxy, as a client sends them: their first token waits for both legs.

Everything it started stops on exit or Ctrl-C; --keep-running leaves the stack up for your own
requests.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from connector.load_policy import MARGIN, POLICIES
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
DOC2 = (
    "A prefix cache keeps the KV of prompts a server has seen, so a repeated prefix is not "
    "computed twice; Redis shares those blocks between servers that never met. "
) * 8  # another document, of about the same length, for the requests through the proxy
METRIC_PREFIX = "vllm:redis_kv_"
WAYS = [p for p in POLICIES if p != "auto"]  # what the load policy may choose: async, split, ...


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local model directory (default: make a tiny Llama)")
    ap.add_argument("--proxy-port", type=int, default=8000)
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--redis-port", type=int, default=6380)
    ap.add_argument("--workdir", type=Path, default=Path(".run"), help="logs and the tiny model")
    ap.add_argument("--keep-running", action="store_true", help="leave the stack up until Ctrl-C")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="requests of each kind in the same-prompt comparison (more: steadier medians)",
    )
    return ap.parse_args(argv)


def show_progress(procs: list[stack.Proc]) -> None:
    with console.status("starting vLLM servers (about a minute on a CPU)...") as status:

        def tick(p: stack.Proc, elapsed: float) -> None:
            status.update(f"[{elapsed:4.0f}s] waiting for {p.name}: {p.last_line()}")

        stack.wait_healthy(procs, timeout_s=900, on_tick=tick)


def kvstore_ls(redis_url: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "--url", redis_url, "ls"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def stream_completion(
    url: str,
    model: str,
    prompt: str,
    max_tokens: int = 16,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed completion: time to first token, total time, prompt tokens and how many of
    them the server did not compute (``cached_tokens``: its own prefix cache and Redis)."""
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
        extra_body=extra_body,
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


# ---------------------------------------------------------------- the connector's /metrics
def parse_metrics(text: str) -> dict[str, float]:
    """The connector's series in a Prometheus scrape (``vllm:redis_kv_*``), each summed over its
    labels (one engine here): ``{"vllm:redis_kv_chose_async_total": 2.0, ...}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC_PREFIX):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def counted(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much the series ``vllm:redis_kv_<name>`` grew between two scrapes."""
    key = METRIC_PREFIX + name
    return after.get(key, 0.0) - before.get(key, 0.0)


def scrape_after(url: str, before: dict[str, float], expect_choice: bool) -> dict[str, float]:
    """The server's series once a request's own counts are in: its choice is counted as the
    request is admitted and reaches /metrics with that step's output, normally before the
    answer ends; ``expect_choice``: wait (a little) for it."""
    after = scrape(url)
    deadline = time.monotonic() + 3
    while expect_choice and not chosen(before, after) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = scrape(url)
    return after


def chosen(before: dict[str, float], after: dict[str, float]) -> str | None:
    """The way the load policy served a request's hit between two scrapes (one request)."""
    for way in WAYS:
        if counted(before, after, f"chose_{way}_total") > 0:
            return way
    return None


class Choice(NamedTuple):
    """What the decode server's load policy did with one request: ``short`` for a table cell,
    ``why`` in a sentence (the same for every request served the same way for the same
    reason, whatever its numbers)."""

    short: str
    why: str

    @property
    def reason(self) -> str:
        """``short`` without its numbers: the legend's entry."""
        return re.sub(r"\d+ ms", "N ms", self.short)


def explain_choice(before: dict[str, float], after: dict[str, float], handed_over: bool) -> Choice:
    """What the decode server's load policy did with one request and why, from the connector's
    counters before and after it (docs/metrics.md): its choice (``chose_*``), and whether it
    had measured Redis and its own compute (a measured choice observes its predicted gain
    against recomputing, ``predicted_gain_seconds``; a first load has no prediction)."""
    way = chosen(before, after)
    measured = counted(before, after, "predicted_gain_seconds_count") > 0
    gain_ms = counted(before, after, "predicted_gain_seconds_sum") * 1000
    if way is None:
        if not handed_over:
            return Choice("-", "nothing was handed over, so there was nothing to load")
        if counted(before, after, "transfer_params_ignored_total") > 0:
            why = "the handoff did not match this server or prompt, so it computed the prompt"
            return Choice("ignored the handoff", why)
        return Choice("own cache", "its own prefix cache held the prompt: nothing to load")
    done = {
        "async": "loaded the KV",
        "split": "loaded the first blocks layer by layer while computing the rest",
        "recompute": "computed the prompt although its KV was in Redis",
    }[way]
    if way == "recompute" and measured:
        short = "compute: load not faster"
        why = (
            f"{done}: from what it has measured, loading was not predicted to bring the first "
            f"token at least {MARGIN:.0%} sooner"
        )
    elif way == "recompute":
        short = "compute: not measured"
        why = f"{done}: it has not measured Redis yet (background probes do that meanwhile)"
    elif measured:
        short = f"{'load' if way == 'async' else way}: predicted {gain_ms:.0f} ms sooner"
        why = (
            f"{done}: from what it has measured (how fast Redis delivers to it, how fast it "
            "computes), loading was predicted to bring the first token that much sooner than "
            "computing the prompt"
        )
    else:
        short = f"{'load' if way == 'async' else way}: first, not measured"
        why = (
            f"{done}: a server that has not measured Redis yet loads what was handed over to "
            "it, and computes the prompt instead if the load takes longer than computing would"
        )
    if counted(before, after, "requests_given_up_total") > 0:
        short += ", gave up"
        why += "; it then gave up waiting for Redis and computed the prompt"
    elif counted(before, after, "loads_expired_total") > 0:
        short += ", too slow"
        why += (
            "; the load then ran past its deadline (what it predicted plus what computing "
            "takes) and the prompt was computed"
        )
    elif counted(before, after, "tokens_load_failed_total") > 0:
        short += ", failed"
        why += "; some of its blocks failed to load and were computed ('computed' counts them)"
    return Choice(short, why)


def rate(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.0f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.0f} hours"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds * 1000:.0f} ms"


def store_figures(metrics: dict[str, float], kv_bytes: float, expired: bool = False) -> str | None:
    """What the load policy measured of Redis (its /metrics gauges), and what that makes of a
    prompt's ``kv_bytes`` (0: not known); ``expired``: a load ran past its deadline meanwhile."""
    bw = metrics.get(METRIC_PREFIX + "policy_load_bytes_per_second")
    if not bw:
        return None
    overhead = metrics.get(METRIC_PREFIX + "policy_load_overhead_seconds") or 0.0
    fixed = f" after {overhead * 1000:.1f} ms" if overhead >= 0.0005 else ""
    text = f"it takes Redis to deliver {rate(bw)}{fixed} to its loads"
    if kv_bytes > 0:
        took = duration(overhead + kv_bytes / bw)
        text += f": this prompt's {kv_bytes / 1e6:.1f} MB of KV in ~{took}"
    if expired:
        text += (
            " (a load ran past its deadline here: until newer loads or its probes measure "
            "Redis again, the policy takes Redis to be as slow as that load)"
        )
    return text


# ---------------------------------------------------------------- the walkthrough
def handoff(redis: RedisServer, pre: stack.Proc, dec: stack.Proc, model: str) -> None:
    """1. One prompt's KV from the prefill server through Redis to the decode server."""
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
    record = next(
        (k.decode() for k in client.scan_iter(match=f"kv:*:handoff:{{{info.get('handoff')}}}")),
        None,
    )
    if record:
        console.print(
            f"the producer's commit record {record} = {client.get(record)!r}: the blocks it "
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
    before = scrape(dec.url)
    t0 = time.perf_counter()
    d = httpx.post(dec.url + "/v1/completions", json=body, timeout=600).json()
    elapsed = time.perf_counter() - t0
    after = scrape_after(dec.url, before, expect_choice=True)
    loaded = counted(before, after, "tokens_loaded_total")
    console.print(
        f"decode server answered in {elapsed:.2f}s with {loaded:.0f} of "
        f"{d['usage']['prompt_tokens']} prompt tokens loaded from Redis: "
        f"{d['choices'][0]['text']!r}"
    )
    choice = explain_choice(before, after, handed_over=True)
    console.print(f"its load policy chose '{choice.short}': {choice.why}")
    kinds = [parse_key(k.decode()) for k in client.scan_iter(match="kv:*")]
    blocks = sum(1 for k in kinds if k is not None and k.kind == "block")
    console.print(
        f"blocks left in Redis after decode (consume mode takes them): {blocks}; the commit "
        f"record now says {client.get(record) if record else None!r} and expires within a minute"
    )


def prefill_only(url: str, model: str, prompt: str, salt: str) -> tuple[dict[str, Any], float]:
    """What the proxy's first leg does: the prefill server computes the prompt and writes its
    KV to Redis; its answer's kv_transfer_params name the handoff."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json().get("kv_transfer_params") or {}, time.perf_counter() - t0


def ask_decode(
    dec: stack.Proc, model: str, prompt: str, salt: str, params: dict[str, Any] | None
) -> dict[str, Any]:
    """The prompt asked of the decode server (its KV handed over in ``params``, or not), with
    what its connector counted meanwhile."""
    before = scrape(dec.url)
    extra: dict[str, Any] = {"cache_salt": salt}
    if params is not None:
        extra["kv_transfer_params"] = params
    res = stream_completion(dec.url, model, prompt, extra_body=extra)
    after = scrape_after(dec.url, before, expect_choice=params is not None)
    res["from_redis"] = int(counted(before, after, "tokens_loaded_total"))
    res["kv_bytes"] = counted(before, after, "bytes_loaded_total")
    res["computed"] = (res["prompt_tokens"] or 0) - res["cached_tokens"]
    res["policy"] = explain_choice(before, after, handed_over=params is not None)
    res["way"] = chosen(before, after)
    res["expired"] = counted(before, after, "loads_expired_total") > 0
    # the connector's own timings: its scheduler taking the request until it knew what to load
    # (lookups, the wait for the producer's commit record), and the load itself
    res["wait_s"] = counted(before, after, "handoff_wait_seconds_sum")
    res["load_s"] = counted(before, after, "load_seconds_sum")
    measured = counted(before, after, "predicted_gain_seconds_count") > 0
    res["predicted_gain_s"] = (
        counted(before, after, "predicted_gain_seconds_sum") if measured else None
    )
    return res


def same_prompt(pre: stack.Proc, dec: stack.Proc, model: str, rounds: int = 3) -> None:
    """2. Like with like: one prompt, one server (the decode server), its KV computed there or
    loaded from Redis. Each request carries a fresh ``cache_salt``, so vLLM's own prefix cache
    never answers for either (it would have the prompt after the first request)."""
    console.rule("2. the same prompt on the same server: computed there, or loaded from Redis")
    prompt = DOC + "Question: is loading faster than computing?"
    run = uuid.uuid4().hex[:8]

    def computed(tag: str) -> dict[str, Any]:
        return ask_decode(dec, model, prompt, f"demo-{run}-{tag}-c", None)

    def loaded(tag: str) -> dict[str, Any]:
        params, prefill_s = prefill_only(pre.url, model, prompt, f"demo-{run}-{tag}-l")
        res = ask_decode(dec, model, prompt, f"demo-{run}-{tag}-l", params)
        res["prefill_s"] = prefill_s
        return res

    # one of each first, not shown: a server's first request of a new length runs slower
    computed("warm")
    loaded("warm")
    results: list[tuple[int, str, dict[str, Any]]] = []
    for n in range(1, rounds + 1):
        # alternate which goes first, so neither always follows the other
        order = ("computed", "loaded") if n % 2 else ("loaded", "computed")
        for kind in order:
            results.append((n, kind, computed(str(n)) if kind == "computed" else loaded(str(n))))
    console.print(comparison_table(results))
    console.print(verdict(results))
    if (where := breakdown(results)) is not None:
        console.print(where)
    console.print("Why the decode server's load policy chose as it did ('load policy'):")
    for short, why in legend(results):
        console.print(f"  {short}: {why}")
    kv_bytes = max(r["kv_bytes"] for _, _, r in results)
    expired = any(r["expired"] for _, _, r in results)
    if figures := store_figures(scrape(dec.url), kv_bytes, expired):
        console.print(f"  {figures}")
    if (check := prediction_check(results)) is not None:
        console.print(f"  {check}")
    console.print(prefill_note(results))


def legend(results: list[tuple[int, str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """Each reason the table's 'load policy' column shows, once: (its cell, N for a number;
    why)."""
    seen: dict[str, tuple[str, str]] = {}
    for _, _, res in results:
        choice = res["policy"]
        seen.setdefault(choice.reason, (choice.reason, choice.why))
    return list(seen.values())


def comparison_table(results: list[tuple[int, str, dict[str, Any]]]) -> Table:
    """One row a request: whether the prompt's KV was handed over, TTFT, where the prompt's
    tokens came from, the load policy's choice."""
    tokens = results[0][2]["prompt_tokens"]
    table = Table(
        "KV in Redis",
        "TTFT",
        "computed",
        "from Redis",
        "load policy",
        title=f"the same prompt ({tokens} tokens), asked of the decode server",
        caption="each request with a cache_salt of its own, so vLLM's prefix cache never "
        "answers; after one request of each kind not shown (a first one runs slower)",
    )
    for _, kind, res in results:
        table.add_row(
            "no" if kind == "computed" else "yes",
            f"{res['ttft_s'] * 1000:.0f} ms",
            str(res["computed"]),
            str(res["from_redis"]),
            res["policy"].short,
        )
    return table


def verdict(results: list[tuple[int, str, dict[str, Any]]]) -> str:
    """The comparison in a sentence: median TTFT of the same prompt on the same server, KV
    loaded from Redis against computed; which way it goes is the measurement's, not ours."""
    comp = [r for _, kind, r in results if kind == "computed"]
    hand = [r for _, kind, r in results if kind == "loaded"]
    load = [r for r in hand if r["from_redis"] > 0]
    c_ms = statistics.median(r["ttft_s"] for r in comp) * 1000
    lines = []
    if load:
        l_ms = statistics.median(r["ttft_s"] for r in load) * 1000
        ratio = c_ms / l_ms if l_ms > 0 else math.inf
        faster = (
            f"{ratio:.1f}x as fast as computing it"
            if ratio >= 1.05
            else f"slower than computing it ({l_ms / c_ms:.1f}x the time)"
            if ratio <= 1 / 1.05
            else "about as fast as computing it"
        )
        counts = (
            f"medians of {len(load)} requests each"
            if len(load) == len(comp)
            else f"medians of {len(load)} loaded and {len(comp)} computed requests"
        )
        lines.append(
            f"Same prompt, same server ({counts}): the first token came after {l_ms:.0f} ms "
            f"when the decode server loaded the prompt's KV from Redis (lookup, wait for the "
            f"prefill server's commit record and copy included), after {c_ms:.0f} ms when it "
            f"computed the prompt itself: loading was {faster}."
        )
    else:
        lines.append(
            f"The decode server loaded none of the prompts whose KV was handed over; computing "
            f"one took it {c_ms:.0f} ms to the first token (median)."
        )
    if not_loaded := [r for r in hand if r["from_redis"] == 0]:
        chose = sum(1 for r in not_loaded if r["way"] == "recompute")
        fell_back = sum(1 for r in not_loaded if r["way"] in ("async", "split"))
        parts = [
            f"{chose} its load policy chose to compute" if chose else "",
            f"{fell_back} started loading and fell back to computing" if fell_back else "",
            f"{len(not_loaded) - chose - fell_back} were computed for other reasons"
            if len(not_loaded) > chose + fell_back
            else "",
        ]
        wasted = statistics.median(r["ttft_s"] for r in not_loaded) * 1000
        lines.append(
            f"Of the {len(hand)} prompts whose KV was handed over, "
            f"{', '.join(p for p in parts if p)} (why: below); those took a median "
            f"{wasted:.0f} ms (computing, after looking at the handoff) and are not in the "
            "loaded median."
        )
    return " ".join(lines)


def breakdown(results: list[tuple[int, str, dict[str, Any]]]) -> str | None:
    """Where a loaded request's time to first token went, by the connector's own timings."""
    load = [r for _, kind, r in results if kind == "loaded" and r["from_redis"] > 0]
    if not load:
        return None

    def median_ms(key: str) -> float:
        return statistics.median(r[key] for r in load) * 1000

    rest = statistics.median(r["ttft_s"] - r["wait_s"] - r["load_s"] for r in load) * 1000
    mb = statistics.median(r["kv_bytes"] for r in load) / 1e6
    tokens = statistics.median(r["computed"] for r in load)
    return (
        f"Where a loaded request's {median_ms('ttft_s'):.0f} ms went (medians, by the "
        f"connector's own timings): {median_ms('wait_s'):.0f} ms from the decode server's "
        "scheduler taking the request until it knew what to load (looking the blocks up, "
        "waiting for the prefill server's commit record), "
        f"{median_ms('load_s'):.0f} ms loading {mb:.1f} MB of KV, {rest:.0f} ms the rest: "
        f"computing the last {tokens:.0f} prompt tokens, vLLM's steps around the load, the "
        "HTTP request and response."
    )


def prediction_check(results: list[tuple[int, str, dict[str, Any]]]) -> str | None:
    """The load policy's predicted gain beside the gain measured here (median against median):
    the demo says when the policy was wrong."""
    gains = [
        r["predicted_gain_s"]
        for _, kind, r in results
        if kind == "loaded" and r["from_redis"] > 0 and r["predicted_gain_s"] is not None
    ]
    comp = [r["ttft_s"] for _, kind, r in results if kind == "computed"]
    load = [r["ttft_s"] for _, kind, r in results if kind == "loaded" and r["from_redis"] > 0]
    if not gains or not comp or not load:
        return None
    predicted = statistics.median(gains) * 1000
    got = (statistics.median(comp) - statistics.median(load)) * 1000
    outcome = f"{got:.0f} ms sooner" if got >= 0 else f"{-got:.0f} ms later"
    right = "loading did come first" if got > 0 else "the prediction was wrong here"
    return (
        f"it predicted loading would bring the first token a median {predicted:.0f} ms sooner; "
        f"measured above, it came {outcome} ({right})"
    )


def prefill_note(results: list[tuple[int, str, dict[str, Any]]]) -> str:
    """Where the KV in Redis came from, and what that means for a request through the proxy."""
    pre_ms = statistics.median(r["prefill_s"] for _, kind, r in results if kind == "loaded") * 1000
    return (
        f"The KV in Redis came from the prefill server, which spent {pre_ms:.0f} ms (median) "
        "computing the prompt first: the pair moves that work off the decode server, it does "
        "not remove it, so through the proxy (3.) a lone request's first token waits for both."
    )


def through_proxy(dec: stack.Proc, prx: stack.Proc, model: str) -> None:
    """3. What a client sees: requests through the proxy, each one prefill leg then decode leg."""
    console.rule(f"3. requests through the proxy (OpenAI API at {prx.url})")
    table = Table(
        "request",
        "prompt tokens",
        "decode: from Redis",
        "decode: own cache",
        "TTFT (both legs)",
        "total",
        "answer",
    )
    requests = [
        ("short prompt", "Hello, Redis!"),
        ("new doc + question A", DOC2 + "Question: what is Redis?"),
        ("same doc + question B", DOC2 + "Question: what does decode do?"),
    ]
    for name, p in requests:
        before = scrape(dec.url)
        res = stream_completion(prx.url, model, p)
        after = scrape_after(dec.url, before, expect_choice=False)
        from_redis = int(counted(before, after, "tokens_loaded_total"))
        table.add_row(
            name,
            str(res["prompt_tokens"]),
            str(from_redis),
            str(res["cached_tokens"] - from_redis),
            f"{res['ttft_s'] * 1000:.0f} ms",
            f"{res['total_s'] * 1000:.0f} ms",
            repr(res["text"][:24]),
        )
    console.print(table)
    console.print(
        "Through the proxy the first token waits for both legs: the prefill server computes "
        "the prompt and writes its KV to Redis, then the decode server loads it, if its load "
        "policy so chooses (2. measures that part alone). 'own cache' counts prompt tokens the "
        "decode server found in its own prefix cache (question B repeats question A's "
        "document), 'from Redis' those it loaded; the last partial block and the last token "
        "are always computed. The tiny model's "
        "weights are random, so its answers are gibberish by design."
    )


def walkthrough(
    redis: RedisServer,
    pre: stack.Proc,
    dec: stack.Proc,
    prx: stack.Proc,
    model: str,
    rounds: int = 3,
) -> None:
    handoff(redis, pre, dec, model)
    same_prompt(pre, dec, model, rounds)
    through_proxy(dec, prx, model)


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
        walkthrough(redis, pre, dec, prx, served, max(1, args.rounds))
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
