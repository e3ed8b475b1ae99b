"""``LookupBuffer.select_into``: reads that land in the caller's buffers, against a real
redis-server (the reader needs a real socket)."""

from __future__ import annotations

import itertools
import time

import pytest
import redis
import torch

from kvstore import LookupBuffer, chain_hashes
from testing.blocks import random_k_v_block

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_url: str) -> LookupBuffer:
    return LookupBuffer.from_url(redis_url, namespace="into", layout={"m": "select_into"})


def buffers(n: int, size: int = 64 << 10) -> list[torch.Tensor]:
    return [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]


@pytest.mark.parametrize("connections", [1, 3])
def test_values_land_in_the_buffers_and_equal_select(store: LookupBuffer, connections: int) -> None:
    hashes = chain_hashes(list(range(10 * 16)), 16)
    store.insert_many([(h, random_k_v_block(i)) for i, h in enumerate(hashes)])
    bufs = buffers(len(hashes))
    got = store.select_into(hashes, bufs, connections=connections)
    want = store.select(hashes)
    for g, w, buf in zip(got, want, bufs, strict=True):
        assert g is not None and w is not None
        for name in w:
            assert torch.equal(g[name], w[name])
            start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
            assert start <= g[name].data_ptr() < end  # a view into the caller's buffer


def test_misses_wrong_types_oversize_and_corrupt_values_are_counted_misses(
    store: LookupBuffer, redis_url: str
) -> None:
    hashes = chain_hashes(list(range(5 * 16)), 16)
    store.insert_many([(h, random_k_v_block(i)) for i, h in enumerate(hashes[:4])])
    client = redis.Redis.from_url(redis_url)
    client.delete(store.redis_key(hashes[1]))
    client.lpush(store.redis_key(hashes[1]), "not a block")  # wrong type
    corrupt = store.redis_key(hashes[2])
    client.setrange(corrupt, client.strlen(corrupt) - 3, b"\x00\x01\x02")
    bufs = buffers(5)
    bufs[3] = torch.zeros(1000, dtype=torch.uint8)  # smaller than the value
    got = store.select_into(hashes, bufs)
    assert got[0] is not None and got[1:] == [None, None, None, None]
    reasons = store.stats().corrupt_by_reason
    assert reasons == {"wrong-type": 1, "checksum": 1, "oversize": 1}
    assert store.select_into(hashes[:1], bufs[:1])[0] is not None  # the connection is in sync


def test_consume_takes_each_value_once(store: LookupBuffer, redis_url: str) -> None:
    hashes = chain_hashes(list(range(3 * 16)), 16)
    store.insert_many([(h, random_k_v_block(i)) for i, h in enumerate(hashes)])
    got = store.select_into(hashes, buffers(3), consume=True, connections=2)
    assert all(g is not None for g in got)
    assert torch.equal(got[2]["v"], random_k_v_block(2)["v"])  # type: ignore[index]
    assert store.select_into(hashes, buffers(3), consume=True) == [None, None, None]
    assert redis.Redis.from_url(redis_url).keys("kv:into:*") == []


def test_bad_buffers_are_refused(store: LookupBuffer) -> None:
    from kvstore import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        store.select_into(["ab" * 16], [torch.zeros(8, dtype=torch.float32)])
    with pytest.raises(InvalidArgumentError):
        store.select_into(["ab" * 16], [])


def value_parts(store: LookupBuffer, h: str, seed: int, pieces: int = 7) -> list[memoryview]:
    """A value cut into ``pieces`` buffers, as the data mover hands them over."""
    whole = store.encode(h, random_k_v_block(seed)).tobytes()
    cuts = sorted({0, len(whole), *(len(whole) * i // pieces for i in range(1, pieces))})
    return [memoryview(whole)[a:b] for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize("connections", [1, 3])
def test_values_sent_in_pieces_read_back_whole(store: LookupBuffer, connections: int) -> None:
    hashes = chain_hashes(list(range(9 * 16)), 16)
    store.insert_parts(
        [(h, value_parts(store, h, i)) for i, h in enumerate(hashes)], connections=connections
    )
    for i, got in enumerate(store.select(hashes)):
        assert got is not None and torch.equal(got["k"], random_k_v_block(i)["k"])
    assert store.stats().inserts == 9


def test_big_values_in_many_pieces_survive_partial_sends(store: LookupBuffer) -> None:
    """Multi-MiB values, hundreds of pieces each: sendmsg sends part of a batch at a time."""
    big = {"k": torch.randn(1 << 20)}  # 4 MiB
    hashes = chain_hashes(list(range(3 * 16)), 16)
    items = []
    for h in hashes:
        whole = store.encode(h, big).tobytes()
        step = len(whole) // 700 + 1
        items.append((h, [memoryview(whole)[a : a + step] for a in range(0, len(whole), step)]))
    store.insert_parts(items, connections=2)
    got = store.select_into(hashes, buffers(3, 5 << 20), connections=2)
    assert all(g is not None and torch.equal(g["k"], big["k"]) for g in got)


def test_a_refused_write_is_a_typed_error_and_the_connection_stays_usable(
    store: LookupBuffer, redis_url: str
) -> None:
    from kvstore import StoreOutOfMemoryError

    admin = redis.Redis.from_url(redis_url)
    hashes = chain_hashes(list(range(2 * 16)), 16)
    admin.config_set("maxmemory", "1mb")
    admin.config_set("maxmemory-policy", "noeviction")
    try:
        big = {"k": torch.randn(1 << 19)}
        with pytest.raises(StoreOutOfMemoryError):
            store.insert_parts([(h, [store.encode(h, big)]) for h in hashes])
    finally:
        admin.config_set("maxmemory", "0")
    store.insert_parts([(hashes[0], value_parts(store, hashes[0], 0))])
    assert store.select(hashes[:1])[0] is not None


@pytest.mark.parametrize(("read_depth", "in_flight"), [(None, 15), (1, 1), (4, 4)])
def test_small_values_are_pipelined_unless_a_read_depth_is_set(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, read_depth: int | None, in_flight: int
) -> None:
    """Unset, reads keep 1 MiB of small values in flight (15 destinations of 68 KiB); a
    read_depth set by the caller is kept exactly (what bench_paths --sweep measures). With d
    in flight, 16 GETs take one send of d, then one send per reply received."""
    store = LookupBuffer.from_url(
        redis_url, namespace="depth", layout={"m": "depth"}, read_depth=read_depth
    )
    hashes = chain_hashes(list(range(16 * 16)), 16)
    store.insert_many([(h, {"kv": torch.zeros(16 << 10)}) for h in hashes])  # 64 KiB each
    counted: list[int] = []
    real = redis.connection.Connection.send_packed_command

    def send(self: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        counted.append(1)
        real(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", send)
    got = store.select_into(hashes, buffers(16, (64 << 10) + 4096), connections=1)
    assert all(v is not None for v in got)
    assert len(counted) == 1 + 16 - in_flight
    store.close()


@pytest.mark.redis
@pytest.mark.parametrize("consume", [False, True])
def test_a_health_check_never_pings_in_the_middle_of_a_pipelined_read(
    redis_url: str, consume: bool
) -> None:
    # redis-py PINGs on a send once health_check_interval (30 s in production) has passed since
    # it last parsed a reply; the raw reads parse their own, so a later send of the same read
    # must not check: it would take a value's bytes for the PONG. Here the interval is 50 ms.
    reader = LookupBuffer.from_url(redis_url, namespace="hc", ttl_s=600, breaker_failures=10**6)
    writer = LookupBuffer.from_url(redis_url, namespace="hc", ttl_s=600)
    hashes = chain_hashes(list(range(16 * 16)), 16)
    blocks = [(h, {"kv": torch.full((2, 16, 4096), float(i))}) for i, h in enumerate(hashes)]
    try:
        writer.insert_many(blocks)
        reader.select(hashes[:1])  # a pooled connection exists
        pool = reader._transport.client.connection_pool
        pool.connection_kwargs["health_check_interval"] = 0.05
        for conn in pool.made():  # type: ignore[attr-defined]
            if conn is not None:
                conn.health_check_interval = 0.05
                conn.next_health_check = time.monotonic() + 0.05
        end = time.monotonic() + 2
        while time.monotonic() < end:
            got = reader.drop_select(hashes) if consume else reader.select(hashes)
            assert all(g is not None for g in got)
            if consume:
                writer.insert_many(blocks)
    finally:
        reader.close()
        writer.close()
