"""scripts/bench_serving.py: its workloads send repeats to the other server, its checks catch
what a broken setup shows, and ``--quick`` runs end to end on real vLLM CPU servers through
vLLM's own benchmark client (the figures it reports must be sane, not fast)."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.bench_serving import (
    QUICK,
    SETUPS,
    WORKLOADS,
    Row,
    alternating,
    checks,
    doc_qa_prompts,
    multi_turn_prompts,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("items", [1, 2, 3, 4, 6, 7])
def test_each_items_next_request_goes_to_the_other_of_two_servers(items: int) -> None:
    rounds = [[f"{i}-{q}" for i in range(items)] for q in range(4)]
    order = alternating(rounds)
    assert sorted(order) == sorted(p for r in rounds for p in r)
    server = {p: n % 2 for n, p in enumerate(order)}  # the proxy's round robin
    for i in range(items):
        seen = [server[f"{i}-{q}"] for q in range(4)]
        assert all(a != b for a, b in itertools.pairwise(seen)), (i, seen)
        # an item's rounds stay in order: a conversation's turn after its previous turn
        assert [order.index(f"{i}-{q}") for q in range(4)] == sorted(
            order.index(f"{i}-{q}") for q in range(4)
        )


def test_doc_qa_and_multi_turn_prompts_repeat_prefixes_as_described() -> None:
    docs = doc_qa_prompts(QUICK, random.Random(0))
    assert len(docs) == QUICK.docs * QUICK.questions
    heads = {p[: QUICK.doc_tokens] for p in docs}
    assert len(heads) == QUICK.docs  # each document asked QUICK.questions times
    turns = multi_turn_prompts(QUICK, random.Random(0))
    assert len(turns) == QUICK.conversations * QUICK.turns
    for p in turns:  # a later turn starts with an earlier turn of the same conversation
        earlier = [q for q in turns if q != p and p.startswith(q.removesuffix("<assistant>"))]
        assert p.count("<user>") == 1 or earlier


def row(setup: str, workload: str, **kw: float) -> Row:
    base = dict(requests=4, completed=4, failed=0, prompt_tokens=1000, ttft_p50_ms=1.0,
                ttft_p90_ms=1.0, ttft_p99_ms=1.0, output_tok_s=1.0, request_per_s=1.0,
                redis_share=0.0, local_share=0.0, external_share=0.0,
                load_failed_blocks=0.0)  # fmt: skip
    return Row(setup=setup, workload=workload, **{**base, **kw})  # type: ignore[arg-type]


def sane_run() -> list[Row]:
    rows = []
    for setup in ("single", "pair", "share", "consume"):
        for w in WORKLOADS:
            reuse = w != "no_reuse"
            local = 0.4 if reuse and (setup in ("single", "consume") or w == "system_prompt") else 0
            redis_ = 0.4 if setup == "consume" or (setup == "share" and reuse) else 0.0
            rows.append(row(setup, w, local_share=local, redis_share=redis_, external_share=redis_))
    return rows


def test_a_sane_run_passes_every_check() -> None:
    assert checks(sane_run()) == []


@pytest.mark.parametrize(
    ("setup", "workload", "change", "complaint"),
    [
        ("share", "doc_qa", {"failed": 1, "completed": 3}, "3 of 4 answered"),
        ("single", "doc_qa", {"local_share": 0.0}, "no token came from a cache"),
        ("single", "no_reuse", {"local_share": 0.1}, "nothing repeats"),
        ("share", "no_reuse", {"redis_share": 0.1}, "from Redis"),
        ("consume", "multi_turn", {"redis_share": 0.0}, "loaded nothing"),
        ("pair", "doc_qa", {"local_share": 0.3}, "should reach the other server"),
    ],
)
def test_the_checks_name_what_a_broken_setup_shows(
    setup: str, workload: str, change: dict, complaint: str
) -> None:
    rows = [
        replace(r, **change) if (r.setup, r.workload) == (setup, workload) else r
        for r in sane_run()
    ]
    problems = checks(rows)
    assert len(problems) == 1 and complaint in problems[0] and f"{setup}/{workload}" in problems[0]


def test_with_two_requests_in_flight_repeats_may_reach_the_same_server() -> None:
    """Requests that start together race to the proxy: no alternation is promised then."""
    rows = [
        replace(r, local_share=0.3)
        if r.setup == "pair" and r.workload in ("doc_qa", "multi_turn")
        else r
        for r in sane_run()
    ]
    assert checks(rows, concurrency=2) == []
    assert checks(rows, concurrency=1) != []


def test_a_pool_that_never_loads_from_redis_fails_the_run() -> None:
    rows = [
        replace(r, redis_share=0.0, external_share=0.0) if r.setup == "share" else r
        for r in sane_run()
    ]
    assert any("no token was loaded from Redis" in p for p in checks(rows))


@pytest.mark.e2e
@pytest.mark.redis
@pytest.mark.vllm
@pytest.mark.default_vllm_only
def test_quick_runs_every_setup_with_sane_figures(tmp_path: Path) -> None:
    """The command CI runs: every setup this platform supports and every workload, through
    vLLM's own client, its checks passing (exit 0), the JSON and plots written. (Over a
    2-layer model: what is checked is the setups' plumbing and figures, not the model's speed;
    8 layers took 418 s of a 2-core machine beside the other lane, 2 layers 141 s alone.)"""
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench_serving", "--quick", "--layers", "2",
         "--json", str(out), "--plot-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    result = json.loads(out.read_text())
    assert result["problems"] == []
    ran = {(r["setup"], r["workload"]) for r in result["rows"]}
    expected_setups = [s for s in SETUPS if s not in result["skipped"]]
    assert ran == {(s, w) for s in expected_setups for w in WORKLOADS}
    assert set(result["skipped"]) <= {"offload"}  # vLLM's offloading needs CUDA or XPU
    by = {(r["setup"], r["workload"]): r for r in result["rows"]}
    # the figures say what each setup is: the pool loads what the other server saved
    assert by[("share", "doc_qa")]["redis_share"] > 0
    assert by[("pair", "doc_qa")]["redis_share"] == 0
    assert all(r["failed"] == 0 and r["ttft_p50_ms"] > 0 for r in result["rows"])
    assert (tmp_path / "serving_ttft.png").stat().st_size > 0


def test_failed_requests_count_in_the_shares_and_leave_no_made_up_ttft() -> None:
    from scripts.bench_serving import Round, answered, summarize

    counters = {"vllm:prefix_cache_hits_total": 300.0, "vllm:redis_kv_tokens_loaded_total": 100.0}
    one_of_four = Round(requests=4, completed=1, failed=3, prompt_tokens=400, ttfts_ms=[12.0],
                        output_tok_s=1.0, request_per_s=1.0, counters=counters)  # fmt: skip
    row = summarize("target", "doc_qa", [one_of_four])
    assert (row.local_share, row.redis_share) == (0.75, 0.25)  # of every prompt sent
    assert answered([row]) == ["target/doc_qa: 1 of 4 answered, 3 failed"]
    none = replace(one_of_four, completed=0, failed=4, ttfts_ms=[])
    assert math.isnan(summarize("target", "doc_qa", [none]).ttft_p50_ms)  # not 0 ms


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--concurrency", "-1"],
                                 ["--rounds", "0"], ["--setups", "single,nope"],
                                 ["--target", "http://x"]])  # fmt: skip
def test_bad_arguments_are_refused_before_any_server_starts(bad: list[str]) -> None:
    from scripts.bench_serving import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(bad)
    assert exit_info.value.code == 2
