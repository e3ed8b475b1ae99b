"""What a Cluster's own troubles look like to a caller: a slot no master serves (CLUSTERDOWN)
is unavailability -- typed so, and it opens the breaker -- not a URL mistake; a hung master
costs one timeout per call, never a retried one. Real Cluster nodes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from kvstore import (
    LookupBuffer,
    StoreCircuitOpenError,
    StoreTimeoutError,
    StoreUnavailableError,
    chain_hashes,
)
from testing.redis_server import ClusterServers

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * 4)), 16)


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
    buf.longest_prefix([HASHES[0]])  # a pooled connection to the master is open now
    client.config_resetstat()
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreTimeoutError):
            buf.longest_prefix([HASHES[0]])
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    # the stopped master still ran what reached it, and accepted who connected: one attempt
    # is one EXISTS on the pooled connection; a second one would have connected again
    stats = client.info("commandstats")
    assert stats.get("cmdstat_exists", {}).get("calls") == 1, stats
    assert client.info("stats")["total_connections_received"] <= 1  # a retry connects again
    buf.close()
