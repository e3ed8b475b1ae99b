"""vLLM sleep mode (0.33+): the GPU worker calls ``unregister_kv_caches`` before the KV cache's
memory is released (sleep, discard) and ``restore_kv_caches`` after wake-up. Driven here through
the real ``RedisConnector`` class in the worker role, the way vLLM's worker calls it; the KV
cache is CPU tensors, the store a real redis-server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")


from connector.metadata import LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.redis_connector import RedisConnector
from kvstore import LookupBuffer, chain_hashes
from testing.scheduler_harness import BS, LAYERS, make_worker_connector, run_worker_step

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

NUM_BLOCKS = 8


def finished_loads(conn: RedisConnector, timeout_s: float = 10) -> set[str]:
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    while time.monotonic() < deadline:
        done |= conn.get_finished(set())[1] or set()
        if done:
            return done
        time.sleep(0.01)
    return done


def test_sleep_cancels_loads_in_flight_and_nothing_touches_the_cache_until_wake_up(
    tiny_model: Path, redis_url: str
) -> None:
    conn, caches = make_worker_connector(tiny_model, redis_url, NUM_BLOCKS)
    worker = conn.worker
    hashes = chain_hashes(list(range(2 * BS)), BS)
    blocks = [{name: torch.full((2, BS, 128), float(i + 1)) for name in LAYERS} for i in range(2)]
    LookupBuffer.from_url(
        redis_url, namespace="vllm", fingerprint=worker.store.fingerprint
    ).insert_many(list(zip(hashes, blocks, strict=True)))

    release, reading, answered = threading.Event(), threading.Event(), threading.Event()
    real_select = worker.store.select_into

    def slow_select(*a: object, **k: object) -> object:
        reading.set()
        release.wait(10)  # the reply is on its way when vLLM goes to sleep
        answered.set()
        return real_select(*a, **k)  # type: ignore[arg-type]

    worker.store.select_into = slow_select  # type: ignore[method-assign]
    run_worker_step(
        conn, RedisConnectorMetadata(loads=[LoadSpec("r1", [[3, 4]], [hashes], timeout_s=30)])
    )

    assert reading.wait(10)
    conn.unregister_kv_caches()  # vLLM: sleep(level=1)
    conn.unregister_kv_caches()  # idempotent (discard after sleep)
    assert not answered.is_set()  # it did not wait for Redis: the reply is still held
    assert finished_loads(conn) == {"r1"}  # reported now: the request recomputes
    assert conn.get_block_ids_with_load_errors() == {3, 4}

    release.set()  # the late reply must not land in released memory
    worker.store.select_into = real_select  # type: ignore[method-assign]
    # while asleep: a load is refused at once and a save copies nothing
    run_worker_step(
        conn,
        RedisConnectorMetadata(
            loads=[LoadSpec("r2", [[5]], [hashes[:1]], timeout_s=30)],
            saves=[SaveSpec("r3", [[6]], [["ab" * 16]], 0, "h3")],
        ),
    )
    assert finished_loads(conn) == {"r2"} and conn.get_block_ids_with_load_errors() == {5}
    assert worker.shutdown_pending(timeout_s=120) == 0
    assert all(t.abs().sum() == 0 for t in caches.values())
    assert not worker.store.contains(["ab" * 16])[0]
    stats = worker.take_stats()
    assert stats["loads_cancelled"] == 2 and stats["blocks_shed"] == 1

    conn.restore_kv_caches()  # vLLM: wake_up()
    conn.restore_kv_caches()
    run_worker_step(
        conn, RedisConnectorMetadata(loads=[LoadSpec("r4", [[1, 2]], [hashes], timeout_s=30)])
    )
    assert finished_loads(conn) == {"r4"} and conn.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(caches[name][1], blocks[0][name])
        assert torch.equal(caches[name][2], blocks[1][name])
    conn.shutdown()


def test_a_save_staged_before_the_caches_are_registered_again_is_written_by_its_own_mover(
    tiny_model: Path, redis_url: str
) -> None:
    """A register_kv_caches (new tensors) while a save is being written replaces the movers:
    the write goes on with the mover that staged it, and its staging buffer goes back to that
    mover's pool, never into the new one's (which would then hold more than its budget)."""
    # one writer thread: the second save waits in its queue, behind the first
    conn, caches = make_worker_connector(tiny_model, redis_url, NUM_BLOCKS, io_threads=1)
    worker = conn.worker
    for t in caches.values():
        t[2:4].fill_(7.0)
    old = worker.movers[0]
    release = threading.Event()
    real_insert = old.store.insert_parts

    def slow_insert(*a: object, **k: object) -> object:
        release.wait(10)  # the write is on its way when the caches are registered again
        return real_insert(*a, **k)  # type: ignore[arg-type]

    old.store.insert_parts = slow_insert  # type: ignore[method-assign]
    old_free = len(old._save_pool._free)  # (the pools' free lists: what each mover holds)
    keys = ["cd" * 16, "ef" * 16]
    for n, key in enumerate(keys):  # two steps: two chunks, two staging buffers
        run_worker_step(
            conn, RedisConnectorMetadata(saves=[SaveSpec(f"r{n}", [[2 + n]], [[key]], 0, f"h{n}")])
        )
    assert len(old._save_pool._free) == old_free - 2  # staged: two buffers out

    conn.register_kv_caches({n: torch.zeros_like(t) for n, t in caches.items()})
    new = worker.movers[0]
    assert new is not old
    new_free = len(new._save_pool._free)
    release.set()
    assert worker.shutdown_pending(timeout_s=60) == 0
    assert len(old._save_pool._free) == old_free  # its buffers came home
    assert len(new._save_pool._free) == new_free  # and nothing foreign joined the new pool
    assert all(worker.store.contains(keys))  # both written, from the old cache's blocks
    conn.shutdown()
