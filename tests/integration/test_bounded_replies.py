"""Replies redis-py parses for kvstore (control replies, the handshake) are bounded in size and
time (``kvstore.net.bounded_replies``), against a loopback server that answers what a hostile
or broken one would (issue 52): a 128 MiB generation, a reply dripped a byte at a time, a HELLO
answered with a string."""

from __future__ import annotations

import contextlib
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest
import redis
import redis.exceptions as rex

from kvstore import LookupBuffer
from kvstore.errors import (
    StoreCommandError,
    StoreReplyTooLargeError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvstore.net.bounded_replies import MAX_CONTROL_REPLY_BYTES, BoundedConnection
from kvstore.net.connection import make_client, parse_url, translated_errors
from kvstore.net.wire import native_available
from testing.redis_server import RedisServer, SentinelServer
from testing.scripted_server import ScriptedServer

HELLO = (
    b"%7\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.0.0\r\n"
    b"$5\r\nproto\r\n:3\r\n$2\r\nid\r\n:1\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n"
    b"$4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n"
)


def handshake_then(get: bytes | Callable[[socket.socket], None]) -> Callable[[bytes], object]:
    def answer(name: bytes) -> object:
        if name == b"HELLO":
            return HELLO
        if name == b"GET":
            return get
        return b"+OK\r\n"

    return answer


@pytest.fixture
def serve() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(answer: Callable[[bytes], object]) -> ScriptedServer:
        servers.append(ScriptedServer(answer))  # type: ignore[arg-type]
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _client(port: int, timeout_s: float = 0.5) -> redis.Redis:
    return make_client(parse_url(f"redis://127.0.0.1:{port}/0"), socket_timeout_s=timeout_s)


def read_generation(client: redis.Redis, port: int) -> object:
    """The namespace's generation, as kvstore reads it: redis-py's errors typed."""
    with translated_errors(parse_url(f"redis://127.0.0.1:{port}/0").safe_url, "GET"):
        return client.get("kv:vllm:generation")


def reading_the_generation_raises(port: int, error: type[Exception], match: str) -> None:
    """One read of the generation from the server at ``port``, on a client of its own, raises
    ``error`` saying ``match``."""
    client = _client(port)
    try:
        with pytest.raises(error, match=match):
            read_generation(client, port)
    finally:
        client.close()


def _huge_generation(conn: socket.socket) -> None:
    """128 MiB of a generation, as fast as the client takes it."""
    conn.sendall(b"$134217728\r\n")
    chunk = b"7" * (1 << 20)
    for _ in range(128):
        conn.sendall(chunk)


def _dripped(conn: socket.socket) -> None:
    """A short reply, a byte every 50 ms (each within the socket timeout)."""
    for byte in b"$100\r\n" + b"7" * 100 + b"\r\n":
        conn.sendall(bytes([byte]))
        time.sleep(0.05)


def test_the_handshake_and_control_replies_go_through_the_bounded_parser(serve: object) -> None:
    server = serve(handshake_then(b"$1\r\n7\r\n"))  # type: ignore[operator]
    client = _client(server.port)
    try:
        assert client.get("kv:vllm:generation") == b"7"
        conn = client.connection_pool.get_connection()
        try:
            assert isinstance(conn, BoundedConnection)
        finally:
            client.connection_pool.release(conn)
    finally:
        client.close()


def test_a_dripped_control_reply_ends_within_its_deadline(serve: object) -> None:
    """The socket timeout (0.2 s) bounds each recv; the reply itself must end within the
    timeout plus its size at wire.MIN_BYTES_PER_S, not after 100 bytes x 50 ms."""
    server = serve(handshake_then(_dripped))  # type: ignore[operator]
    client = _client(server.port, timeout_s=0.2)
    try:
        with pytest.raises(StoreTimeoutError):
            read_generation(client, server.port)
    finally:
        client.close()


@pytest.mark.parametrize("text", [b"MOVED garbage", b"ASK 12 nocolon", b"MOVED x 1.2.3.4:5"])
def test_a_malformed_redirect_answering_a_control_call_is_a_typed_error(
    serve: object, text: bytes
) -> None:
    # redis-py parses a MOVED / ASK into slot and address: garbage there was its ValueError,
    # which went past every typed handler (a review's); the connection stays in step
    server = serve(handshake_then(b"-" + text + b"\r\n"))  # type: ignore[operator]
    client = _client(server.port)
    try:
        for _ in range(2):
            with pytest.raises(StoreCommandError, match=text.decode()):
                read_generation(client, server.port)
    finally:
        client.close()


def test_a_malformed_handshake_reply_is_a_typed_protocol_error(serve: object) -> None:
    def answer(name: bytes) -> bytes:
        return b"+OK\r\n"  # HELLO answered with a string, not a map

    server = serve(answer)  # type: ignore[operator]
    reading_the_generation_raises(server.port, StoreCommandError, "handshake")


def test_pipelined_control_replies_are_bounded_each_not_together(serve: object) -> None:
    """Many small replies in one pipeline (a lookup) stay within the bound however many."""
    server = serve(handshake_then(b"$1\r\n1\r\n"))  # type: ignore[operator]
    client = _client(server.port)
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(2000):
            pipe.get(f"k{i}")
        assert pipe.execute() == [b"1"] * 2000
    finally:
        client.close()


def test_the_bound_is_an_exception_redis_py_types(serve: object) -> None:
    """(Without kvstore's translation: redis-py's own InvalidResponse, the connection closed.)"""
    server = serve(handshake_then(_huge_generation))  # type: ignore[operator]
    client = _client(server.port, timeout_s=5.0)
    try:
        with pytest.raises(rex.InvalidResponse):
            client.get("kv:vllm:generation")
        pool = client.connection_pool
        assert all(c._sock is None for c in pool.made())  # type: ignore[attr-defined]
    finally:
        client.close()


def _array_of(count: int, each: int = 1024) -> Callable[[socket.socket], None]:
    """An array of ``count`` strings of ``each`` bytes, as fast as the client takes it."""

    def send(conn: socket.socket) -> None:
        conn.sendall(b"*%d\r\n" % count)
        item = b"$%d\r\n" % each + b"x" * each + b"\r\n"
        with contextlib.suppress(OSError):  # (the client hangs up at the bound)
            for _ in range(count):
                conn.sendall(item)

    return send


@pytest.mark.parametrize(
    ("reply", "peak_bound"),
    [
        (_huge_generation, 3 * MAX_CONTROL_REPLY_BYTES),  # 128 MiB of one bulk string
        # found by a review: the bound read hiredis's buffer, which it trims as it builds an
        # array's elements, so a 1 GiB array never looked larger than 64 KiB and was taken
        # whole
        (_array_of(64 << 10), 4 * MAX_CONTROL_REPLY_BYTES),  # 64 MiB of an array
    ],
    ids=["bulk", "array"],
)
def test_a_huge_control_reply_costs_bounded_memory_and_fails_typed(
    serve: object, reply: Callable[[socket.socket], None], peak_bound: int
) -> None:
    """Bounded by the bytes that came, not by what hiredis buffers."""
    server = serve(handshake_then(reply))  # type: ignore[operator]
    client = _client(server.port, timeout_s=5.0)
    tracemalloc.start()
    try:
        with pytest.raises(StoreCommandError, match="control replies"):
            read_generation(client, server.port)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        client.close()
    assert peak < peak_bound, f"peak {peak >> 20} MiB"


def test_an_array_declaring_billions_of_elements_is_a_typed_protocol_error(
    serve: object,
) -> None:
    server = serve(handshake_then(b"*4000000000\r\n"))  # type: ignore[operator]
    reading_the_generation_raises(server.port, StoreCommandError, "more elements than memory")


def test_a_sentinel_client_never_reads_the_rest_of_a_refused_reply_as_the_next_ones() -> None:
    """Found by a review: redis-py's Sentinel connections go back to the pool after an error
    that is not a ConnectionError, so a reply refused half-read answered the next command:
    every later GET got an earlier key's value. The socket is shut down at the bound."""
    with RedisServer() as master, SentinelServer("kvs", master.port) as sentinel:
        plain = redis.Redis(port=master.port)
        plain.set("big", b"B" * (5 << 20))
        for i in range(20):
            plain.set(f"key{i}", f"value-of-key{i}")
        plain.close()
        client = make_client(parse_url(sentinel.url()), socket_timeout_s=5.0)
        address = parse_url(sentinel.url())
        wrong = []
        try:
            for i in range(20):
                with (
                    contextlib.suppress(StoreCommandError),
                    translated_errors(address.safe_url, "GET"),
                ):
                    client.get("big")
                with translated_errors(address.safe_url, "GET"):
                    got = client.get(f"key{i}")
                if got != f"value-of-key{i}".encode():
                    wrong.append((i, got[:20] if isinstance(got, bytes) else got))
        finally:
            client.close()
        assert not wrong, wrong


def _never(conn: socket.socket) -> None:
    """No reply at all (the client gives up; its hang-up ends the wait)."""
    with contextlib.suppress(OSError):
        conn.recv(1)


def test_a_sentinels_huge_reply_costs_bounded_memory_and_the_next_sentinel_is_asked(
    serve: object,
) -> None:
    """The sentinels' connections were redis-py's own, unbounded: a 300 MiB reply to the
    master's address was read whole (888 MiB peak) and then crashed untyped (a review); and
    bounded, a reply over the bound stopped the search instead of asking the next sentinel."""
    huge = serve(  # type: ignore[operator]
        lambda name: HELLO if name == b"HELLO" else _huge_generation
    )
    with RedisServer() as master, SentinelServer("kvs", master.port) as sentinel:
        redis.Redis(port=master.port).set("kv:vllm:generation", b"7")
        address = parse_url(f"redis-sentinel://127.0.0.1:{huge.port},127.0.0.1:{sentinel.port}/kvs")
        client = make_client(address, socket_timeout_s=5.0)
        tracemalloc.start()
        try:
            with translated_errors(address.safe_url, "GET"):
                assert client.get("kv:vllm:generation") == b"7"
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            client.close()
    assert peak < 3 * MAX_CONTROL_REPLY_BYTES, f"peak {peak >> 20} MiB"


def test_a_hung_sentinel_is_asked_twice_at_most_not_retried_with_backoff(serve: object) -> None:
    """redis-py's default retry (three more tries, with backoff) made a sentinel that never
    answers cost 30 s at a 1 s socket timeout (a review)."""
    asked: list[bytes] = []

    def answer(name: bytes) -> object:
        asked.append(name)
        return _never

    sentinel = serve(answer)  # type: ignore[operator]
    address = parse_url(f"redis-sentinel://127.0.0.1:{sentinel.port}/kvs")
    client = make_client(address, socket_timeout_s=0.5, connect_timeout_s=0.5)
    try:
        with pytest.raises(StoreUnavailableError), translated_errors(address.safe_url, "GET"):
            client.get("kv:vllm:generation")
    finally:
        client.close()
    assert len(asked) <= 2, asked  # (one immediate retry of a broken connection)


def _lookup_server(
    serve: object, exists: bytes, pause_s: float = 0.0, get: bytes = b"$-1\r\n"
) -> ScriptedServer:
    """A server answering each EXISTS of a lookup with ``exists`` (after ``pause_s``)."""

    def answer(name: bytes) -> bytes:
        if name == b"HELLO":
            return HELLO
        if name == b"EXISTS":
            time.sleep(pause_s)
            return exists
        if name == b"GET":
            return get
        return b"+OK\r\n"

    return serve(answer)  # type: ignore[operator,no-any-return]


def _buffer(port: int, timeout_s: float = 2.0) -> LookupBuffer:
    return LookupBuffer.from_url(
        f"redis://127.0.0.1:{port}/0",
        namespace="t",
        fingerprint="fp",
        socket_timeout_s=timeout_s,
        control_timeout_s=timeout_s,
        check=False,
    )


def test_a_lookups_replies_are_bounded_together_in_size(serve: object) -> None:
    """Each reply within its own bound, the pipeline's together past it: refused at the bound,
    typed (a review's server answered 512 EXISTS with 3.75 MiB each: 2 GiB for one lookup)."""
    each = MAX_CONTROL_REPLY_BYTES // 4
    server = _lookup_server(serve, b"$%d\r\n" % each + b"1" * each + b"\r\n")
    buf = _buffer(server.port)
    try:
        with pytest.raises(StoreReplyTooLargeError, match="pipeline's replies"):
            buf.longest_prefix([f"h{i}" for i in range(16)])
    finally:
        buf.close()


def test_a_lookups_replies_are_bounded_together_in_time(serve: object) -> None:
    """Each reply within the socket timeout (0.3 s), 20 of them 3 s: the lookup ends typed at
    its budget (the timeout plus its bytes' time), not after every reply."""
    server = _lookup_server(serve, b":1\r\n", pause_s=0.15)
    buf = _buffer(server.port, timeout_s=0.3)
    try:
        with pytest.raises(StoreTimeoutError):
            buf.longest_prefix([f"h{i}" for i in range(20)])
    finally:
        buf.close()


@pytest.mark.parametrize("reply", [b"$3\r\nabc\r\n", b"$2\r\n-5\r\n", b"+1\r\n", b"*0\r\n"])
def test_an_integer_reply_that_is_not_an_integer_is_a_typed_error(
    serve: object, reply: bytes
) -> None:
    """(Before: ``int()`` of it, an untyped ValueError past the proxy's handlers -- or a
    string of digits taken as a count.)"""
    server = _lookup_server(serve, reply)
    buf = _buffer(server.port)
    try:
        with pytest.raises(StoreCommandError, match="where an integer is due"):
            buf.longest_prefix(["h0", "h1"])
        with pytest.raises(StoreCommandError, match="where an integer is due"):
            buf.block_info(["h0"])
    finally:
        buf.close()


@pytest.mark.parametrize("core", ["python", "native"])
def test_a_servers_error_text_is_printable_and_cut_in_every_message(
    serve: object, monkeypatch: pytest.MonkeyPatch, core: str
) -> None:
    """A server's error line with a newline and an ANSI escape forged a log line; one of 3 MB
    went whole into the exception (a review's). Values' path (wire.py, either core) and the
    control path (hiredis) alike."""
    if core == "native" and not native_available():
        pytest.skip("the compiled core is not built here")
    monkeypatch.setenv("KVSTORE_WIRE_CORE", core)
    text = b"-ERR x\n2031-01-01 CRITICAL [vllm] forged \x1b[31mred" + b"y" * 5_000
    # (hiredis refuses a bare newline in an error line itself: the control path's has none)
    for call, forged in (
        (LookupBuffer.select, text + b"\r\n"),
        (LookupBuffer.longest_prefix, text.replace(b"\n", b" ") + b"\r\n"),
    ):
        # (a server each: a scripted one serves one connection at a time)
        buf = _buffer(_lookup_server(serve, forged, get=forged).port)
        try:
            with pytest.raises(StoreCommandError) as raised:
                call(buf, ["h0"])
        finally:
            buf.close()
        message = str(raised.value)
        assert "\n" not in message and "\x1b" not in message, message[:200]
        assert "forged" in message and len(message) < 1000


def test_a_slow_handshake_is_not_counted_against_a_lookups_replies(serve: object) -> None:
    """The batch's clock starts at its first reply: a fresh connection's HELLO answered in
    0.3 s, then the lookup's replies in 0.3 s, each within the 0.5 s socket timeout, is no
    timeout (a review found the handshake counted in the batch's budget)."""

    def answer(name: bytes) -> bytes:
        if name == b"HELLO":
            time.sleep(0.3)
            return HELLO
        if name == b"EXISTS":
            time.sleep(0.15)
            return b":1\r\n"
        return b"$-1\r\n" if name == b"GET" else b"+OK\r\n"

    buf = _buffer(serve(answer).port, timeout_s=0.5)  # type: ignore[operator]
    try:
        assert buf.longest_prefix(["h0", "h1"]) == 2
    finally:
        buf.close()


def _slots(*ranges: bytes) -> bytes:
    return b"*%d\r\n" % len(ranges) + b"".join(ranges)


def _range(first: int, last: int, host: bytes, port: bytes = b":7000\r\n") -> bytes:
    return b"*3\r\n:%d\r\n:%d\r\n*2\r\n$%d\r\n%s\r\n%s" % (first, last, len(host), host, port)


@pytest.mark.parametrize(
    "slot_map",
    [
        _slots(_range(0, 2_000_000, b"127.0.0.1")),  # redis-py made a dict entry per slot
        _slots(_range(0, 16383, b"127.0.0.1", b"$3\r\nabc\r\n")),  # a port that is no number
        _slots(_range(0, 16383, b"a" * 70 + b".example")),  # a label IDNA refuses, cached
        _slots(_range(0, 16383, "x\u202eevil".encode())),  # not ASCII
        b"$-1\r\n",  # nil
        _slots(*(_range(i, i, b"127.0.0.1", b":%d\r\n" % (1000 + i)) for i in range(1001))),
        _slots(_range(0, 16383, b"a..b")),  # an empty label: the resolver's UnicodeError
        _slots(*[_range(0, 16383, b"127.0.0.1")] * 2048),  # 5 s of redis-py's CPU
    ],
    ids=[
        "slots-past-16383",
        "port-string",
        "long-label",
        "not-ascii",
        "nil",
        "1001-masters",
        "empty-label",
        "overlapping",
    ],
)
def test_a_slot_map_no_cluster_sends_is_refused_typed_at_once_in_bounded_memory(
    serve: object, slot_map: bytes
) -> None:
    """Found in review: redis-py built its slot cache from CLUSTER SLOTS as it came -- a
    61-byte map naming slots 0 to 2**62 grew the process past 2.5 GiB; a wrong type raised
    ValueError, KeyError or TypeError untyped; a host the resolver refuses was cached and
    failed every later call; 2,000 masters opened 2,020 connections. The map is refused whole."""

    def answer(name: bytes) -> bytes:
        return HELLO if name == b"HELLO" else slot_map if name == b"CLUSTER" else b"+OK\r\n"

    server = serve(answer)  # type: ignore[operator]
    tracemalloc.start()
    try:
        with pytest.raises(StoreUnavailableError, match="slot map no Cluster sends"):
            LookupBuffer.from_url(f"redis-cluster://127.0.0.1:{server.port}", socket_timeout_s=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_a_password_the_server_repeats_in_an_error_never_reaches_a_message(
    serve: object,
) -> None:
    """Found in review, on a real Redis with HELLO renamed: "unknown command 'HELLO', with args
    beginning with: '3' 'AUTH' 'default' '<password>'" went into kvstore's exception."""

    def answer(name: bytes) -> bytes:
        if name == b"HELLO":
            return b"-ERR unknown command 'HELLO', with args beginning with: '3' 'AUTH' "\
                b"'default' 'S3cret-pw' \r\n"  # fmt: skip
        return b"+OK\r\n"

    server = serve(answer)  # type: ignore[operator]
    with pytest.raises(StoreCommandError) as raised:
        LookupBuffer.from_url(f"redis://:S3cret-pw@127.0.0.1:{server.port}/0")
    assert "unknown command 'HELLO'" in str(raised.value)
    assert "S3cret" not in str(raised.value)


def test_push_messages_ahead_of_a_reply_end_typed_not_in_a_recursion_error(
    serve: object,
) -> None:
    """Found in review: redis-py reads each RESP3 push ahead of a reply by recursing, and 500
    of them (7 KB) raised an untyped RecursionError past every handler."""
    push = b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n"
    server = serve(handshake_then(push * 2000 + b"$1\r\n7\r\n"))  # type: ignore[operator]
    reading_the_generation_raises(server.port, StoreCommandError, "push messages")
