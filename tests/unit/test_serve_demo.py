"""The one-command demo: its failure messages, and what it prints from what it measured (its
happy path is the README's first command, and the same stack runs in test_e2e_serving.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from connector.load_policy import MARGIN
from scripts import serve_demo
from testing.redis_server import free_port
from tests.conftest import ROOT


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.serve_demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},  # a narrow console: long lines must not wrap
    )


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_a_taken_port_fails_with_a_clear_message(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_demo("--proxy-port", str(port), "--workdir", str(tmp_path))
    assert out.returncode == 1
    assert f"proxy port {port} already in use" in one_line(out.stdout)


def test_a_model_directory_without_config_fails_clearly(tmp_path) -> None:
    ports = [str(free_port()) for _ in range(4)]
    out = run_demo(
        "--model", str(tmp_path),
        "--proxy-port", ports[0], "--prefill-port", ports[1],
        "--decode-port", ports[2], "--redis-port", ports[3],
    )  # fmt: skip
    assert out.returncode == 1
    # the whole message on one line, whatever the path's length
    assert f"--model {tmp_path.resolve()} has no config.json" in out.stdout.splitlines()[-1]


# ---------------------------------------------------------------- the demo's comparison
# Its happy path needs real servers (README's first command); what it prints from what it
# measured is checked here: a scrape in vLLM's format (a real decode server's, cut down), the
# load policy's choices in words, and the comparison's verdict whichever way it goes.

LABELS = '{engine="0",model_name="tiny-llama"}'


def scrape_text(**values: float) -> str:
    """A /metrics scrape as vLLM writes it, with the connector's series ``values`` (names without
    the ``vllm:redis_kv_`` prefix), among the lines the demo must skip."""
    lines = [
        "# HELP vllm:redis_kv_chose_async_total How the load policy served each hit in Redis",
        "# TYPE vllm:redis_kv_chose_async_total counter",
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0',
        f"vllm:redis_kv_chose_async_created{LABELS} 1.7648e+09",
        'vllm:redis_kv_load_seconds_bucket{engine="0",le="0.01",model_name="tiny-llama"} 6.0',
    ]
    lines += [f"vllm:redis_kv_{name}{LABELS} {value!r}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def metrics(**values: float) -> dict[str, float]:
    return serve_demo.parse_metrics(scrape_text(**values))


def test_the_connectors_series_are_read_from_a_scrape_summed_over_their_labels() -> None:
    text = scrape_text(chose_async_total=6.0, predicted_gain_seconds_sum=0.524084)
    text += 'vllm:redis_kv_chose_async_total{engine="1",model_name="tiny-llama"} 1.0\n'
    got = serve_demo.parse_metrics(text)
    assert got["vllm:redis_kv_chose_async_total"] == 7.0
    assert got["vllm:redis_kv_predicted_gain_seconds_sum"] == 0.524084
    assert "vllm:num_requests_running" not in got  # vLLM's own series are not the connector's
    assert got["vllm:redis_kv_chose_async_created"] > 1e9  # (a series of its own, unread)


@pytest.mark.vllm
def test_every_series_the_demo_reads_is_one_the_connector_exports() -> None:
    """A renamed counter must not leave the demo saying 'nothing to load' for ever."""
    pytest.importorskip("vllm")  # (connector.stats builds on vLLM's metrics classes)
    from connector.stats import COUNTERS, GAUGES, HISTOGRAMS

    exported = {name + "_total" for name, _ in COUNTERS.values()}
    exported |= {name + s for name, _, _ in HISTOGRAMS.values() for s in ("_sum", "_count")}
    exported |= {name for name, _ in GAUGES.values()}
    read = {
        *(f"chose_{way}_total" for way in serve_demo.WAYS),
        "predicted_gain_seconds_sum",
        "predicted_gain_seconds_count",
        "tokens_loaded_total",
        "bytes_loaded_total",
        "tokens_load_failed_total",
        "requests_given_up_total",
        "transfer_params_ignored_total",
        "policy_load_bytes_per_second",
        "policy_load_overhead_seconds",
    }
    assert serve_demo.WAYS == ["async", "split", "recompute"]
    assert {serve_demo.METRIC_PREFIX + name for name in read} <= exported
    source = Path(serve_demo.__file__).read_text()
    for name in read - {f"chose_{w}_total" for w in serve_demo.WAYS}:
        assert f'"{name}"' in source  # (the list above is the demo's)


BEFORE = metrics(chose_async_total=1.0, predicted_gain_seconds_count=0.0)


@pytest.mark.parametrize(
    ("after", "handed_over", "short", "why"),
    [
        (metrics(chose_async_total=1.0), False, "-", "nothing was handed over"),
        (metrics(chose_async_total=1.0), True, "own cache", "its own prefix cache held"),
        (
            metrics(chose_async_total=1.0, transfer_params_ignored_total=1.0),
            True,
            "ignored the handoff",
            "did not match",
        ),
        (
            metrics(chose_async_total=2.0),
            True,
            "load: first, not measured",
            "has not measured Redis yet loads what was handed over",
        ),
        (
            metrics(
                chose_async_total=2.0,
                predicted_gain_seconds_count=1.0,
                predicted_gain_seconds_sum=0.1194,
            ),
            True,
            "load: predicted 119 ms sooner",
            "loading was predicted to bring the first token that much sooner",
        ),
        (
            metrics(
                chose_async_total=1.0,
                chose_split_total=1.0,
                predicted_gain_seconds_count=1.0,
                predicted_gain_seconds_sum=0.02,
            ),
            True,
            "split: predicted 20 ms sooner",
            "layer by layer while computing the rest",
        ),
        (
            metrics(
                chose_async_total=1.0, chose_recompute_total=1.0, predicted_gain_seconds_count=1.0
            ),
            True,
            "compute: load not faster",
            f"not predicted to bring the first token at least {MARGIN:.0%} sooner",
        ),
        (
            metrics(chose_async_total=1.0, chose_recompute_total=1.0),
            True,
            "compute: not measured",
            "has not measured Redis yet",
        ),
        (
            metrics(chose_async_total=2.0, requests_given_up_total=1.0),
            True,
            "load: first, not measured, gave up",
            "gave up waiting for Redis and computed the prompt",
        ),
        (
            metrics(
                chose_async_total=2.0, loads_expired_total=1.0, tokens_load_failed_total=1280.0
            ),
            True,
            "load: first, not measured, too slow",
            "ran past its deadline (what it predicted plus what computing takes)",
        ),
        (
            metrics(chose_async_total=2.0, tokens_load_failed_total=256.0),
            True,
            "load: first, not measured, failed",
            "failed to load and were computed",
        ),
    ],
    ids=[
        "no-handoff",
        "own-cache",
        "ignored",
        "first-load",
        "measured-load",
        "split",
        "measured-compute",
        "unmeasured-compute",
        "gave-up",
        "expired",
        "failed",
    ],
)
def test_the_load_policys_choice_is_told_from_its_counters(
    after: dict[str, float], handed_over: bool, short: str, why: str
) -> None:
    choice = serve_demo.explain_choice(BEFORE, after, handed_over)
    assert choice.short == short
    assert why in choice.why


def result(
    kind: str,
    ttft_ms: float,
    from_redis: int,
    choice: str = "-",
    *,
    way: str | None = None,
    gain_ms: float | None = None,
) -> tuple:
    """One row of the comparison as the demo measures it (a prompt of 1387 tokens)."""
    policy = serve_demo.Choice(choice, f"why {serve_demo.Choice(choice, '').reason}")
    res = {
        "ttft_s": ttft_ms / 1000,
        "prompt_tokens": 1387,
        "computed": 1387 - from_redis,
        "from_redis": from_redis,
        "policy": policy,
        "way": way or ("async" if from_redis else None),
        "expired": False,
        "kv_bytes": from_redis * 1024.0,
        "wait_s": 0.012 if kind == "loaded" else 0.0,
        "load_s": 0.025 if from_redis else 0.0,
        "predicted_gain_s": gain_ms / 1000 if gain_ms is not None else None,
        "prefill_s": 0.381 if kind == "loaded" else None,
    }
    return (1, kind, res)


def test_the_verdict_compares_the_same_prompt_on_the_same_server_loaded_against_computed() -> None:
    rows = [
        result("computed", 236, 0),
        result("loaded", 257, 1280, "load: predicted 119 ms sooner", gain_ms=119),
        result("loaded", 151, 1280, "load: predicted 116 ms sooner", gain_ms=116),
        result("computed", 1333, 0),  # an outlier: a median, not a mean
        result("computed", 176, 0),
        result("loaded", 182, 1280, "load: predicted 99 ms sooner", gain_ms=99),
    ]
    text = serve_demo.verdict(rows)
    assert "Same prompt, same server (medians of 3 requests each)" in text
    assert "after 182 ms when the decode server loaded the prompt's KV from Redis" in text
    assert "after 236 ms when it computed the prompt itself" in text
    assert "loading was 1.3x as fast as computing it" in text
    assert "Of the" not in text  # every prompt handed over was loaded
    where = serve_demo.breakdown(rows)
    assert "Where a loaded request's 182 ms went" in where
    assert "12 ms from the decode server's scheduler taking the request" in where
    assert "25 ms loading 1.3 MB of KV, 145 ms the rest: computing the last 107" in where
    check = serve_demo.prediction_check(rows)
    assert check == (
        "it predicted loading would bring the first token a median 116 ms sooner; measured "
        "above, it came 54 ms sooner (loading did come first)"
    )
    note = serve_demo.prefill_note(rows)
    assert "prefill server, which spent 381 ms" in note and "waits for both" in note
    # one legend entry per reason, whatever its numbers
    assert serve_demo.legend(rows) == [
        ("-", "why -"),
        ("load: predicted N ms sooner", "why load: predicted N ms sooner"),
    ]


def test_the_verdict_says_so_when_loading_is_slower() -> None:
    slower = [
        result("computed", 100, 0),
        result("loaded", 150, 1280, "load: predicted 40 ms sooner", gain_ms=40),
    ]
    assert "loading was slower than computing it (1.5x the time)" in serve_demo.verdict(slower)
    assert serve_demo.prediction_check(slower) == (
        "it predicted loading would bring the first token a median 40 ms sooner; measured "
        "above, it came 50 ms later (the prediction was wrong here)"
    )
    even = [result("computed", 100, 0), result("loaded", 102, 1280, "load: first")]
    assert "loading was about as fast as computing it" in serve_demo.verdict(even)
    assert serve_demo.prediction_check(even) is None  # a first load predicts nothing


def test_prompts_handed_over_but_computed_are_told_apart_and_kept_out_of_the_loaded_median() -> (
    None
):
    """As on the loaded 2-core VM: one load ran past its deadline, then the policy, taking
    Redis for that slow, computed every prompt handed over."""
    rows = [
        result("computed", 140, 0),
        result("loaded", 268, 1280, "load: predicted 75 ms sooner", gain_ms=75),
        result("loaded", 444, 0, "load: predicted 84 ms sooner, too slow", way="async"),
        result("computed", 149, 0),
        result("loaded", 218, 0, "compute: load not faster", way="recompute"),
        result("loaded", 270, 0, "compute: load not faster", way="recompute"),
        result("computed", 288, 0),
        result("loaded", 220, 0, "own cache"),
    ]
    text = serve_demo.verdict(rows)
    assert "(medians of 1 loaded and 3 computed requests)" in text
    assert "after 268 ms when the decode server loaded" in text  # the loaded request's alone
    assert "after 149 ms when it computed the prompt itself" in text
    assert (
        "Of the 5 prompts whose KV was handed over, 2 its load policy chose to compute, 1 "
        "started loading and fell back to computing, 1 were computed for other reasons (why: "
        "below); those took a median 245 ms"
    ) in text
    none = [result("computed", 100, 0), rows[4]]
    text = serve_demo.verdict(none)
    assert "loaded none of the prompts whose KV was handed over" in text
    assert "computing one took it 100 ms to the first token (median)" in text
    assert "1 its load policy chose to compute" in text
    assert serve_demo.breakdown(none) is None and serve_demo.prediction_check(none) is None


def test_the_comparison_table_shows_each_request_and_where_its_tokens_came_from() -> None:
    rows = [result("computed", 236, 0), result("loaded", 182, 1280, "load: predicted 99 ms sooner")]
    console = Console(width=80, record=True, color_system=None)
    console.print(serve_demo.comparison_table(rows))
    out = console.export_text()
    assert "the same prompt (1387 tokens), asked of the decode server" in out
    lines = [line for line in out.splitlines() if "ms" in line and "│" in line]
    assert [[cell.strip() for cell in line.split("│")[1:6]] for line in lines] == [
        ["no", "236 ms", "1387", "0", "-"],
        ["yes", "182 ms", "107", "1280", "load: predicted 99 ms sooner"],  # on one line
    ]
    assert "cache_salt" in out


def test_what_the_policy_measured_of_redis_is_put_in_a_prompts_terms() -> None:
    figures = metrics(policy_load_bytes_per_second=38.3e6, policy_load_overhead_seconds=0.0)
    assert serve_demo.store_figures(figures, 1_310_720) == (
        "it takes Redis to deliver 38 MB/s to its loads: this prompt's 1.3 MB of KV in ~34 ms"
    )
    slow = metrics(policy_load_bytes_per_second=1e6, policy_load_overhead_seconds=0.002)
    assert "1 MB/s after 2.0 ms to its loads" in serve_demo.store_figures(slow, 1e6)
    # after a load ran past its deadline the policy's figure is that load's bound (seen: 6 B/s)
    bound = metrics(policy_load_bytes_per_second=6.17, policy_load_overhead_seconds=0.0)
    text = serve_demo.store_figures(bound, 1_310_720, expired=True)
    assert "deliver 6 B/s to its loads: this prompt's 1.3 MB of KV in ~59 hours" in text
    assert "a load ran past its deadline here" in text
    # nothing loaded in the comparison: the figure alone
    assert serve_demo.store_figures(bound, 0) == "it takes Redis to deliver 6 B/s to its loads"
    assert serve_demo.store_figures(metrics(), 1e6) is None  # nothing measured yet
