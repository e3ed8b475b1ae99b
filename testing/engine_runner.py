"""Runs one offline vLLM engine (optionally with a KV connector) over prompts, in phases.

Used by the end-to-end tests and by bench_connector.py, one process per engine like real
instances:

    python testing/engine_runner.py --model DIR --out out.json --prompts prompts.json \
        [--role kv_producer --url redis://... --extra '{"mode": "share"}'] [--params in.json] \
        [--connector ExampleConnector --extra '{"shared_storage_path": "/tmp/kv"}']

prompts.json: a list of phases, each a list of {"id", "prompt_token_ids"}, or "reset" (vLLM's
``reset_prefix_cache(reset_connector=True)``; out.json's "resets" lists what it returned), or
"reset-local" (vLLM's prefix cache only: the connectors keep what they hold).
out.json: per prompt id the greedy token ids, their logprobs, num_cached_tokens,
kv_transfer_params and the phase's wall time (``elapsed_s``), plus the engine's connector metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, NoReturn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--role")
    ap.add_argument("--url")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--params", help="json: prompt id -> kv_transfer_params (from a producer)")
    ap.add_argument("--by-module-path", action="store_true")
    ap.add_argument("--connector", default="RedisConnector")
    ap.add_argument("--dtype", default="float32", help="model dtype")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument(
        "--block-size",
        type=int,
        help="vLLM's --block-size (a Mamba / GDN hybrid's state block size: vLLM splits "
        "prefills at multiples of it)",
    )
    ap.add_argument("--max-batched-tokens", type=int, help="vLLM's --max-num-batched-tokens")
    ap.add_argument("--kv-cache-dtype", help="vLLM's --kv-cache-dtype (fp8, fp8_e5m2, ...)")
    ap.add_argument(
        "--attention-backend",
        help="vLLM's --attention-backend (CPU_MLA: vLLM's reference MLA even on a CPU with "
        "AMX, where vLLM would pick AMX_MLA)",
    )
    ap.add_argument(
        "--gate",
        action="append",
        default=[],
        help="PHASE:PATH (repeatable): before that phase (0-based), create PATH.ready and wait "
        "for PATH to exist, so a test can inject a fault between phases",
    )
    ap.add_argument(
        "--layout-file", help="where the connector's scheduler writes its layout (JSON)"
    )
    ap.add_argument(
        "--kv-events-endpoint",
        help="publish vLLM's KV events over ZMQ here (e.g. tcp://*:5557; vLLM binds a '*')",
    )
    args = ap.parse_args()
    if args.layout_file:  # read by the connector in the engine process, which inherits it
        os.environ["REDIS_KV_CONNECTOR_LAYOUT_FILE"] = args.layout_file

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if args.role:
        extra = json.loads(args.extra)
        if args.connector == "RedisConnector":
            extra = {"url": args.url, **extra}
        cfg = {
            "kv_connector": args.connector,
            "kv_role": args.role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        if args.by_module_path:
            cfg["kv_connector_module_path"] = "connector.redis_connector"
        kv = KVTransferConfig(**cfg)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv,
        disable_log_stats=False,
        tensor_parallel_size=args.tp,
        **({"block_size": args.block_size} if args.block_size else {}),
        **({"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}),
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=args.kv_events_endpoint
        )
        if args.kv_events_endpoint
        else None,
    )
    with open(args.prompts) as f:
        phases = json.load(f)
    params: dict = {}
    if args.params:
        with open(args.params) as f:
            params = json.load(f)
    out: dict = {"prompts": {}}
    gates = {int(g.split(":", 1)[0]): g.split(":", 1)[1] for g in args.gate}
    for n, phase in enumerate(phases):
        if n in gates:
            open(gates[n] + ".ready", "w").close()
            waited = time.monotonic()
            while not os.path.exists(gates[n]):
                if time.monotonic() - waited > 300:
                    die(f"gate {gates[n]} never opened")
                time.sleep(0.05)
        if phase == "reset":  # vLLM's reset_prefix_cache, the connector's store too
            out.setdefault("resets", []).append(llm.reset_prefix_cache(reset_connector=True))
            continue
        if phase == "reset-local":  # vLLM's own prefix cache only: the next hit is external
            out.setdefault("local_resets", []).append(llm.reset_prefix_cache())
            continue
        sps = []
        for p in phase:
            extra = {"kv_transfer_params": params[p["id"]]} if p["id"] in params else None
            sps.append(
                SamplingParams(
                    max_tokens=args.max_tokens, temperature=0, logprobs=0, extra_args=extra
                )
            )
        prompts = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in phase]
        t0 = time.perf_counter()
        results = llm.generate(prompts, sps, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        for p, res in zip(phase, results, strict=True):
            c = res.outputs[0]
            assert c.logprobs is not None  # asked for (logprobs=0: the sampled token's)
            key = p["id"] if p["id"] not in out["prompts"] else p["id"] + "#2"
            out["prompts"][key] = {
                "token_ids": list(c.token_ids),
                "logprobs": [
                    lp[t].logprob  # type: ignore[index]
                    for lp, t in zip(c.logprobs, c.token_ids, strict=True)
                ],
                "num_cached_tokens": res.num_cached_tokens,
                "num_prompt_tokens": len(p["prompt_token_ids"]),
                "kv_transfer_params": res.kv_transfer_params,
                "elapsed_s": elapsed,
            }
    tiny = ([TokensPrompt(prompt_token_ids=[3])], SamplingParams(max_tokens=1))
    drain_in_process_connector(llm, tiny)
    # An offline LLM processes engine outputs only while generate() runs; counters of work that
    # ended after the last request's final token (commit records, late saves) arrive in later,
    # stats-only outputs. One tiny request, a moment later, pulls them in. (A server's output
    # loop always pulls; it needs nothing like this.)
    time.sleep(0.5)
    llm.generate(*tiny, use_tqdm=False)
    metrics: dict = {}
    for m in llm.get_metrics():
        if "redis_kv" in m.name or "prefix_cache" in m.name:
            if hasattr(m, "sum"):  # a histogram
                metrics[m.name] = {"count": getattr(m, "count", None), "sum": m.sum}
            else:
                metrics[m.name] = getattr(m, "value", None)
    out["metrics"] = metrics
    with open(args.out, "w") as f:
        json.dump(out, f)
    os._exit(0)  # skip slow engine teardown


def drain_in_process_connector(llm: Any, tiny: tuple, timeout_s: float = 120) -> None:
    """An engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only inside
    ``generate``: a finished request's commit record reaches the connector's worker a step
    later, and its write, like a consumer's handoff deletes on the scheduler side, then runs on
    a connector thread that the runner's exit would kill. Step with tiny requests until no
    connector of ours tracks a request, runs a transfer or waits to delete a handoff. (In
    separate processes the engine core keeps stepping on its own until shut down.)"""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # the in-process EngineCore's
    sides = [get_kv_transfer_group(), scheduler.connector]
    # ours, alone or inside a MultiConnector (another connector's shutdown is its business)
    ours = [c for side in sides for c in getattr(side, "_connectors", [side])]
    workers = [c.connector_worker for c in ours if getattr(c, "connector_worker", None)]
    schedulers = [c.connector_scheduler for c in ours if getattr(c, "connector_scheduler", None)]

    def busy() -> list[str]:
        what = [r for w in workers for r in sorted(w.tracked_requests())]
        what += ["a transfer"] * sum(w.shutdown_pending(0) for w in workers)
        what += ["a handoff delete"] * sum(s.drops_waiting for s in schedulers)
        return what

    deadline = time.monotonic() + timeout_s
    while left := busy():
        if time.monotonic() > deadline:
            die(f"the connector still has {left} after {timeout_s:.0f} s of steps")
        time.sleep(0.02)
        llm.generate(*tiny, use_tqdm=False)


def die(message: str) -> NoReturn:
    """Exit at once, failed: an orderly exit would join the connector's threads (perhaps what
    is stuck) and tear vLLM down, and the test would wait out its own timeout."""
    print(f"engine_runner: {message}", file=sys.stderr, flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
