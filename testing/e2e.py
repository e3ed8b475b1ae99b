"""Helpers for the end-to-end tests: a tiny model, engine processes, prompts."""

from __future__ import annotations

import atexit
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from testing import stack
from testing.zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]
# Tests that assert a load happened give each request a Redis deadline, and each lookup and read
# a socket timeout, that no busy CI machine reaches (the defaults -- 2 s plus 1 s per 1,000
# prompt tokens, 0.5 s a lookup, 5 s a read -- were each passed while a 2-core machine was
# loaded: a TP 2 instance's read timed out and it recomputed). What a deadline or a timeout
# does is test_e2e_faults' and the fuzzer's to check.
# They also load every hit: where loading is slower than computing (a relay that delays every
# reply, a busy machine) the load policy rightly recomputes, and a test of the load path would
# see no load. What the policy chooses is test_e2e_load_policy's to check.
PATIENT = {
    "deadline_s": 30.0,  # (deadline_max_s, 30 s, caps it anyway)
    "control_timeout_s": 5.0,
    "socket_timeout_s": 30.0,
    "load_policy": "async",
}
RUNNER = ROOT / "testing" / "engine_runner.py"


def make_model(tmp_path_factory: Any, name: str, *options: str) -> Path:
    """A tiny model made by ``scripts/make_tiny_model.py`` with ``options`` (no downloads)."""
    out = tmp_path_factory.mktemp("models") / name
    script = ROOT / "scripts" / "make_tiny_model.py"
    subprocess.run(
        [sys.executable, str(script), str(out), *options], check=True, capture_output=True
    )
    return out


def engine_env(core: int | str) -> dict[str, str]:
    """Every engine gets one pinned core: the same thread count everywhere, so floating-point
    reductions happen in the same order and outputs can be compared bit for bit. (vLLM reserves
    a different number of cores when a KV connector is configured, which would otherwise change
    the thread count between a connector run and a plain run.)"""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # "0|1": a core per tensor-parallel rank
        "VLLM_CPU_OMP_THREADS_BIND": (
            core if isinstance(core, str) else str(core % max(1, os.cpu_count() or 1))
        ),
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 259) for _ in range(n)]


def one_per_phase(prompts: dict[str, list[int]], ids: list[str]) -> list[list[dict]]:
    """Phases of one prompt each: batch composition is then the same in every engine."""
    return [[{"id": i, "prompt_token_ids": prompts[i]}] for i in ids]


def start_engine(
    tmp: Path,
    name: str,
    model: Path,
    phases: list[list[dict]],
    core: int | str,
    *,
    role: str | None = None,
    url: str | None = None,
    extra: dict | None = None,
    params: dict | None = None,
    by_module_path: bool = False,
    gates: dict[int, Path] | None = None,
    dtype: str | None = None,
    max_tokens: int | None = None,
    tp: int = 1,
    block_size: int | None = None,
    max_batched_tokens: int | None = None,
    kv_cache_dtype: str | None = None,
    layout_file: Path | None = None,
    kv_events_endpoint: str | None = None,
    attention_backend: str | None = None,
    connector: str = "RedisConnector",
    separate_processes: bool = False,
) -> tuple[stack.Proc, Path]:
    """One offline engine over ``phases``, in a process of its own.

    By default its engine core and worker run inside that process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the scheduler, the connector's two sides and the
    model run the same code, but an engine starts in 11 s instead of 26 on a 2-core machine,
    and no engine core busy-polls for its worker's replies beside another engine's worker.
    ``separate_processes=True`` (and ``tp > 1``, which needs a worker per rank) runs them as a
    server does, so what crosses between the sides is serialized: ``test_e2e_connector`` and
    ``test_e2e_tensor_parallel`` keep that path covered, as do the OpenAI-server tests. An
    engine's logprobs differ between the two ways in the last float bits: engines whose
    outputs or KV a test compares run the same way. (An in-process runner steps its engine
    until the connector's last commit record is written: ``drain_in_process_connector``.)"""
    prompts = tmp / f"{name}.prompts.json"
    prompts.write_text(json.dumps(phases))
    out = tmp / f"{name}.out.json"
    cmd = [sys.executable, str(RUNNER), "--model", str(model), "--prompts", str(prompts)]
    cmd += ["--out", str(out)]
    if role:
        cmd += ["--role", role, "--url", str(url), "--extra", json.dumps(extra or {})]
    if params:
        p = tmp / f"{name}.params.json"
        p.write_text(json.dumps(params))
        cmd += ["--params", str(p)]
    if by_module_path:
        cmd.append("--by-module-path")
    if connector != "RedisConnector":  # another, or one composing ours (MultiConnector)
        cmd += ["--connector", connector]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_tokens:
        cmd += ["--max-tokens", str(max_tokens)]
    if tp > 1:
        cmd += ["--tp", str(tp)]
    if block_size:
        cmd += ["--block-size", str(block_size)]
    if max_batched_tokens:
        cmd += ["--max-batched-tokens", str(max_batched_tokens)]
    if kv_cache_dtype:
        cmd += ["--kv-cache-dtype", kv_cache_dtype]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    for phase, path in (gates or {}).items():
        cmd += ["--gate", f"{phase}:{path}"]
    if kv_events_endpoint:
        cmd += ["--kv-events-endpoint", kv_events_endpoint]
    if layout_file:
        cmd += ["--layout-file", str(layout_file)]
    env = engine_env(core)
    if not separate_processes and tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # forked from the zygote; in separate processes, so are the engine core and workers it spawns
    return stack.spawn(name, cmd, tmp, env=env, fork_from=zygote()), out


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()
_zygote_failed: Exception | None = None


def zygote() -> Zygote | None:
    """This process's zygote (``testing/zygote.py``), started on first use, stopped at exit:
    in-process engines and OpenAI servers fork from it instead of importing vLLM each (an
    engine: 25 -> 10 s beside another test run on a 2-core machine). ``None`` with
    ``KVSTORE_TEST_ZYGOTE=0``: they start as plain processes."""
    global _zygote, _zygote_failed
    if os.environ.get("KVSTORE_TEST_ZYGOTE", "1") == "0":
        return None
    with _zygote_lock:
        if _zygote_failed is not None:  # (each test retrying would import vLLM again)
            raise RuntimeError("the zygote failed to start earlier") from _zygote_failed
        if _zygote is None or _zygote.proc.poll() is not None:
            try:
                _zygote = Zygote(Path(tempfile.mkdtemp(prefix="kvstore-zygote-")))
            except Exception as e:
                _zygote_failed = e
                raise
            atexit.register(_zygote.stop)
        return _zygote


def wait_at_gate(gate: Path, timeout_s: float = 600) -> None:
    """Wait until an engine stopped at ``gate`` (see ``start_engine(gates=...)``)."""
    deadline = time.monotonic() + timeout_s
    while not Path(str(gate) + ".ready").exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine never reached {gate}")
        time.sleep(0.1)


def release(gate: Path) -> None:
    gate.touch()


def finish(job: tuple[stack.Proc, Path], timeout_s: float = 600) -> dict:
    proc, out = job
    try:
        rc = proc.popen.wait(timeout=timeout_s)
    finally:
        proc.kill()  # the runner exits without tearing vLLM down: its children go here
    if rc != 0 or not out.exists():
        raise AssertionError(f"engine {out.name} failed (rc={rc}):\n{proc.log_tail(6000)}")
    return json.loads(out.read_text())


def finish_all(*jobs: tuple[stack.Proc, Path], timeout_s: float = 600) -> list[dict]:
    """``finish`` each of engines running side by side; when one fails, the others are killed
    too (they run in sessions of their own: nothing else would stop them)."""
    try:
        return [finish(job, timeout_s) for job in jobs]
    finally:
        for proc, _ in jobs:
            proc.kill()


def count_blocks(client: Any, namespace: str = "vllm") -> int:
    """How many block keys (not handoff records, claims or counters) ``namespace`` holds."""
    from kvstore.values.keys import parse_key

    keys = (parse_key(k.decode()) for k in client.scan_iter(match=f"kv:{namespace}:*"))
    return sum(1 for k in keys if k is not None and k.kind == "block")


def stored_dtypes(client: Any, keys: list[str]) -> list[str]:
    """The tensor dtypes (safetensors' spelling) in the headers of the blocks among ``keys``."""
    from kvstore.values.codec import read_header
    from kvstore.values.keys import parse_key

    found = set()
    for key in keys:
        parsed = parse_key(key)
        if parsed is not None and parsed.kind == "block":
            found |= {e.dtype for e in read_header(client.get(key)).tensors}
    return sorted(found)


def assert_loaded_like_plain(runs: dict[str, Any], prompt_ids: Any, prefix_tokens: int) -> None:
    """Each of ``prompt_ids`` the loader ran found at least ``prefix_tokens`` cached (its
    prefix came from Redis: a fresh instance has nothing of its own) and answered exactly as
    the connector-less engine did: tokens and logprobs."""
    for pid in prompt_ids:
        want = runs["plain"]["prompts"][pid]
        got = runs["loader"]["prompts"][pid]
        assert got["num_cached_tokens"] >= prefix_tokens, pid
        assert got["token_ids"] == want["token_ids"], pid
        assert got["logprobs"] == want["logprobs"], pid


def plain_saver_loader(
    tmp: Path,
    model: Path,
    first: dict[str, list[int]],
    sharing: dict[str, list[int]],
    other_loaders: dict[str, dict[str, Any]] | None = None,
    **run: Any,
) -> dict[str, Any]:
    """``plain`` (no connector, on core 1) beside ``saver`` (share mode, an empty Redis): each
    runs ``first`` then ``sharing``, one prompt per phase; then ``loader``, a fresh share-mode
    instance, runs only ``sharing``; then each of ``other_loaders`` (name -> what it changes
    of ``run``) likewise, one after another. Also ``keys``: Redis's keys after the saver. (One
    pinned core each gives every engine the same thread count, so which core does not change
    a bit; side by side, their start-ups share the two cores.)"""
    import redis

    from testing.redis_server import RedisServer

    everything = {**first, **sharing}
    phases = one_per_phase(everything, list(everything))
    out: dict[str, Any] = {}
    with RedisServer() as server:
        plain = start_engine(tmp, "plain", model, phases, **{**run, "core": 1})
        share: dict[str, Any] = {
            "role": "kv_both",
            "url": server.url,
            "extra": {"mode": "share", **PATIENT},
        }
        try:
            saver = start_engine(tmp, "saver", model, phases, **run, **share)
        except BaseException:
            plain[0].kill()
            raise
        out["plain"], out["saver"] = finish_all(plain, saver)
        client = redis.Redis.from_url(server.url)
        out["keys"] = sorted(k.decode() for k in client.scan_iter(count=1000))
        out["dtypes"] = stored_dtypes(client, out["keys"])
        client.close()
        loads = one_per_phase(sharing, list(sharing))
        out["loader"] = finish(start_engine(tmp, "loader", model, loads, **run, **share))
        for name, changes in (other_loaders or {}).items():
            out[name] = finish(start_engine(tmp, name, model, loads, **{**run, **changes}, **share))
    return out


def family_runs(
    tmp: Path,
    model: Path,
    first: dict[str, list[int]],
    sharing: dict[str, list[int]],
    **run: Any,
) -> dict[str, Any]:
    """One model family end to end, against one Redis, one prompt per phase:
    - ``plain``: no connector; every prompt, then all of them again (warm: their prefix from
      vLLM's local cache, under ``<id>#2``);
    - ``prod``: a consume-mode ``kv_producer`` (namespace ``pd``) runs every prompt, beside it;
    - ``saver``: share mode, an empty pool; ``loader``: a fresh share-mode instance given only
      ``sharing``; beside it ``cons``, a ``kv_consumer`` given every prompt and the producer's
      ``kv_transfer_params``.
    Also ``saver_log``, ``keys`` (Redis's keys after the saver), ``pd_keys`` (after the
    producer) and ``pd_keys_after_decode`` (after the consumer)."""
    import redis

    from testing.redis_server import RedisServer

    everything = {**first, **sharing}
    phases = one_per_phase(everything, list(everything))
    out: dict[str, Any] = {}
    beside = {**run, "core": 1}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)

        def keys(pattern: str = "*") -> list[str]:
            return sorted(k.decode() for k in client.scan_iter(pattern, count=1000))

        pd: dict[str, Any] = {"url": server.url, "extra": {"namespace": "pd", **PATIENT}}
        plain = start_engine(tmp, "plain", model, phases * 2, **run)
        prod = start_engine(tmp, "prod", model, phases, **beside, **pd, role="kv_producer")
        out["plain"], out["prod"] = finish_all(plain, prod)
        out["pd_keys"] = keys("kv:pd:*")
        params = {k: v["kv_transfer_params"] for k, v in out["prod"]["prompts"].items()}
        share: dict[str, Any] = {
            "role": "kv_both",
            "url": server.url,
            "extra": {"mode": "share", **PATIENT},
        }
        saver = start_engine(tmp, "saver", model, phases, **run, **share)
        out["saver"] = finish(saver)
        out["saver_log"] = saver[0].log.read_text(errors="replace")
        out["keys"] = keys()
        loads = one_per_phase(sharing, list(sharing))
        loader = start_engine(tmp, "loader", model, loads, **run, **share)
        cons = start_engine(
            tmp, "cons", model, phases, **beside, **pd, role="kv_consumer", params=params
        )
        out["loader"], out["cons"] = finish_all(loader, cons)
        out["pd_keys_after_decode"] = keys("kv:pd:*")
        client.close()
    return out
