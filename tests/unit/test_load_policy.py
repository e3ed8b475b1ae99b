"""The load policy's choice from given figures (``connector.load_policy``), and the figures
fitted from samples (``connector.figures``): no vLLM, no Redis."""

from __future__ import annotations

import random

import pytest

from connector.figures import ComputeFit, LoadFit, LoadRate, PrefillRate, step_shape
from connector.load_policy import PROBE_EVERY, Hit, Way, best_split, choose, pinned

# a prompt of 2,000 tokens, 16-token blocks, 1,984 tokens (124 blocks) in Redis, 32 bands:
# Llama-3.1-8B's block is 2 MiB (128 KiB a token)
HIT = Hit(start=0, end=124, prompt_tokens=2000, block_size=16, block_bytes=2 << 20, bands=32)
# an H100 prefilling Llama-3.1-8B: ~34 us a token, attention small at this length
H100 = ComputeFit(step_s=0.004, token_s=34e-6, attention_s=1e-9, samples=64)


def at(gbps: float, overhead_s: float = 0.0005) -> LoadFit:
    return LoadFit(overhead_s, gbps * 1e9, samples=8)


def test_a_store_far_slower_than_computing_is_not_loaded() -> None:
    d = choose(HIT, at(0.1), H100)
    assert d.way is Way.RECOMPUTE and d.blocks == 0
    assert d.predicted_s["recompute"] < d.predicted_s["async"]


def test_a_store_far_faster_than_computing_is_loaded_whole() -> None:
    d = choose(HIT, at(50), H100)
    assert d.way in (Way.SPLIT, Way.ASYNC)
    assert d.blocks == HIT.blocks or (d.way is Way.SPLIT and d.blocks >= 0.9 * HIT.blocks)


def test_near_the_break_even_a_split_beats_both_and_loads_about_half() -> None:
    # break-even: 128 KiB a token in 34 us is ~3.9 GB/s
    d = choose(HIT, at(3.9), H100)
    assert d.way is Way.SPLIT
    assert 0.3 * HIT.blocks < d.blocks < 0.7 * HIT.blocks
    best_other = min(d.predicted_s["recompute"], d.predicted_s["async"])
    assert d.predicted_s["split"] < 0.7 * best_other


@pytest.mark.parametrize("gbps", [0.05, 0.5, 1.88, 3.9, 10, 100])
def test_the_choice_is_never_predicted_slower_than_recomputing(gbps: float) -> None:
    d = choose(HIT, at(gbps), H100)
    assert d.predicted_s[d.way.value] <= d.predicted_s["recompute"]


def test_without_splits_it_picks_the_faster_of_async_and_recompute() -> None:
    slow = choose(HIT, at(0.5), H100, split_ok=False)
    fast = choose(HIT, at(20), H100, split_ok=False)
    assert (slow.way, fast.way) == (Way.RECOMPUTE, Way.ASYNC)
    assert "split" not in slow.predicted_s


def test_a_busy_engine_prefers_async_where_an_idle_one_would_not() -> None:
    idle = choose(HIT, at(1.5), H100, split_ok=False)
    busy = choose(HIT, at(1.5), H100, split_ok=False, others=8)
    assert (idle.way, busy.way) == (Way.RECOMPUTE, Way.ASYNC)
    assert choose(HIT, at(1.5), H100, others=8).way is Way.ASYNC  # a split stalls them all


def test_a_hit_too_small_to_gain_is_not_loaded() -> None:
    one = Hit(start=10, end=11, prompt_tokens=200, block_size=16, block_bytes=2 << 20, bands=32)
    assert choose(one, at(3.9, overhead_s=0.02), H100).way is Way.RECOMPUTE


def test_until_measured_it_loads_every_hit_as_before() -> None:
    assert choose(HIT, None, H100).way is Way.ASYNC
    assert choose(HIT, at(0.1), None).reason == "not measured yet"


def test_a_probe_loads_a_split_sized_for_a_faster_store() -> None:
    d = choose(HIT, at(0.5), H100, probe=True)
    assert d.way is Way.SPLIT and d.reason == "probe"
    assert 1 <= d.blocks < choose(HIT, at(1.0), H100).blocks + 2
    assert choose(HIT, at(0.5), H100, split_ok=False, probe=True).way is Way.ASYNC
    assert PROBE_EVERY > 1


def test_a_pinned_way_is_taken_as_it_is() -> None:
    assert pinned(Way.SPLIT, HIT, split_ok=True).blocks == HIT.blocks
    assert pinned(Way.SPLIT, HIT, split_ok=False).way is Way.ASYNC
    assert pinned(Way.RECOMPUTE, HIT, split_ok=True).blocks == 0


@pytest.mark.parametrize("gbps", [0.5, 3.9, 40])
def test_the_best_split_is_the_fastest_of_every_split(gbps: float) -> None:
    """Against every j, by the model the module documents: the pass waits for each band, the
    loads and the computing overlap band by band."""
    loads, b = at(gbps), HIT.bands

    def predicted(j: int) -> float:
        transfer = j * HIT.block_bytes / loads.bytes_per_s
        rest = H100.seconds((HIT.start + j) * HIT.block_size, HIT.prompt_tokens)
        return loads.overhead_s + max(transfer / b + rest, transfer + rest / b)

    j, t = best_split(HIT, loads, H100)
    assert t == pytest.approx(predicted(j))
    assert t == pytest.approx(min(predicted(k) for k in range(1, HIT.blocks + 1)))


def test_the_load_fit_recovers_overhead_and_bandwidth() -> None:
    rate = LoadRate()
    assert rate.estimate() is None
    rng = random.Random(1)
    for _ in range(20):
        nbytes = rng.choice([1 << 20, 8 << 20, 64 << 20])
        rate.add(nbytes, 0.002 + nbytes / 2e9)
    fit = rate.estimate()
    assert fit is not None
    assert fit.bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert fit.overhead_s == pytest.approx(0.002, rel=1e-6)
    rate.add(float("nan"), 1.0)  # garbage is not a sample
    rate.add(-5, 1.0)
    assert rate.estimate() == fit


def test_the_compute_fit_recovers_token_and_attention_costs() -> None:
    rate = PrefillRate()
    for n in (1, 2, 4, 8):  # decode steps alone predict no prompt
        rate.add(n, n * 500, 0.003 + 1e-5 * n)
    assert rate.estimate() is None
    for n, ctx in ((128, 0), (512, 0), (1024, 1024), (2048, 0), (256, 4096), (64, 64)):
        tokens, attention = step_shape([(ctx, n)])
        rate.add(tokens, attention, 0.003 + 3e-5 * tokens + 2e-9 * attention)
    fit = rate.estimate()
    assert fit is not None
    assert fit.token_s == pytest.approx(3e-5, rel=0.05)
    assert fit.attention_s == pytest.approx(2e-9, rel=0.05)
    assert fit.seconds(0, 1000) == pytest.approx(0.003 + 0.03 + 2e-9 * 1000 * 500, rel=0.05)


def test_the_load_fit_follows_a_store_that_got_slower_within_a_few_loads() -> None:
    rate = LoadRate()
    for i in range(32):
        nbytes = (1 + i % 3) << 20
        rate.add(nbytes, nbytes / 2e9)  # 2 GB/s
    for i in range(8):
        nbytes = (1 + i % 3) << 20
        rate.add(nbytes, nbytes / 2e7)  # then 20 MB/s
    fit = rate.estimate()
    assert fit is not None and fit.bytes_per_s < 4e7


def test_a_pinned_split_is_sized_by_the_figures_once_measured() -> None:
    d = pinned(Way.SPLIT, HIT, True, at(3.9), H100)
    assert d.way is Way.SPLIT and d.blocks == best_split(HIT, at(3.9), H100)[0]
    # what a split waits for at most is its prediction plus recomputing's: both are there
    assert set(d.predicted_s) == {"split", "recompute"}
