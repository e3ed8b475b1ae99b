"""What vLLM does to a request -- aborts, preemption, a full KV cache, local hits that change --
against the real connector on both sides and vLLM's real Scheduler (``testing.sim_engine``: no
model, a stand-in forward pass whose KV values say which request and tokens they belong to).
Every test checks, besides its own assertions, that the connector wrote no block it did not
own at that moment and that every block a request ran on held that request's KV."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

import connector.lookup_polls
from connector.chains import handoff_salt
from connector.request_state import Phase
from kvstore import LookupBuffer, chain_hashes
from testing.scheduler_harness import BS, make_request, make_scheduler, prompt
from testing.sim_engine import Gate, SimEngine, produce

pytestmark = pytest.mark.vllm

URL = "redis://fake:6379/0"


def until(pred: Any, engine: SimEngine, steps: int = 400) -> None:
    for _ in range(steps):
        if pred():
            return
        engine.step()
        time.sleep(0.002)
    raise AssertionError("condition never held")


def loaded_blocks(engine: SimEngine) -> int:
    return int(engine.take_stats().get("blocks_loaded", 0))


def answered(conn: Any, req: Any, local_blocks: int) -> tuple[int | None, bool]:
    """The connector's answer to vLLM about ``req`` with ``local_blocks`` cached locally,
    asked again (as vLLM does each step) until it is no longer "not known yet"."""
    for _ in range(500):
        answer = conn.get_num_new_matched_tokens(req, local_blocks * BS)
        if answer[0] is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("no answer")


class AllocatedBlocks:
    """What vLLM hands ``update_state_after_alloc``: block ids 10-16 of one group."""

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(range(10, 17)),)


# ---------------------------------------------------------------------- defect 1
def test_an_abort_during_a_share_mode_load_holds_the_blocks_until_the_load_ends(
    engines: Any,
) -> None:
    """The aborted request only loaded: it must not report "finished sending" (vLLM would free
    its blocks under the load, hand them to the next request, then die on the load's report)."""
    tokens = prompt(6 * BS + 3)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    reader = engines()
    held = Gate.hold(reader.worker.store)
    reader.add("a", tokens)
    until(lambda: held.entered.is_set(), reader)
    assert reader.sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    reader.abort("a")
    for _ in range(3):  # vLLM must keep a's blocks: the load may still write them
        res = reader.step()
        assert "a" not in res.sending
    assert "a" in reader.sched.requests
    reader.add("b", prompt(7 * BS + 5, seed=2))  # would get a's blocks if they were freed
    for _ in range(5):
        reader.step()
    held.opened.set()
    reader.run_until_idle()
    assert "a" not in reader.sched.requests and "b" in reader.finished_params


def test_a_request_that_loaded_and_saved_is_reported_sent_once(engines: Any) -> None:
    tokens = prompt(4 * BS)
    writer = engines()
    writer.add("w", tokens[: 2 * BS + 1])  # the pool holds the first 2 blocks
    writer.run_until_idle()
    reader = engines()
    reader.add("r", tokens + prompt(BS + 1, seed=5))
    sent: list[str] = []
    for _ in range(200):
        if not reader.sched.has_requests():
            break
        sent += reader.step().sending
        time.sleep(0.002)
    assert sent == ["r"]  # it saved blocks 2..4: vLLM held them until the saves were staged


# ---------------------------------------------------------------------- defect 2
def test_a_full_kv_cache_at_admission_keeps_the_handoff(engines: Any) -> None:
    """vLLM asks again when it could not allocate: the answer must stay, and the handoff must
    be loaded once there is room, not recomputed and deleted unread."""
    tokens = prompt(8 * BS + 1, seed=3)
    producer = engines("kv_producer")
    producer.add("p", tokens, max_tokens=1)
    producer.run_until_idle()
    params = producer.finished_params["p"]
    assert params is not None
    consumer = engines("kv_consumer", num_blocks=16)
    consumer.add("hog", prompt(10 * BS, seed=4), max_tokens=12)  # most of the 15 blocks
    consumer.step()
    consumer.add("d", tokens, params=params)
    waits = 0
    for _ in range(6):  # the hog holds the cache: d cannot be allocated yet
        res = consumer.step()
        waits += "d" not in res.output.num_scheduled_tokens and not any(
            s.req_id == "d" for s in res.output.kv_connector_metadata.loads
        )
    assert waits >= 3
    consumer.run_until_idle()
    assert loaded_blocks(consumer) == 8
    chain = chain_hashes(tokens, BS, handoff_salt("", params["redis_kv"]["handoff"]))
    store = consumer.worker.store
    deadline = time.monotonic() + 10
    while store.longest_prefix(chain, consumer.worker.layout.all_fingerprints()):
        assert time.monotonic() < deadline, "the consumed handoff was never deleted"
        time.sleep(0.01)


# ---------------------------------------------------------------------- defect 3
def test_prompts_that_differ_only_in_their_embeddings_never_share_blocks(
    engines: Any,
) -> None:
    n = 5 * BS + 2
    gen = torch.Generator().manual_seed(0)
    e1 = torch.randn(n, 32, generator=gen)
    e2 = e1.clone()
    e2[3 * BS + 1] += 1.0  # block 3 differs; blocks 0..2 are the same
    placeholder = [0] * n
    mask = [False] * n
    writer = engines()
    writer.add("w", placeholder, prompt_embeds=e1, prompt_is_token_ids=mask)
    writer.run_until_idle()
    reader = engines()
    reader.add("r", placeholder, prompt_embeds=e2, prompt_is_token_ids=mask)
    reader.run_until_idle()
    assert loaded_blocks(reader) == 3  # the shared prefix, and nothing of block 3 on


# ---------------------------------------------------------------------- defect 4
@pytest.mark.parametrize("changed", ["after the answer", "while the lookup is out"])
def test_a_lookup_answer_survives_a_change_of_local_hits(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, changed: str
) -> None:
    """vLLM may present another local-hit length on the next call (its prefix cache changed,
    or it could not allocate and asks again): the request must still load its handoff, not
    find it taken by itself."""
    sched = make_scheduler(tiny_model, "kv_consumer", url=URL, lookup_wait_s=0, deadline_s=30)
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    layout = sched.connector.layout  # type: ignore[union-attr]
    tokens = prompt(6 * BS + 1)
    chain = chain_hashes(tokens, BS, handoff_salt("", "feed"))
    store = LookupBuffer.from_url(URL, namespace="vllm", fingerprint=layout.fingerprint(0))
    block = {n: torch.zeros(2, BS, 128) for n in layout.layer_names}
    store.insert_many([(h, block) for h in chain])
    store.publish_handoff("feed", 6)
    params = {
        "redis_kv": {
            "handoff": "feed",
            "scope": "handoff",
            "num_blocks": 6,
            "last_hash": chain[5],
            "namespace": "vllm",
            "block_size": BS,
        }
    }
    held = Gate(conn.store, "survey")
    req = make_request("r", tokens, params)

    try:
        assert conn.get_num_new_matched_tokens(req, 0) == (None, False)  # the lookup is out
        assert held.entered.wait(10)
    finally:
        held.opened.set()
    if changed == "after the answer":
        assert answered(conn, req, 0) == (6 * BS, True)
    assert answered(conn, req, 1) == (5 * BS, True)  # a local hit of one block appeared
    assert answered(conn, req, 1) == (5 * BS, True)  # and vLLM asks again: the same answer
    assert answered(conn, req, 0) == (
        6 * BS,
        True,
    )  # the local hit went: looked up and decided anew
    stats = conn.stats.take()
    assert stats.get("requests_given_up") is None
    assert not any(k.startswith("chose_") for k in stats)  # (counted once it takes effect)

    conn.update_state_after_alloc(req, AllocatedBlocks(), 6 * BS)
    conn.update_state_after_alloc(req, AllocatedBlocks(), 6 * BS)  # (admitted again: nothing new)
    stats = conn.stats.take()
    # one request, one hit: the choice that was served counted once, however often decided
    assert sum(v for k, v in stats.items() if k.startswith("chose_")) == 1, stats
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_the_choice_counted_is_the_one_served(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decided twice (its local hits shrank), first recompute, then a load: the load is what
    it is served, and what is counted (a review found the first decision counted)."""
    import dataclasses

    import connector.load_choices as load_choices
    from connector.load_policy import Way

    sched = make_scheduler(tiny_model, "kv_both", url=URL, deadline_s=30)
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    tokens = prompt(6 * BS + 1, seed=51)
    block = {n: torch.zeros(2, BS, 128) for n in sched.connector.layout.layer_names}  # type: ignore[union-attr]
    conn.store.insert_many([(h, block) for h in chain_hashes(tokens, BS)])
    ways = iter([Way.RECOMPUTE, Way.ASYNC])

    def decided(real: Any) -> Any:  # the policy's decision, its way replaced
        def decide(*args: Any, **kwargs: Any) -> Any:
            hit = next(a for a in args if isinstance(a, load_choices.Hit))
            way = next(ways)
            blocks = hit.blocks if way is Way.ASYNC else 0
            return dataclasses.replace(real(*args, **kwargs), way=way, blocks=blocks)

        return decide

    monkeypatch.setattr(load_choices, "choose", decided(load_choices.choose))
    monkeypatch.setattr(load_choices, "pinned", decided(load_choices.pinned))
    req = make_request("r", tokens)

    assert answered(conn, req, 1) == (0, False)  # recompute
    assert answered(conn, req, 0) == (6 * BS, True)  # the local hit went: decided again, a load

    conn.update_state_after_alloc(req, AllocatedBlocks(), 6 * BS)
    stats = conn.stats.take()
    sched.connector.shutdown()  # type: ignore[union-attr]
    assert stats.get("chose_async") == 1 and "chose_recompute" not in stats, stats
    assert "tokens_recompute_chosen" not in stats


def test_a_request_asked_about_again_gives_up_once(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Past its deadline a request recomputes; vLLM asking again (another local hit, or an
    allocation that failed) is the same give-up, counted and logged once."""
    sched = make_scheduler(tiny_model, "kv_both", url=URL, lookup_wait_s=0, deadline_s=0.05)
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    held = Gate(conn.store, "survey")  # Redis never answers the lookup
    req = make_request("r", prompt(6 * BS + 1))
    try:
        for local_blocks in (3, 2, 1, 0):  # (each fewer: it is looked up anew)
            assert answered(conn, req, local_blocks) == (0, False)
        assert conn.stats.take().get("requests_given_up") == 1
    finally:
        held.opened.set()
        sched.connector.shutdown()  # type: ignore[union-attr]


# ---------------------------------------------------------------------- defect 5
def test_one_step_waits_for_lookups_once_however_many_requests_arrive(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 new requests against a slow Redis: the step's waits share one lookup_wait_s, so they
    all end when the first one would, not a lookup_wait_s apart. (Their ends, not the sum of
    their timeouts: on a busy machine lookups that began in add_request are done by the step,
    a wait returns at once and the budget's remainder passes to the next.)"""
    ends: list[tuple[float, float]] = []  # (when the wait was called, when it would time out)
    real_wait = futures.wait

    def counting_wait(fs: Any, timeout: float | None = None, **kw: Any) -> Any:
        now = time.monotonic()
        ends.append((now, now + (timeout or 0.0)))
        return real_wait(fs, timeout=timeout, **kw)

    monkeypatch.setattr(connector.lookup_polls, "wait", counting_wait)
    wait_s = 0.02
    sched = make_scheduler(tiny_model, "kv_both", url=URL, lookup_wait_s=wait_s)
    store = sched.connector.scheduler.store  # type: ignore[union-attr]
    real_lookup = store.survey
    # Redis answers only after the step: however slowly this machine adds the 64 requests,
    # every lookup is still out when the step polls it (a sleep once let a busy machine's
    # lookups all finish first, and the step then rightly waited for none)
    answer = threading.Event()

    def slow(*a: Any, **k: Any) -> Any:
        answer.wait(timeout=30)
        return real_lookup(*a, **k)

    store.survey = slow
    for i in range(64):
        sched.add_request(make_request(f"r{i}", prompt(3 * BS + 1, seed=i)))
    try:
        sched.schedule()
    finally:
        answer.set()
    assert ends, "the step never waited for a lookup that was still out"
    assert all(end - called <= wait_s + 1e-9 for called, end in ends)
    # (within one more wait_s: a busy machine may pause the scheduler between reading its clock
    # and calling wait; a budget per request ends each wait a whole wait_s after the last)
    first_end = ends[0][1]
    assert max(end for _, end in ends) < first_end + wait_s


# ---------------------------------------------------------------------- defect 6
@pytest.mark.parametrize(
    ("first", "second", "shares"),
    [
        (("alice", 1, "/a"), ("bob", 1, "/b"), False),  # another adapter under the same id
        (("alice", 1, "/a"), ("alice", 1, "/b"), False),  # the name pointed at another adapter
        (("alice", 1, "/a"), ("alice", 2, "/a"), True),  # the same adapter under another id
        (("alice", 1, "/a"), None, False),  # the base model
        (("a@b", 1, "/c"), ("a", 2, "b@/c"), False),  # fields that once ran into each other
    ],
)
def test_lora_adapters_are_told_apart_by_name_and_path_not_by_id(
    engines: Any, first: Any, second: Any, shares: bool
) -> None:
    tokens = prompt(4 * BS + 1, seed=8)
    writer = engines()
    writer.add("w", tokens, lora=first)
    writer.run_until_idle()
    reader = engines()
    reader.add("r", tokens, lora=second)
    reader.run_until_idle()
    assert loaded_blocks(reader) == (4 if shares else 0)


# ---------------------------------------------------------------------- consume mode
def handoff_chain(tokens: list[int], params: dict) -> list[str]:
    return chain_hashes(tokens, BS, handoff_salt("", params["redis_kv"]["handoff"]))


def wait_deleted(engine: SimEngine, chain: list[str]) -> None:
    store, fps = engine.worker.store, engine.worker.layout.all_fingerprints()
    deadline = time.monotonic() + 10
    while any(store.contains(chain)):
        assert time.monotonic() < deadline, "the handoff was never deleted"
        time.sleep(0.01)
    del fps


def test_the_same_handoff_on_two_consumers_is_loaded_by_one_and_recomputed_by_the_other(
    engines: Any,
) -> None:
    """A retried request reaches a second decode server while the first still has it: both
    may plan a load, one claim wins, the loser recomputes without touching the chain."""
    tokens = prompt(6 * BS + 1, seed=11)
    params = produce(engines, tokens)
    a, b = engines("kv_consumer"), engines("kv_consumer")
    a.add("d", tokens, params=params)
    b.add("d", tokens, params=params)
    for _ in range(300):
        if not (a.sched.has_requests() or b.sched.has_requests()):
            break
        a.step()
        b.step()
        time.sleep(0.002)
    loaded = sorted([loaded_blocks(a), loaded_blocks(b)])
    assert loaded == [0, 6]
    wait_deleted(a, handoff_chain(tokens, params))


@pytest.mark.parametrize("when", ["looking up", "answered", "loading"])
def test_an_aborted_consumer_leaves_nothing_behind(engines: Any, when: str) -> None:
    """Aborted while waiting for the producer, while waiting for room in the KV cache, or
    while its load runs: the handoff is deleted (after the load, or at once), vLLM keeps
    every block the load writes until the load reports, and nothing else is disturbed."""
    tokens = prompt(8 * BS + 1, seed=12)
    params = produce(engines, tokens)
    # (a lookup held at the gate must not be taken for a hung Redis on a slow machine)
    consumer = engines("kv_consumer", num_blocks=16, control_timeout_s=30)
    if when == "looking up":
        held = Gate.hold(consumer.connector.scheduler.store, "survey")
    elif when == "answered":
        consumer.add("hog", prompt(10 * BS, seed=4), max_tokens=12)
        consumer.step()
    else:
        held = Gate.hold(consumer.worker.store, "select_into")
    consumer.add("d", tokens, params=params)
    if when == "loading":
        # stepped until its load reads (not a few steps, then a wait: on a busy CI machine the
        # producer's record was not found yet after four steps, and nothing stepped after them)
        until(lambda: held.entered.is_set(), consumer)
        assert consumer.sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    else:
        for _ in range(4):
            consumer.step()
            time.sleep(0.005)
        assert consumer.sched.requests["d"].status == RequestStatus.WAITING
    consumer.abort("d")
    consumer.add("next", prompt(5 * BS + 1, seed=13))
    for _ in range(3):
        consumer.step()
    Gate.open_all()
    consumer.run_until_idle()
    assert "next" in consumer.finished_params
    wait_deleted(consumer, handoff_chain(tokens, params))


# ---------------------------------------------------------------------- share mode
def test_a_preempted_request_looks_up_again_and_runs_on_its_own_values(engines: Any) -> None:
    tokens = prompt(6 * BS + 1, seed=14)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    reader = engines()
    req = reader.add("r", tokens, max_tokens=30)
    until(lambda: req.status == RequestStatus.RUNNING and req.num_output_tokens > 2, reader)
    assert reader.preempt("r")
    reader.sched.reset_prefix_cache()  # its blocks are gone locally: Redis again
    reader.run_until_idle()
    assert loaded_blocks(reader) == 12  # 6 blocks, twice
    assert reader.finished_params["r"] is not None


def test_a_corrupt_block_is_recomputed_once_and_saved_again(
    engines: Any, fake_redis: fakeredis.FakeRedis
) -> None:
    """A block that fails its checksum is reported with the load; vLLM recomputes from there;
    the request never loads again in the same admission; its recomputed value replaces the
    bad one in the pool."""
    tokens = prompt(5 * BS + 1, seed=15)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    writer.settle()
    key = writer.worker.store.redis_key(chain_hashes(tokens, BS)[2])
    value = bytearray(fake_redis.get(key))
    value[-5] ^= 0xFF
    fake_redis.set(key, bytes(value), keepttl=True)
    reader = engines()
    reader.add("r", tokens)
    loads: list[Any] = []
    for _ in range(300):
        if not reader.sched.has_requests():
            break
        loads += reader.step().output.kv_connector_metadata.loads
        time.sleep(0.002)
    assert [len(s.block_ids[0]) for s in loads] == [5]  # one load, never retried
    stats = reader.take_stats()
    # blocks 3 and 4 arrived, but vLLM recomputes from block 2 on: they count as failed
    assert stats["blocks_loaded"] == 2 and stats["blocks_load_failed"] == 3
    reader.settle()
    third = engines()
    third.add("t", tokens)
    third.run_until_idle()
    assert loaded_blocks(third) == 5  # the pool's block 2 was replaced by a good one


# ---------------------------------------------------------------------- vLLM's own scenarios
def test_the_fail_policy_ends_the_request_only_after_its_load_reports(
    engines: Any, fake_redis: fakeredis.FakeRedis
) -> None:
    """kv_load_failure_policy "fail": vLLM finishes the request with an error when a block
    fails, while the load may still be running; its blocks must stay vLLM's until the load
    reports (vLLM's test_invalid_blocks_race_conditions, test_error_propagation)."""
    tokens = prompt(5 * BS + 1, seed=16)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    key = writer.worker.store.redis_key(chain_hashes(tokens, BS)[1])
    value = bytearray(fake_redis.get(key))
    value[-5] ^= 0xFF
    fake_redis.set(key, bytes(value), keepttl=True)
    reader = engines(failure_policy="fail")
    reader.add("r", tokens)
    reader.add("other", prompt(3 * BS + 1, seed=17))
    reader.run_until_idle()
    assert reader.finish_reasons == {"r": "error", "other": "length"}
    assert reader.sched.requests == {}


@pytest.mark.parametrize("ended_by", ["nothing", "abort", "fail policy"])
def test_a_failed_load_counts_as_failed_however_its_request_ended_first(
    engines: Any, fake_redis: fakeredis.FakeRedis, ended_by: str
) -> None:
    """Every value of a share-mode load gone before the worker reads them: six failed blocks,
    none loaded -- also where the request finished while its load ran (aborted; or ended by
    ``kv_load_failure_policy=fail``, which finishes it before the load reports). Before, the
    load's block trace was dropped at the finish, its failures went unseen, and all six
    counted loaded (a review's)."""
    tokens = prompt(6 * BS + 3, seed=21)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    reader = engines(failure_policy="fail" if ended_by == "fail policy" else "recompute")
    held = Gate.hold(reader.worker.store)
    reader.add("a", tokens)
    until(lambda: held.entered.is_set(), reader)
    if ended_by == "abort":
        reader.abort("a")
    for key in fake_redis.keys("kv:*"):  # evicted between the lookup and the load
        fake_redis.delete(key)
    held.opened.set()
    invalid: set[int] = set()
    for _ in range(400):
        if not reader.sched.has_requests():
            break
        invalid |= reader.step().invalid
        time.sleep(0.002)
    assert not reader.sched.has_requests() and len(invalid) == 6
    stats = reader.take_stats()
    assert (stats.get("blocks_loaded", 0), stats.get("blocks_load_failed", 0)) == (0, 6), stats


def test_a_bug_while_reporting_a_load_still_ends_it_and_the_request_recomputes(
    engines: Any,
) -> None:
    """An exception in the report of a load (a bug) left it marked reported but never
    finished: vLLM waited for it for ever, and an expiry on the engine's thread raised out of
    the step (a review's). The load now ends failed as a whole; the request recomputes."""
    tokens = prompt(4 * BS + 3, seed=31)
    writer = engines()
    writer.add("w", tokens)
    writer.run_until_idle()
    reader = engines(deadline_s=1)
    loads = reader.worker._whole_loads  # type: ignore[attr-defined]
    calls = {"n": 0}
    real = loads._uncopied

    def broken(job: Any) -> Any:
        calls["n"] += 1
        if calls["n"] >= 2:  # (the first is the receive's; the second, the report's)
            raise RuntimeError("a bug while reporting")
        return real(job)

    loads._uncopied = broken
    reader.add("r", tokens)
    reader.run_until_idle()
    assert reader.finish_reasons == {"r": "length"}
    assert reader.take_stats().get("internal_errors") == 1


def test_a_systematic_bug_is_counted_per_load_and_logged_with_one_traceback(
    engines: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every load's copy-in raises (a bug): each request recomputes, each is counted, and the
    log holds a few lines, one traceback -- not one per load (a review's 6 loads, 6)."""
    prompts = [prompt(4 * BS + 3, seed=40 + i) for i in range(6)]
    writer = engines()
    for i, tokens in enumerate(prompts):
        writer.add(f"w{i}", tokens)
    writer.run_until_idle()
    reader = engines()
    for mover in reader.worker.movers:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise TypeError("a bug in the scatter")

        mover.kv.scatter = broken
    caplog.set_level(logging.INFO)
    for i, tokens in enumerate(prompts):
        reader.add(f"r{i}", tokens)
    reader.run_until_idle()
    assert set(reader.finish_reasons.values()) == {"length"}
    assert reader.take_stats().get("internal_errors") == 6
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 1 <= len(errors) <= 3 and sum(r.exc_info is not None for r in errors) == 1


def test_vllm_allocating_fewer_tokens_than_answered_loads_only_those_blocks(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Newer vLLM may cap an async load by its token budget: the connector loads the blocks of
    the tokens vLLM allocated, not of its answer (vLLM's test_large_async_load...)."""
    sched = make_scheduler(tiny_model, "kv_both", url=URL, deadline_s=30)
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    tokens = prompt(6 * BS + 1, seed=18)
    hashes = chain_hashes(tokens, BS)
    block = {n: torch.zeros(2, BS, 128) for n in sched.connector.layout.layer_names}  # type: ignore[union-attr]
    conn.store.insert_many([(h, block) for h in hashes])
    req = make_request("r", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (6 * BS, True)

    # 2 blocks and a part of a third
    conn.update_state_after_alloc(req, AllocatedBlocks(), 2 * BS + 3)
    (load,) = conn._pending_loads
    assert load.block_ids == [[10, 11, 12]] and load.names[0] == hashes[:3]
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_hit_another_connector_loads_plans_no_load_here_and_saves_the_prompt(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """Behind vLLM's MultiConnector a child that holds the prompt too (the CPU tier, asked
    first) loads it: this connector answered a hit, then vLLM allocates it 0 external tokens.
    Nothing may be loaded here (the blocks are the other child's to write), and the request
    runs on as a computed request."""
    sched = make_scheduler(tiny_model, "kv_both", url=URL, deadline_s=30)
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    tokens = prompt(6 * BS + 1, seed=19)
    hashes = chain_hashes(tokens, BS)
    block = {n: torch.zeros(2, BS, 128) for n in sched.connector.layout.layer_names}  # type: ignore[union-attr]
    conn.store.insert_many([(h, block) for h in hashes[:3]])
    req = make_request("r", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (3 * BS, True)

    conn.update_state_after_alloc(req, AllocatedBlocks(), 0)  # the other child's load
    assert conn._pending_loads == []  # nothing written into blocks the other child fills
    assert conn._reqs["r"].phase is Phase.RUNNING  # computed from there on, never waiting
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_load_planned_while_the_kv_cache_sleeps_still_deletes_its_handoff(
    engines: Any,
) -> None:
    """vLLM 0.33 sleep mode: a load the worker receives while the KV cache is released is
    cancelled (the request recomputes), and its handoff is still claimed and deleted (it was
    left for its whole TTL)."""
    tokens = prompt(6 * BS + 1, seed=21)
    params = produce(engines, tokens)
    consumer = engines("kv_consumer")
    consumer.add("d", tokens, params=params)
    for _ in range(200):  # the KV cache sleeps in the step that plans the load
        consumer.worker_conn.unregister_kv_caches()
        res = consumer.step()
        consumer.worker_conn.restore_kv_caches()
        if res.output.kv_connector_metadata.loads:
            break
        time.sleep(0.005)
    else:
        raise AssertionError("no load was planned")
    consumer.run_until_idle()
    assert consumer.take_stats()["loads_cancelled"] == 1
    assert "d" in consumer.finished_params
    wait_deleted(consumer, handoff_chain(tokens, params))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # a LoRA path holding what another request's cache_salt adds
        ({"lora": ("x", 1, "/p|salt=s")}, {"lora": ("x", 1, "/p"), "cache_salt": "s"}),
        ({"lora": ("x", 1, "/p|salt=s")}, {"lora": ("x", 1, "/p|salt=s"), "cache_salt": "s"}),
    ],
)
def test_no_salt_can_pass_for_another(engines: Any, first: dict, second: dict) -> None:
    """cache_salt and LoRA names and paths come from clients: no choice of them may make two
    requests whose KV differs share blocks (the salt's parts were joined with "|" unescaped)."""
    tokens = prompt(4 * BS + 1, seed=9)
    writer = engines()
    writer.add("w", tokens, **first)
    writer.run_until_idle()
    reader = engines()
    reader.add("r", tokens, **second)
    reader.run_until_idle()
    assert loaded_blocks(reader) == 0


def test_many_requests_on_one_prefix_wait_for_one_load_and_survive_aborts(
    engines: Any,
) -> None:
    """Share mode: twelve requests on one cached prefix, loads slow, two aborted mid-way. The
    others wait for the one load of the prefix (then a local hit), and all run on right KV."""
    base = prompt(6 * BS, seed=30)
    writer = engines()
    writer.add("w", [*base, 5])
    writer.run_until_idle()
    reader = engines(num_blocks=200, max_num_seqs=16)
    real = reader.worker.store.select_into

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(0.05)
        return real(*a, **k)

    reader.worker.store.select_into = slow  # type: ignore[method-assign]
    for i in range(12):
        reader.add(f"r{i}", base + prompt(BS + 3, seed=100 + i))
    for step in range(2000):
        if not reader.sched.has_requests():
            break
        reader.step()
        if step == 3:
            reader.abort("r0")
            reader.abort("r5")
        time.sleep(0.002)
    assert set(reader.finished_params) == {f"r{i}" for i in range(12)} - {"r0", "r5"}
    assert 6 <= loaded_blocks(reader) <= 12  # the prefix once (twice if its loader was aborted)


@pytest.mark.parametrize("abort_at", [None, 1, 3])
def test_kv_both_in_consume_mode_hands_off_and_on(engines: Any, abort_at: int | None) -> None:
    """Instances that both produce and consume handoffs (kv_both, consume mode): a prompt of
    an exact number of blocks goes from one to the other and back, with an abort on the way."""
    tokens = prompt(7 * BS, seed=61)
    x = engines("kv_both", mode="consume")
    y = engines("kv_both", mode="consume")
    x.add("p", tokens, max_tokens=1)
    x.run_until_idle()
    params = x.finished_params["p"]
    assert params is not None
    y.add("d", tokens, params=params, max_tokens=3)
    for i in range(400):
        if not y.sched.has_requests():
            break
        y.step()
        if abort_at is not None and i == abort_at:
            y.abort("d")
        time.sleep(0.002)
    y.run_until_idle()
    wait_deleted(y, handoff_chain(tokens, params))
    again = y.finished_params.get("d")
    if abort_at is None:
        assert again is not None and loaded_blocks(y) == 6  # never the last prompt token
    if again:  # and back to the first instance
        x.add("d2", [*tokens, 9], params=again)
        x.run_until_idle()
        wait_deleted(x, handoff_chain(tokens, again))
