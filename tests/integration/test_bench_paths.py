"""scripts/bench_paths.py runs end to end against a real redis-server and reports, beside each
path's GB/s, the CPU time the client and the server spent on it (the figures must be sane, not
fast)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from scripts.bench_paths import main, server_cpu_seconds

pytestmark = pytest.mark.redis


def test_a_processs_cpu_time_counts_its_threads_after_they_exit() -> None:
    def spin() -> None:
        total = 0
        for i in range(2_000_000):  # some milliseconds of CPU
            total += i

    before = server_cpu_seconds(os.getpid())
    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    after_thread = server_cpu_seconds(os.getpid())
    assert after_thread - before >= 0.001
    spin()
    assert server_cpu_seconds(os.getpid()) > after_thread


def test_every_path_reports_its_speed_and_the_cpu_each_side_spent(tmp_path: Path) -> None:
    out = tmp_path / "paths.json"
    assert main(["--sizes", "64K", "--rounds", "1", "--batch", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    speeds, cpu = report["gbps"]["65536"], report["cpu"]["65536"]
    assert set(speeds) == set(cpu)
    assert {"kvstore select_into x1", "kvstore insert_many", "redis-py SET"} <= set(speeds)
    # a write measured in its parts: the framing alone sends nothing
    framing = "kvstore insert_parts x1, checksums alone"
    assert {framing, "kvstore insert_parts x1, framed before"} <= set(speeds)
    for name, gbps in speeds.items():
        assert gbps > 0, name
        assert cpu[name]["client_ms_per_gb"] > 0, name
        if name == framing:
            continue
        # every other path makes the server work: it receives or sends every value's bytes
        assert cpu[name]["server_ms_per_gb"] > 0, name
        assert 0 < cpu[name]["server_busy"] <= 1.5, name  # scheduler counters vs wall clock


def test_the_sweep_reports_each_depth_and_connection_count(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    argv = ["--sweep", "--sizes", "64K", "--rounds", "1", "--batch", "2", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())["65536"]
    rows, cpu = report["gbps"], report["cpu"]
    assert {"depth 1 x1", "depth 4 x2", "depth 16 x4"} <= set(rows) == set(cpu)
    assert all(v > 0 for v in rows.values())
    assert all(c["server_ms_per_gb"] > 0 for c in cpu.values())
