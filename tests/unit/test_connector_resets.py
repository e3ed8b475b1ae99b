"""vLLM's ``reset_prefix_cache(reset_connector=True)`` through the connector, with vLLM's real
Scheduler on fakeredis: after a reset no instance sharing the namespace loads a block saved
before it, and saves go under the new generation's names."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import fakeredis
import pytest

pytest.importorskip("vllm")

from kvstore.values.keys import block_name
from testing.scheduler_harness import (
    BS,
    connector_of,
    fake_redis_scheduler,
    hand_off,
    make_request,
    meta_of,
    prompt,
    seed_blocks,
    store_for,
)
from testing.threads import until

pytestmark = pytest.mark.vllm


def test_after_a_reset_no_instance_loads_an_older_block(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    # older blocks are unlinked deadline_max_s after the reset: loads under way finish first
    resetter = fake_redis_scheduler(tiny_model, "kv_both", deadline_max_s=2.0)
    other = fake_redis_scheduler(tiny_model, "kv_both")  # another instance of the namespace
    tokens = prompt(4 * BS + 3)
    hashes = seed_blocks(resetter, tokens, 4)
    store = store_for(resetter)
    assert resetter.reset_prefix_cache(reset_connector=True)
    assert store.contains(hashes[:4]) == [True] * 4  # a load looked up before may be reading
    assert connector_of(resetter).store.generation == 1
    for i, sched in enumerate((resetter, other)):
        req = make_request(f"r{i}", tokens)
        sched.add_request(req)
        out = sched.schedule()
        if meta_of(out).loads == [] and out.num_scheduled_tokens == {}:
            out = sched.schedule()  # ``other`` learned the reset from this lookup: asks again
        assert meta_of(out).loads == []
        assert out.num_scheduled_tokens == {f"r{i}": len(tokens)}  # computed, not loaded
        renamed = [block_name(h, 1) for h in hashes[:4]]
        assert [h for s in meta_of(out).saves for h in s.names[0]] == renamed
    # the older blocks are unlinked in the background; nothing else was
    until(lambda: store.contains(hashes[:4]) == [False] * 4)


def test_a_handoff_from_before_a_reset_is_computed_not_loaded(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS)
    params, _ = hand_off(sched, tokens, 4, commit=4)  # a producer in generation 0
    store_for(sched).reset()  # e.g. `kvstore reset`, or another instance's reset
    with caplog.at_level(logging.WARNING, logger="connector.scheduler"):
        sched.add_request(make_request("c", tokens, params))
        out = sched.schedule()
        if out.num_scheduled_tokens == {}:
            out = sched.schedule()  # its lookup brought the reset: named again, asked again
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"c": len(tokens)}
    assert "the namespace was reset" in caplog.text


def test_a_reset_redis_refuses_is_reported_failed(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    sched = fake_redis_scheduler(tiny_model, "kv_both")
    fake_redis.server.connected = False  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR, logger="connector.scheduler"):
        assert not sched.reset_prefix_cache(reset_connector=True)
    assert "resetting namespace 'vllm' failed" in caplog.text
    assert connector_of(sched).store.generation == 0


def test_shutdown_closes_the_connections_only_after_background_calls_end(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CI caught fakeredis raising "generator already executing" in shutdown: the connections
    # were closed while a background call still used them
    sched = fake_redis_scheduler(tiny_model, "kv_both", deadline_max_s=0.1)
    store = connector_of(sched).store
    running: list[int] = []
    started = threading.Event()
    closed_while_running: list[int] = []
    sweep, close = store.sweep, store.close

    def slow_sweep(below: int, stop: Callable[[], bool]) -> int:
        running.append(1)
        started.set()
        time.sleep(0.3)  # a batch still on the wire when shutdown comes
        try:
            return sweep(below, stop)
        finally:
            running.pop()

    def recorded_close() -> None:
        closed_while_running.append(len(running))
        close()

    monkeypatch.setattr(store, "sweep", slow_sweep)
    monkeypatch.setattr(store, "close", recorded_close)
    assert sched.reset_prefix_cache(reset_connector=True)
    assert started.wait(30)
    sched.connector.shutdown()  # type: ignore[union-attr]
    assert closed_while_running == [0]
