#!/usr/bin/env python3
"""The load policy at GPU scale, simulated: the connector's own policy code
(``connector.load_policy``, ``connector.figures``, ``connector.probes``) deciding for a
modelled vLLM engine on a GPU and a modelled store, learning its figures from the samples the
modelled engine gives it as the workers would. No GPU, no vLLM: one request's time to first
token is what the model of the engine and the store says, not a measurement.

The engine (``Deployment``), as vLLM's V1 scheduler runs it: each step serves the running
requests first (a decode is one token; a prompt a chunk of at most the token budget), then
admits waiting requests in arrival order while the budget lasts, telling the policy how many
wait behind each (as the connector counts vLLM's waiting queue). A pass takes
``launch + max(linear FLOPs / achieved FLOPs, weights / HBM bandwidth) + attention FLOPs /
achieved FLOPs + decode KV reads / HBM bandwidth``, with 5% noise: a compute-bound prefill,
memory-bound decodes. Not the policy's own (linear) model: the policy has to learn it.

The store (``Store``): each rank's link gives ``gbps`` to whole loads, served first come first
served two at a time (a worker's two load threads), shared evenly among those; a load pays
``overhead_s`` first. A split reads band by band at ``split_ratio`` of that, ``band_s`` per
band and ``first_s`` before the first, sharing the link evenly with each load it serves while
that load has bytes left; its forward pass runs each band of layers once that band landed
(the loads are not slowed by the bands: not modelled). 10% noise on every transfer. With
TP, every rank reads its share; one rank is 15% slower (the slowest sets the pace). An
asynchronous load starts ``lag_s`` after its step (vLLM launches the pass first); it is seen at
the end of the step it lands in, and its request is scheduled in the next step. A load or split
past the policy's wait ends; its request recomputes (what landed says how slow the store was).

The ways: ``recompute``, ``async`` and ``split`` pinned (a split sized by the figures once they
exist: ``load_policy: split``), and ``auto``. The loads (``Workload``): one client at a time
(idle), 4 and 16 clients each sending its next request once the last one finished (busy), and
one client beside 64 long decodes (a decode-heavy batch). Every request is a prompt whose first
``hit`` tokens are in Redis and whose last 64 are new, then 16 decoded tokens. Every cell starts
with the engine warm (its compute figures measured on other prompts) and the store's figures
cold: what ``auto`` knows of the store, it learns in the cell. The first two requests of each
client are its warm-up, as in a benchmark, and not counted in the means and p99s; the first
request's own TTFT is shown apart (``cold``: auto's against recompute's), since before the
store is measured ``auto`` recomputes a share-mode hit.

    python -m scripts.sim_load_policy [--quick] [--requests 100] [--seeds 1,2,3] [--jobs N]
        [--only "70B,16 clients"] [--json OUT] [--plot OUT.png]

A change to the policy is judged on more than one seed (``--seeds``): the busy cells are
chaotic, one early choice changes the rest of a run, and a seed alone moved the cells missing
a target from 14 to 18 on one version. ``--jobs`` runs the cells in processes (the whole
matrix is about 600 s in one).

Prints, per cell, each way's mean and p99 TTFT and ``auto`` against ``recompute`` and against the
best fixed way, and checks the targets: in every cell ``auto``'s mean at most 1.0x recompute's and
1.05x the best fixed way's, its p99 at most 1.2x recompute's. What ``auto`` chose counts each
hit's way once, and apart from it the hits that waited a pass first (``waited a pass``: a split
left for the next pass, as the connector leaves it unanswered for a step).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from connector.figures import (
    ComputeRate,
    LoadRate,
    SplitRate,
    attention_work,
    splits_within_loads,
    step_shape,
)
from connector.load_policy import (
    LOAD_THREADS,
    Busy,
    BusyWeights,
    Decision,
    Engine,
    Figures,
    Hit,
    LoadsInFlight,
    Way,
    admitted,
    choose,
    next_pass,
    pinned,
)
from connector.probes import ProbeKind, ProbePlanner, ProbeSpec
from datamover.mover import layer_bands
from kvstore.values.keys import BlockName

from .perf_model import MODELS, Model, gqa

BLOCK = 16  # vLLM's default block size on GPUs
BAND_BYTES = 32 << 10  # the connector's default split band (split_band_bytes)
QUESTION = 64  # new tokens after the hit
DECODED = 16  # tokens each request decodes after its first
WAYS = ("recompute", "async", "split", "auto")
# targets (the issue): auto's mean against recompute and the best fixed way; its p99
MEAN_VS_RECOMPUTE, MEAN_VS_BEST, P99_VS_RECOMPUTE = 1.0, 1.05, 1.2


@dataclass(frozen=True)
class Deployment:
    """One instance: a model on ``gpus`` GPUs (tensor parallel)."""

    name: str
    model: Model
    gpus: int
    tflops: float  # dense BF16 per GPU
    hbm_tbps: float  # per GPU
    weight_bytes: float  # what a decode pass reads of the weights, in all (MoE: every expert)
    mfu: float = 0.5
    launch_s: float = 0.003  # a pass's fixed cost: scheduling, launches
    token_budget: int = 8192  # vLLM's max_num_batched_tokens on H100/H200 (online serving)

    @property
    def kv_bytes_per_rank(self) -> float:
        return self.model.kv_bytes_per_token / self.gpus

    def pass_seconds(self, prefills: Iterable[tuple[int, int]], decodes: list[int]) -> float:
        """A pass computing prompt chunks ``(tokens before, tokens)`` and decodes of these
        contexts."""
        m, flops = self.model, self.gpus * self.tflops * 1e12 * self.mfu
        chunks = list(prefills)
        tokens = sum(n for _, n in chunks) + len(decodes)
        if not tokens:
            return 0.0
        linear = 2 * m.active_params * tokens / flops
        weights = self.weight_bytes / self.gpus / (self.hbm_tbps * 1e12)
        per_pair = m.layers * 2 * m.heads * (m.qk_dim + m.v_dim)
        attention = per_pair * sum(attention_work(n, before) for before, n in chunks) / flops
        kv = sum(decodes) * self.kv_bytes_per_rank / (self.hbm_tbps * 1e12)
        return self.launch_s + max(linear, weights) + attention + kv


QWEN3_30B_A3B = gqa(
    "Qwen3-30B-A3B (MoE)", 48, 32, 4, 128, 3.3e9, 131072,
    "huggingface.co/Qwen/Qwen3-30B-A3B config.json: 48 layers, 4 KV heads of 128, 3.3B active",
)  # fmt: skip
LLAMA_8B, LLAMA_70B = MODELS[0], MODELS[2]
DEPLOYMENTS = [
    Deployment("Llama-3.1-8B, H100", LLAMA_8B, 1, 989.0, 3.35, 16.1e9),
    Deployment("Llama-3.1-8B, H200", LLAMA_8B, 1, 989.0, 4.8, 16.1e9),
    Deployment("Llama-3.1-70B, 4x H100", LLAMA_70B, 4, 989.0, 3.35, 141e9),
    # an MoE computes at a lower utilisation (expert routing, small matrices)
    Deployment("Qwen3-30B-A3B, H100", QWEN3_30B_A3B, 1, 989.0, 3.35, 61e9, mfu=0.3),
]


@dataclass(frozen=True)
class Store:
    gbps: float  # whole loads, per GPU (each rank's link)
    split_ratio: float  # a split's band reads against whole loads
    overhead_s: float = 0.005  # a load's claim and first round trip
    first_s: float = 0.003  # a split's, before its first band
    band_s: float = 0.0002  # each band's commands
    lag_s: float = 0.002  # an asynchronous load starts this long after its step
    noise: float = 0.1

    def rank_bytes_per_s(self, rank: int, ranks: int) -> float:
        slow = 0.85 if ranks > 1 and rank == ranks - 1 else 1.0
        return self.gbps * 1e9 * slow


@dataclass(frozen=True)
class Workload:
    name: str
    clients: int
    decodes: int = 0  # long decodes running beside


WORKLOADS = [
    Workload("idle", 1),
    Workload("4 clients", 4),
    Workload("16 clients", 16),
    Workload("64 decodes", 1, decodes=64),
]
GBPS = (0.94, 1.9, 3.5, 8.0)
SPLIT_RATIOS = (0.33, 1.0)
HITS = (2048, 8192, 32768)


@dataclass
class Request:
    rid: int
    arrival: float
    prompt: int
    hit: int  # tokens in Redis (whole blocks)
    computed: int = 0
    decoded: int = 0
    state: str = "new"  # new, loading, loaded, recompute, running, done
    first_token: float | None = None
    decision: Decision | None = None
    decided_at: float = 0.0
    background: bool = False  # a long decode beside the measured requests
    waited_a_pass: bool = False  # its split waited for a pass free of another once


@dataclass
class Transfer:
    """Bytes one rank still receives for one load or probe."""

    rank: int
    left: float
    started: float
    first_byte: float
    nbytes: float
    owner: object  # the request, or a probe
    done_at: float | None = None
    began: float | None = None  # when the link began serving it (a load thread took it)
    moved_before: float = 0.0  # the link's bytes moved (every transfer's) when it began
    moved_by_done: float = 0.0  # and when it was done


class Links:
    """Each rank's link to the store: its transfers are served first come first served, at
    most ``LOAD_THREADS`` at a time (the worker's load threads), sharing its bandwidth
    evenly."""

    def __init__(self, store: Store, ranks: int, rng: random.Random) -> None:
        self.store, self.ranks, self.rng = store, ranks, rng
        self.transfers: list[Transfer] = []
        self.moved = [0.0] * ranks  # bytes each link moved so far

    def start(self, owner: object, nbytes_per_rank: float, at: float, overhead: float) -> None:
        noise = 1 + self.store.noise * (2 * self.rng.random() - 1)
        for rank in range(self.ranks):
            # the overhead counts as bytes at the link's rate (it holds the load, not the link)
            rate = self.store.rank_bytes_per_s(rank, self.ranks)
            self.transfers.append(
                Transfer(rank, nbytes_per_rank * noise + overhead * rate, at, at,
                         nbytes_per_rank, owner, moved_before=self.moved[rank])
            )  # fmt: skip

    def _served(self, rank: int) -> list[Transfer]:
        """The transfers the link serves now (begun, not done)."""
        return [
            t for t in self.transfers
            if t.rank == rank and t.done_at is None and t.began is not None
        ]  # fmt: skip

    def active(self, rank: int) -> int:
        """Transfers the link serves now (a probe shares it with them)."""
        return len(self._served(rank))

    def advance(self, t0: float, t1: float) -> None:
        """Progress every transfer from ``t0`` to ``t1``."""
        for rank in range(self.ranks):
            rate = self.store.rank_bytes_per_s(rank, self.ranks)
            mine = [t for t in self.transfers if t.rank == rank and t.done_at is None]
            now = t0
            while now < t1 and mine:
                live = [t for t in mine if t.started <= now][:LOAD_THREADS]
                later = [t.started for t in mine if t.started > now]
                if not live:
                    if not later or min(later) >= t1:
                        break
                    now = min(later)
                    continue
                for t in live:
                    if t.began is None:  # its first byte (the worker times it from here)
                        t.began, t.moved_before = now, self.moved[rank]
                share = rate / len(live)
                arrivals = later if len(live) < LOAD_THREADS else []
                until = min([t1, *arrivals, now + min(t.left for t in live) / share])
                self.moved[rank] += share * len(live) * (until - now)
                for t in live:
                    t.left -= share * (until - now)
                    # (done within a nanosecond of transfer: below the clock's resolution)
                    if t.left <= share * 1e-9:
                        t.done_at, t.moved_by_done = until, self.moved[rank]
                mine = [t for t in mine if t.done_at is None]
                now = until

    def left(self, rank: int) -> list[float]:
        """What each transfer the link serves now has left to receive (a split's bands share
        it with each while it has any)."""
        return [max(0.0, t.left) for t in self._served(rank)]

    def _of(self, owner: object) -> list[Transfer]:
        return [t for t in self.transfers if t.owner is owner]

    def finished(self, owner: object) -> float | None:
        """When every rank's transfer of ``owner`` finished (None: not yet)."""
        mine = self._of(owner)
        if not mine or any(t.done_at is None for t in mine):
            return None
        return max(t.done_at for t in mine if t.done_at is not None)

    def landed(self, owner: object) -> list[tuple[int, float, float | None]]:
        """(rank, bytes landed, when its first byte went) of each of ``owner``'s transfers."""
        return [(t.rank, max(0.0, t.nbytes - max(0.0, t.left)), t.began) for t in self._of(owner)]

    def shared(self, owner: object, rank: int) -> float:
        """What ``rank``'s link moved while ``owner``'s transfer ran (every transfer's bytes:
        what a worker's sample counts), at least its own."""
        t = next(t for t in self._of(owner) if t.rank == rank)
        return max(t.nbytes, t.moved_by_done - t.moved_before)

    def drop(self, owner: object) -> None:
        self.transfers = [t for t in self.transfers if t.owner is not owner]

    def next_event(self, now: float) -> float:
        """When the next transfer finishes or starts, if nothing new comes (inf: none)."""
        soonest = math.inf
        for rank in range(self.ranks):
            mine = [t for t in self.transfers if t.rank == rank and t.done_at is None]
            live = [t for t in mine if t.started <= now][:LOAD_THREADS]
            if live:
                share = self.store.rank_bytes_per_s(rank, self.ranks) / len(live)
                soonest = min(soonest, now + min(t.left for t in live) / share)
            soonest = min([soonest, *(t.started for t in mine if t.started > now)])
        return soonest


@dataclass
class Cell:
    deployment: str
    gbps: float
    split_ratio: float
    workload: str
    hit: int
    ttft: dict[str, list[float]] = field(default_factory=dict)  # after the warm-up
    first: dict[str, float] = field(default_factory=dict)  # the cold instance's first request
    auto_chose: dict[str, int] = field(default_factory=dict)
    seed: int = 1
    # auto's predicted time to first token over what each request got (from its admission),
    # the median per way it chose: where the model is wrong, and which way
    auto_predicted_over_got: dict[str, float] = field(default_factory=dict)

    def mean(self, way: str) -> float:
        return statistics.fmean(self.ttft[way])

    def p99(self, way: str) -> float:
        values = sorted(self.ttft[way])
        return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]

    def best_fixed(self) -> str:
        return min(("recompute", "async", "split"), key=self.mean)

    def ratios(self) -> dict[str, float]:
        best = self.best_fixed()
        return {
            "mean_vs_recompute": self.mean("auto") / self.mean("recompute"),
            "mean_vs_best": self.mean("auto") / self.mean(best),
            "p99_vs_recompute": self.p99("auto") / self.p99("recompute"),
        }

    def passes(self) -> bool:
        """Whether ``auto`` meets the targets (ratios as printed: to two decimals)."""
        r = {k: round(v, 2) for k, v in self.ratios().items()}
        return (
            r["mean_vs_recompute"] <= MEAN_VS_RECOMPUTE
            and r["mean_vs_best"] <= MEAN_VS_BEST
            and r["p99_vs_recompute"] <= P99_VS_RECOMPUTE
        )


class EngineSim:
    """One instance serving one workload one way."""

    def __init__(
        self,
        d: Deployment,
        store: Store,
        work: Workload,
        hit_tokens: int,
        way: str,
        requests: int,
        seed: int,
    ) -> None:
        self.d, self.store, self.work, self.way = d, store, work, way
        # one stream for the passes' noise, one for the store's: the same passes take the
        # same time whichever way (and however many probes) the store served
        self.rng = random.Random(seed)
        self.store_rng = random.Random(seed + 1)
        self.t = 0.0
        clock = lambda: self.t  # noqa: E731
        self.load_rate, self.split_rate = LoadRate(clock=clock), SplitRate(clock=clock)
        self.compute_rate = ComputeRate()
        self.probes = ProbePlanner(clock=clock)
        self.links = Links(store, d.gpus, self.store_rng)
        self.engine = Engine(token_budget=d.token_budget)
        self.block_bytes = int(BLOCK * d.kv_bytes_per_rank)
        layer_bytes = self.block_bytes // d.model.layers
        self.bands = len(layer_bands(d.model.layers, layer_bytes, BAND_BYTES))
        self.hit_tokens, self.requests = hit_tokens, requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[int, Request] = {}
        self.loads_out = LoadsInFlight()
        self.ttft: list[float] = []  # in the order requests got their first token
        self.first_ttft = math.nan  # the first request's
        self.chose: dict[str, int] = {}
        self.predicted_over_got: dict[str, list[float]] = {}  # per way chosen
        self.sent = 0
        self.busy_next = Busy()
        self.deadline_s = 30.0
        self._warm_compute()
        for i in range(work.decodes):  # long decodes, mid-way through their outputs
            r = Request(-1 - i, 0.0, 2048, 0, computed=2048 + 64 * i % 512, background=True)
            r.state, r.first_token = "running", 0.0
            self.running.append(r)
        # a client pauses half a request's idle recompute time between requests, on average
        hit = hit_tokens // BLOCK * BLOCK
        self.think_s = 0.5 * d.pass_seconds([(0, hit + QUESTION)], [])
        self.arrival_rng = random.Random(seed + 2)
        self.arrivals: list[Request] = []
        for _ in range(work.clients):
            self._send(think=False)

    # ------------------------------------------------------------------ setup
    def _warm_compute(self) -> None:
        """The engine has served other prompts: its compute figures exist (rank 0's passes)."""
        for n in (256, 512, 1024, 2048, 4096, 8192, 1024, 2048):
            shape = step_shape([(0, n, True)])
            self.compute_rate.add(shape, self._noisy(self.d.pass_seconds([(0, n)], [])))
        for rows in (8, 32, 64, 128):
            ctx = [2048] * rows
            shape = step_shape([(c, 1, False) for c in ctx])
            self.compute_rate.add(shape, self._noisy(self.d.pass_seconds([], ctx)))

    def _noisy(self, seconds: float, spread: float = 0.05) -> float:
        return seconds * (1 + spread * (2 * self.rng.random() - 1))

    def _send(self, think: bool = True) -> None:
        """A client's next request, after a pause drawn at random (clients in step with one
        another would share every step's budget in turn: no real load is that regular)."""
        if self.sent >= self.requests:
            return
        self.sent += 1
        hit = self.hit_tokens // BLOCK * BLOCK
        pause = self.arrival_rng.expovariate(1 / self.think_s) if think else 0.0
        self.arrivals.append(Request(self.sent, self.t + pause, hit + QUESTION, hit))
        self.arrivals.sort(key=lambda r: r.arrival)

    def _arrived(self) -> None:
        while self.arrivals and self.arrivals[0].arrival <= self.t:
            self.waiting.append(self.arrivals.pop(0))

    # ------------------------------------------------------------------ deciding
    def figures(self) -> Figures:
        return Figures(
            loads := self.load_rate.estimate(),
            splits_within_loads(loads, self.split_rate.estimate()),
            self.compute_rate.estimate(),
        )

    def _load_rate(self) -> float | None:
        """What the loads in flight drain at: the whole loads' figure (None: not measured)."""
        loads = self.load_rate.estimate()
        return loads.bytes_per_s if loads is not None else None

    def decide(self, r: Request, busy: Busy) -> Decision:
        hit = Hit(0, r.hit // BLOCK, r.prompt, BLOCK, self.block_bytes, self.bands)
        figures = self.figures()
        if self.way == "auto":
            decision = choose(
                hit, figures, engine=self.engine, busy=busy,
                token_s=self.compute_rate.token_seconds(), weights=BusyWeights(),
                may_wait_a_pass=not r.waited_a_pass,
            )  # fmt: skip
            self.probes.note_choice(decision.way is Way.RECOMPUTE)
        else:
            decision = pinned(Way(self.way), hit, True, figures, self.engine, busy)
        self.probes.remember([BlockName(f"{r.rid}:{i}") for i in range(hit.blocks)], str(r.rid))
        r.decided_at = self.t
        chose = "waited a pass" if decision.waits_a_pass else decision.way.value
        self.chose[chose] = self.chose.get(chose, 0) + 1
        return decision

    # ------------------------------------------------------------------ a step
    def run(self) -> list[float]:
        while len(self.ttft) < self.requests:
            if not self.step():
                self.idle()
            if self.t > 3600:
                raise RuntimeError(f"no end in sight: {self.d.name}, {self.way}")
        return self.ttft

    def idle(self) -> None:
        """Nothing to run: the engine loop spins until a load lands (an empty step is ~1 ms),
        or waits for the next request."""
        t0 = self.t
        if not self.loading and not self.running and not self.waiting and self.arrivals:
            self.t = max(self.t, self.arrivals[0].arrival)
        else:
            # empty steps until the next thing happens: a load lands, runs out of time, or a
            # request arrives (each empty step is ~1 ms: the engine notices within one)
            events = [self.links.next_event(t0), *(self._limit(r) for r in self.loading.values())]
            if self.arrivals:
                events.append(self.arrivals[0].arrival)
            self.t = max(t0 + 0.001, min(events))
        self.links.advance(t0, self.t)
        self._loads_done(self.t)
        self._arrived()

    def step(self) -> bool:
        self._arrived()
        t0 = self.t
        budget = self.d.token_budget
        rows: list[tuple[Request, int, int]] = []  # (request, tokens before, tokens now)
        for r in self.running:
            if budget <= 0:
                break
            n = 1 if r.computed >= r.prompt else min(r.prompt - r.computed, budget)
            rows.append((r, r.computed, n))
            budget -= n
        splits: list[tuple[Request, int]] = []  # (request, tokens it loads)
        busy = self._busy()
        for r in list(self.waiting):
            if budget <= 0:
                break
            if r.state == "new":
                # (the connector's count: the requests added and not yet admitted)
                behind = sum(q.state == "new" for q in self.waiting) - 1
                r.decision = self.decide(r, replace(busy, waiting=behind))
                hit = Hit(0, r.hit // BLOCK, r.prompt, BLOCK, self.block_bytes, self.bands)
                busy = admitted(busy, hit, r.decision)
                if r.decision.waits_a_pass:  # (vLLM asks again next step, first)
                    r.waited_a_pass = True
                    continue
                way = r.decision.way
                if way is Way.ASYNC:
                    self._start_load(r, t0)
                    continue
                if way is Way.SPLIT:
                    splits.append((r, r.decision.blocks * BLOCK))
                    r.computed = splits[-1][1]
                r.state = "running"
            elif r.state == "loaded":
                r.computed, r.state = r.hit, "running"
            elif r.state == "recompute":
                r.computed, r.state = 0, "running"
            else:
                continue
            self.waiting.remove(r)
            self.running.append(r)
            n = min(r.prompt - r.computed, budget)
            rows.append((r, r.computed, n))
            budget -= n
        if not rows:
            return False
        compute = self._noisy(
            self.d.pass_seconds(
                [(b, n) for r, b, n in rows if b < r.prompt],
                [b for r, b, n in rows if b >= r.prompt],
            )
        )
        duration, failed = compute, set[int]()
        if splits:
            duration, failed = self._split_step(splits, compute)
        self.t = t0 + duration
        self.links.advance(t0, self.t)
        if not splits:  # (a CUDA pass that waited for bands gives no sample)
            shape = step_shape([(b, n, b < r.prompt) for r, b, n in rows])
            self.compute_rate.add(shape, compute)
        for r, before, n in rows:
            r.computed = before + n
            if id(r) in failed:
                r.computed = 0  # its split's blocks come back failed: computed again
        for r in list(self.running):
            if r.computed < r.prompt:
                continue
            if r.first_token is None:
                r.first_token = self.t
                self._note_outcome(r)
                if not r.background:
                    self.ttft.append(self.t - r.arrival)
                    if r.rid == 1:
                        self.first_ttft = self.t - r.arrival
            elif any(r is row[0] for row in rows):
                r.decoded += 1
            if r.decoded >= DECODED and not r.background:
                self.running.remove(r)
                self._send()
        self.busy_next = next_pass(
            [(b, n, b < r.prompt, r.prompt) for r, b, n in rows], self.engine
        )
        self._loads_done(self.t)
        self._probe()
        return True

    def _note_outcome(self, r: Request) -> None:
        """``r``'s first token came now: its predicted time over what it got (auto's)."""
        if r.decision is None or self.t <= r.decided_at:
            return
        way = r.decision.way.value
        predicted = r.decision.predicted_s.get(way)
        if predicted is not None:
            self.predicted_over_got.setdefault(way, []).append(predicted / (self.t - r.decided_at))

    def _busy(self) -> Busy:
        """What the connector's scheduler side sees as a step's admissions begin."""
        run = self.busy_next
        return Busy(
            batch=run.batch,
            prefills=run.prefills,
            prefill_tokens_ahead=run.prefill_tokens_ahead,
            loads=len(self.loads_out),
            load_bytes_ahead=self.loads_out.bytes_left(self.t, self._load_rate()),
        )

    def _split_step(
        self, splits: list[tuple[Request, int]], compute: float
    ) -> tuple[float, set[int]]:
        """A pass holding splits (each of its tokens loaded): each band of layers waits for
        every split's band (they are read side by side), each split's until its own wait (the
        policy's), as a worker waits; a split whose last band comes past its wait fails.
        Returns the pass's time and the failed splits' requests (``id``)."""
        s, b = self.store, self.bands
        band_bytes = sum(loaded for _, loaded in splits) / BLOCK * self.block_bytes / b
        # each rank's link: the bands take an even share of it beside each load it serves,
        # while that load has bytes left (the bands' reads at ``split_ratio`` of the link, the
        # loads' at their share of it), then the whole; ``moved``: the bands' bytes and the
        # loads' beside them, in the bands' terms (as the split figure counts a link's bytes
        # here: the simulator's bands are slower than the link, not sharing it with more)
        noise = self._noise(s.noise)
        per_rank: list[tuple[float, float]] = []  # (a band's time, the link's bytes per band)
        total = b * band_bytes
        for rank in range(self.d.gpus):
            rate = s.rank_bytes_per_s(rank, self.d.gpus) * s.split_ratio
            moved = total + sum(min(total, left * s.split_ratio) for left in self.links.left(rank))
            per_rank.append(((len(splits) * s.band_s + moved / rate / b) * noise, moved / b))
        x = max(t for t, _ in per_rank)
        first = s.first_s
        lands = [first + (i + 1) * x for i in range(b)]
        c = compute / b
        end = 0.0
        for i in range(b):
            end = max(end, lands[i]) + c
        waits = {
            id(r): r.decision.wait_s if r.decision and r.decision.wait_s else math.inf
            for r, _ in splits
        }
        failed = {rid for rid, w in waits.items() if lands[-1] > w}
        wait = min(waits.values())
        if not failed:
            gaps = [q - p for p, q in itertools.pairwise(lands)]
            between = statistics.median(gaps) if gaps else 0.0
            for rank, (x_rank, shared) in enumerate(per_rank):
                # the bands shared each link with the loads on it: what it gave the rank
                scale = x / x_rank
                self.split_rate.add(shared, first + x_rank, between / scale, b, rank)
            return end, failed
        # the shortest wait ran out: what had landed by then bounds the store (a worker's
        # split that ends sends its bound); the pass waited for each band until it landed or
        # every split had run out of its wait, then ran on
        landed = [t for t in lands if t <= wait]
        self.split_rate.add_bound(band_bytes * (len(landed) + 1), wait, self.d.gpus - 1)
        longest = max(waits.values())
        end = 0.0
        for i in range(b):
            end = max(end, min(lands[i], longest)) + c
        return end, failed

    def _noise(self, spread: float) -> float:
        return 1 + spread * (2 * self.store_rng.random() - 1)

    # ------------------------------------------------------------------ loads
    def _start_load(self, r: Request, step_start: float) -> None:
        r.state = "loading"
        at = step_start + self.store.lag_s
        nbytes = r.hit // BLOCK * self.block_bytes
        self.links.start(r, nbytes, at, self.store.overhead_s)
        self.loading[r.rid] = r
        self.loads_out.started(str(r.rid), nbytes, step_start, self._load_rate())
        r.arrival_load = step_start  # type: ignore[attr-defined]

    def _limit(self, r: Request) -> float:
        """When ``r``'s load runs out of time (the policy's wait, within its deadline)."""
        wait = r.decision.wait_s if r.decision and r.decision.wait_s is not None else math.inf
        return r.arrival_load + min(self.deadline_s, wait)  # type: ignore[attr-defined]

    def _loads_done(self, now: float) -> None:
        """Loads that landed (their requests are scheduled next step) or ran past their wait
        (their requests recompute)."""
        for rid, r in list(self.loading.items()):
            limit = self._limit(r)
            done = self.links.finished(r)
            if done is not None and done <= limit:
                for rank, _, first in self.links.landed(r):
                    assert first is not None
                    # (from its step to when it was started, as a worker times it: the queue
                    # behind other loads is the model's)
                    lag = self.store.lag_s
                    done_rank = next(
                        t.done_at for t in self.links.transfers if t.owner is r and t.rank == rank
                    )
                    assert done_rank is not None
                    self.load_rate.add(self.links.shared(r, rank), done_rank - first, rank, lag)
                r.state = "loaded"
            elif now >= limit:
                for rank, nbytes, first in self.links.landed(r):
                    if first is not None:  # (one still queued says nothing of the store)
                        self.load_rate.add_bound(nbytes, limit - first, rank)
                r.state = "recompute"
            else:
                continue
            del self.loading[rid]
            self.loads_out.ended(str(r.rid), now, self._load_rate())
            self.links.drop(r)

    def _probe(self) -> None:
        figures = self.figures()
        spec = self.probes.due(figures.loads, figures.splits, True, self.block_bytes)
        if spec is None:
            return
        # a probe is read at the link's share it gets now (one small transfer; not modelled
        # as slowing the loads beside it); like a worker's, its sample counts what the link
        # gave every transfer meanwhile
        nbytes = len(spec.names) * self.block_bytes
        for rank in range(self.d.gpus):
            sharing = 1 + self.links.active(rank)
            rate = self.store.rank_bytes_per_s(rank, self.d.gpus) / sharing
            if spec.kind is ProbeKind.WHOLE:
                seconds = (self.store.overhead_s + nbytes / rate) * self._noise(self.store.noise)
                if seconds > spec.timeout_s:
                    landed = nbytes * spec.timeout_s / seconds
                    self.load_rate.add_bound(landed * sharing, spec.timeout_s, rank)
                else:
                    self.load_rate.add(nbytes * sharing, seconds, rank, None)
                continue
            self._band_probe(spec, rank, rate, nbytes, sharing)

    def _band_probe(
        self, spec: ProbeSpec, rank: int, rate: float, nbytes: float, sharing: int
    ) -> None:
        s, b = self.store, self.bands
        x = (s.band_s + nbytes / b / (rate * s.split_ratio)) * self._noise(s.noise)
        total = s.first_s + b * x
        if total > spec.timeout_s:
            landed = nbytes * spec.timeout_s / total
            self.split_rate.add_bound(landed * sharing, spec.timeout_s, rank)
        else:
            self.split_rate.add(nbytes / b * sharing, s.first_s + x, x, b, rank)


def run_cell(
    d: Deployment, gbps: float, ratio: float, work: Workload, hit: int, requests: int, seed: int
) -> Cell:
    cell = Cell(d.name, gbps, ratio, work.name, hit, seed=seed)
    store = Store(gbps, ratio)
    warm_up = 2 * work.clients
    for way in WAYS:
        sim = EngineSim(d, store, work, hit, way, requests + warm_up, seed)
        ttft = sim.run()
        cell.first[way], cell.ttft[way] = sim.first_ttft, ttft[warm_up:]
        if way == "auto":
            cell.auto_chose = sim.chose
            cell.auto_predicted_over_got = {
                k: round(statistics.median(v), 3) for k, v in sorted(sim.predicted_over_got.items())
            }
    return cell


def _run_cell_args(args: tuple[Deployment, float, float, Workload, int, int, int]) -> Cell:
    return run_cell(*args)


def table(cells: list[Cell], seeds: bool = False) -> str:
    """The cells as a markdown table (``seeds``: a column saying each one's seed)."""
    lines = [
        "| deployment | store GB/s (split x) | load | hit | recompute | async | split | auto "
        "(mean / p99 ms) | auto / recompute (mean, p99) | auto / best fixed | cold | auto "
        "chose |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if seeds:
        lines = ["| seed " + lines[0], "| --- " + lines[1]]
    for c in cells:
        r = c.ratios()
        ways = " | ".join(f"{1e3 * c.mean(w):,.0f} / {1e3 * c.p99(w):,.0f}" for w in WAYS)
        chose = ", ".join(f"{k} {v}" for k, v in sorted(c.auto_chose.items()))
        flag = "" if c.passes() else " **x**"
        lines.append(
            (f"| {c.seed} " if seeds else "")
            + f"| {c.deployment} | {c.gbps:g} ({c.split_ratio:g}) | {c.workload} | "
            f"{c.hit // 1024}k | {ways} | {r['mean_vs_recompute']:.2f}, "
            f"{r['p99_vs_recompute']:.2f} | {r['mean_vs_best']:.2f} ({c.best_fixed()}){flag} | "
            f"{c.first['auto'] / c.first['recompute']:.2f} | {chose} |"
        )
    return "\n".join(lines)


def summary(cells: list[Cell]) -> str:
    worst = {k: max(c.ratios()[k] for c in cells) for k in cells[0].ratios()}
    failed = [c for c in cells if not c.passes()]
    means = [c.ratios()["mean_vs_recompute"] for c in cells]
    return (
        f"{len(cells)} cells; auto's mean TTFT against recompute: median "
        f"{statistics.median(means):.2f}x, worst {worst['mean_vs_recompute']:.2f}x (target "
        f"{MEAN_VS_RECOMPUTE}); against the best fixed way: worst {worst['mean_vs_best']:.2f}x "
        f"(target {MEAN_VS_BEST}); p99 against recompute: worst "
        f"{worst['p99_vs_recompute']:.2f}x (target {P99_VS_RECOMPUTE}); "
        f"{len(failed)} cell(s) miss a target"
    )


def plot(cells: list[Cell], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deployments = list(dict.fromkeys(c.deployment for c in cells))
    workloads = list(dict.fromkeys(c.workload for c in cells))
    fig, axes = plt.subplots(
        len(deployments), len(workloads), figsize=(3.2 * len(workloads), 2.6 * len(deployments)),
        squeeze=False, sharey=True,
    )  # fmt: skip
    for i, dep in enumerate(deployments):
        for k, work in enumerate(workloads):
            ax = axes[i][k]
            for ratio, style in zip(SPLIT_RATIOS, ("-", "--"), strict=False):
                for hit, color in zip(HITS, ("C0", "C1", "C2"), strict=False):
                    mine = [c for c in cells if (c.deployment, c.workload, c.split_ratio, c.hit)
                            == (dep, work, ratio, hit)]  # fmt: skip
                    if not mine:
                        continue
                    xs = [c.gbps for c in mine]
                    ax.plot(xs, [c.ratios()["mean_vs_recompute"] for c in mine], style,
                            color=color, marker="o", ms=3,
                            label=f"{hit // 1024}k, split {ratio:g}x")  # fmt: skip
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log")
            ax.set_xticks(list(GBPS), [f"{g:g}" for g in GBPS])
            ax.minorticks_off()
            ax.set_title(f"{dep}\n{work}", fontsize=8)
            if k == 0:
                ax.set_ylabel("auto / recompute, mean TTFT", fontsize=8)
            if i == len(deployments) - 1:
                ax.set_xlabel("store GB/s per GPU", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("simulated (scripts/sim_load_policy.py): the policy's own code, a modelled "
                 "engine and store", fontsize=9)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="per cell and way")
    ap.add_argument("--quick", action="store_true", help="one deployment, 2k and 8k hits")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--seeds", default="", help="several seeds, comma-separated (overrides --seed): the "
        "busy cells are chaotic -- one early choice changes the rest of a run -- so a change "
        "is judged on more than one"
    )  # fmt: skip
    ap.add_argument(
        "--jobs", type=int, default=1, help="cells run in this many processes at once (the "
        "results do not depend on it)"
    )  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, help="draw --plot from a --json written before")
    ap.add_argument(
        "--only", default="", help="cells whose deployment, GB/s, load or hit contain this "
        "(comma-separated, all must match): e.g. '70B,16 clients'"
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(args.replot.read_text())["cells"]
        fields = Cell.__dataclass_fields__
        cells = [Cell(**{k: v for k, v in c.items() if k in fields}) for c in saved]
        print(summary(cells))
        if args.plot:
            plot(cells, args.plot)
        return 0
    deployments = DEPLOYMENTS[:1] if args.quick else DEPLOYMENTS
    hits = HITS[:2] if args.quick else HITS
    requests = min(args.requests, 40) if args.quick else args.requests
    seeds = [int(x) for x in args.seeds.split(",") if x] or [args.seed]
    todo = []
    for seed, (d, gbps, ratio, work, hit) in itertools.product(
        seeds, itertools.product(deployments, GBPS, SPLIT_RATIOS, WORKLOADS, hits)
    ):
        name = f"{d.name} {gbps:g} GB/s {work.name} {hit // 1024}k"
        if all(part in name for part in args.only.split(",") if part):
            todo.append((d, gbps, ratio, work, hit, requests, seed))
    if not todo:
        print(f"no cell's name contains all of {args.only!r} (names read like {name!r})")
        return 2
    t0 = time.monotonic()
    cells = []
    with contextlib.ExitStack() as stack:
        if args.jobs > 1:  # (in order, each printed as it is done: the pool runs ahead)
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(args.jobs))
            done: Iterable[Cell] = pool.map(_run_cell_args, todo)
        else:
            done = map(_run_cell_args, todo)
        for cell in done:
            cells.append(cell)
            print(table([cell], len(seeds) > 1).splitlines()[-1], flush=True)
    per_seed = {seed: summary([c for c in cells if c.seed == seed]) for seed in seeds}
    print()
    for seed, said in per_seed.items():
        print(f"{f'seed {seed}: ' if len(seeds) > 1 else ''}{said}")
    ratios: dict[str, list[float]] = {}
    for c in cells:
        for way, r in c.auto_predicted_over_got.items():
            ratios.setdefault(way, []).append(r)
    print(
        "auto's predicted time to first token over what it got, median over cells: "
        + ", ".join(f"{w} {statistics.median(v):.2f}" for w, v in sorted(ratios.items()))
    )
    print(f"({time.monotonic() - t0:.0f} s)\n")
    print(table(cells, len(seeds) > 1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()},
            "summary": summary(cells),
            "per_seed": per_seed,
            "deployments": [asdict(d) for d in deployments],
            "cells": [{**asdict(c), "ratios": c.ratios(), "passes": c.passes()} for c in cells],
        }, indent=1))  # fmt: skip
    if args.plot:
        plot([c for c in cells if c.seed == seeds[0]], args.plot)
    return 0 if all(c.passes() for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
