"""A Cluster master killed while blocks are being loaded: every call ends within its bound
with hits, misses or a typed error (never wrong bytes, never a hang), and the store recovers
by itself once the master's replica has taken over."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvstore import KVStoreError, LookupBuffer, chain_hashes
from testing.blocks import filled_block
from testing.redis_server import ClusterServers

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * (96 + 1))), 16)
N = 96
# a call's worst case here: a connect (1 s) and a reply (1 s) per attempt, two attempts
CALL_BOUND_S = 5.0


@pytest.fixture
def cluster() -> Iterator[ClusterServers]:
    with ClusterServers() as servers:
        yield servers


def test_a_master_killed_mid_load_gives_misses_then_recovers(cluster: ClusterServers) -> None:
    buf = LookupBuffer.from_url(
        cluster.url, namespace="kill", socket_timeout_s=1, connect_timeout_s=1,
        breaker_probe_s=0.2,
    )  # fmt: skip
    buf.insert_many([(HASHES[i], filled_block(i)) for i in range(N)])
    for master in cluster.master_nodes():  # every block is on a replica before the crash
        assert cluster.client(master).wait(1, 5000) >= 1
    victim = cluster.node_of(buf.redis_key(HASHES[0]))

    calls: list[tuple[float, str]] = []  # (seconds, "hits:<n>" or the error's type)
    wrong: list[int] = []
    stop = threading.Event()

    def load() -> None:
        bufs = [torch.empty(4096, dtype=torch.uint8) for _ in range(N)]
        while not stop.is_set():
            start = time.monotonic()
            try:
                got = buf.select_into(HASHES[:N], bufs, connections=2)
                outcome = f"hits:{sum(g is not None for g in got)}"
                wrong.extend(
                    i
                    for i, g in enumerate(got)
                    if g is not None and not torch.equal(g["kv"], filled_block(i)["kv"])
                )
            except KVStoreError as exc:
                outcome = type(exc).__name__
                time.sleep(0.05)
            calls.append((time.monotonic() - start, outcome))

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(0.5)
        victim.kill()
        killed_at = time.monotonic()
        cluster.wait_healthy(timeout_s=30)  # the replica was promoted
        promoted_after = time.monotonic() - killed_at
        # recovery by itself: the loader sees every block again, with no help from the test
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (calls and calls[-1][1] == f"hits:{N}"):
            time.sleep(0.1)
    finally:
        stop.set()
        loader.join(timeout=30)
    assert not loader.is_alive(), "a load hung"
    assert not wrong, f"wrong bytes returned for blocks {wrong}"
    during = [c for c in calls if c[1] != f"hits:{N}"]
    assert during, "the crash was never seen (killed the wrong node?)"
    slowest = max(t for t, _ in calls)
    assert slowest < CALL_BOUND_S, f"a call took {slowest:.1f}s (promotion {promoted_after:.1f}s)"
    assert calls[-1][1] == f"hits:{N}", f"no recovery; last outcomes {calls[-5:]}"
    # and writes land on the new master
    buf.insert(HASHES[N], filled_block(N))
    assert buf.select(HASHES[N : N + 1])[0] is not None
    assert buf.stats().breaker_opens >= 1
    buf.close()
