"""The load policy's own code deciding for a modelled GPU engine and store
(``scripts/sim_load_policy.py``), in cells where each way is the best fixed one: ``auto``
learns the store from its probes and loads, and meets the targets the simulator checks (its
mean TTFT at most recompute's and 1.05x the best fixed way's, its p99 at most 1.2x
recompute's). The whole matrix is the script's to run (minutes); these take seconds."""

from __future__ import annotations

import pytest

from scripts.sim_load_policy import DEPLOYMENTS, WORKLOADS, Cell, run_cell

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
