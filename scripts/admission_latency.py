#!/usr/bin/env python3
"""What the connector itself adds to a request's wait when Redis misbehaves, without a model.

vLLM's real Scheduler with RedisConnector (consume mode, default settings) runs against a real
redis-server that is healthy, killed, stopped (SIGSTOP), paused (CLIENT PAUSE ALL) or blocked
in a loop of DEBUG SLEEP. Each request carries a producer's handoff whose blocks and commit
record were written while Redis was healthy. The scheduler is stepped the way vLLM's engine loop
steps it (a loop with 1 ms pauses; a planned load is reported done at once, as an instant
worker would) until the request is scheduled to compute; that wait is the connector's added
latency. A request without transfer params never asks Redis: its wait is the baseline.

    python -m scripts.admission_latency [--requests 10] [--burst 64] [--delay-ms 20]

There is no model, so there is no compute noise: the figures isolate the connector (the
end-to-end figures with real servers are scripts/reliability.py).

The burst table: ``--burst`` new requests arrive at once, each with a handoff to load, while
Redis answers through a relay that delays every reply by ``--delay-ms``. What matters is how
long one ``schedule()`` call takes while their lookups are out -- every running stream's next
token waits for it -- against the same burst without transfer params (no Redis at all).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis
import torch

from connector.chains import handoff_salt
from connector.metadata import RedisConnectorMetadata
from kvstore import LookupBuffer, chain_hashes
from testing.redis_server import RedisServer
from testing.relay import DelayRelay
from testing.scheduler_harness import BS, LAYERS, make_request, make_scheduler, runner_output
from testing.tiny_model import make_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT_BLOCKS = 8


def prompt(seed: int) -> list[int]:
    """Distinct prompts: one request must never find another's blocks in vLLM's local cache."""
    r = random.Random(seed)
    return [r.randrange(3, 253) for _ in range(PROMPT_BLOCKS * BS + 1)]


def hand_off(store: LookupBuffer, tokens: list[int], handoff: str) -> dict:
    """What a consume-mode producer leaves in Redis, and the params it returns."""
    chain = chain_hashes(tokens, BS, handoff_salt("", handoff))
    block = {name: torch.zeros(2, BS, 128) for name in LAYERS}
    store.insert_many([(h, block) for h in chain])
    store.publish_handoff(handoff, len(chain))
    return {
        "redis_kv": {
            "handoff": handoff,
            "scope": "handoff",
            "num_blocks": len(chain),
            "last_hash": chain[-1],
            "namespace": "vllm",
            "block_size": BS,
        }
    }


def admission_wait(sched: object, rid: str, tokens: list[int], params: dict | None) -> float:
    """Seconds from adding the request to the step that schedules it to compute."""
    from vllm.v1.request import RequestStatus

    req = make_request(rid, tokens, params)
    sched.add_request(req)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    while True:
        out = sched.schedule()  # type: ignore[attr-defined]
        if rid in out.num_scheduled_tokens:
            took = time.perf_counter() - t0
            break
        loading = {s.req_id for s in out.kv_connector_metadata.loads}
        sched.update_from_output(out, runner_output([], recving=loading))  # type: ignore[attr-defined]
        time.sleep(0.001)  # vLLM's engine loop pauses 1 ms when nothing ran
    sched.update_from_output(out, runner_output([req]))  # type: ignore[attr-defined]
    sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)  # type: ignore[attr-defined]
    return took


@contextlib.contextmanager
def fault(server: RedisServer, name: str) -> Iterator[None]:
    assert server.proc is not None
    pid = server.proc.pid
    stop = threading.Event()
    if name == "killed":
        server.kill()
    elif name == "hung":
        os.kill(pid, signal.SIGSTOP)
    elif name == "client-pause":
        redis.Redis.from_url(server.url).execute_command("CLIENT", "PAUSE", 600_000, "ALL")
    elif name == "debug-sleep":

        def sleeper() -> None:
            with redis.Redis.from_url(server.url, socket_timeout=10) as c:
                while not stop.is_set():
                    with contextlib.suppress(redis.RedisError):
                        c.execute_command("DEBUG", "SLEEP", 2)

        threading.Thread(target=sleeper, daemon=True).start()
        time.sleep(0.1)
    try:
        yield
    finally:
        stop.set()
        if name == "hung":
            os.kill(pid, signal.SIGCONT)


FAULTS: list[tuple[str, str]] = [
    ("none", "healthy Redis (requests load their handoff)"),
    ("killed", "redis-server killed: connections refused"),
    ("hung", "redis-server stopped (SIGSTOP): accepts, never answers"),
    ("client-pause", "CLIENT PAUSE ALL: every command waits"),
    ("debug-sleep", "DEBUG SLEEP 2 in a loop: the server blocks for seconds"),
]


def measure(model: Path, name: str, n: int) -> dict[str, float]:
    with RedisServer(extra_args=["--enable-debug-command", "yes"]) as server:
        sched = make_scheduler(model, "kv_consumer", url=server.url, lookup_wait_s=0.005)
        conn: Callable[[], object] = lambda: sched.connector  # noqa: E731
        fp = conn().layout.fingerprint(0)  # type: ignore[attr-defined]
        with LookupBuffer.from_url(server.url, namespace="vllm", fingerprint=fp) as store:
            params = [hand_off(store, prompt(i), f"h{name.replace('-', '')}{i}") for i in range(n)]
        base = [admission_wait(sched, f"b{i}", prompt(1000 + i), None) for i in range(n)]
        with fault(server, name):
            waits = [admission_wait(sched, f"r{i}", prompt(i), params[i]) for i in range(n)]
        sched.connector.shutdown()  # type: ignore[union-attr]
    added = [w - statistics.median(base) for w in waits]
    return {
        "first": added[0],
        "worst": max(added),
        "worst_after_3": max(added[3:]),
        "median_after_3": statistics.median(added[3:]),
        "baseline": statistics.median(base),
    }


def burst_steps(
    model: Path, n: int, delay_s: float, with_params: bool
) -> tuple[list[float], float]:
    """``n`` requests arrive at once; (each schedule() call's seconds until every one is
    admitted or loading, seconds from arrival until then)."""
    with RedisServer() as server, DelayRelay("127.0.0.1", server.port, delay_s) as relay:
        sched = make_scheduler(
            model, "kv_consumer", url=relay.url, lookup_wait_s=0.005, max_num_seqs=256
        )
        fp = sched.connector.layout.fingerprint(0)  # type: ignore[union-attr]
        with LookupBuffer.from_url(server.url, namespace="vllm", fingerprint=fp) as store:
            params = [hand_off(store, prompt(i), f"burst{i}") for i in range(n)]
        t0 = time.perf_counter()
        for i in range(n):
            sched.add_request(make_request(f"q{i}", prompt(i), params[i] if with_params else None))
        steps: list[float] = []
        pending = {f"q{i}" for i in range(n)}
        while pending:
            s0 = time.perf_counter()
            out = sched.schedule()
            steps.append(time.perf_counter() - s0)
            meta = out.kv_connector_metadata
            assert isinstance(meta, RedisConnectorMetadata)
            loading = {s.req_id for s in meta.loads}
            pending -= loading | set(out.num_scheduled_tokens)
            computed = [sched.requests[r] for r in out.num_scheduled_tokens]
            sched.update_from_output(out, runner_output(computed))  # (a forward is not timed)
            time.sleep(0.001)
        took = time.perf_counter() - t0
        sched.connector.shutdown()  # type: ignore[union-attr]
    return steps, took


def burst_table(model: Path, n: int, delay_ms: float, rounds: int = 3) -> None:
    print(f"\n| {n} new requests, Redis {delay_ms:g} ms away | first step | worst step "
          "| all admitted after |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    worst: dict[bool, float] = {}
    for with_params in (False, True):
        runs = [burst_steps(model, n, delay_ms / 1000, with_params) for _ in range(rounds)]
        first = statistics.median(r[0][0] for r in runs)
        worst[with_params] = statistics.median(max(r[0]) for r in runs)
        took = statistics.median(r[1] for r in runs)
        what = "each loads a handoff" if with_params else "no transfer params (baseline)"
        print(f"| {what} | {1000 * first:.1f} ms | {1000 * worst[with_params]:.1f} ms "
              f"| {1000 * took:.1f} ms |", flush=True)  # fmt: skip
    print(
        f"\nMedian of {rounds} bursts. Worst step with lookups / without: "
        f"{worst[True] / worst[False]:.2f}x ({1000 * (worst[True] - worst[False]):.1f} ms added; "
        "the bound is lookup_wait_s = 5 ms per step)."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--model", type=Path, help="a model directory (its config is all it reads)")
    ap.add_argument("--burst", type=int, default=64, help="requests arriving at once")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="Redis reply delay in the burst")
    ap.add_argument("--only-burst", action="store_true", help="skip the fault table")
    args = ap.parse_args(argv)
    if args.requests < 4:
        ap.error("--requests must be at least 4 (three meet the fault first)")
    model = args.model or ROOT / ".run" / "tiny-llama"
    if not (model / "config.json").exists():
        make_model(model)

    def ms(v: float) -> str:
        return f"{1000 * v:.1f} ms"

    if args.only_burst:
        burst_table(model, args.burst, args.delay_ms)
        return 0
    print("| fault | what happens | first request | worst | after the first 3: worst "
          "| after the first 3: median |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    baselines = []
    for name, what in FAULTS:
        r = measure(model, name, args.requests)
        baselines.append(r["baseline"])
        print(f"| {name} | {what} | {ms(r['first'])} | {ms(r['worst'])} "
              f"| {ms(r['worst_after_3'])} | {ms(r['median_after_3'])} |", flush=True)  # fmt: skip
    print(
        f"\n{args.requests} requests per fault, {PROMPT_BLOCKS * BS + 1} prompt tokens each; "
        f"the baseline (a request without transfer params) waited {ms(max(baselines))} at most. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores."
    )
    burst_table(model, args.burst, args.delay_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
