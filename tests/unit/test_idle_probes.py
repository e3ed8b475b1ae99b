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
from connector.figures import LoadFit, LoadRate
from connector.idle_probes import IdleProbes
from connector.probes import FEW_SAMPLES, ProbeKind, ProbePlanner, ProbeSpec
from connector.stats import StatsBuffer
from tests.unit.test_load_policy import Clock


@pytest.fixture(autouse=True)
def short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle after 50 ms, probes 50 ms apart after the first few: the same rules, sooner."""
    monkeypatch.setattr(idle_probes, "IDLE_AFTER_S", 0.05)
    monkeypatch.setattr(idle_probes, "PROBE_INTERVAL_S", 0.05)


class Probes:
    """``ProbeReads.start`` standing in: records each probe and when it started; ``found``
    says whether its blocks were there; ``hold`` keeps the next one running until set."""

    def __init__(self, found: bool = True) -> None:
        self.found = found
        self.started: list[tuple[ProbeSpec, float]] = []
        self.stops: list[threading.Event] = []  # what each was told to stop on
        self.missing_seen = threading.Event()
        self.hold: threading.Event | None = None
        self.lock = threading.Lock()

    def __call__(self, spec: ProbeSpec, stop: threading.Event) -> Future[bool]:
        with self.lock:
            self.started.append((spec, time.monotonic()))
            self.stops.append(stop)
        fut: Future[bool] = Future()
        found, hold = self.found, self.hold
        if hold is None:
            self._end(fut, found)
        else:
            self.hold = None
            threading.Thread(target=lambda: (hold.wait(60), self._end(fut, found))).start()
        return fut

    def _end(self, fut: Future[bool], found: bool) -> None:
        if not found:
            self.missing_seen.set()
        fut.set_result(found)


def order(names: int = 4) -> list[ProbeSpec]:
    blocks: list = [chr(97 + i) for i in range(names)]
    small = ProbeSpec(ProbeKind.WHOLE, blocks[:1], probe_id=-1)
    large = ProbeSpec(ProbeKind.WHOLE, blocks, probe_id=-1)
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
        assert [len(spec.names) for spec, _ in probes.started[:3]] == [1, 4, 1]
        probes.found = False  # the blocks are evicted: a probe finds them gone
        assert probes.missing_seen.wait(60)
        assert idle.wait_completed(len(probes.started), timeout_s=60)  # (it was counted)
        assert not idle.wait_completed(len(probes.started) + 1, timeout_s=0.5)  # none until told
        idle.step_began(order())  # a new order
        idle.step_ended()
        assert idle.wait_completed(len(probes.started) + 1, timeout_s=60)
    finally:
        idle.stop()


def test_a_probe_that_ends_after_a_step_began_does_not_start_the_next_at_once() -> None:
    """Found in review: a probe still reading when a step began, ending after it, counted in
    the next idle spell as one of its first few, so the next one started the moment the step
    ended, and so on beside every step of a busy engine. The step stops it, it counts in no
    spell, and every spell's first probe waits ``IDLE_AFTER_S``."""
    probes = Probes()
    idle = IdleProbes(probes)
    try:
        idle.step_began(order())
        hold = probes.hold = threading.Event()
        idle.step_ended()
        deadline = time.monotonic() + 60
        while not probes.started:  # the first idle probe starts, and reads on
            assert time.monotonic() < deadline, "no idle probe started"
            time.sleep(0.001)
        assert not probes.stops[0].is_set()
        idle.step_began(None)  # a step begins while it reads: told to stop
        assert probes.stops[0].is_set()
        ended = time.monotonic()  # (before the spell's start is taken)
        idle.step_ended()
        hold.set()  # it ends now, in the next idle spell
        assert idle.wait_completed(2, timeout_s=60)
        (_, second_start) = probes.started[1]
        assert second_start - ended >= idle_probes.IDLE_AFTER_S
    finally:
        idle.stop()


def test_a_probe_that_raises_or_cannot_start_does_not_end_the_idle_probes() -> None:
    """Whatever a probe raised (the worker logs it where it ran), a probe whose start raised
    (a bug: logged here), and a probe that could not start (another runs, the KV cache
    sleeps): the thread goes on with the order."""
    calls: list[str] = []

    def start(spec: ProbeSpec, stop: threading.Event) -> Future[bool] | None:
        calls.append("x")
        fut: Future[bool] = Future()
        if len(calls) == 1:
            return None  # could not start: tried again a probe interval later
        if len(calls) == 2:
            fut.set_exception(RuntimeError("a probe's own failure"))
        elif len(calls) == 3:  # starting one raised (a bug): the thread died of it, silently
            raise TypeError("a bug in starting a probe")
        else:
            fut.set_result(True)
        return fut

    bugs: list[tuple[str, BaseException]] = []
    idle = IdleProbes(start, lambda where, exc, what: bugs.append((where, exc)))
    try:
        idle.step_began(order())
        idle.step_ended()
        assert idle.wait_completed(3, timeout_s=60)  # the raised one, and two after it
        assert len(calls) >= 5
        # the start's bug went to the worker's reporter (counted there), the probe's own
        # failure not (logged where it ran)
        assert [(where, type(exc)) for where, exc in bugs] == [("idle-probe", TypeError)]
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


def test_idle_engines_probe_only_where_the_next_choice_hangs_on_it() -> None:
    """Not to refresh a figure that is only stale or young: idle engines sharing a store do
    not read it for that."""
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
    assert len({s.probe_id for s in specs}) == 1 and specs[0].probe_id < 0
    fresh = LoadFit(0.001, 1e9, samples=2, age_s=40.0)  # young and stale, but a figure
    assert planner.idle_order(fresh, None, False, 1 << 20) == ()
    planner.note_choice(recomputed_for_the_store=True)  # under watch: it is probed
    watched = planner.idle_order(fresh, None, False, 1 << 20)
    assert [len(s.names) for s in watched] == [1, 4]  # (5 blocks fit: 4, a power of two)
    assert planner.idle_order(fresh, None, False, 1 << 20) == watched  # the same order


def test_an_idle_probe_that_found_its_blocks_gone_ends_the_order_on_every_rank() -> None:
    """Found in review: the worker dropped its order, the scheduler side kept it, so every
    first request after an idle spell waited a step for samples that never came."""
    planner = ProbePlanner()
    planner.remember(["a", "b"], "r0")  # type: ignore[list-item]
    first = planner.idle_order(None, None, False, 1 << 20)
    planner.remember(["c", "d"], "r1")  # type: ignore[list-item]
    newer = planner.idle_order(None, None, False, 1 << 20)
    assert newer and newer[0].probe_id != first[0].probe_id
    assert [s.names for s in newer] == [["c"], ["c"]]  # (the newest hit's blocks; bounded: 1)
    planner.missing(first[0].probe_id)  # an older order's: the newest hit's blocks stay
    assert planner.idle_order(None, None, False, 1 << 20) == newer
    planner.missing(newer[0].probe_id)
    assert planner.idle_order(None, None, False, 1 << 20) == ()


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
    # nonsense ages from a worker: new (below zero), or too old to be used (not a number,
    # or older than the samples' life)
    for age in (float("nan"), float("inf"), 1e12):
        rate.add(nbytes * 100, seconds, age_s=age)
    fit = rate.estimate()
    assert fit is not None and fit.age_s == pytest.approx(40.0)  # (none of them counts)
    rate.add(nbytes, seconds, age_s=-5.0)
    fit = rate.estimate()
    assert fit is not None and fit.age_s == pytest.approx(0.0)
