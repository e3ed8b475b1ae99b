"""The fault matrix: a prefill server (kv_producer) and two decode servers (kv_consumer), real
vLLM CPU servers with RedisConnector, sharing one redis-server that each scenario kills, pauses,
stops, restarts or fills while prompts are sent the way the proxy sends them. Per request it
records wrong answers (against a connector-less server), hangs, added latency and tokens from
Redis.

Run by ``scripts/reliability.py`` (the table in docs/reliability.md) and by
``tests/e2e/test_e2e_faults.py`` (the same scenarios, fewer requests).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from testing import stack
from testing.redis_server import RedisServer, free_port
from testing.tiny_model import make_model
from testing.zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 1200  # 9 full blocks of 128 (vLLM's CPU block size)
MAX_TOKENS = 8
# What kvstore's circuit breaker logs (through vLLM's log) when it opens and closes again.
BREAKER_OPENED = "not sending it anything until it answers again"
BREAKER_CLOSED = "answers again after"
# The connector settings under test (the defaults, spelled out so the table can say them).
# load_policy async: the matrix is about what faults do to loads; under auto a decode server
# that measured slow loads during a fault (or a busy CI machine) may rightly choose to
# recompute a hit, and the rows would then say nothing about the load path
CONNECTOR = {
    "deadline_s": 2.0,
    "control_timeout_s": 0.5,
    "breaker_probe_s": 0.5,
    "load_policy": "async",
}


@dataclass
class Outcome:
    prompt: int
    ok: bool  # answered, and equal to the reference
    hung: bool
    prefill_s: float | None
    decode_s: float | None
    cached_tokens: int
    added_s: float | None = None  # decode latency minus the prompt's recompute latency
    prefill_added_s: float | None = None
    error: str = ""


@dataclass
class FaultResult:
    fault: str
    what: str
    outcomes: list[Outcome] = field(default_factory=list)
    # the decode servers' connector counters, summed, during the scenario
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def wrong(self) -> int:
        return sum(1 for o in self.outcomes if not o.ok and not o.hung)

    @property
    def hung(self) -> int:
        return sum(1 for o in self.outcomes if o.hung)

    def worst(self, attr: str, skip: int = 0) -> float | None:
        vals = [getattr(o, attr) for o in self.outcomes[skip:] if getattr(o, attr) is not None]
        return max(vals) if vals else None

    def median(self, attr: str, skip: int = 0) -> float | None:
        vals = [getattr(o, attr) for o in self.outcomes[skip:] if getattr(o, attr) is not None]
        return statistics.median(vals) if vals else None

    @property
    def cached_fraction(self) -> float:
        return sum(o.cached_tokens for o in self.outcomes) / max(1, self.sent * PROMPT_TOKENS)

    def row(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "what": self.what,
            "sent": self.sent,
            "wrong": self.wrong,
            "hung": self.hung,
            "worst_added_s": self.worst("added_s"),
            "worst_added_after_3_s": self.worst("added_s", skip=3),
            "median_added_after_3_s": self.median("added_s", skip=3),
            "worst_prefill_added_s": self.worst("prefill_added_s"),
            "tokens_from_redis": round(self.cached_fraction, 3),
            "counters": self.counters,
            "outcomes": [asdict(o) for o in self.outcomes],
        }


def prompt_tokens(i: int, shared: list[int] | None = None) -> list[int]:
    r = random.Random(1000 + i)
    head = list(shared or [])
    return head + [r.randrange(3, 259) for _ in range(PROMPT_TOKENS - len(head))]


class Harness:
    """Redis plus the vLLM servers; one instance serves every scenario."""

    def __init__(
        self,
        workdir: Path,
        model: Path | None = None,
        hang_s: float = 60,
        fork_from: Zygote | None = None,
    ) -> None:
        self.workdir = workdir
        self.fork_from = fork_from  # (tests: servers forked from a zygote, see stack.spawn)
        self.logs = workdir / "logs"
        self.model = model
        self.hang_s = hang_s
        self.redis = RedisServer(extra_args=["--enable-debug-command", "yes"])
        self.stack = stack.Stack()
        self.urls: dict[str, str] = {}
        # per prompt (its tokens): the connector-less server's answer, the decode server's
        # latency computing it from scratch, the prefill server's latency with Redis healthy
        self.reference: dict[tuple[int, ...], str] = {}
        self.recompute_s: dict[tuple[int, ...], float] = {}
        self.prefill_s: dict[tuple[int, ...], float] = {}
        self.noise_s = 0.0  # the largest spread of one prompt's recompute latency over 3 runs
        self.http = httpx.Client(timeout=hang_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        model = self.model
        if model is None:
            model = self.workdir / "tiny-llama"
            if not (model / "config.json").exists():
                make_model(model)
        self.redis.start()

        def server(name: str, role: str | None, core: int) -> stack.Proc:
            return stack.vllm_server(
                name,
                model=str(model),
                port=free_port(),
                role=role,
                redis_url=self.redis.url,
                log_dir=self.logs,
                core=core,
                extra_config=CONNECTOR,
                # no local prefix cache: every cached token comes from Redis, and a prompt
                # computed for the baselines is computed again, not remembered
                extra_args=["--no-enable-prefix-caching"],
                fork_from=self.fork_from,
            )

        procs = [
            server("prefill", "kv_producer", 1),
            server("decode", "kv_consumer", 0),
            server("decode2", "kv_consumer", 1),
            server("reference", None, 0),
        ]
        for p in procs:
            self.stack.add(p)
            self.urls[p.name] = p.url
        stack.wait_healthy(procs, timeout_s=900)

    def stop(self) -> None:
        self.stack.stop()
        self.redis.cleanup()
        self.http.close()

    def prepare(self, prompts: list[list[int]]) -> None:
        """Reference answers (a server without any connector) and the latency baselines."""
        for p in prompts:
            self.reference[tuple(p)] = self.complete("reference", p)[0]
        ref = self.stack.procs.pop()  # the reference server is not needed any more
        ref.stop()
        for p in prompts:
            runs = []
            for _ in range(3):
                # the same sequence as a faulty request -- a prefill, then the decode server --
                # but without transfer params: it computes the prompt and never asks Redis
                self.prefill(p)
                runs.append(self.complete("decode", p))
            if any(r[0] != self.reference[tuple(p)] for r in runs):
                raise AssertionError("the decode server's recompute differs from the reference")
            took = sorted(r[1] for r in runs)
            self.recompute_s[tuple(p)] = took[1]  # the median: noise both ways
            self.noise_s = max(self.noise_s, took[-1] - took[0])
        self.flush()

    # ------------------------------------------------------------------ requests
    def complete(
        self, server: str, prompt: list[int], params: dict | None = None
    ) -> tuple[str, float, int, dict | None]:
        body: dict[str, Any] = {
            "model": "tiny-llama",
            "prompt": prompt,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        t0 = time.perf_counter()
        r = self.http.post(self.urls[server] + "/v1/completions", json=body)
        took = time.perf_counter() - t0
        r.raise_for_status()
        doc = r.json()
        details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
        return (
            doc["choices"][0]["text"],
            took,
            int(details.get("cached_tokens") or 0),
            doc.get("kv_transfer_params"),
        )

    def prefill(self, prompt: list[int]) -> tuple[dict | None, float]:
        _, took, _, params = self.complete("prefill", prompt)
        return params, took

    def disaggregated(
        self,
        i: int,
        prompt: list[int],
        *,
        decoder: str = "decode",
        during_prefill: Callable[[], None] | None = None,
        during_decode: Callable[[], None] | None = None,
        params: dict | None = None,
        prefill_s: float | None = None,
        committed_first: bool = False,
    ) -> Outcome:
        """One request as the proxy sends it; faults may be injected while either half runs.
        ``committed_first``: the decode is sent once the prefill's commit record is in Redis
        (for checks of what is loaded, which must not race a busy machine)."""
        try:
            if params is None:
                params, prefill_s = self._with(during_prefill, lambda: self.prefill(prompt))
            if committed_first:
                self.wait_committed([params])
            text, decode_s, cached, _ = self._with(
                during_decode, lambda: self.complete(decoder, prompt, params)
            )
        except httpx.TimeoutException as exc:
            return Outcome(i, False, True, prefill_s, None, 0, error=repr(exc))
        except httpx.HTTPError as exc:
            return Outcome(i, False, False, prefill_s, None, 0, error=repr(exc))
        key = tuple(prompt)
        healthy_prefill = self.prefill_s.get(key)
        return Outcome(
            i,
            ok=text == self.reference[key],
            hung=False,
            prefill_s=prefill_s,
            decode_s=decode_s,
            cached_tokens=cached,
            added_s=decode_s - self.recompute_s[key],
            prefill_added_s=None
            if healthy_prefill is None or prefill_s is None
            else prefill_s - healthy_prefill,
        )

    @staticmethod
    def _with(fault: Callable[[], None] | None, request: Callable[[], Any]) -> Any:
        if fault is None:
            return request()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(request)
            fault()
            return fut.result()

    # ------------------------------------------------------------------ the server's state
    def admin(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, socket_timeout=5)

    def kill(self) -> None:
        self.redis.kill()

    def kill_after(self, delay_s: float) -> Callable[[], None]:
        """A fault for ``disaggregated``: SIGKILL Redis ``delay_s`` into a request."""

        def fault() -> None:
            time.sleep(delay_s)
            self.kill()

        return fault

    def revive(self, timeout_s: float = 120.0) -> None:
        """Start Redis again if it is down, and wait until every breaker that opened has closed
        (each server logs both): the event that matters, not a pause that a busy machine may
        outlast."""
        if self.redis.proc is None:
            self.redis.start()
        deadline = time.monotonic() + timeout_s
        while True:
            still_open = [name for name, n in self.breakers_open().items() if n > 0]
            if not still_open:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"breakers of {still_open} did not close in {timeout_s:.0f}s")
            time.sleep(0.1)

    def breakers_open(self) -> dict[str, int]:
        """Per server: breakers opened minus breakers closed again, from its log."""
        counts = {}
        for proc in self.stack.procs:
            log = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            counts[proc.name] = log.count(BREAKER_OPENED) - log.count(BREAKER_CLOSED)
        return counts

    def counters(self, server: str) -> dict[str, float]:
        """The connector's counters on a server's /metrics (``vllm:redis_kv_<name>_total``)."""
        out: dict[str, float] = {}
        for line in self.http.get(self.urls[server] + "/metrics").text.splitlines():
            if line.startswith("vllm:redis_kv_") and "_total" in line:
                name = line.split("{")[0].split(" ")[0][len("vllm:redis_kv_") : -len("_total")]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def wait_committed(self, params: list[dict | None], timeout_s: float = 120.0) -> None:
        """Until every producer's commit record is in Redis: a consumer then never waits for
        one, so what it loads does not depend on how busy the machine is."""
        ids = [p["redis_kv"]["handoff"] for p in params if p and "redis_kv" in p]
        deadline = time.monotonic() + timeout_s
        with self.admin() as a:
            for handoff in ids:
                while True:
                    values = [a.get(k) for k in a.keys(f"kv:*:handoff:{{{handoff}}}")]
                    if values and all(v is not None and v.isdigit() for v in values):
                        break
                    if time.monotonic() > deadline:
                        raise AssertionError(f"handoff {handoff} was never committed")
                    time.sleep(0.05)

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """SIGSTOP: the kernel still accepts connections, the server never answers."""
        assert self.redis.proc is not None
        os.kill(self.redis.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.redis.proc.pid, signal.SIGCONT)
            self.revive()

    @contextlib.contextmanager
    def paused(self, seconds: float) -> Iterator[None]:
        """CLIENT PAUSE ALL for ``seconds``: every command waits (UNPAUSE would wait too)."""
        ends = time.monotonic() + seconds
        with self.admin() as a:
            a.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        try:
            yield
        finally:
            time.sleep(max(0.0, ends - time.monotonic()))
            self.revive()

    @contextlib.contextmanager
    def debug_sleeping(self, seconds: float = 2.0) -> Iterator[None]:
        """The server blocks in DEBUG SLEEP again and again (a long blocking command)."""
        stop = threading.Event()

        def sleeper() -> None:
            with redis.Redis.from_url(self.redis.url, socket_timeout=seconds + 5) as a:
                while not stop.is_set():
                    with contextlib.suppress(redis.RedisError):
                        a.execute_command("DEBUG", "SLEEP", seconds)

        t = threading.Thread(target=sleeper, daemon=True)
        t.start()
        time.sleep(0.1)
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=seconds + 10)
            self.revive()

    def flush(self) -> None:
        with self.admin() as a:
            a.flushall()


# ---------------------------------------------------------------------- scenarios
def healthy(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("none", "healthy Redis: the baseline")
    for i, p in enumerate(prompts):
        o = h.disaggregated(i, p)
        if o.prefill_s is not None:
            h.prefill_s[tuple(p)] = o.prefill_s
        o.prefill_added_s = 0.0
        res.outcomes.append(o)
    return res


def killed(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("killed", "redis-server killed (SIGKILL): connections refused")
    h.kill()
    try:
        res.outcomes = [h.disaggregated(i, p) for i, p in enumerate(prompts)]
    finally:
        h.revive()
    return res


def sigstopped(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("hung", "redis-server stopped (SIGSTOP): accepts, never answers")
    with h.stopped():
        res.outcomes = [h.disaggregated(i, p) for i, p in enumerate(prompts)]
    return res


def client_paused(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("client-pause", "CLIENT PAUSE ALL: every command times out")
    with h.paused(seconds=2.0 * len(prompts) + 2):
        res.outcomes = [h.disaggregated(i, p) for i, p in enumerate(prompts)]
    return res


def debug_sleep(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("debug-sleep", "DEBUG SLEEP 2 in a loop: the server blocks for seconds")
    with h.debug_sleeping():
        res.outcomes = [h.disaggregated(i, p) for i, p in enumerate(prompts)]
    return res


def killed_mid_save(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("killed-mid-save", "SIGKILL while the prefill server saves, then restart")
    for i, p in enumerate(prompts):
        res.outcomes.append(h.disaggregated(i, p, during_prefill=h.kill_after(0.02 * (i % 5))))
        h.revive()
    return res


def killed_mid_load(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("killed-mid-load", "SIGKILL while the decode server loads, then restart")
    for i, p in enumerate(prompts):
        res.outcomes.append(h.disaggregated(i, p, during_decode=h.kill_after(0.005 * (i % 5))))
        h.revive()
    return res


def restarted(h: Harness, prompts: list[list[int]]) -> FaultResult:
    res = FaultResult("restarted", "killed, half the requests, restarted (empty), the rest")
    half = len(prompts) // 2
    h.kill()
    res.outcomes = [h.disaggregated(i, p) for i, p in enumerate(prompts[:half])]
    h.revive()
    res.outcomes += [
        h.disaggregated(i + half, p, committed_first=True) for i, p in enumerate(prompts[half:])
    ]
    return res


def evicting(h: Harness, prompts: list[list[int]]) -> FaultResult:
    """maxmemory + allkeys-lru: later prefills evict earlier prompts' blocks before decode."""
    res = FaultResult("evicted", "maxmemory for ~2 prompts, allkeys-lru; all prefills first")
    with h.admin() as a:
        used = int(a.info("memory")["used_memory"])
        a.config_set("maxmemory-policy", "allkeys-lru")
        a.config_set("maxmemory", str(used + 2 * 9 * 270_000))
    try:
        saved = [h.prefill(p) for p in prompts]
        for i, p in enumerate(prompts):
            params, took = saved[i]
            res.outcomes.append(h.disaggregated(i, p, params=params or {}, prefill_s=took))
    finally:
        with h.admin() as a:
            a.config_set("maxmemory", "0")
        h.flush()
    return res


def shared_prefix(h: Harness, prompts: list[list[int]]) -> FaultResult:
    """Two decode servers, prompts sharing 1,000 tokens, decoded at the same time."""
    res = FaultResult("two-consumers", "two decode servers, a shared 1,000-token prefix")
    saved = [h.prefill(p) for p in prompts]
    h.wait_committed([params for params, _ in saved])
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(
                h.disaggregated,
                i,
                p,
                decoder=("decode", "decode2")[i % 2],
                params=saved[i][0] or {},
                prefill_s=saved[i][1],
            )
            for i, p in enumerate(prompts)
        ]
        res.outcomes = [f.result() for f in futs]
    return res


SCENARIOS: dict[str, Callable[[Harness, list[list[int]]], FaultResult]] = {
    "none": healthy,
    "killed": killed,
    "hung": sigstopped,
    "client-pause": client_paused,
    "debug-sleep": debug_sleep,
    "killed-mid-save": killed_mid_save,
    "killed-mid-load": killed_mid_load,
    "restarted": restarted,
    "evicted": evicting,
    "two-consumers": shared_prefix,
}


def run(h: Harness, n: int, names: list[str]) -> list[FaultResult]:
    shared = prompt_tokens(10_000)[:1000]
    prompts = [prompt_tokens(i) for i in range(n)]
    sharing = [prompt_tokens(100 + i, shared) for i in range(n)]
    h.prepare(prompts + (sharing if "two-consumers" in names else []))
    results = []
    decoders = ("decode", "decode2")
    for name in names:
        before = [h.counters(d) for d in decoders]
        result = SCENARIOS[name](h, sharing if name == "two-consumers" else prompts)
        after = [h.counters(d) for d in decoders]
        for b, a in zip(before, after, strict=True):
            for key, value in a.items():
                result.counters[key] = result.counters.get(key, 0.0) + value - b.get(key, 0.0)
        results.append(result)
        h.flush()
    return results
