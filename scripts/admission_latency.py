#!/usr/bin/env python3
"""What the connector itself adds to a request's wait when Redis misbehaves, without a model.

vLLM's real Scheduler with RedisConnector (consume mode, default settings) runs against a real
redis-server that is healthy, killed, stopped (SIGSTOP), paused (CLIENT PAUSE ALL) or blocked
in a loop of DEBUG SLEEP. Each request carries a producer's handoff whose blocks and commit
record were written while Redis was healthy. The scheduler is stepped the way vLLM's engine loop
steps it (a loop with 1 ms pauses; a planned load is reported done at once, as an instant
worker would) until the request is scheduled to compute; that wait is the connector's added
latency. A request without transfer params never asks Redis: its wait is the baseline.

    python -m scripts.admission_latency [--requests 10]

There is no model, so there is no compute noise: the figures isolate the connector (the
end-to-end figures with real servers are scripts/reliability.py).
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

from connector.scheduler import handoff_salt
from kvstore import LookupBuffer, chain_hashes
from scripts.make_tiny_model import make_model
from testing.redis_server import RedisServer
from testing.scheduler_harness import BS, LAYERS, make_request, make_scheduler, runner_output

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--model", type=Path, help="a model directory (its config is all it reads)")
    args = ap.parse_args(argv)
    if args.requests < 4:
        ap.error("--requests must be at least 4 (three meet the fault first)")
    model = args.model or ROOT / ".run" / "tiny-llama"
    if not (model / "config.json").exists():
        make_model(model)

    def ms(v: float) -> str:
        return f"{1000 * v:.1f} ms"

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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
