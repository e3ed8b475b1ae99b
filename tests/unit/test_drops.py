"""Dropped handoffs (connector/drops.py) on fakeredis: deleted once their producer is done
writing, never under another request's claim, and at the latest after ``max_wait_s``."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from connector.drops import HandoffDrops
from kvstore import Claim, LookupBuffer, chain_hashes

pytestmark = pytest.mark.vllm

HASHES = chain_hashes(list(range(48)), 16)


def setup(max_wait_s: float = 30.0) -> tuple[LookupBuffer, HandoffDrops, list[BaseException]]:
    store = LookupBuffer(fakeredis.FakeRedis(), namespace="d", fingerprint="f0", ttl_s=60)
    errors: list[BaseException] = []
    return store, HandoffDrops(store, ["f0"], max_wait_s, errors.append), errors


def write(store: LookupBuffer, n: int) -> None:
    store.insert_many([(h, {"x": torch.zeros(4)}) for h in HASHES[:n]])


def until(pred: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def test_a_record_that_is_not_there_yet_is_waited_for_then_everything_goes() -> None:
    store, drops, errors = setup()
    drops.drop("h1", "me", HASHES, expect_record=True)
    time.sleep(0.3)  # several ticks: nothing there, nothing deleted, still waiting
    assert drops.waiting == 1
    write(store, 3)  # the lagging producer writes ...
    store.publish_handoff("h1", 3)  # ... and commits
    until(lambda: drops.waiting == 0)
    assert store.contains(HASHES) == [False] * 3
    assert store.read_handoff("h1", HASHES[:1]).committed is None  # the record went too
    assert errors == []
    drops.shutdown()


def test_a_missing_record_the_producer_had_confirmed_is_evicted_not_late() -> None:
    store, drops, _ = setup()
    write(store, 2)  # blocks, but the record was evicted
    drops.drop("h2", "me", HASHES, expect_record=False)
    until(lambda: drops.waiting == 0)
    assert store.contains(HASHES) == [False] * 3
    drops.shutdown()


def test_another_requests_claim_keeps_its_chain() -> None:
    store, drops, _ = setup()
    write(store, 3)
    store.publish_handoff("h3", 3)
    assert store.claim_handoff("h3", owner="loader") == Claim.WON
    drops.drop("h3", "me", HASHES, expect_record=False)
    until(lambda: drops.waiting == 0)
    assert store.contains(HASHES) == [True] * 3  # the loader deletes it when it is done
    drops.shutdown()


def test_a_producer_that_never_finishes_is_given_up_on() -> None:
    store, drops, _ = setup(max_wait_s=0.3)
    write(store, 2)
    store.open_handoff("h4")  # "pending" for good: the producer died writing
    drops.drop("h4", "me", HASHES, expect_record=True)
    until(lambda: drops.waiting == 0)
    assert store.contains(HASHES) == [False] * 3
    drops.shutdown()


def test_redis_errors_are_reported_and_the_drop_tried_again() -> None:
    server = fakeredis.FakeServer()
    store = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="d", fingerprint="f0")
    errors: list[BaseException] = []
    drops = HandoffDrops(store, ["f0"], 30.0, errors.append)
    write(store, 2)
    store.publish_handoff("h5", 2)
    server.connected = False
    drops.drop("h5", "me", HASHES, expect_record=False)
    until(lambda: len(errors) >= 2)
    assert drops.waiting == 1  # still there, for when Redis answers again
    server.connected = True
    store.breaker.wait_closed(10)
    until(lambda: drops.waiting == 0)
    assert store.contains(HASHES) == [False] * 3
    drops.shutdown()


def test_a_delete_that_fails_once_is_tried_again_not_left_to_the_ttl() -> None:
    """The producer is done, the check passes, and only the delete times out (a busy server):
    the next tick deletes the chain, instead of leaving it in Redis for its whole TTL."""
    store, drops, errors = setup()
    write(store, 3)
    store.publish_handoff("h6", 3)
    real_delete, failed = store.delete, []

    def delete_failing_once(*a: Any, **k: Any) -> Any:
        if not failed:
            failed.append(True)
            raise TimeoutError("Timeout reading from socket")
        return real_delete(*a, **k)

    store.delete = delete_failing_once  # type: ignore[method-assign]
    drops.drop("h6", "me", HASHES, expect_record=False)
    until(lambda: drops.waiting == 0)
    assert failed and [type(e) for e in errors] == [TimeoutError]  # reported, not hidden
    assert store.contains(HASHES) == [False] * 3
    assert store.read_handoff("h6", HASHES[:1]).committed is None
    drops.shutdown()


def test_a_delete_that_keeps_failing_is_given_up_after_a_few_tries() -> None:
    store, drops, errors = setup()
    write(store, 2)
    store.publish_handoff("h7", 2)

    def delete_failing(*a: Any, **k: Any) -> Any:
        raise TimeoutError("Timeout reading from socket")

    store.delete = delete_failing  # type: ignore[method-assign]
    drops.drop("h7", "me", HASHES, expect_record=False)
    until(lambda: drops.waiting == 0)
    assert 1 < len(errors) < 10  # each try reported; a bounded number of them
    drops.shutdown()
