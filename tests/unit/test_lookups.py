"""Batched lookups (connector/lookups.py) on fakeredis: lookups queued while one is out go in
one round trip, each gets its own answer, and an error reaches every request of the batch."""

from __future__ import annotations

import threading
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from connector.layout import KVLayout
from connector.lookups import LookupBatcher
from connector.stats import StatsBuffer
from kvstore import LookupBuffer, StoreUnavailableError, chain_hashes

pytestmark = pytest.mark.vllm


DENSE = KVLayout("m", 16, 2, 64, "float32", ("layer0",), 1)  # one group: keys are the hashes


def store_with(chains: list[list[str]], present: list[int]) -> LookupBuffer:
    store = LookupBuffer(fakeredis.FakeRedis(), namespace="l", fingerprint="f0", ttl_s=60)
    block = {"x": torch.zeros(4)}
    for chain, n in zip(chains, present, strict=True):
        store.insert_many([(h, block) for h in chain[:n]])
    return store


class Held:
    """Counts calls of a store method; the first one waits until released."""

    def __init__(self, store: LookupBuffer, name: str) -> None:
        self.calls: list[int] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        real = getattr(store, name)

        def call(items: Any, *a: Any, **k: Any) -> Any:
            self.calls.append(len(items))
            if len(self.calls) == 1:
                self.entered.set()
                self.release.wait(10)
            return real(items, *a, **k)

        setattr(store, name, call)


def test_lookups_queued_while_one_is_out_share_one_round_trip() -> None:
    chains = [chain_hashes(list(range(i, i + 64)), 16) for i in range(40)]
    present = [i % 5 for i in range(40)]
    store = store_with(chains, present)
    held = Held(store, "survey")
    batcher = LookupBatcher(store, ["f0"], threads=1, stats=StatsBuffer(), layout=DENSE)
    first = batcher.submit(chains[0], 0).future
    assert held.entered.wait(10)
    rest = [batcher.submit(c[1:], 1).future for c in chains[1:]]  # asked from block 1 on
    held.release.set()
    assert first.result(10).present == 0
    assert [f.result(10).present for f in rest] == [max(1, n) if n else 1 for n in present[1:]]
    assert held.calls == [1, 39]  # two round trips for 40 lookups
    batcher.shutdown()


def test_handoff_lookups_read_records_and_blocks_together() -> None:
    chains = [chain_hashes(list(range(i, i + 48)), 16) for i in range(3)]
    store = store_with(chains, [3, 2, 0])
    store.publish_handoff("h0", 3)
    store.open_handoff("h1")
    batcher = LookupBatcher(store, ["f0"], threads=2, stats=StatsBuffer(), layout=DENSE)
    got = [batcher.submit(c, 0, f"h{i}").future.result(10) for i, c in enumerate(chains)]
    assert [(r.present, r.committed, r.pending) for r in got] == [
        (3, 3, False),
        (2, None, True),
        (0, None, False),
    ]
    batcher.shutdown()


def one_held_out(n: int, present: int) -> tuple[LookupBuffer, LookupBatcher, Held, list, Any]:
    """A one-thread batcher whose first lookup is held in Redis; the other chains not sent."""
    chains = [chain_hashes(list(range(i, i + 32)), 16) for i in range(n)]
    store = store_with(chains, [present] * n)
    held = Held(store, "survey")
    batcher = LookupBatcher(store, ["f0"], threads=1, stats=StatsBuffer(), layout=DENSE)
    first = batcher.submit(chains[0], 0).future
    assert held.entered.wait(10)
    return store, batcher, held, chains, first


def test_an_error_reaches_every_lookup_of_the_batch() -> None:
    store, batcher, held, chains, first = one_held_out(5, present=2)
    store.client.connection_pool.get_connection = lambda *a, **k: (_ for _ in ()).throw(  # type: ignore[method-assign]
        ConnectionError("refused")
    )
    rest = [batcher.submit(c, 0).future for c in chains[1:]]
    held.release.set()
    for fut in [first, *rest]:
        with pytest.raises(StoreUnavailableError):
            fut.result(10)
    batcher.shutdown()


def test_shutdown_cancels_what_is_queued() -> None:
    _, batcher, held, chains, first = one_held_out(4, present=1)
    queued = [batcher.submit(c, 0).future for c in chains[1:]]
    batcher.shutdown()
    held.release.set()
    assert first.result(10).present == 1  # the one out still answers
    assert all(f.cancelled() for f in queued)
    assert batcher.submit(chains[0], 0).future.cancelled()  # and nothing new is taken


def test_only_time_redis_has_a_lookup_counts_it_as_hung(
    tiny_model: Any, fake_redis: fakeredis.FakeRedis
) -> None:
    """A lookup queued behind a slow one is not a failure of Redis, and a slow lookup polled in
    several steps is one failure, not one per step: otherwise a slow but healthy Redis opened
    the breaker and requests recomputed."""
    import time

    from testing.scheduler_harness import make_request, make_scheduler

    sched = make_scheduler(
        tiny_model,
        "kv_both",
        url="redis://fake:6379/0",
        lookup_wait_s=0.001,
        lookup_threads=1,
        control_timeout_s=0.01,  # a lookup out for 0.26 s counts as hung
        breaker_failures=2,
        deadline_s=30,
    )
    conn = sched.connector.scheduler  # type: ignore[union-attr]
    held = Held(conn.store, "survey")
    reqs = [make_request(f"r{i}", list(range(i, i + 49))) for i in range(3)]
    for r in reqs:  # the first round trip hangs in Redis; what is not in it waits in the queue
        sched.add_request(r)
    assert held.entered.wait(10)
    for _ in range(4):  # several steps, each past the hung limit
        time.sleep(0.3)
        for r in reqs:
            assert conn.get_num_new_matched_tokens(r, 0) == (None, False)
    # one failure (the round trip Redis holds), under the threshold of two, whichever lookups
    # went in it and however many steps polled them
    assert conn.store.breaker.opens == 0
    held.release.set()
    sched.connector.shutdown()  # type: ignore[union-attr]
