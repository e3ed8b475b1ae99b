"""The delaying relay the abort-storm tests and the admission script reach Redis through."""

from __future__ import annotations

import os
import time

import pytest
import redis

from testing.redis_server import RedisServer
from testing.relay import DelayRelay

pytestmark = pytest.mark.redis


def test_replies_come_back_whole_in_order_and_late(redis_server: RedisServer) -> None:
    value = os.urandom(3 << 20)
    with DelayRelay("127.0.0.1", redis_server.port, delay_s=0.05) as relay:
        client = redis.Redis.from_url(relay.url, socket_timeout=10)
        pipe = client.pipeline(transaction=False)
        for i in range(20):
            pipe.set(f"relay:{i}", value[i:])
        for i in range(20):
            pipe.get(f"relay:{i}")
        t0 = time.monotonic()
        replies = pipe.execute()
        took = time.monotonic() - t0
        assert replies[:20] == [True] * 20
        assert replies[20:] == [value[i:] for i in range(20)]
        assert took >= 0.05  # no reply can come sooner than the delay
        client.close()


def test_closing_the_relay_drops_its_connections(redis_server: RedisServer) -> None:
    relay = DelayRelay("127.0.0.1", redis_server.port, delay_s=0.0).start()
    client = redis.Redis.from_url(relay.url, socket_timeout=2, retry_on_timeout=False)
    assert client.ping()
    relay.close()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_a_rate_cap_holds_every_connection_together_to_its_bandwidth(
    redis_server: RedisServer,
) -> None:
    value = os.urandom(1 << 20)
    redis.Redis.from_url(redis_server.url).set("relay:big", value)
    with DelayRelay("127.0.0.1", redis_server.port, 0.0, rate_bytes_per_s=8e6) as relay:
        clients = [redis.Redis.from_url(relay.url, socket_timeout=30) for _ in range(2)]
        t0 = time.monotonic()
        got = [c.get("relay:big") for c in clients]  # 2 MiB through one 8 MB/s link
        took = time.monotonic() - t0
        assert got == [value, value]
        assert took >= 2 * len(value) / 8e6 * 0.99  # never faster than the link
        relay.rate_bytes_per_s = None  # lifted while it runs
        assert clients[0].get("relay:big") == value
        for c in clients:
            c.close()
