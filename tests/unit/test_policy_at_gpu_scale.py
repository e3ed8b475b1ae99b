"""The load policy's own code deciding for a modelled GPU engine and store
(``scripts/sim_load_policy.py``), in cells where each way is the best fixed one: ``auto``
learns the store from its probes and loads, and meets the targets the simulator checks (its
mean TTFT at most recompute's and 1.05x the best fixed way's, its p99 at most 1.2x
recompute's). The whole matrix is the script's to run (minutes); these take seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.sim_load_policy import DEPLOYMENTS, WORKLOADS, Cell, run_cell
from scripts.sim_load_policy import main as sim_main

LLAMA_8B, LLAMA_70B = DEPLOYMENTS[0], DEPLOYMENTS[2]
IDLE, FOUR, SIXTEEN, DECODES = WORKLOADS


@pytest.mark.parametrize(
    ("deployment", "gbps", "split_ratio", "workload", "hit", "best"),
    [
        (LLAMA_8B, 0.94, 0.33, IDLE, 2048, "recompute"),  # the store too slow to gain
        (LLAMA_8B, 1.9, 1.0, IDLE, 8192, "split"),  # near the break-even
        (LLAMA_8B, 8.0, 0.33, IDLE, 2048, "async"),  # fast loads, slow bands
        (LLAMA_8B, 3.5, 1.0, FOUR, 8192, "split"),  # busy: prompts share passes
        (LLAMA_8B, 8.0, 0.33, SIXTEEN, 2048, "async"),  # busy: loads share the store
        (LLAMA_70B, 1.9, 0.33, DECODES, 8192, None),  # TP 4 (one slower rank), 64 decodes
    ],
    ids=lambda v: getattr(v, "name", None) or str(v),
)
def test_auto_meets_the_targets_where_each_way_is_best(
    deployment: object, gbps: float, split_ratio: float, workload: object, hit: int, best: str
) -> None:
    cell: Cell = run_cell(deployment, gbps, split_ratio, workload, hit, 40, seed=1)  # type: ignore[arg-type]
    if best is not None:
        assert cell.best_fixed() == best  # (the cell is what it is chosen for)
    assert cell.passes(), cell.ratios()


def test_the_simulator_runs_seeds_side_by_side_and_processes_change_nothing(
    tmp_path: Path,
) -> None:
    """``--seeds`` runs every cell once per seed and says each seed's summary; ``--jobs``
    runs cells in processes, with the very results of one process."""
    args = ["--requests", "8", "--only", "8B, H200,8 GB/s,4 clients,8k", "--seeds", "1,2"]
    sim_main([*args, "--json", str(tmp_path / "one.json")])
    sim_main([*args, "--jobs", "2", "--json", str(tmp_path / "two.json")])
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert [c["seed"] for c in one["cells"]] == [1, 1, 2, 2]  # two split ratios, two seeds
    assert set(one["per_seed"]) == {"1", "2"}
    assert one["cells"] == two["cells"]
    # the seeds draw different runs (arrivals, noise)
    assert one["cells"][0]["ttft"] != one["cells"][2]["ttft"]


def test_on_an_idle_engine_autos_predictions_are_what_its_requests_get() -> None:
    """The simulator reports auto's predicted time to first token over what each request got,
    per way it chose: on an idle engine, where nothing else shares the passes or the store,
    the model has nothing to miss (busy cells are where it errs: docs/benchmarks.md)."""
    cell = run_cell(LLAMA_8B, 0.94, 1.0, IDLE, 8192, 20, seed=1)
    assert cell.auto_chose.get("split", 0) > 10  # (the cell is what it is chosen for)
    assert "split" in cell.auto_predicted_over_got
    for way, ratio in cell.auto_predicted_over_got.items():
        assert 0.9 < ratio < 1.1, (way, ratio)
