"""What a Cluster's own troubles look like to a caller: a slot no master serves (CLUSTERDOWN)
is unavailability -- typed so, and it opens the breaker -- not a URL mistake; a hung master
costs one timeout per call, never a retried one. Real Cluster nodes."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator

import pytest
import torch

import kvstore.cli
from kvstore import (
    LookupBuffer,
    StoreCircuitOpenError,
    StoreCommandError,
    StoreTimeoutError,
    StoreUnavailableError,
    chain_hashes,
)
from kvstore.fleet.functions import LIBRARY
from kvstore.net.connection import make_client, parse_url, translated_errors
from kvstore.net.server_code import server_digest
from testing.blocks import filled_block
from testing.redis_server import ClusterServers
from testing.threads import ends_before_release

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * 4)), 16)
MANY = chain_hashes(list(range(16 * 64)), 16)  # enough for 8 transfers per master


@pytest.fixture
def cluster() -> Iterator[ClusterServers]:
    with ClusterServers(masters=3, replicas=0) as servers:
        yield servers


def test_a_slot_no_master_serves_is_unavailability_and_opens_the_breaker(
    cluster: ClusterServers,
) -> None:
    buf = LookupBuffer.from_url(cluster.url, namespace="down", breaker_failures=2)
    buf.insert(HASHES[0], {"kv": torch.ones(4)})
    key = buf.redis_key(HASHES[0])
    owner = cluster.client(cluster.node_of(key))
    owner.execute_command("CLUSTER DELSLOTS", owner.cluster("keyslot", key))
    for _ in range(2):
        with pytest.raises(StoreUnavailableError) as err:
            buf.select([HASHES[0]])
        assert "redis-cluster:// URL" not in str(err.value)  # the user's URL is not the problem
    with pytest.raises(StoreCircuitOpenError):  # the outage is no longer sent to Redis
        buf.select([HASHES[0]])
    buf.close()


def test_a_hung_master_costs_one_timeout_not_a_retried_one(cluster: ClusterServers) -> None:
    buf = LookupBuffer.from_url(
        cluster.url, namespace="hung", control_timeout_s=0.5, breaker_failures=10
    )
    key = buf.redis_key(HASHES[0])
    node = cluster.node_of(key)
    client = cluster.client(node)
    handoff = next(
        f"h{i}" for i in range(10_000) if cluster.node_of(buf.keys.handoff(f"h{i}")) is node
    )
    buf.longest_prefix([HASHES[0]])  # a pooled connection to the master is open now
    client.config_resetstat()
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreTimeoutError):
            buf.longest_prefix([HASHES[0]])
        with pytest.raises(StoreTimeoutError):
            buf.publish_handoff(handoff, 4)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    # the stopped master still ran what reached it, and accepted who connected: one attempt
    # is one command; each call's timeout drops its connection, so the publish connected once
    # (its connection handshake may be what timed out) and a retry would have connected again
    stats = client.info("commandstats")
    assert stats.get("cmdstat_exists", {}).get("calls") == 1, stats
    assert stats.get("cmdstat_set", {}).get("calls", 0) <= 1, stats  # 0: it timed out connecting
    assert client.info("stats")["total_connections_received"] <= 1
    buf.close()


def test_a_lookup_never_waits_behind_reads_from_a_hung_master(cluster: ClusterServers) -> None:
    """Lookups have threads of their own: value reads stuck on a hung master (each for its
    60 s socket timeout) may fill every transfer thread, and a lookup of keys on the other
    masters still answers before any of those reads gives up."""
    buf = LookupBuffer.from_url(
        cluster.url, namespace="hol", socket_timeout_s=60, control_timeout_s=60, breaker_failures=99
    )
    buf.insert_many([(h, {"kv": torch.ones(4)}) for h in MANY])
    hung = cluster.node_of(buf.redis_key(MANY[0]))
    elsewhere = [h for h in MANY if cluster.node_of(buf.redis_key(h)) is not hung]
    stop, gave_up = threading.Event(), threading.Event()

    def read_until_stopped() -> None:
        buffers = [torch.empty(1 << 12, dtype=torch.uint8) for _ in MANY]
        while not stop.is_set():
            try:
                buf.select_into(MANY, buffers, connections=8)
            except StoreTimeoutError:
                gave_up.set()

    readers = [threading.Thread(target=read_until_stopped, daemon=True) for _ in range(2)]
    assert hung.proc is not None
    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        for reader in readers:
            reader.start()
        # the event that matters: every transfer thread exists, so reads fill the pool
        while sum(t.name.startswith("kvstore-fanout") for t in threading.enumerate()) < 8:
            threading.Event().wait(0.01)
        assert buf.longest_prefix(elsewhere) == len(elsewhere)
        assert not gave_up.is_set()  # answered while the reads still wait on the hung master
    finally:
        stop.set()
        os.kill(hung.proc.pid, signal.SIGCONT)
    for reader in readers:
        reader.join()
    buf.close()


def test_every_master_holds_the_functions_and_one_that_lost_them_gets_them_again(
    cluster: ClusterServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """Functions are not copied between a Cluster's shards: a zero-key FCALL checked one master
    at random and redis-py's FUNCTION LOAD stopped at the first error, so a master that lost
    the library (a restart without persistence) failed every claim on its slots, and
    `functions load` said all was well (fresh-eyes review, 2026-11-29)."""
    lost = cluster.master_nodes()[1]
    with LookupBuffer.from_url(cluster.url, namespace="fn", fingerprint="fp", ttl_s=60) as buf:
        buf.insert_many([(h, {"kv": torch.ones(4)}) for h in MANY])
        assert all(v is not None for v in buf.drop_select(MANY[:32]))
        for node in cluster.master_nodes():  # every master got it, not one at random
            assert server_digest(cluster.client(node), LIBRARY) == LIBRARY.digest
        cluster.client(lost).function_flush()
        assert all(v is not None for v in buf.drop_select(MANY[32:]))  # loaded again there
        assert server_digest(cluster.client(lost), LIBRARY) == LIBRARY.digest
    cluster.client(lost).function_flush()
    url = ["--url", cluster.url, "--json", "functions"]
    assert kvstore.cli.main([*url, "show"]) == kvstore.cli.ExitStatus.FAILED
    shown = json.loads(capsys.readouterr().out)["server_digests"]
    assert sorted(d is None for d in shown.values()) == [False, False, True]
    assert kvstore.cli.main([*url, "load"]) == kvstore.cli.ExitStatus.OK
    assert server_digest(cluster.client(lost), LIBRARY) == LIBRARY.digest


def test_a_clusters_control_replies_are_bounded_like_every_other_topologys(
    cluster: ClusterServers,
) -> None:
    """Issue 52: redis-py built a Cluster's node clients with its own parser, so a control
    reply (the generation, a handoff record, a lookup's answer) was taken whole however large.
    Each node's connections are now the bounded ones: a 5 MiB string where a control reply is
    read fails typed, and the node's later replies answer their own commands."""
    address = parse_url(cluster.url)
    client = make_client(address, socket_timeout_s=5.0)
    owner = cluster.client(cluster.node_of("big"))
    owner.set("big", b"B" * (5 << 20))
    keys = [f"key{i}" for i in range(8)]
    for key in keys:
        cluster.client(cluster.node_of(key)).set(key, f"value of {key}")
    try:
        for key in keys:
            with (
                pytest.raises(StoreCommandError, match="control replies"),
                translated_errors(address.safe_url, "GET"),
            ):
                client.get("big")
            with translated_errors(address.safe_url, "GET"):
                assert client.get(key) == f"value of {key}".encode()
    finally:
        client.close()


def test_a_read_redirected_keeps_its_deadline_while_the_slot_map_is_relearnt(
    cluster: ClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a redirect makes the read learn the slot map again, which redis-py
    does by asking the nodes in a random order -- a hung master holding none of the read's
    keys held a load with 0.5 s left for 3 s. The relearn here hangs until released: the
    read must end typed at its own deadline, and the relearn goes on for the next caller."""
    import time

    from kvstore.errors import DeadlinePassedError
    from kvstore.net.shards import Shards

    buf = LookupBuffer.from_url(cluster.url, namespace="late")
    buf.insert(HASHES[0], filled_block(0))
    key = buf.redis_key(HASHES[0])
    source = cluster.node_of(key)
    target = next(n for n in cluster.master_nodes() if n.port != source.port)
    src, dst = cluster.client(source), cluster.client(target)
    slot = int(src.execute_command("CLUSTER KEYSLOT", key))
    dst_id = dst.execute_command("CLUSTER MYID")
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src.execute_command("CLUSTER MYID"))
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    src.execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)
    for client in (dst, src):
        client.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)  # buf's map is stale
    hung, relearn = threading.Event(), Shards.relearn
    monkeypatch.setattr(Shards, "relearn", lambda self: (hung.wait(), relearn(self)))
    raised = ends_before_release(  # (it waited for the relearn, which hangs until released)
        lambda: buf.select_into([HASHES[0]], [torch.zeros(1 << 16, dtype=torch.uint8)],
                                deadline=time.monotonic() + 0.3),
        hung.set,
    )  # fmt: skip
    assert isinstance(raised, DeadlinePassedError), raised
    monkeypatch.undo()
    assert buf.select_into([HASHES[0]], [torch.zeros(1 << 16, dtype=torch.uint8)])[0] is not None
    buf.close()


def test_a_sweep_reaches_a_master_added_since_the_buffer_started(cluster: ClusterServers) -> None:
    """Found by a review: key walks (the generations sweep, ``ls``, warm records) took the
    masters from the slot map the client learned at start; a master added since -- scale-out
    -- kept its older-generation blocks for ever (with no TTL)."""
    import time

    from testing.redis_server import RedisServer, free_cluster_port

    buf = LookupBuffer.from_url(cluster.url, namespace="grow")
    buf.insert_many([(h, filled_block(i)) for i, h in enumerate(MANY[:16])])
    extra = RedisServer(
        free_cluster_port(),
        extra_args=["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"],
    ).start()
    try:
        added = cluster.client(extra)
        added.execute_command("CLUSTER MEET", "127.0.0.1", cluster.nodes[0].port)
        while added.cluster("info").get("cluster_state") != "ok":  # (it joins in a second)
            time.sleep(0.05)
        added_id = added.execute_command("CLUSTER MYID")
        for h in MANY[:4]:  # the added master takes four blocks' slots
            key = buf.redis_key(h)
            source = cluster.client(cluster.node_of(key))
            slot = int(source.execute_command("CLUSTER KEYSLOT", key))
            added.execute_command(
                "CLUSTER SETSLOT", slot, "IMPORTING", source.execute_command("CLUSTER MYID")
            )
            source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", added_id)
            source.execute_command("MIGRATE", "127.0.0.1", extra.port, key, 0, 5000)
            for node in [extra, *cluster.master_nodes()]:
                cluster.client(node).execute_command("CLUSTER SETSLOT", slot, "NODE", added_id)
        assert added.dbsize() == 4
        buf.sweep(buf.reset())
        assert added.dbsize() == 0, "the added master's older blocks were not swept"
        buf.close()
    finally:
        extra.cleanup()
