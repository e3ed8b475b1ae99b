"""Topology URLs (Sentinel, Cluster), a URL of the wrong kind caught at startup, and the store
behind Redis Sentinel -- including a failover -- against real servers."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from kvstore import (
    InvalidURLError,
    LookupBuffer,
    StoreAuthenticationError,
    StoreBusyError,
    StoreTopologyError,
    StoreUnavailableError,
    chain_hashes,
    parse_url,
)
from kvstore.net.connection import make_client
from testing.blocks import filled_block
from testing.redis_server import ClusterServers, RedisServer, SentinelServer, free_cluster_port
from testing.threads import ends_before_release

HASHES = chain_hashes(list(range(16 * 8)), 16)


bf16_block = partial(filled_block, shape=(2, 16, 64), dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("url", "topology", "tls", "nodes", "service", "db"),
    [
        ("redis-sentinel://a:26379,b:26380/mymaster/2", "sentinel", False,
         (("a", 26379), ("b", 26380)), "mymaster", 2),
        ("rediss-sentinel://h/svc", "sentinel", True, (("h", 26379),), "svc", 0),
        ("valkey-sentinel://h:1/svc", "sentinel", False, (("h", 1),), "svc", 0),
        ("valkeys-sentinel://h:1/svc", "sentinel", True, (("h", 1),), "svc", 0),
        ("redis-cluster://h1:7000,h2:7001", "cluster", False, (("h1", 7000), ("h2", 7001)), "", 0),
        ("rediss-cluster://h1:7000/0", "cluster", True, (("h1", 7000),), "", 0),
        ("valkey-cluster://h1:7000", "cluster", False, (("h1", 7000),), "", 0),
        ("valkeys-cluster://h1:7000", "cluster", True, (("h1", 7000),), "", 0),
    ],
)  # fmt: skip
def test_topology_urls(
    url: str, topology: str, tls: bool, nodes: tuple[tuple[str, int], ...], service: str, db: int
) -> None:
    a = parse_url(url)
    assert (a.topology, a.tls, a.nodes, a.service, a.db) == (topology, tls, nodes, service, db)


@pytest.mark.parametrize(
    "url",
    [
        "rediss-cluster://h1:7000,h2:7001?tls_verify=false&tls_ca_file=/ca.pem",
        "rediss-cluster://h1:7000,h2:7001/?tls_verify=false&tls_ca_file=/ca.pem",
        "rediss-sentinel://h1:7000,h2:7001/svc?tls_verify=false&tls_ca_file=/ca.pem",
    ],
)
def test_topology_urls_take_tls_options_as_query_parameters(url: str) -> None:
    a = parse_url(url)
    assert a.options == {"tls_verify": "false", "tls_ca_file": "/ca.pem"}
    assert a.nodes == (("h1", 7000), ("h2", 7001))


def test_topology_url_credentials_are_parsed_and_never_shown() -> None:
    a = parse_url("redis-sentinel://us%40er:p%40ss:w@h1:1,h2:2/svc")
    assert (a.username, a.password) == ("us@er", "p@ss:w")
    assert "p%40ss" not in a.safe_url and "***" in a.safe_url
    assert "h1:1,h2:2" in a.safe_url and "p%40ss" not in repr(a)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis-sentinel://h:1", "no Sentinel service name"),
        ("redis-cluster://h:1/3", "only database 0"),
        ("redis-cluster://h:1,:2", "bad host:port"),
        ("redis-sentinel://h:99999/s", "bad host:port"),
        ("redis-sentinel://h:1/s?nope=1", "unknown query parameter"),
        ("redis-sentinel://h:1/s/x", "database must be an integer"),
    ],
)
def test_bad_topology_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(InvalidURLError, match=says):
        parse_url(url)


@pytest.mark.redis
def test_a_cluster_url_to_a_standalone_server_fails_at_startup_naming_the_plain_form() -> None:
    with RedisServer() as server:
        want = re.escape(f"use redis://127.0.0.1:{server.port}")
        with pytest.raises(StoreTopologyError, match=want):
            LookupBuffer.from_url(f"redis-cluster://127.0.0.1:{server.port}")


def test_a_cluster_url_with_no_reachable_seed_is_unavailable() -> None:
    with pytest.raises(StoreUnavailableError, match="slot map"):
        LookupBuffer.from_url(f"redis-cluster://127.0.0.1:{free_cluster_port()}")


@pytest.mark.redis
def test_a_plain_url_to_a_cluster_node_fails_at_startup_naming_the_cluster_form() -> None:
    with RedisServer(free_cluster_port(), extra_args=["--cluster-enabled", "yes"]) as node:
        want = re.escape(f"redis-cluster://127.0.0.1:{node.port}")
        with pytest.raises(StoreTopologyError, match=want):
            LookupBuffer.from_url(node.url)


@pytest.fixture
def sentinel_setup() -> Iterator[tuple[RedisServer, RedisServer, SentinelServer]]:
    master = RedisServer().start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)]).start()
    sentinel = SentinelServer("kvmaster", master.port).start()
    try:
        yield master, replica, sentinel
    finally:
        sentinel.cleanup()
        replica.cleanup()
        master.cleanup()


@pytest.mark.redis
def test_a_plain_url_to_a_sentinel_fails_at_startup_naming_the_sentinel_form(
    sentinel_setup: tuple[RedisServer, RedisServer, SentinelServer],
) -> None:
    _, _, sentinel = sentinel_setup
    with pytest.raises(StoreTopologyError, match=re.escape("redis-sentinel://127.0.0.1:")):
        LookupBuffer.from_url(f"redis://127.0.0.1:{sentinel.port}/0")


def wait_replicated(replica: RedisServer, keys: int, timeout_s: float = 10) -> None:
    client = redis.Redis(port=replica.port)
    deadline = time.monotonic() + timeout_s
    while client.dbsize() < keys:
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.05)


@pytest.mark.redis
def test_every_operation_through_sentinel_and_recovery_after_a_failover(
    sentinel_setup: tuple[RedisServer, RedisServer, SentinelServer],
) -> None:
    master, replica, sentinel = sentinel_setup
    store = LookupBuffer.from_url(sentinel.url(), namespace="sent", socket_timeout_s=2)
    store.insert_many([(h, bf16_block(i)) for i, h in enumerate(HASHES[:4])])
    assert store.longest_prefix(HASHES) == 4
    bufs = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(4)]
    got = store.select_into(HASHES[:4], bufs, connections=2)
    assert all(g is not None for g in got)
    assert torch.equal(got[3]["kv"], bf16_block(3)["kv"])  # type: ignore[index]
    taken = store.drop_select(HASHES[3:4])
    assert taken[0] is not None and store.longest_prefix(HASHES) == 3
    wait_replicated(replica, 3)

    # the master dies; the sentinel promotes the replica (down-after 1 s)
    master.kill()
    deadline = time.monotonic() + 30
    while sentinel.master_port() != replica.port:
        assert time.monotonic() < deadline, "the sentinel did not fail over"
        time.sleep(0.1)
    # operations recover by themselves, with the same bytes
    deadline = time.monotonic() + 15
    while True:
        try:
            if store.longest_prefix(HASHES) == 3:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "operations did not recover after the failover"
        time.sleep(0.1)
    got = store.select(HASHES[:3])
    assert all(torch.equal(g["kv"], bf16_block(i)["kv"]) for i, g in enumerate(got))  # type: ignore[index]
    store.insert(HASHES[5], bf16_block(5))  # the new master takes writes
    assert redis.Redis(port=replica.port).exists(store.redis_key(HASHES[5]))
    store.close()


def every_pool(client: redis.Redis) -> list[Any]:
    """The client's connection pools: a Cluster client's, one per node."""
    nodes = client.get_nodes() if isinstance(client, RedisCluster) else [client]
    return [getattr(n, "redis_connection", n).connection_pool for n in nodes]


@pytest.mark.redis
@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_a_client_short_of_connections_waits_then_is_busy_not_the_server_down(
    topology: str, request: pytest.FixtureRequest
) -> None:
    """Found by a review: a Cluster node's pool and Sentinel's raised redis-py's
    MaxConnectionsError at once, a ConnectionError taken for the server down -- eight lookups
    on a pool of two against a slow but healthy Cluster: six "cannot reach ... check that the
    server runs", and the breaker opened. Now as the standalone pool: the caller waits for a
    connection given back, and past its socket timeout gets StoreBusyError, breaker closed."""
    cluster = ClusterServers(masters=3, replicas=0).start() if topology == "cluster" else None
    try:
        if cluster is not None:
            url = cluster.url
        else:
            url = request.getfixturevalue("sentinel_setup")[2].url()
        client = make_client(parse_url(url), socket_timeout_s=0.3, max_connections=1)
        buf = LookupBuffer(client, namespace="busy", control_client=client, breaker_failures=2)
        buf.insert_many([(h, filled_block(i)) for i, h in enumerate(HASHES[:2])])
        pools = every_pool(client)
        held = [(pool, pool.get_connection()) for pool in pools]
        for _ in range(3):
            with pytest.raises(StoreBusyError, match="max_connections"):
                buf.longest_prefix(HASHES[:2])
        assert buf.available and buf.stats().breaker_opens == 0
        # a connection given back while a caller waits is the caller's
        waiting = threading.Thread(target=lambda: got.append(buf.longest_prefix(HASHES[:2])))
        got: list[int] = []
        waiting.start()
        for pool, conn in held:
            pool.release(conn)
        waiting.join()
        assert got == [2]
        buf.close()
    finally:
        if cluster is not None:
            cluster.cleanup()


@pytest.mark.redis
def test_sentinels_with_a_password_are_asked_with_the_urls_credentials_when_told() -> None:
    """Found by a review: sentinels with requirepass (as most charts set them) could not be
    used, and the error was redis-py's repr of every sentinel client. ``?sentinel_auth=url``
    gives them the URL's credentials; without it the error says so, and never the password."""
    password = "sentinel-and-master-pw"
    master = RedisServer(password=password).start()
    sentinel = SentinelServer("kvauth", master.port, password=password).start()
    try:
        url = f"redis-sentinel://:{password}@127.0.0.1:{sentinel.port}/kvauth"
        with pytest.raises(StoreUnavailableError, match="sentinel_auth=url") as refused:
            LookupBuffer.from_url(url, namespace="auth").ping()
        assert password not in str(refused.value) and "object at 0x" not in str(refused.value)
        buf = LookupBuffer.from_url(f"{url}?sentinel_auth=url", namespace="auth")
        buf.insert(HASHES[0], filled_block(0))
        assert buf.select([HASHES[0]])[0] is not None
        assert password not in buf.safe_url
        buf.close()
        with pytest.raises(InvalidURLError, match="sentinel_auth must be one of") as wrong:
            parse_url(f"{url}?sentinel_auth=the-sentinels-password")  # (a natural mistake)
        assert "the-sentinels-password" not in str(wrong.value)
        with pytest.raises(InvalidURLError, match="sentinel_auth must be one of"):
            parse_url(f"{url}?sentinel_auth=%75rl")  # (as written: errors read it so)
        # told, and still refused: the sentinels' password is not the URL's
        other = f"redis-sentinel://:another-pw@127.0.0.1:{sentinel.port}/kvauth?sentinel_auth=url"
        with pytest.raises(StoreAuthenticationError, match="must be the URL's") as refused:
            LookupBuffer.from_url(other, namespace="auth").ping()
        assert "another-pw" not in str(refused.value)
    finally:
        sentinel.cleanup()
        master.cleanup()


@pytest.mark.redis
@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_a_read_waits_for_a_free_connection_until_its_deadline_not_the_pools(
    topology: str,
) -> None:
    """Found by a review: a read with 0.2 s left waited the pool's whole wait (its socket
    timeout, 60 s here) for a connection before failing. It must end typed at its deadline."""
    from kvstore.errors import DeadlinePassedError

    servers = ClusterServers(masters=3, replicas=0) if topology == "cluster" else RedisServer()
    servers.start()
    try:
        client = make_client(parse_url(servers.url), socket_timeout_s=60, max_connections=1)
        control = make_client(parse_url(servers.url), socket_timeout_s=60, max_connections=4)
        buf = LookupBuffer(client, namespace="late", control_client=control)
        buf.insert(HASHES[0], filled_block(0))
        pools = every_pool(client)
        held = [(pool, pool.get_connection()) for pool in pools]
        raised = ends_before_release(  # (the pool's own wait is 60 s)
            lambda: buf.select_into([HASHES[0]], [torch.zeros(1 << 16, dtype=torch.uint8)],
                                    deadline=time.monotonic() + 0.2),
            lambda: [pool.release(conn) for pool, conn in held],
        )  # fmt: skip
        assert isinstance(raised, DeadlinePassedError), raised
        buf.close()
    finally:
        servers.cleanup()
