"""The GPU suite's figures, gathered from bench_gpu results, are what the performance model
reads (scripts/gpu_suite_summary.py, scripts/perf_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import gpu_suite_summary, perf_model


def bench_result(binary: str, masters: int, io: int, load: float, **client: int) -> dict:
    return {
        "machine": {"device": "NVIDIA H100", "cpus": 16},
        "server": {"binary": binary, "masters": masters, "io_threads": io, "connections": 4},
        "save_GBps": load / 2,
        "load_GBps": load,
        **client,
    }


def test_the_suite_gathers_every_bench_result_and_the_model_reads_it(tmp_path: Path) -> None:
    runs = {
        "masters-baseline": bench_result("redis-server", 0, 1, 1.9),
        "masters-standalone-io4-w4": bench_result("redis-server", 0, 4, 1.7, writers=4),
        "masters-cluster4-io4-w4-ra4": bench_result(
            "redis-server", 4, 4, 4.2, writers=4, read_ahead=4
        ),
    }
    for name, result in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "shards.json").write_text(json.dumps({"gbps": {}}))  # another script's
    (tmp_path / "broken.json").write_text("{")

    assert gpu_suite_summary.main([str(tmp_path)]) == 0
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert set(suite["runs"]) == set(runs)
    fastest = suite["runs"]["masters-cluster4-io4-w4-ra4"]
    assert (fastest["masters"], fastest["read_ahead"], fastest["writers"]) == (4, 4, 4)
    assert suite["runs"]["masters-baseline"]["read_ahead"] == 1  # older results: the default

    measured = perf_model.Measured.from_docs(str(tmp_path / "suite.json"))
    assert measured.suite_one_server_gbps == 1.9  # one redis-server, no I/O threads
    assert (measured.suite_best_gbps, measured.suite_best_run) == (
        4.2,
        "masters-cluster4-io4-w4-ra4",
    )
    assert "4.20 GB/s at best (masters-cluster4-io4-w4-ra4)" in perf_model.policy_table(
        0.5, 0.005, measured
    )


def test_a_folder_without_bench_results_is_refused(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit, match="no bench_gpu results"):
        gpu_suite_summary.collect(tmp_path)


def test_the_model_reads_the_newest_suite_in_docs() -> None:
    measured = perf_model.Measured.from_docs()
    assert Path(measured.suite_file).name == "suite.json"
    assert measured.suite_best_gbps >= measured.suite_one_server_gbps > 0
