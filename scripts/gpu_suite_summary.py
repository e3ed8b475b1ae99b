"""The GPU suite's figures in one file: every ``bench_gpu`` result of one run (a folder of its
JSON files) gathered into ``suite.json`` -- per run the server, masters, I/O threads,
connections, read-ahead and writer threads, and save / load GB/s into and out of GPU memory --
and printed as a table. ``scripts/perf_model.py`` reads its figures from that file.

    # writes docs/results/gpu_suite/h200-2026-11-27/suite.json
    python -m scripts.gpu_suite_summary docs/results/gpu_suite/h200-2026-11-27
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SUITE_FILE = "suite.json"


def run_of(result: dict[str, Any]) -> dict[str, Any]:
    """One ``bench_gpu`` result, reduced to what the suite compares."""
    server = result.get("server", {})
    return {
        "server": server.get("binary", "redis-server"),
        "masters": server.get("masters", 0),
        "io_threads": server.get("io_threads", 1),
        "connections": server.get("connections", 4),
        "read_ahead": result.get("read_ahead", 1),
        "writers": result.get("writers", 1),
        "chunk_mib": result.get("chunk_mib", 32),
        "save_GBps": result["save_GBps"],
        "load_GBps": result["load_GBps"],
    }


def collect(folder: Path) -> dict[str, Any]:
    """Every ``bench_gpu`` result in ``folder`` (files with save and load figures)."""
    runs: dict[str, dict[str, Any]] = {}
    machine: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == SUITE_FILE:
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(result, dict) or "load_GBps" not in result:
            continue  # another script's output
        machine = machine or result.get("machine", {})
        runs[path.stem] = run_of(result)
    if not runs:
        raise SystemExit(f"no bench_gpu results in {folder}")
    return {"machine": machine, "runs": runs}


def one_server(suite: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Today's default deployment: one standalone redis-server without I/O threads (the
    fastest such run, whatever the client's settings)."""
    plain = [
        (name, r)
        for name, r in suite["runs"].items()
        if r["masters"] == 0 and r["io_threads"] == 1 and r["server"] == "redis-server"
    ]
    if not plain:
        raise ValueError("the suite has no run against one redis-server without I/O threads")
    return max(plain, key=lambda nr: nr[1]["load_GBps"])


def best(suite: dict[str, Any], figure: str = "load_GBps") -> tuple[str, dict[str, Any]]:
    return max(suite["runs"].items(), key=lambda nr: nr[1][figure])


def table(suite: dict[str, Any]) -> str:
    out = [
        f"{suite['machine'].get('device', '?')}, {suite['machine'].get('cpus', '?')} CPUs; "
        "GB/s into and out of GPU memory, one rank",
        "",
        "| run | server | masters | io | connections | read-ahead | writers | save | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in sorted(suite["runs"].items(), key=lambda nr: -nr[1]["load_GBps"]):
        masters = f"Cluster x{r['masters']}" if r["masters"] else "standalone"
        out.append(
            f"| {name} | {r['server']} | {masters} | {r['io_threads']} | {r['connections']} | "
            f"{r['read_ahead']} | {r['writers']} | {r['save_GBps']:.2f} | {r['load_GBps']:.2f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a GPU suite run's outputs")
    args = ap.parse_args(argv)
    suite = collect(args.folder)
    (args.folder / SUITE_FILE).write_text(json.dumps(suite, indent=2) + "\n")
    print(table(suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
