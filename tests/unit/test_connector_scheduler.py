"""Scheduler-side connector logic, driven by vLLM's real Scheduler and Request objects (no model,
no worker), with the store on fakeredis. The worker is simulated by the model-runner outputs the
scheduler receives, the way vLLM's own connector unit tests do it."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import fakeredis
import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from connector import load_choices
from connector.chains import handoff_salt
from connector.load_policy import Busy, Decision, Hit, Reason, Way
from kvstore import Claim, InvalidArgumentError, StoreTimeoutError, chain_hashes
from testing.scheduler_harness import (
    BS,
    connector_of,
    fake_redis_scheduler,
    hand_off,
    make_request,
    meta_of,
    prompt,
    runner_output,
    seed_blocks,
    store_for,
    zero_block,
)
from testing.threads import until

pytestmark = pytest.mark.vllm

T = TypeVar("T")


def schedule_until_admitted(sched: Scheduler, rid: str, steps: int = 50) -> Any:
    """Step the scheduler (nothing else running) until ``rid`` is admitted or starts loading."""
    for _ in range(steps):
        out = sched.schedule()
        if rid in out.num_scheduled_tokens or any(s.req_id == rid for s in meta_of(out).loads):
            return out
        sched.update_from_output(out, runner_output([]))
        time.sleep(0.012)
    raise AssertionError(f"{rid} was never admitted")


def while_redis_hangs(fake_redis: fakeredis.FakeRedis, call: Callable[[], T]) -> T:
    """``call()``, run while Redis hangs: fakeredis answers no command while its server's lock
    is held (the breaker's probe and the connector's threads wait too). Fails if ``call`` does
    not come back meanwhile: it waited for Redis."""
    with ThreadPoolExecutor(1) as pool:
        with fake_redis.server.lock:  # type: ignore[attr-defined]
            running = pool.submit(call)
            came_back_while_hung = running in futures.wait([running], timeout=30).done
        assert came_back_while_hung, "it waited for Redis"
    return running.result()


def test_consumer_loads_a_handoff_asynchronously_and_never_the_last_token(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS)  # exactly 4 blocks: only 3 may be loaded
    params, chain = hand_off(sched, tokens, 4, commit=4)
    req = make_request("r1", tokens, params)
    sched.add_request(req)
    out = sched.schedule()
    meta = meta_of(out)
    assert [(s.req_id, s.names[0]) for s in meta.loads] == [("r1", chain[:3])]
    assert [len(ids) for ids in meta.loads[0].block_ids] == [3] and 0 < meta.loads[0].timeout_s <= 3
    assert meta.loads[0].claim == "feed1234"  # the worker claims it before it reads
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    store = store_for(sched)
    assert store.longest_prefix(chain) == 4  # nothing goes while a rank may still read it
    # every rank reports the load done; the request then runs from the loaded prefix ...
    sched.update_from_output(out, runner_output([], recving={"r1"}))
    out2 = sched.schedule()
    assert out2.num_scheduled_tokens == {"r1": BS}
    assert [r.num_computed_tokens for r in out2.scheduled_new_reqs] == [3 * BS]
    # ... and the whole handed-off chain, the unloaded last block too, and its record go
    until(lambda: store.contains(chain) == [False] * 4)
    until(lambda: fake_redis.exists(store.keys.handoff("feed1234")) == 0)


def test_a_consumed_handoff_is_deleted_once_loaded_even_when_its_request_was_aborted(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS + 1)
    params, chain = hand_off(sched, tokens, 4, commit=4)
    req = make_request("r1", tokens, params)
    sched.add_request(req)
    out = sched.schedule()
    assert [s.req_id for s in meta_of(out).loads] == ["r1"]
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # aborted while loading
    store = store_for(sched)
    time.sleep(0.2)
    assert store.longest_prefix(chain) == 4  # its load may still be reading
    sched.update_from_output(out, runner_output([], recving={"r1"}))
    until(lambda: store.contains(chain) == [False] * 4)
    assert fake_redis.exists(store.keys.handoff("feed1234")) == 0


def test_consume_mode_without_a_handoff_never_asks_redis(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS + 1)
    seed_blocks(sched, tokens, 4)  # shared blocks are share mode's business, not ours
    fake_redis.server.connected = False  # type: ignore[attr-defined]  # and Redis is down
    sched.add_request(make_request("r1", tokens))
    out = sched.schedule()
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"r1": 4 * BS + 1}
    assert connector_of(sched).stats.take().get("lookups") is None


def test_consumer_waits_for_the_commit_record_without_blocking_then_loads(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(5 * BS + 3)
    params, chain = hand_off(sched, tokens, 2, announced=5, pending=True)  # 2 of 5 written
    waiting = make_request("late", tokens, params)
    other = make_request("other", prompt(20, seed=9))
    sched.add_request(waiting)
    sched.add_request(other)
    out = sched.schedule()
    # the scheduler is not blocked: the other request runs, the waiting one is asked again later
    assert out.num_scheduled_tokens == {"other": 20}
    assert meta_of(out).loads == []
    store = store_for(sched)
    store.insert_many([(h, zero_block()) for h in chain[2:5]])  # the producer's last saves land
    store.publish_handoff("feed1234", 5)  # and its commit record
    sched.update_from_output(out, runner_output([other]))
    time.sleep(0.05)  # waiting requests re-poll Redis at most every 10 ms
    out = sched.schedule()
    assert [s.names[0] for s in meta_of(out).loads] == [chain[:5]]


def test_a_commit_of_fewer_blocks_loads_those_at_once(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """The producer shed or failed saves: its commit record says so, the consumer never waits
    for blocks that are not coming (formerly: the whole load_timeout_s)."""
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(6 * BS + 3)
    params, chain = hand_off(sched, tokens, 2, announced=6, commit=2)
    sched.add_request(make_request("r", tokens, params))
    out = sched.schedule()
    assert [s.names[0] for s in meta_of(out).loads] == [chain[:2]]
    assert "requests_given_up" not in connector_of(sched).stats.take()  # not at its deadline


def test_blocks_missing_after_the_commit_are_recomputed_at_once(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(5 * BS + 3)
    params, chain = hand_off(sched, tokens, 5, commit=5)
    fake_redis.delete(store_for(sched).redis_key(chain[2]))  # evicted after it was written
    sched.add_request(make_request("r", tokens, params))
    out = sched.schedule()
    assert [s.names[0] for s in meta_of(out).loads] == [chain[:2]]


def test_a_missing_record_is_waited_for_briefly_then_what_is_there_loads(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """The record was evicted (allkeys-lru takes any key) or never written: waiting for it
    until the deadline, as every request under memory pressure did, helps nobody."""
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30, handoff_grace_s=0.2)
    tokens = prompt(5 * BS + 3)
    params, chain = hand_off(sched, tokens, 3, announced=5)  # no record: evicted
    # (from before add_request: vLLM >= 0.33 hands the request to the connector right there,
    # and its lookup -- the grace's clock -- starts then; a busy CI machine caught a t0 taken
    # after it)
    t0 = time.monotonic()
    sched.add_request(make_request("r", tokens, params))
    out = schedule_until_admitted(sched, "r")
    assert time.monotonic() - t0 >= 0.2  # its grace ...
    assert [s.names[0] for s in meta_of(out).loads] == [chain[:3]]
    assert "requests_given_up" not in connector_of(sched).stats.take()  # ... not its deadline


def test_a_record_the_producer_could_not_confirm_is_waited_for_not_taken_as_evicted(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """A one-step prefill answers before its background "pending" write lands: its params say
    so, and the consumer waits for the record (up to its deadline) instead of loading what is
    there after the grace period and leaving the producer's late blocks behind."""
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30, handoff_grace_s=0.05)
    tokens = prompt(5 * BS + 3)
    params, chain = hand_off(sched, tokens, 0, announced=5, opened=False)  # nothing there yet
    sched.add_request(make_request("r", tokens, params))
    for _ in range(20):  # well past the grace period: still waiting
        out = sched.schedule()
        assert meta_of(out).loads == [] and out.num_scheduled_tokens == {}
        sched.update_from_output(out, runner_output([]))
        time.sleep(0.01)
    store = store_for(sched)
    store.insert_many([(h, zero_block()) for h in chain[:5]])  # the producer's writes land ...
    store.publish_handoff("feed1234", 5)  # ... and its commit
    out = schedule_until_admitted(sched, "r")
    assert [s.names[0] for s in meta_of(out).loads] == [chain[:5]]


def test_the_deadline_ends_the_wait_for_a_producer_and_scales_with_the_prompt(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = {"deadline_s": 0.2, "deadline_per_1k_tokens_s": 10.0, "deadline_max_s": 0.5}
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", **cfg)
    rc = sched.connector.rc  # type: ignore[union-attr]
    assert rc.deadlines.for_prompt(0) == 0.2 and rc.deadlines.for_prompt(10) == pytest.approx(0.3)
    assert rc.deadlines.for_prompt(100_000) == 0.5
    tokens = prompt(5 * BS + 3)
    # the producer died writing: its record says "pending" for good
    params, _ = hand_off(sched, tokens, 2, announced=5, pending=True)
    t0 = time.monotonic()  # (before add_request: vLLM >= 0.33 starts the lookup there)
    sched.add_request(make_request("r", tokens, params))
    with caplog.at_level(logging.WARNING, logger="connector.scheduler"):
        out = schedule_until_admitted(sched, "r")
    assert time.monotonic() - t0 >= 0.2  # its deadline ...
    gave_up = [r.getMessage() for r in caplog.records if "not loading from Redis" in r.msg]
    assert gave_up and "(deadline passed)" in gave_up[0]  # ... not "pending" for good
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"r": 5 * BS + 3}
    assert connector_of(sched).stats.take()["requests_given_up"] == 1


@pytest.mark.parametrize("error", [StoreTimeoutError("socket timeout"), ValueError("bug")])
def test_a_failing_lookup_recomputes_instead_of_hanging(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, error: Exception
) -> None:
    """A real Redis timeout is a builtin TimeoutError, hence concurrent.futures.TimeoutError on
    Python >= 3.11: it was taken for "not answered yet" and the request waited forever."""
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(4 * BS + 1)
    params, _ = hand_off(sched, tokens, 4, commit=4)

    def failing(*a: object, **k: object) -> None:
        raise error

    connector_of(sched).store.survey = failing
    sched.add_request(make_request("r", tokens, params))
    out = schedule_until_admitted(sched, "r", steps=5)
    assert out.num_scheduled_tokens == {"r": 4 * BS + 1}


def test_an_open_breaker_answers_at_once_without_asking_redis(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    store = connector_of(sched).store
    for _ in range(3):
        store.breaker.record_failure("refused")
    tokens = prompt(8 * BS + 1)
    params, _ = hand_off(sched, tokens, 8, commit=8)
    sched.add_request(make_request("r", tokens, params))
    # the step comes back while Redis hangs: it never asks Redis (the breaker's probe waits
    # too, so the breaker is still open when the stats are taken)
    out, stats = while_redis_hangs(
        fake_redis, lambda: (sched.schedule(), connector_of(sched).take_stats())
    )
    assert out.num_scheduled_tokens == {"r": 8 * BS + 1}
    assert stats["breaker_open"] == 1 and stats["requests_given_up"] == 1
    assert "lookups" not in stats


def test_two_consumers_with_a_shared_prefix_never_take_each_others_blocks(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    system = prompt(4 * BS, seed=3)
    a, b = system + prompt(BS + 5, seed=4), system + prompt(2 * BS + 1, seed=5)
    dec_a = fake_redis_scheduler(tiny_model, "kv_consumer")
    dec_b = fake_redis_scheduler(tiny_model, "kv_consumer")
    params_a, chain_a = hand_off(dec_a, a, 5, commit=5, handoff="aaaa")
    params_b, chain_b = hand_off(dec_b, b, 6, commit=6, handoff="bbbb")
    assert not set(chain_a) & set(chain_b)  # the same system prompt, different keys
    dec_a.add_request(make_request("ra", a, params_a))
    dec_b.add_request(make_request("rb", b, params_b))
    loads_a, loads_b = meta_of(dec_a.schedule()).loads, meta_of(dec_b.schedule()).loads
    assert [s.names[0] for s in loads_a] == [chain_a[:5]]
    assert [s.names[0] for s in loads_b] == [chain_b[:6]]


def test_a_handoff_is_taken_once(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    """The same params twice (a retried request): once the first request's worker has claimed
    the handoff, the second recomputes at once instead of waiting for blocks the first takes."""
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(4 * BS + 1)
    params, _ = hand_off(sched, tokens, 4, commit=4)
    sched.add_request(make_request("first", tokens, params))
    (load,) = meta_of(sched.schedule()).loads
    assert load.claim == "feed1234"  # the worker claims it before reading
    assert store_for(sched).claim_handoff("feed1234", owner=load.owner) == Claim.WON
    other = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    other.add_request(make_request("again", tokens, params))
    out = other.schedule()
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"again": 4 * BS + 1}
    assert connector_of(other).stats.take()["requests_given_up"] == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("namespace", "other"),
        ("block_size", 32),
        ("last_hash", "0" * 32),
        ("num_blocks", 99),
        ("store_tp_size", 2),  # the producer cut blocks into other head slices
        ("tp_scope", 4),  # the producer computed them at another TP size
        ("tp_shared", True),  # the producer opted into sharing across TP sizes, this one not
    ],
)
def test_params_that_do_not_match_are_ignored_with_one_warning(
    tiny_model: Path,
    fake_redis: fakeredis.FakeRedis,
    caplog: pytest.LogCaptureFixture,
    field: str,
    value: object,
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(4 * BS + 1)
    params, _ = hand_off(sched, tokens, 4, commit=4)
    params["redis_kv"][field] = value
    with caplog.at_level(logging.WARNING, logger="connector.scheduler"):
        for i in range(3):
            sched.add_request(make_request(f"r{i}", tokens, params))
        out = sched.schedule()
    assert meta_of(out).loads == [] and len(out.num_scheduled_tokens) == 3
    assert len([r for r in caplog.records if "ignoring" in r.getMessage()]) == 2  # 1st, 2nd
    assert connector_of(sched).stats.take()["transfer_params_ignored"] == 3


def loading_handoff(tiny_model: Path) -> tuple[Any, Any, list[int]]:
    """A consumer loading a 4-block handoff for request "r": the scheduler, the step that
    planned the load, and the block ids it loads into."""
    sched = fake_redis_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS + 1)
    params, _ = hand_off(sched, tokens, 4, commit=4)
    sched.add_request(make_request("r", tokens, params))
    out = sched.schedule()
    (block_ids,) = meta_of(out).loads[0].block_ids
    return sched, out, block_ids


def test_failed_blocks_are_recomputed(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    sched, out, block_ids = loading_handoff(tiny_model)
    # the worker found block 2 corrupt: it reports it with the finished load
    outputs = sched.update_from_output(
        out, runner_output([], recving={"r"}, invalid={block_ids[2]})
    )
    out2 = sched.schedule()
    assert [r.num_computed_tokens for r in out2.scheduled_new_reqs] == [2 * BS]
    assert out2.num_scheduled_tokens == {"r": 2 * BS + 1}
    # counted once, as vLLM heard it from every rank: blocks 0 and 1 loaded; block 3 arrived,
    # but vLLM recomputes from block 2 on
    stats = reported(outputs)
    assert (stats["loads"], stats["blocks_loaded"], stats["blocks_load_failed"]) == (1, 2, 2)
    assert (stats["tokens_loaded"], stats["tokens_load_failed"]) == (2 * BS, 2 * BS)


def reported(outputs: Any) -> dict[str, Any]:
    """The connector counters vLLM reported with a step's outputs."""
    out: dict[str, Any] = {}
    for eco in outputs.values():
        if eco.scheduler_stats is not None:
            out.update(eco.scheduler_stats.kv_connector_stats or {})
    return out


def test_a_load_failed_on_one_rank_reported_before_it_finished_is_counted_once(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """With TP, vLLM unions the ranks' failed blocks each step and reports a load finished once
    every rank has: a failure may come a step before the finish, and the counters (which each
    rank used to add, TP times) come from the scheduler side, once."""
    sched, out, block_ids = loading_handoff(tiny_model)
    first = sched.update_from_output(out, runner_output([], invalid={block_ids[3]}))  # rank 1
    assert "loads" not in reported(first)  # rank 0 is still loading
    out = sched.schedule()
    stats = reported(sched.update_from_output(out, runner_output([], recving={"r"})))
    assert (stats["loads"], stats["blocks_loaded"], stats["blocks_load_failed"]) == (1, 3, 1)


def test_share_mode_saves_a_block_again_when_its_load_failed(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_both")
    tokens = prompt(4 * BS + 1)
    hashes = seed_blocks(sched, tokens, 4)
    req = make_request("s", tokens)
    sched.add_request(req)
    out = sched.schedule()
    (block_ids,) = meta_of(out).loads[0].block_ids
    sched.update_from_output(out, runner_output([], recving={"s"}, invalid={block_ids[1]}))
    out = sched.schedule()  # recomputes blocks 1..; they replace the bad values in the pool
    assert [h for s in meta_of(out).saves for h in s.names[0]] == hashes[1:4]


def test_a_preempted_request_does_not_wait_for_its_handoff_again(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    tokens = prompt(4 * BS + 1)
    params, _ = hand_off(sched, tokens, 4, commit=4)
    req = make_request("r", tokens, params)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, runner_output([], recving={"r"}))
    out = sched.schedule()
    sched.update_from_output(out, runner_output([req]))
    sched.running.remove(req)  # memory pressure: it starts over
    sched._preempt_request(req, time.monotonic())
    fake_redis.flushall()  # the consumed handoff is gone from Redis
    out = while_redis_hangs(fake_redis, sched.schedule)  # it does not ask Redis again ...
    assert meta_of(out).loads == [] and out.num_scheduled_tokens["r"] > 0
    assert "requests_given_up" not in connector_of(sched).stats.take()  # ... nor wait for it


def test_the_policy_hears_how_many_requests_wait_behind_each_admission(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM admits first come first served, so each admission has the rest of the waiting
    queue behind it (what a split saves the engine, every one of them gains): counted from
    vLLM's own calls, a request aborted while it waited no longer among them."""
    behind: list[int] = []
    pinned = load_choices.pinned

    def heard(*args: Any) -> Any:
        behind.append(args[-1].waiting)  # (the Busy the policy decides from)
        return pinned(*args)

    monkeypatch.setattr(load_choices, "pinned", heard)
    sched = fake_redis_scheduler(tiny_model, "kv_both")

    def arrive(rid: str, seed: int) -> None:
        tokens = prompt(4 * BS + 1, seed=seed)
        seed_blocks(sched, tokens, 4)
        sched.add_request(make_request(rid, tokens))

    for seed, rid in enumerate("abcd", start=1):
        arrive(rid, seed)
    sched.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    sched.schedule()  # a, b and c, in one step
    assert behind == [2, 1, 0]
    arrive("e", 9)  # the others admitted or gone: it waits alone
    sched.schedule()
    assert behind[-1] == 0
    assert connector_of(sched).stats.take().get("splits_for_the_queue", 0) == 0  # (pinned)


def test_a_request_vllm_leaves_at_the_head_of_its_queue_is_not_behind_those_it_lets_pass(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer's request whose producer has not committed yet stays at the head of vLLM's
    queue while those after it are admitted: it is ahead of them, not behind."""
    behind: list[tuple[str, int]] = []
    pinned = load_choices.pinned

    def heard(*args: Any) -> Any:
        behind.append((args[1].prompt_tokens, args[-1].waiting))
        return pinned(*args)

    monkeypatch.setattr(load_choices, "pinned", heard)
    sched = fake_redis_scheduler(tiny_model, "kv_consumer", deadline_s=30)
    first, second, third = (prompt(n * BS + 1, seed=n) for n in (4, 5, 6))
    params, _ = hand_off(sched, first, 4, pending=True, handoff="aaaa1111")
    sched.add_request(make_request("a", first, params))
    for rid, tokens, handoff in (("b", second, "bbbb2222"), ("c", third, "cccc3333")):
        params, _ = hand_off(sched, tokens, 4, commit=4, handoff=handoff)
        sched.add_request(make_request(rid, tokens, params))
    sched.schedule()
    assert sched.requests["a"].status is RequestStatus.WAITING  # (left at the head)
    assert sorted(behind) == [(len(second), 1), (len(third), 0)]


def test_the_pass_a_split_waits_for_is_promised_once_and_kept_for_it(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a split that waits a pass was promised nothing. A second hit of the
    same step waited for the same pass (one of the two waited for nothing), and in the next
    step a request vLLM asked first (one it had skipped before, back at the head of its queue)
    took the split. Driven with a stand-in policy that splits, or waits a pass to, wherever
    what the connector tells it of the engine allows."""

    def eager(hit: Hit, figures: Any, *, busy: Busy, may_wait_a_pass: bool = False, **kw: Any):
        if not busy.split_bytes and not busy.split_reserved:
            return Decision(Way.SPLIT, 1, Reason.MEASURED)
        if may_wait_a_pass and busy.split_bytes and not busy.next_split_taken:
            return Decision(Way.SPLIT, 1, Reason.AFTER_THIS_PASS)
        return Decision(Way.RECOMPUTE, 0, Reason.MEASURED)

    monkeypatch.setattr(load_choices, "choose", eager)
    sched = fake_redis_scheduler(tiny_model, "kv_both", load_policy="auto")
    conn = connector_of(sched)
    reqs = {}
    for n, rid in enumerate("abcd", start=4):
        tokens = prompt(n * BS + 1, seed=n)
        seed_blocks(sched, tokens, n)
        reqs[rid] = make_request(rid, tokens)
        sched.add_request(reqs[rid])

    def ask(rid: str) -> int | None:
        return conn.get_num_new_matched_tokens(reqs[rid], 0)[0]

    assert ask("a") == BS  # split
    assert ask("b") is None  # waits for the next pass
    assert ask("c") == 0  # the next pass is b's: c recomputes
    conn.load_choices.next_pass([])  # the step is scheduled
    conn.load_choices.next_pass([])  # and one in which vLLM asked no one waiting (a preemption)
    assert ask("d") == 0  # asked before b (vLLM skipped it earlier): the split is kept for b
    assert ask("b") == BS
    assert conn.stats.take().get("splits_after_a_pass") == 1


def test_redis_down_degrades_to_recompute(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_both")
    tokens = prompt(4 * BS + 1)
    seed_blocks(sched, tokens, 4)
    fake_redis.server.connected = False  # type: ignore[attr-defined]
    sched.add_request(make_request("r", tokens))
    out = sched.schedule()
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"r": 4 * BS + 1}
    # marking the handoff runs in the background and counts its failure in a done callback,
    # which runs on the executor's one thread after waiters on the call have woken: a no-op
    # queued behind it finishes only after that callback (CI once read the count before it)
    connector_of(sched)._background_io.submit(lambda: None).result(30)
    # the lookup, and marking the handoff of the blocks it then saves (kv_both)
    assert connector_of(sched).take_stats()["redis_errors"] == 2


def test_producer_saves_its_private_chain_and_publishes_a_commit_when_done(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_producer", max_batched=2 * BS + 8)
    tokens = prompt(5 * BS + 3)
    req = make_request("p", tokens)
    sched.add_request(req)
    saved: list[str] = []
    positions: list[int] = []
    handoffs: set[str] = set()
    for _ in range(5):
        out = sched.schedule()
        meta = meta_of(out)
        assert meta.loads == []  # a producer never loads
        for s in meta.saves:
            assert [len(ids) for ids in s.block_ids] == [len(s.names[0])]
            saved += s.names[0]
            positions.append(s.first_position)
            handoffs.add(s.handoff)
        sched.update_from_output(out, runner_output([req]))
        if req.num_computed_tokens >= len(tokens):
            break
    (handoff,) = handoffs
    chain = chain_hashes(tokens, BS, handoff_salt("", handoff))
    assert saved == chain and positions == [0, 2]  # every block once, in order, by chunk
    st = connector_of(sched)._reqs["p"]
    assert st.opening is not None
    st.opening.result(10)  # the "pending" record is in Redis: the params say so
    delay_free, params = sched.connector.request_finished(req, [])  # type: ignore[union-attr]
    assert delay_free  # blocks stay until the worker's commit record is written
    assert params == {
        "redis_kv": {
            "handoff": handoff,
            "scope": "handoff",
            "num_blocks": 5,
            "last_hash": chain[4],
            "namespace": "vllm",
            "block_size": BS,
            "store_tp_size": 1,
            "tp_scope": None,
            "tp_shared": False,
            "generation": 0,
            "opened": True,
        }
    }
    commits = meta_of(sched.schedule()).commits
    assert [(c.req_id, c.handoff, c.num_blocks, c.present_blocks) for c in commits] == [
        ("p", handoff, 5, 0)
    ]


def test_salt_separates_tenants(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_both")
    tokens = prompt(4 * BS + 1)
    seed_blocks(sched, tokens, 4)  # stored without a salt
    req = make_request("salted", tokens, cache_salt="tenant-b")
    sched.add_request(req)
    out = sched.schedule()
    assert meta_of(out).loads == []


def test_share_mode_loads_the_pool_and_saves_only_what_it_lacks(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_both")
    tokens = prompt(5 * BS + 3)
    hashes = seed_blocks(sched, tokens, 3)  # another instance cached the first 3 blocks
    req = make_request("s", tokens)
    sched.add_request(req)
    out = sched.schedule()
    load = meta_of(out).loads
    assert [(s.names[0], s.claim) for s in load] == [(hashes[:3], None)]
    sched.update_from_output(out, runner_output([], recving={"s"}))
    out = sched.schedule()
    saves = [h for s in meta_of(out).saves for h in s.names[0]]
    assert saves == hashes[3:5]
    assert store_for(sched).longest_prefix(hashes) == 3  # select kept the pool's blocks


def test_consume_mode_deletes_a_handoff_it_gives_up_on(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    # deadline_max_s also bounds how long a dropped handoff waits for a producer that died
    sched = fake_redis_scheduler(
        tiny_model, "kv_consumer", deadline_s=0.2, deadline_per_1k_tokens_s=0, deadline_max_s=1
    )
    tokens = prompt(4 * BS + 1)
    params, chain = hand_off(sched, tokens, 4, pending=True)  # the producer died writing
    sched.add_request(make_request("r", tokens, params, cache_salt="x"))
    schedule_until_admitted(sched, "r")
    time.sleep(0.1)
    assert store_for(sched).longest_prefix(chain) == 4  # params ignored: not ours to delete
    sched.add_request(make_request("r2", tokens, params))
    schedule_until_admitted(sched, "r2")  # the deadline passes: it recomputes ...
    deadline = time.monotonic() + 5
    while store_for(sched).longest_prefix(chain) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store_for(sched).longest_prefix(chain) == 0  # ... and leaves nothing behind:
    assert fake_redis.exists(store_for(sched).keys.handoff("feed1234")) == 0  # nor its record


def test_a_dropped_handoff_is_deleted_after_its_producer_finishes_writing(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    """The consumer gives up on a handoff whose producer is still writing (the prefill's
    response comes before its writes are acknowledged); blocks written after that used to
    stay for their whole TTL."""
    sched = fake_redis_scheduler(
        tiny_model, "kv_consumer", deadline_s=0.2, deadline_per_1k_tokens_s=0
    )
    tokens = prompt(6 * BS + 1)
    params, chain = hand_off(sched, tokens, 2, announced=6, pending=True)
    sched.add_request(make_request("r", tokens, params))
    schedule_until_admitted(sched, "r")  # the deadline passes: it recomputes, drops the handoff
    time.sleep(0.3)
    store = store_for(sched)
    store.insert_many([(h, zero_block()) for h in chain[2:6]])  # the producer's late writes ...
    store.publish_handoff("feed1234", 6)  # ... and it commits
    deadline = time.monotonic() + 5
    while store.contains(chain).count(True) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.contains(chain) == [False] * 6  # nothing left behind
    assert fake_redis.exists(store.keys.handoff("feed1234")) == 0


def test_unreachable_redis_at_startup_is_logged_and_requests_are_served(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from testing.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.ERROR, logger="connector"):
        sched = fake_redis_scheduler(tiny_model, "kv_both", url=url, connect_timeout_s=0.5)
    assert any("cannot use" in r.getMessage() and url in r.getMessage() for r in caplog.records)
    req = make_request("r", prompt(3 * BS + 1))
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 3 * BS + 1}  # computed, not loaded


def test_a_preempted_request_gets_a_fresh_budget_scaled_with_its_prompt(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    cfg = {"deadline_s": 0.0, "deadline_per_1k_tokens_s": 10.0, "deadline_max_s": 60.0}
    sched = fake_redis_scheduler(tiny_model, "kv_both", **cfg)
    tokens = prompt(8 * BS + 1)
    seed_blocks(sched, tokens, 8)
    req = make_request("r", tokens)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, runner_output([], recving={"r"}))
    out = sched.schedule()
    sched.update_from_output(out, runner_output([req]))
    sched.running.remove(req)
    sched._preempt_request(req, time.monotonic())
    sched.schedule()
    left = connector_of(sched)._reqs["r"].deadline - time.monotonic()
    assert left > 0.9 * 10.0 * len(tokens) / 1000  # tokens, not blocks (that gave 0.08 s)


@pytest.mark.parametrize("source", ["handoff", "pool"])
def test_redis_hits_are_reported_per_source_where_vllm_counts_them(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, source: str
) -> None:
    hit_source = pytest.importorskip("vllm.v1.metrics.cache_hit_source")  # vLLM 0.32+
    tokens = prompt(4 * BS)
    if source == "handoff":
        sched = fake_redis_scheduler(tiny_model, "kv_consumer")
        params, _ = hand_off(sched, tokens, 4, commit=4)
        want = hit_source.CacheHitSource.P2P  # from a prefill instance
    else:
        sched = fake_redis_scheduler(tiny_model, "kv_both")
        seed_blocks(sched, tokens, 4)
        params, want = None, hit_source.CacheHitSource.EXTERNAL_UNSPECIFIED  # a remote store
    sched.add_request(make_request("r", tokens, params))
    out = sched.schedule()
    assert len(meta_of(out).loads) == 1
    stats = sched.make_stats()
    assert stats is not None and stats.connector_prefix_cache_stats is not None
    assert stats.connector_prefix_cache_stats.hits_by_source == {want: 3 * BS}


@pytest.mark.parametrize(
    ("device", "env", "said"),
    [
        ("cpu", {}, True),
        ("cpu", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, True),
        ("cpu", {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, False),
        ("cpu", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, False),
        ("cuda", {}, False),
    ],
)
def test_cpu_servers_say_why_their_bf16_outputs_may_differ(
    device: str, env: dict[str, str], said: bool
) -> None:
    """Issue 21: vLLM's CPU backend gives a server with any KV connector another thread count;
    the connector says so (and how to pin) where that applies, and nowhere else."""
    from connector.redis_connector import cpu_threads_note

    note = cpu_threads_note(device, env)
    assert (note is not None) == said
    if note:
        assert "VLLM_CPU_OMP_THREADS_BIND" in note


def test_an_engine_that_cannot_attend_to_a_loaded_prefix_saves_but_never_loads() -> None:
    """vLLM's CPU MLA backend computes prompts without the KV already cached (a loaded prefix
    gave wrong tokens, tests/e2e/test_e2e_mla.py): such an engine never loads; elsewhere it does."""
    from connector.config import RedisConnectorConfig
    from connector.redis_connector import load_refusal

    assert load_refusal("cpu", use_mla=False) is None
    assert load_refusal("cuda", use_mla=True) is None
    why = load_refusal("cpu", use_mla=True)
    assert why is not None and "MLA" in why
    config = RedisConnectorConfig.from_extra({"url": "redis://r:6379/0"}, "kv_both")
    assert config.loads and config.saves
    refused = dataclasses.replace(config, cannot_load=why)
    assert not refused.loads and refused.saves
    assert refused.operations("worker") == ["ping", "insert"]
    with pytest.raises(InvalidArgumentError, match="unknown"):  # not a user setting
        RedisConnectorConfig.from_extra({"url": "redis://r:6379/0", "cannot_load": "x"}, "kv_both")


def test_shutdown_ends_in_bounded_time_with_a_background_call_hung(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A background call that hangs in no socket (a bug) held the scheduler side's shutdown
    for ever (a review's); it now waits as long as a socket call could take, then says so."""
    sched = fake_redis_scheduler(tiny_model, "kv_both", socket_timeout_s=0.2)
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    release = threading.Event()
    started = threading.Event()

    def hung() -> None:
        started.set()
        release.wait(60)

    conn._background_io.submit(hung)  # (where handoff marks and deletions run)
    assert started.wait(10)
    ended = threading.Event()
    connector: Any = sched.connector
    closer = threading.Thread(target=lambda: (connector.shutdown(), ended.set()))
    closer.start()
    try:
        assert ended.wait(30), "shutdown waits for the hung call"
        assert "still running" in caplog.text
    finally:
        release.set()
        closer.join(10)
