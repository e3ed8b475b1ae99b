"""kvstore against a real redis-server started on a free port by the fixtures."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import redis
import torch

from kvstore import (
    InvalidURLError,
    LookupBuffer,
    StoreAuthenticationError,
    StoreUnavailableError,
    chain_hashes,
)
from testing.blocks import filled_block
from testing.redis_server import RedisServer, free_port

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * 64)), 16)


bf16_block = partial(filled_block, shape=(4, 16, 8), dtype=torch.bfloat16)


def test_round_trip_over_tcp(redis_url: str) -> None:
    with LookupBuffer.from_url(redis_url, namespace="it", ttl_s=60) as buf:
        buf.insert_many([(h, bf16_block(i)) for i, h in enumerate(HASHES[:4])])
        assert buf.longest_prefix(HASHES) == 4
        got = buf.select(HASHES[:5])
        assert torch.equal(got[3]["kv"], bf16_block(3)["kv"]) and got[4] is None
        got = buf.drop_select(HASHES[:4])
        assert all(torch.equal(g["kv"], bf16_block(i)["kv"]) for i, g in enumerate(got))
        assert buf.longest_prefix(HASHES) == 0


def test_unix_socket(redis_server: RedisServer, redis_url: str) -> None:
    with LookupBuffer.from_url(redis_server.unix_url, namespace="unix") as buf:
        buf.insert(HASHES[0], bf16_block(0))
        assert torch.equal(buf.select(HASHES[:1])[0]["kv"], bf16_block(0)["kv"])  # type: ignore[index]


def test_valkey_alias(redis_server: RedisServer, redis_url: str) -> None:
    url = redis_url.replace("redis://", "valkey://")
    with LookupBuffer.from_url(url, namespace="alias") as buf:
        buf.insert(HASHES[0], bf16_block(0))
        assert buf.longest_prefix(HASHES) == 1


def test_ttl_expires_values(redis_url: str) -> None:
    with LookupBuffer.from_url(redis_url, namespace="ttl", ttl_s=0.2) as buf:
        buf.insert(HASHES[0], bf16_block(0))
        assert buf.longest_prefix(HASHES) == 1
        time.sleep(0.4)
        assert buf.select(HASHES[:1]) == [None]


def test_blocking_drop_select_gets_a_value_inserted_later(redis_url: str) -> None:
    with LookupBuffer.from_url(redis_url, namespace="wait") as buf:
        buf.insert(HASHES[0], bf16_block(0))

        def produce() -> None:
            time.sleep(0.2)
            buf.insert(HASHES[1], bf16_block(1))

        threading.Thread(target=produce).start()
        got = buf.drop_select(HASHES[:2], timeout_s=5)
        assert got[0] is not None and got[1] is not None
        assert torch.equal(got[1]["kv"], bf16_block(1)["kv"])


def test_scripts_reload_after_server_restart(private_redis: RedisServer) -> None:
    buf = LookupBuffer.from_url(private_redis.url, namespace="restart")
    buf.insert(HASHES[0], bf16_block(0))
    assert buf.longest_prefix(HASHES) == 1
    private_redis.restart()  # empty server: the script cache is gone (NOSCRIPT)
    buf.insert(HASHES[0], bf16_block(0))
    assert buf.longest_prefix(HASHES) == 1
    assert buf.drop_select(HASHES[:1])[0] is not None


def test_unreachable_server_raises_unavailable() -> None:
    with pytest.raises(StoreUnavailableError, match="cannot reach"):
        LookupBuffer.from_url(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=1)


def test_server_going_down_mid_use_raises_unavailable(private_redis: RedisServer) -> None:
    buf = LookupBuffer.from_url(private_redis.url, namespace="down", socket_timeout_s=2)
    buf.insert(HASHES[0], bf16_block(0))
    private_redis.kill()
    for op in (
        lambda: buf.select(HASHES[:1]),
        lambda: buf.drop_select(HASHES[:1]),
        lambda: buf.longest_prefix(HASHES),
        lambda: buf.insert(HASHES[1], bf16_block(1)),
    ):
        with pytest.raises(StoreUnavailableError):
            op()
    assert buf.stats().insert_errors == 1


def test_wrong_password_raises_authentication_error_without_the_password() -> None:
    with RedisServer(password="right-password") as server:
        url = f"redis://:wrong-password@127.0.0.1:{server.port}/0"
        with pytest.raises(StoreAuthenticationError) as info:
            LookupBuffer.from_url(url)
        assert "wrong-password" not in str(info.value)
        with pytest.raises(StoreAuthenticationError):
            LookupBuffer.from_url(f"redis://127.0.0.1:{server.port}/0")
        with LookupBuffer.from_url(server.url, namespace="auth") as buf:
            buf.insert(HASHES[0], bf16_block(0))
            assert buf.longest_prefix(HASHES) == 1
            assert "right-password" not in repr(buf)


def test_tls_with_ca_and_client_certificate(tls_files: dict[str, str]) -> None:
    port = free_port()
    args = [
        "--tls-port", str(port), "--port", "0",
        "--tls-cert-file", tls_files["cert"], "--tls-key-file", tls_files["key"],
        "--tls-ca-cert-file", tls_files["ca"], "--tls-auth-clients", "optional",
    ]  # fmt: skip
    with RedisServer(extra_args=args) as server:
        url = f"rediss://127.0.0.1:{port}/0"
        buf = LookupBuffer.from_url(url, namespace="tls", tls_ca_file=tls_files["ca"])
        buf.insert(HASHES[0], bf16_block(0))
        assert buf.longest_prefix(HASHES) == 1
        # zero-copy writes and in-place reads work over TLS too (no sendmsg there)
        parts = [
            memoryview(b) for b in buf.encode(HASHES[1], bf16_block(1)).tobytes().partition(b"}")
        ]
        buf.insert_parts([(HASHES[1], parts)], connections=2)
        got = buf.select_into(HASHES[:2], [torch.zeros(1 << 16, dtype=torch.uint8)] * 2)
        assert got[1] is not None and torch.equal(got[1]["kv"], bf16_block(1)["kv"])
        assert_odd_tensors_round_trip(buf)  # TLS sends each buffer with sendall, not sendmsg
        buf.close()
        # without the CA the certificate cannot be verified: a typed error that says so (it
        # said "cannot reach ... check that the server runs", a review's)
        with pytest.raises(StoreUnavailableError, match="tls_ca_file"):
            LookupBuffer.from_url(url)
        assert server.port  # keep the server alive until here


def test_invalid_url_never_connects() -> None:
    with pytest.raises(InvalidURLError):
        LookupBuffer.from_url("memcached://127.0.0.1:11211")


def test_starting_a_started_test_server_does_not_start_a_second_one() -> None:
    """``with RedisServer().start() as s`` used to start a second redis-server that could not
    bind the port, so ``s.proc`` was a dead process and the first server leaked."""
    with RedisServer().start() as server:
        assert server.proc is not None and server.proc.poll() is None
        pid = redis.Redis.from_url(server.url).info("server")["process_id"]
        assert pid == server.proc.pid
        url = server.url
    with pytest.raises(redis.exceptions.ConnectionError):  # and the one server is gone
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()


def bits(t: torch.Tensor) -> bytes:
    return t.detach().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def odd_tensors() -> dict[str, torch.Tensor]:
    """CPU tensors whose memory is not simply their values, one of each kind."""
    base = torch.arange(64, dtype=torch.float32).view(8, 8)
    tensors = {
        "transposed": base.t(),
        "every_other": base[:, ::2],
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.float32),
        # contiguous, but its last (size-1) dimension has stride 5: its bytes cannot be viewed
        # without flattening it first
        "column": torch.arange(5, dtype=torch.float32).view(1, 5).t(),
        "one_head": torch.arange(12, dtype=torch.float16).view(3, 1, 4).permute(0, 2, 1),
        "grad": torch.ones(4, requires_grad=True),
        "bytes": torch.arange(16, dtype=torch.uint8),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["fp8"] = torch.linspace(-2, 2, 16).to(torch.float8_e4m3fn)
    if hasattr(torch, "_neg_view"):  # a lazily negated view: its bytes are not its values
        tensors["negated"] = torch._neg_view(torch.arange(4, dtype=torch.float32))
    return tensors


def assert_odd_tensors_round_trip(store: LookupBuffer) -> None:
    """``insert_many`` (framed around the tensors' own memory) and ``insert`` store each of
    ``odd_tensors`` as its logical value."""
    tensors = odd_tensors()
    base = tensors["transposed"].t()
    store.insert_many([("h0", tensors), ("h1", {"x": base})])
    store.insert("h2", tensors)
    got = store.select(["h0", "h1", "h2"])
    assert got[0] is not None and got[1] is not None and got[2] is not None
    for value in (got[0], got[2]):
        for name, t in tensors.items():
            assert value[name].dtype == t.dtype and value[name].shape == t.shape, name
            assert bits(value[name]) == bits(t), name
    assert torch.equal(got[1]["x"], base)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_insert_many_sends_any_cpu_tensor_as_its_logical_value(
    redis_url: str, compression: str
) -> None:
    # CPU tensors are framed around their own memory and sent from there: strided, 0-d, empty,
    # grad-tracking and one-byte float tensors must still arrive as their logical values
    store = LookupBuffer.from_url(redis_url, namespace="views", compression=compression)
    try:
        assert_odd_tensors_round_trip(store)
    finally:
        store.close()


def test_insert_many_through_a_client_without_a_socket_sends_any_cpu_tensor() -> None:
    # fakeredis has no socket: values are joined for redis-py (an N-d view with a zero in its
    # shape could not be cast to bytes there)
    import fakeredis

    store = LookupBuffer(fakeredis.FakeRedis(server=fakeredis.FakeServer()), namespace="views")
    assert_odd_tensors_round_trip(store)
    store.close()


def test_insert_many_from_an_iterator_that_refills_one_tensor_stores_every_value(
    redis_url: str,
) -> None:
    # a generator may hand out the same tensor for every item, refilled each time: each
    # value must be what the tensor held when its item was produced
    buf = torch.empty(1024, dtype=torch.float32)
    hashes = [f"h{i}" for i in range(4)]

    def items():  # type: ignore[no-untyped-def]
        for i, h in enumerate(hashes):
            buf.fill_(float(i))
            yield h, {"k": buf}

    store = LookupBuffer.from_url(redis_url, namespace="refill")
    try:
        store.insert_many(items())
        got = store.select(hashes)
        assert [g["k"][0].item() if g is not None else None for g in got] == [0.0, 1.0, 2.0, 3.0]
    finally:
        store.close()
