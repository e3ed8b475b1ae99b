"""Probes an idle engine's workers run on their own (``connector.idle_probes``), and the ages
their samples carry to the scheduler side (``StatsBuffer.timed_sample``, ``connector.figures``).
The engine-level behaviour (a store that recovered while the engine was idle is loaded from
by the next request) is tested in tests/unit/test_split_loads.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from connector import idle_probes
from connector.figures import LoadRate
from connector.idle_probes import IdleProbes
from connector.probes import FEW_SAMPLES, IDLE_PROBE_ID, ProbeKind, ProbePlanner, ProbeSpec
from connector.stats import StatsBuffer
from tests.unit.test_load_policy import Clock


@pytest.fixture(autouse=True)
def short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle after 50 ms, probes 50 ms apart after the first few: the same rules, sooner."""
    monkeypatch.setattr(idle_probes, "IDLE_AFTER_S", 0.05)
    monkeypatch.setattr(idle_probes, "PROBE_INTERVAL_S", 0.05)


class Probes:
    """``ProbeReads.start`` standing in: records each probe; ``found`` says whether its blocks
    were there."""

    def __init__(self, found: bool = True) -> None:
        self.found = found
        self.started: list[ProbeSpec] = []
        self.lock = threading.Lock()

    def __call__(self, spec: ProbeSpec) -> Future[bool]:
        with self.lock:
            self.started.append(spec)
        fut: Future[bool] = Future()
        fut.set_result(self.found)
        return fut


def order(names: int = 4) -> list[ProbeSpec]:
    small = ProbeSpec(ProbeKind.WHOLE, ["a"], probe_id=IDLE_PROBE_ID)  # type: ignore[list-item]
    large = ProbeSpec(
        ProbeKind.WHOLE,
        [chr(97 + i) for i in range(names)],  # type: ignore[misc]
        probe_id=IDLE_PROBE_ID,
    )
    return [small, large]


def test_a_worker_probes_only_once_no_step_runs_and_stops_when_the_blocks_are_gone() -> None:
    probes = Probes()
    idle = IdleProbes(probes)
    try:
        idle.step_began(order())
        # a long step (a CPU prefill takes seconds): not idle, however long it runs
        assert not idle.wait_completed(1, timeout_s=0.5)
        idle.step_ended()
        assert idle.wait_completed(FEW_SAMPLES + 1, timeout_s=60)
        # small and large in turn
        assert [len(s.names) for s in probes.started[:3]] == [1, 4, 1]
        probes.found = False  # the blocks are evicted: the next probe finds them gone
        done = idle.completed
        assert idle.wait_completed(done + 1, timeout_s=60)
        assert not idle.wait_completed(done + 2, timeout_s=0.5)  # no more until told
        idle.step_began(order())  # a new order
        idle.step_ended()
        assert idle.wait_completed(done + 2, timeout_s=60)
    finally:
        idle.stop()


def test_an_empty_order_stops_the_probes() -> None:
    probes = Probes()
    idle = IdleProbes(probes)
    try:
        idle.step_began([])
        idle.step_ended()
        assert not idle.wait_completed(1, timeout_s=0.5)
        assert probes.started == []
    finally:
        idle.stop()


def test_the_idle_order_is_what_the_planner_would_probe() -> None:
    planner = ProbePlanner()
    assert planner.idle_order(None, None, False, 1 << 20) == ()  # nothing to read yet
    planner.remember(["a", "b", "c", "d", "e"], "r0")  # type: ignore[list-item]
    specs = planner.idle_order(None, None, True, 1 << 20)  # nothing measured: both kinds
    assert [(s.kind, len(s.names)) for s in specs] == [
        (ProbeKind.WHOLE, 1),
        (ProbeKind.BANDS, 1),
        (ProbeKind.WHOLE, 1),  # (an unknown store: one block, like a bounded one)
        (ProbeKind.BANDS, 1),
    ]
    assert all(s.probe_id == IDLE_PROBE_ID for s in specs)


def test_samples_carried_together_keep_the_order_they_were_measured_in() -> None:
    """An idle engine's probes wait for the next step to carry them. A bound (a probe that
    expired) and a complete sample measured after it came in one batch; the bound was taken
    last (the keys' order) and held the figure at the slow store's speed, so the next request
    was recomputed. Each sample now says how long ago it was recorded."""
    clock = Clock()
    recovered = LoadRate(clock=clock)
    recovered.add(1 << 20, (1 << 20) / 1e9, age_s=1.0)  # fast, 1 s ago
    recovered.add_bound(1 << 10, 1.0, age_s=3.0)  # expired, 3 s ago
    fit = recovered.estimate()
    assert fit is not None and not fit.bounded and fit.bytes_per_s > 1e8
    slowed = LoadRate(clock=clock)
    slowed.add(1 << 20, (1 << 20) / 1e9, age_s=3.0)  # fast, 3 s ago
    slowed.add_bound(1 << 10, 1.0, age_s=1.0)  # expired since
    fit = slowed.estimate()
    assert fit is not None and fit.bounded and fit.bytes_per_s < 1e4
    # an older bound never replaces a newer one
    slowed.add_bound(1 << 30, 1.0, age_s=5.0)
    fit = slowed.estimate()
    assert fit is not None and fit.bounded and fit.bytes_per_s < 1e4


def test_a_sample_that_waited_for_a_step_is_as_old_as_it_is() -> None:
    stats = StatsBuffer()
    stats.timed_sample("load_samples", 0, 1 << 20, 0.01, -1.0)
    stats.sample("probe_done", 3)
    time.sleep(0.05)
    data = stats.take()
    ((rank, nbytes, seconds, lag, age),) = data["load_samples"]
    assert (rank, nbytes, seconds, lag) == (0, 1 << 20, 0.01, -1.0) and age >= 0.05
    assert data["probe_done"] == [[3]]  # (untimed kinds as they were)
    clock = Clock()
    rate = LoadRate(clock=clock)
    rate.add(nbytes, seconds, age_s=40.0)
    fit = rate.estimate()
    assert fit is not None and fit.age_s == pytest.approx(40.0)
    # nonsense ages from a worker: a number within the samples' life, or new
    for age in (float("nan"), float("inf"), -5.0, 1e12):
        rate.add(nbytes, seconds, age_s=age)
    assert rate.estimate() is not None
