"""A stateful fuzzer (Hypothesis) against vLLM's real Scheduler with the real connector on both
sides (``testing.sim_engine``), on fakeredis and on a real redis-server.

Random interleavings of: new requests (shared prefixes, ``cache_salt``, LoRA adapters, prompt
embeddings, prompts shorter than a block; one instance of each pair serves its hits as split
loads, layer by layer in the forward pass), aborts in every state, preemption, allocation
failures (a small KV cache), loads and saves that are slow, fail, or meet corrupt or foreign
values, blocks evicted, a store that goes away and comes back (the breaker), the KV cache put
to sleep and woken, vLLM's prefix cache reset. Share mode runs two instances on one pool;
consume mode a producer and two consumers, with handoffs delivered to one consumer or to both
(a retried request). Both also run on a gated delta-net hybrid (``testing.state_sim``: states
saved from vLLM's offers, one state per hit, every state the stand-in model reads checked).

After every step: vLLM raised nothing (a double free, an unknown request reported, ... are
assertions inside vLLM); the connector wrote no block vLLM had freed or given to another
request; every block a request ran on held that request's KV; no request's Redis wait or load
outlived its deadline; no handoff was claimed by two requests. At the end of each example, with
the store healthy again: every request finished, the connector holds no state of any of them,
every handoff a consumer received was loaded or deleted, and every key in Redis has a TTL.

The bounded run here is deterministic (``derandomize``). A longer, random one::

    KVSTORE_FUZZ_EXAMPLES=400 KVSTORE_FUZZ_STEPS=60 KVSTORE_FUZZ_RANDOM=1 \\
        python -m pytest tests/integration/test_fuzz_lifecycle.py -p no:cacheprovider \\
        --hypothesis-show-statistics
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
import torch

pytest.importorskip("vllm")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvstore.lookup_buffer
from connector import probes
from connector.chains import RequestChains
from kvstore import Claim, LookupBuffer
from kvstore.values.keys import parse_key
from testing.redis_server import RedisServer
from testing.scheduler_harness import BS
from testing.sim_engine import SimEngine
from testing.state_sim import StateSimEngine

pytestmark = [pytest.mark.vllm]

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "30"))
STEPS = int(os.environ.get("KVSTORE_FUZZ_STEPS", "50"))
RANDOM = os.environ.get("KVSTORE_FUZZ_RANDOM") == "1"

# Short deadlines and timeouts, so that slow stores actually run into them within an example.
CONNECTOR = {
    "deadline_s": 0.4,
    "deadline_per_1k_tokens_s": 0.0,
    "deadline_max_s": 1.0,
    "handoff_grace_s": 0.05,
    "lookup_wait_s": 0.005,
    "control_timeout_s": 0.3,
    "socket_timeout_s": 1.0,
    "connect_timeout_s": 0.3,
    "breaker_probe_s": 0.1,
    "max_inflight_bytes": 2 << 20,  # a small staging pool: saves get shed too
}
ENGINE = {"num_blocks": 40, "max_num_seqs": 6, "max_batched": 96}


@pytest.fixture(autouse=True)
def short_probe_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handoff recomputed because the store looked slow is held until the probes have
    measured the store again, 30 s at most: an example's settling does not step the engine, so
    no probe runs then, and every example ending with one would wait out the cap. Short here,
    like the deadlines."""
    monkeypatch.setattr(probes, "PROBE_HOLD_S", 0.3)


# What the examples did, summed per test (printed at the end; JSON to $KVSTORE_FUZZ_REPORT):
# proof that the interleavings reached loads, aborts in each state, failures and recoveries.
TALLY: dict[str, int] = {}


def count(what: str, n: int = 1) -> None:
    TALLY[what] = TALLY.get(what, 0) + n


TICKS = st.integers(0, 3)


def pick(data: Any, items: list[Any]) -> Any:
    """One of ``items`` (None if there is none), drawn so that the draws never depend on how
    many there are: which requests are live depends on timing, and Hypothesis expects the same
    draws when it replays a sequence of rules."""
    i = data.draw(st.integers(0, 1 << 16))
    return items[i % len(items)] if items else None


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=not RANDOM,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([Phase.shrink] if RANDOM else []),  # shrinking slow examples takes too long for CI
    print_blob=True,
)

# Prompts come from a small catalogue, so they repeat across instances and requests (that is
# what makes loads): shared prefixes (system prompts), whole repeats, partial tails, prompts
# shorter than a block; each may carry a cache_salt, a LoRA adapter, or be given as embeddings.
_SYSTEM = [
    [(7 * i + 3) % 240 + 5 for i in range(2 * BS)],
    [(11 * i) % 240 + 5 for i in range(3 * BS)],
]


def _catalogue() -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for system in ([], *_SYSTEM):
        for blocks, tail in ((0, 5), (1, 0), (2, 9), (4, 3)):
            out.append(system + [rng.randrange(3, 250) for _ in range(blocks * BS + tail)])
    return [p for p in out if p]


CATALOGUE = _catalogue()
LORAS = [None, ("alice", 1, "/adapters/alice"), ("alice", 2, "/adapters/alice"), ("bob", 1, "/b")]


class Prompt(dict):
    """A request's spec (what ``SimEngine.add`` takes); printed short in a failing example, by
    its catalogue entry instead of its tokens (CI shows only the first lines of a failure)."""

    def __init__(self, entry: int, embeds_seed: int | None, **spec: Any) -> None:
        super().__init__(**spec)
        self.entry, self.embeds_seed = entry, embeds_seed

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # Hypothesis's printer
        p.text(repr(self))

    def __repr__(self) -> str:
        hidden = ("tokens", "prompt_embeds", "prompt_is_token_ids")
        extras = {k: v for k, v in self.items() if k not in hidden}
        if self.embeds_seed is not None:
            extras["embeds_seed"] = self.embeds_seed
        return f"Prompt(catalogue[{self.entry}], {extras})"


def request_options(spec: dict[str, Any]) -> dict[str, Any]:
    """What ``SimEngine.add`` takes besides the tokens."""
    return {k: v for k, v in spec.items() if k != "tokens"}


@st.composite
def prompts(draw: Any) -> Prompt:
    entry = draw(st.integers(0, len(CATALOGUE) - 1))
    tokens = list(CATALOGUE[entry])
    options = {
        "max_tokens": draw(st.integers(1, 6)),
        "cache_salt": draw(st.sampled_from([None, None, None, "tenant-b"])),
        "lora": draw(st.sampled_from([None] * 5 + LORAS[1:])),
    }
    if draw(st.integers(0, 7)) != 0:
        return Prompt(entry, None, tokens=tokens, **options)
    # a prompt of embeddings (a mixed prompt, all embeds)
    seed = draw(st.integers(0, 1))
    embeds = torch.randn(len(tokens), 16, generator=torch.Generator().manual_seed(seed))
    return Prompt(
        entry,
        seed,
        tokens=[0] * len(tokens),
        prompt_embeds=embeds,
        prompt_is_token_ids=[False] * len(tokens),
        **options,
    )


# ---------------------------------------------------------------------- the store under test
class FakeStore:
    """A fakeredis server every store of the example opens, whatever its URL."""

    url = "redis://fake:6379/0"

    def __init__(self) -> None:
        self.server = fakeredis.FakeServer()
        self._real = kvstore.lookup_buffer.make_client
        kvstore.lookup_buffer.make_client = lambda *a, **k: fakeredis.FakeRedis(  # type: ignore[assignment]
            server=self.server
        )

    def admin(self) -> redis.Redis:
        return fakeredis.FakeRedis(server=self.server)

    def down(self) -> None:
        self.server.connected = False

    def up(self) -> None:
        self.server.connected = True

    def close(self) -> None:
        kvstore.lookup_buffer.make_client = self._real  # type: ignore[assignment]


class RealStore:
    """A real redis-server, killed and started again (empty) for "goes away"."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        if server.proc is None or server.proc.poll() is not None:
            server.start()
        self.url = server.url
        with self.admin() as a:
            a.flushall()

    def admin(self) -> redis.Redis:
        return redis.Redis.from_url(self.server.url, socket_timeout=5)

    def down(self) -> None:
        self.server.kill()

    def up(self) -> None:
        if self.server.proc is None or self.server.proc.poll() is not None:
            self.server.start()

    def close(self) -> None:
        self.up()


class Slowness:
    """Delays every store call of the example's engines while on (a slow Redis)."""

    # every store call of the connector: whole loads, split bands, saves, lookups, claims
    METHODS = (
        "select_into",
        "select_tensors_into",
        "select_head_into",
        "insert_parts",
        "survey",
        "read_handoffs",
        "claim_handoff",
    )

    def __init__(self) -> None:
        self.delay_s = 0.0

    def wrap(self, store: LookupBuffer) -> None:
        for name in self.METHODS:
            real = getattr(store, name)
            setattr(store, name, self._delayed(real))

    def _delayed(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            if self.delay_s:
                time.sleep(self.delay_s)
            return real(*a, **k)

        return call


class Claims:
    """Every claim outcome, per handoff: at most one owner may ever win."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.winners: dict[str, set[str]] = {}

    def wrap(self, store: LookupBuffer) -> None:
        real = store.claim_handoff

        def claim(handoff_id: str, fingerprints: Any = None, *, owner: str = "") -> Claim:
            outcome = real(handoff_id, fingerprints, owner=owner)
            if outcome is Claim.WON:
                with self.lock:
                    self.winners.setdefault(handoff_id, set()).add(owner)
            return outcome

        store.claim_handoff = claim  # type: ignore[method-assign]


# ---------------------------------------------------------------------- the machines
class LifecycleMachine(RuleBasedStateMachine):
    model: Path
    store_factory: Callable[[], Any]
    mode = "share"
    engine: type[SimEngine] = SimEngine  # StateSimEngine: a gated delta-net hybrid

    def __init__(self) -> None:
        super().__init__()
        self.store = type(self).store_factory()
        self.slow = Slowness()
        self.claims = Claims()
        self.engines: list[SimEngine] = []
        self.faults = 0  # store outages and evictions: cleanup may then be left to TTLs
        self.count = 0
        self.fates: list[tuple[SimEngine, str, str, int]] = []  # (engine, request, what, steps)
        self.answers: list[str] = []  # deadline violations of lookup answers

    def splitting(self) -> dict[str, Any]:
        """An instance that serves every hit as a split load (a synchronous, layer-by-layer
        load in the forward pass: ``load_policy``), in bands of one layer; the hybrid engines
        cannot split (several KV-cache groups), so theirs loads as the others do."""
        if self.engine is not SimEngine:
            return {}
        # splits need vLLM's V1 model runner (vLLM #49250), not the default with Triton (0.33)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        return {"load_policy": "split", "split_band_bytes": 16 << 10}

    def make(self, role: str, **kw: Any) -> SimEngine:
        cfg = {**ENGINE, **CONNECTOR, **kw}
        e = self.engine(self.model, role, self.store.url, **cfg)  # type: ignore[arg-type]
        for store in (e.connector.scheduler.store, e.worker.store):
            self.slow.wrap(store)
            self.claims.wrap(store)
        self._watch_answers(e)
        self.engines.append(e)
        return e

    def _watch_answers(self, e: SimEngine) -> None:
        """A request whose deadline has passed is never told "not known yet"."""
        conn = e.connector
        real = conn.scheduler.get_num_new_matched_tokens

        def answer(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            called = time.monotonic()
            got = real(request, num_computed_tokens)
            state = conn.scheduler._reqs.get(request.request_id)
            if got[0] is None and state is not None and called > state.deadline:
                self.answers.append(
                    f"{request.request_id}: answered None {called - state.deadline:.3f}s past "
                    "its deadline"
                )
            return got

        conn.scheduler.get_num_new_matched_tokens = answer  # type: ignore[method-assign]

    def new_id(self) -> str:
        self.count += 1
        return f"r{self.count}"

    def draw_fate(self, data: Any) -> tuple[str, int]:
        """Whether a request is left alone, or aborted or preempted some steps after it came
        (in whatever state it is then: looking up, loading, running, finished)."""
        return data.draw(st.sampled_from(["live"] * 3 + ["abort"] * 2 + ["preempt"])), data.draw(
            st.integers(0, 5)
        )

    def send(
        self,
        data: Any,
        engine: SimEngine,
        rid: str,
        spec: dict[str, Any],
        fate: tuple[str, int] | None = None,
        **kw: Any,
    ) -> None:
        engine.add(rid, spec["tokens"], **request_options(spec), **kw)
        what, steps = fate or self.draw_fate(data)
        if what != "live":
            self.fates.append((engine, rid, what, steps))

    def note(self, rid: str, what: str) -> None:
        """Remember what happened to a request (a decode's id starts with its prefill's)."""
        if hasattr(self, "events"):
            self.events.setdefault(rid.split("-d")[0], []).append(f"{rid} {what}")

    def _fates_due(self) -> None:
        due, self.fates = self.fates, []
        for engine, rid, fate, steps in due:
            if steps > 0:
                self.fates.append((engine, rid, fate, steps - 1))
            elif fate == "abort":
                req = engine.sched.requests.get(rid)
                if req is not None and not req.is_finished():
                    count(f"aborted while {req.status.name}")
                    self.note(rid, f"aborted while {req.status.name}")
                    engine.abort(rid)
            elif engine.preempt(rid):
                count("preempted")
                self.note(rid, "preempted")

    # ------------------------------------------------------------------ rules shared by modes
    def live(self, engine: SimEngine, rid: str) -> bool:
        req = engine.sched.requests.get(rid)
        return req is not None and not req.is_finished()

    def tick(self, steps: int) -> None:
        """Every engine steps ``steps`` times, as engines do while anything else happens."""
        for _ in range(steps):
            for e in self.engines:
                self.after_step(e, e.step())
            self._fates_due()
            time.sleep(0.001)

    def after_step(self, engine: SimEngine, result: Any) -> None:
        count("steps")
        count("loads planned", len(result.output.kv_connector_metadata.loads))
        count("loads reported", len(result.recving))
        count("requests finished", len(result.finished))
        count("blocks reported failed", len(result.invalid))

    @rule(data=st.data(), steps=st.integers(1, 8))
    def step(self, data: Any, steps: int) -> None:
        e = data.draw(st.sampled_from(self.engines))
        for _ in range(steps):
            self.after_step(e, e.step())
            time.sleep(0.001)

    @rule(
        data=st.data(),
        what=st.sampled_from(["abort", "abort", "abort during a step", "preempt"]),
        ticks=TICKS,
    )
    def disturb_a_request(self, data: Any, what: str, ticks: int) -> None:
        """What vLLM does to requests: a client goes away, between steps or while one runs
        (EngineCore takes it after that step's forward pass, before its output); memory
        pressure preempts one."""
        e = data.draw(st.sampled_from(self.engines))
        if what.startswith("abort"):
            rid = pick(data, sorted(r for r in e.sched.requests if self.live(e, r)))
            if rid is not None:
                when = "" if what == "abort" else " (during the next step)"
                count(f"aborted while {e.sched.requests[rid].status.name}{when}")
                self.note(rid, f"aborted while {e.sched.requests[rid].status.name}{when} (rule)")
                if what == "abort":
                    e.abort(rid)
                else:
                    e.aborts_during_step.add(rid)
        else:
            rid = pick(data, sorted(r.request_id for r in e.sched.running))
            if rid is not None and e.preempt(rid):
                count("preempted")
        self.tick(ticks)

    @rule(
        data=st.data(),
        fault=st.sampled_from(
            ["slow", "slow", "fast", "down", "up", "corrupt", "foreign", "evict", "sleep", "reset"]
        ),
        ticks=TICKS,
    )
    def fault(self, data: Any, fault: str, ticks: int) -> None:
        """What the store and the engine around the connector do."""
        count(f"fault {fault}")
        if fault == "slow":
            self.slow.delay_s = data.draw(st.sampled_from([0.05, 0.2, 0.6]))
        elif fault == "fast":
            self.slow.delay_s = 0.0
        elif fault == "down":
            self.faults += 1
            self.store.down()
        elif fault == "up":
            self.store.up()
        elif fault in ("corrupt", "foreign", "evict"):
            self.damage_a_value(data, fault)
        elif fault == "sleep":
            # vLLM 0.33's sleep mode: the KV cache is released (loads in flight are cancelled
            # and write nothing more; loads planned meanwhile are cancelled too), then restored
            e = data.draw(st.sampled_from(self.engines))
            asleep_for = data.draw(st.integers(0, 2))
            e.worker_conn.unregister_kv_caches()
            for _ in range(asleep_for):
                self.after_step(e, e.step())
            e.worker_conn.restore_kv_caches()
        else:  # vLLM's prefix cache reset: what was local must come from Redis again
            e = data.draw(st.sampled_from(self.engines))
            with e.world:
                e.sched.reset_prefix_cache()
                e._refresh_owners()
        self.tick(ticks)

    def damage_a_value(self, data: Any, how: str) -> None:
        try:
            with self.store.admin() as admin:
                keys = sorted(k.decode() for k in admin.keys("kv:*"))
                parsed = [(k, parse_key(k)) for k in keys]
                found = [(k, p) for k, p in parsed if p and p.kind in ("block", "handoff")]
                chosen = pick(data, found)
                if chosen is None:
                    return
                key, parts = chosen
                if how == "evict" or parts.kind == "handoff":
                    self.faults += 1
                    admin.delete(key)
                elif how == "corrupt":
                    value = admin.get(key)
                    if value:
                        flipped = bytearray(value)
                        flipped[-3] ^= 0x5A
                        admin.set(key, bytes(flipped), keepttl=True)
                else:  # another model's block under this key (same namespace and fingerprint)
                    foreign = LookupBuffer(
                        admin, namespace=parts.namespace, fingerprint=parts.fingerprint, ttl_s=60
                    )
                    foreign.insert(parts.name, {"x": torch.zeros(3, 5)})
        except redis.ConnectionError:
            pass  # the store is away

    # ------------------------------------------------------------------ checks
    @invariant()
    def nothing_went_wrong(self) -> None:
        assert not self.answers, self.answers[:3]
        for e in self.engines:
            assert not e.write_violations, e.write_violations[:3]
            assert not e.value_violations, e.value_violations[:3]
            assert not e.deadline_violations, e.deadline_violations[:3]
            pool = e.sched.kv_cache_manager.block_pool
            free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and not b.is_null)
            assert pool.get_num_free_blocks() == free, "the block pool's free count is off"
        for handoff, owners in self.claims.winners.items():
            assert len(owners) <= 1, f"handoff {handoff} was claimed by {owners}"

    def finish_everything(self) -> None:
        """The store healthy again, every engine stepped until its requests are done."""
        self.slow.delay_s = 0.0
        self.store.up()
        deadline = time.monotonic() + 120
        while any(e.sched.has_requests() for e in self.engines):
            assert time.monotonic() < deadline, {
                e.worker.tp_rank: {r: q.status.name for r, q in e.sched.requests.items()}
                for e in self.engines
            }
            for e in self.engines:
                if e.sched.has_requests():
                    self.after_step(e, e.step())
            time.sleep(0.002)
        for e in self.engines:
            e.settle()

    def final_checks(self) -> None:
        for e in self.engines:  # every request is gone: the connector holds nothing of them
            assert not e.leftovers(), e.leftovers()
        with self.store.admin() as admin:
            for key in admin.keys("kv:*"):
                assert admin.pttl(key) != -1, f"{key!r} has no TTL"  # (-2: just expired)

    def teardown(self) -> None:
        try:
            self.finish_everything()
            self.nothing_went_wrong()
            self.final_checks()
            count("examples")
            for e in self.engines:
                if isinstance(e, StateSimEngine):
                    count("state reads", e.state_reads)
                for side in (e.take_stats(),):
                    for key in (
                        "blocks_loaded",
                        "blocks_saved",
                        "blocks_shed",
                        "loads_expired",
                        "loads_cancelled",
                        "requests_given_up",
                        "handoffs_lost",
                        "redis_errors",
                        "blocks_load_failed",
                    ):
                        count(key, int(side.get(key, 0)))
        finally:
            for e in self.engines:
                e.shutdown()
            self.store.close()


class ShareMachine(LifecycleMachine):
    """Two kv_both instances on one pool."""

    @initialize()
    def start(self) -> None:
        self.make("kv_both", **self.splitting())
        # KV events on: a finished request is freed only once its saves are confirmed. Its
        # hits load asynchronously, always: under auto a vLLM CPU engine may rightly recompute
        # every hit (it never splits there, and a busy machine's loads measure slow), and then
        # no run here exercised async loads in share mode -- CI's bounded run once reached none
        # (2026-11-29). The consume machine's first consumer runs auto.
        self.make("kv_both", kv_events=True, load_policy="async")

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict[str, Any]] = []

    @rule(data=st.data(), spec=prompts(), ticks=TICKS)
    def add_request(self, data: Any, spec: dict[str, Any], ticks: int) -> None:
        e = data.draw(st.sampled_from(self.engines))
        self.sent.append(dict(spec))
        self.send(data, e, self.new_id(), spec)
        self.tick(ticks)

    @rule(data=st.data(), system=st.sampled_from(range(len(_SYSTEM))), ticks=TICKS)
    def send_together(self, data: Any, system: int, ticks: int) -> None:
        """Two or three prompts of one system prompt, to one instance at once: admitted in one
        step, the later ones run on the blocks the first loads (a split's, on the splitting
        instance) as local prefix-cache hits."""
        e = data.draw(st.sampled_from(self.engines))
        family = [
            i for i, p in enumerate(CATALOGUE) if p[: len(_SYSTEM[system])] == _SYSTEM[system]
        ]
        for entry in data.draw(st.lists(st.sampled_from(family), min_size=2, max_size=3)):
            spec = Prompt(entry, None, tokens=list(CATALOGUE[entry]), max_tokens=2)
            self.sent.append(dict(spec))
            self.send(data, e, self.new_id(), spec)
        self.tick(ticks)

    @rule(data=st.data(), ticks=TICKS)
    def send_again(self, data: Any, ticks: int) -> None:
        """A prompt already sent, to either instance: a hit in the pool or a local one."""
        if not self.sent:
            return
        e = data.draw(st.sampled_from(self.engines))
        self.send(data, e, self.new_id(), pick(data, self.sent))
        self.tick(ticks)


TARGETS = {"first": [0], "second": [1], "both": [0, 1]}


class ConsumeMachine(LifecycleMachine):
    """A producer and two consumers; finished prefills are delivered to one consumer, or to both
    (a retried request)."""

    mode = "consume"

    def __init__(self) -> None:
        super().__init__()
        self.ready: list[tuple[str, dict[str, Any], dict]] = []  # finished, not yet delivered
        self.delivered: dict[str, list[str]] = {}  # handoff id -> its chain
        self.specs: dict[str, dict[str, Any]] = {}
        # prefill -> (consumers to deliver to when it finishes, their fates), as a proxy does
        self.routes: dict[str, tuple[list[int], list[tuple[str, int]]]] = {}
        self.params_of: dict[str, tuple[Any, Any, str]] = {}  # prefill -> (.., handoff id)
        self.events: dict[str, list[str]] = {}  # prefill -> what happened to its decodes

    @initialize()
    def start(self) -> None:
        self.producer = self.make("kv_producer")
        self.consumers = [
            self.make("kv_consumer", load_policy="auto"),
            self.make("kv_consumer", **self.splitting()),
        ]
        for c in self.consumers:
            self._trace(c)

    def _trace(self, engine: SimEngine) -> None:
        """Note what the consumer's connector decides for each request (failure messages)."""
        sched = engine.connector.scheduler
        answer, alloc, delete = (
            sched.get_num_new_matched_tokens,
            sched.update_state_after_alloc,
            sched._drops._delete,
        )

        def traced_answer(request: Any, computed: int) -> Any:
            got = answer(request, computed)
            if got[0] is not None:
                self.note(request.request_id, f"answered {got} at {computed}")
            return got

        def traced_alloc(request: Any, blocks: Any, n: int) -> None:
            alloc(request, blocks, n)
            state = sched._reqs.get(request.request_id)
            phase = state.phase.name if state else "-"
            handoff = state.handoff_state.value if state and state.handoff else "-"
            self.note(request.request_id, f"allocated {n} external ({phase}, handoff {handoff})")

        def traced_delete(drop: Any) -> None:
            rid = next((r for r, v in self.params_of.items() if v[2] == drop.handoff_id), "?")
            self.note(rid, "drop: deleting")
            delete(drop)
            self.note(rid, "drop: done")

        sched.get_num_new_matched_tokens = traced_answer  # type: ignore[method-assign]
        sched.update_state_after_alloc = traced_alloc  # type: ignore[method-assign]
        sched._drops._delete = traced_delete  # type: ignore[method-assign]

    @rule(
        data=st.data(),
        spec=prompts(),
        route=st.sampled_from(["first", "second", "both", "later"]),
        ticks=TICKS,
    )
    def prefill(self, data: Any, spec: dict[str, Any], route: str, ticks: int) -> None:
        """A request through the proxy: prefill, then (unless "later") decode on one consumer,
        or on both (a retried request), as soon as the prefill returns."""
        rid = self.new_id()
        self.specs[rid] = dict(spec)
        targets = TARGETS.get(route, [])
        self.routes[rid] = (targets, [self.draw_fate(data) for _ in targets])
        count("prefills")
        self.send(data, self.producer, rid, {**spec, "max_tokens": 1})
        self.tick(ticks)

    def after_step(self, engine: SimEngine, result: Any) -> None:
        super().after_step(engine, result)
        if engine is not self.producer:
            return
        for rid, params in result.params.items():
            if not params or rid in self.producer.aborted:
                continue
            targets, fates = self.routes.pop(rid, ([], []))
            if targets:
                self.deliver_now(rid, params, targets, fates)
            else:
                self.ready.append((rid, self.specs[rid], params))

    def deliver_now(
        self, rid: str, params: dict, targets: list[int], fates: list[tuple[str, int]]
    ) -> None:
        count("handoffs delivered")
        self.params_of[rid] = (targets, fates, params["redis_kv"]["handoff"])
        self.events.setdefault(rid, []).append(f"delivered to {targets} with fates {fates}")
        spec = self.specs[rid]
        for i, fate in zip(targets, fates, strict=True):
            engine = self.consumers[i]
            engine.add(f"{rid}-d{i}", spec["tokens"], params=params, **request_options(spec))
            if fate[0] != "live":
                self.fates.append((engine, f"{rid}-d{i}", *fate))
        handoff = params["redis_kv"]["handoff"]
        probe = self.consumers[targets[0]].sched.requests[f"{rid}-d{targets[0]}"]
        self.delivered[handoff] = RequestChains(probe, BS).handoff(handoff)

    @rule(data=st.data(), to=st.sampled_from(["first", "second", "both", "both"]), ticks=TICKS)
    def deliver_late(self, data: Any, to: str, ticks: int) -> None:
        """A prefill's decode sent long after it finished (its handoff waited in Redis)."""
        targets = TARGETS[to]
        # drawn whether or not a prefill is ready: what is ready depends on timing
        chosen = pick(data, list(range(len(self.ready))))
        fates = [self.draw_fate(data) for _ in targets]
        if chosen is not None:
            rid, _, params = self.ready.pop(chosen)
            self.deliver_now(rid, params, targets, fates)
        self.tick(ticks)

    def final_checks(self) -> None:
        super().final_checks()
        if self.faults:
            return  # an outage or eviction may have left a chain to its TTL (checked above)
        store = self.consumers[0].worker.store
        deadline = time.monotonic() + 30  # drops wait for their producer: events, bounded
        for handoff, chain in self.delivered.items():
            while any(store.contains(chain)):
                assert time.monotonic() < deadline, self.story(handoff, chain)
                time.sleep(0.01)

    def story(self, handoff: str, chain: list[str]) -> str:
        """What happened to a handoff left behind, for the failure message."""
        store = self.consumers[0].worker.store
        with self.store.admin() as admin:
            records = [admin.get(k) for k in admin.keys(f"kv:*:handoff:{{{handoff}}}")]
        rid = next((r for r, (_, _, p) in self.params_of.items() if p == handoff), "?")
        fates = {
            f"{rid}-d{i}": self.consumers[i].finish_reasons.get(f"{rid}-d{i}", "never finished")
            for i in range(2)
        }
        return (
            f"handoff {handoff} (prefill {rid}) was neither loaded nor deleted: blocks present "
            f"{store.contains(chain)}, records {records}, claims won "
            f"{self.claims.winners.get(handoff)}, consumers {fates}, events {self.events.get(rid)}"
        )


class StateShareMachine(ShareMachine):
    """Share mode on a gated delta-net hybrid: states saved from vLLM's offers, one state per
    hit (``testing.state_sim``: every state the stand-in model reads is checked)."""

    engine = StateSimEngine


class StateConsumeMachine(ConsumeMachine):
    """Consume mode on a gated delta-net hybrid."""

    engine = StateSimEngine


def run(machine: type[LifecycleMachine], model: Path, store_factory: Callable[[], Any]) -> None:
    machine.model = model
    machine.store_factory = staticmethod(store_factory)  # type: ignore[assignment]
    TALLY.clear()
    t0 = time.monotonic()
    try:
        run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)
    except FlakyFailure as exc:
        # failed once and passed when replayed: a timing-dependent failure. Say what failed
        # first (the example's steps follow in the chained traceback, which CI may cut short).
        first = exc.exceptions[0]
        where = "".join(traceback.format_list(traceback.extract_tb(first.__traceback__)[-3:]))
        steps = "\n".join(getattr(exc, "__notes__", []))
        raise AssertionError(
            f"failed once, not on replay (timing-dependent): {type(first).__name__}: {first}\n"
            f"{where}\n{steps}"
        ) from None
    finally:
        TALLY["seconds"] = round(time.monotonic() - t0)
        print(f"\nfuzz {machine.__name__}: {json.dumps(TALLY, sort_keys=True)}")
        report = os.environ.get("KVSTORE_FUZZ_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(json.dumps({"machine": machine.__name__, **TALLY}) + "\n")
    # the bounded run must reach what it is for, or it proves nothing
    assert TALLY.get("loads reported", 0) > 0 and TALLY.get("requests finished", 0) > 0


@pytest.fixture(scope="module")
def fuzz_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("machine", [ShareMachine, ConsumeMachine], ids=["share", "consume"])
def test_fuzz_on_fakeredis(tiny_model: Path, machine: type[LifecycleMachine]) -> None:
    run(machine, tiny_model, FakeStore)


@pytest.mark.parametrize(
    "machine", [StateShareMachine, StateConsumeMachine], ids=["share", "consume"]
)
def test_fuzz_state_groups_on_fakeredis(tiny_model: Path, machine: type[LifecycleMachine]) -> None:
    """The same interleavings on a model with two state groups: saves from vLLM's offers,
    one-state hits, loads failed per request; every state the stand-in model reads checked."""
    run(machine, tiny_model, FakeStore)
    assert TALLY.get("state reads", 0) > 0


@pytest.mark.redis
@pytest.mark.parametrize("machine", [ShareMachine, ConsumeMachine], ids=["share", "consume"])
def test_fuzz_on_redis_server(
    tiny_model: Path, machine: type[LifecycleMachine], fuzz_redis: RedisServer
) -> None:
    run(machine, tiny_model, lambda: RealStore(fuzz_redis))
