#!/usr/bin/env python3
"""Faults injected into a real redis-server under real vLLM CPU servers, and what requests see.

A prefill server (kv_producer) and two decode servers (kv_consumer) with RedisConnector share
one redis-server that this script kills, pauses, stops, restarts and fills. For each fault it
sends prompts the way the proxy does (prefill, then decode with the prefill's
kv_transfer_params) and records, per request:

- wrong: the decode server's answer differs from a connector-less server's answer;
- hung: prefill or decode did not answer within --hang-s;
- added latency: the decode request's latency minus the same prompt's latency when the decode
  server computes it from scratch right after the same prefill (a request without transfer
  params never touches Redis), measured beforehand; likewise for prefill against a healthy run;
- tokens from Redis (``usage.prompt_tokens_details.cached_tokens``).

    python -m scripts.reliability [--requests 6] [--markdown docs/reliability.md]

The scenarios and their harness live in ``testing.fault_matrix``; the end-to-end test
tests/e2e/test_e2e_faults.py runs them with fewer requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from testing.fault_matrix import (
    CONNECTOR,
    MAX_TOKENS,
    PROMPT_TOKENS,
    ROOT,
    SCENARIOS,
    FaultResult,
    Harness,
    run,
)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f} ms"


def markdown(results: list[FaultResult], info: dict[str, Any]) -> str:
    lines = [
        "| fault | what happens | requests | wrong answers | hung | worst added latency "
        "| after the first 3: worst / median | worst added prefill latency "
        "| prompt tokens from Redis |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        row = r.row()
        lines.append(
            f"| {r.fault} | {r.what} | {r.sent} | **{r.wrong}** | **{r.hung}** "
            f"| {_ms(row['worst_added_s'])} | {_ms(row['worst_added_after_3_s'])} / "
            f"{_ms(row['median_added_after_3_s'])} "
            f"| {_ms(row['worst_prefill_added_s'])} | {100 * row['tokens_from_redis']:.0f}% |"
        )
    lines.append("")
    lines.append(
        f"Machine: {info['machine']}. Each request: {PROMPT_TOKENS} prompt tokens "
        f"(9 blocks), {MAX_TOKENS} output tokens, tiny 2-layer model, every server on one "
        f"pinned core. Recompute baseline: the decode server computing the prompt right after its "
        f"prefill, without transfer params (median over prompts of each prompt's median of 3 "
        f"runs): "
        f"{_ms(info['recompute_median_s'])}; the same prompt's recompute varied by up to "
        f"{_ms(info['noise_s'])} between runs, the noise below which an added latency means "
        f"nothing here. Connector settings: {json.dumps(CONNECTOR)}."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6, help="requests per fault")
    ap.add_argument("--faults", default=",".join(SCENARIOS), help="comma-separated subset")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".run" / "reliability")
    ap.add_argument("--model", type=Path, help="a local model directory (default: tiny Llama)")
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--markdown", type=Path, help="write the table here")
    ap.add_argument("--json", type=Path, help="write every request's outcome here")
    args = ap.parse_args(argv)
    names = [n for n in args.faults.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown faults {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    h = Harness(args.workdir, args.model, args.hang_s)
    try:
        h.start()
        results = run(h, args.requests, names)
    finally:
        h.stop()
    info = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "recompute_median_s": statistics.median(h.recompute_s.values()),
        "noise_s": h.noise_s,
    }
    table = markdown(results, info)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(
            json.dumps({"info": info, "results": [r.row() for r in results]}, indent=1)
        )
    return 0 if all(r.wrong == 0 and r.hung == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
