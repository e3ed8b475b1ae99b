"""The bulk-reply reader against hiredis (redis-py's parser) on random reply streams cut into
random chunks, and on a real redis-server: both implementations of its receiving path, the
Python one and the compiled core (``core``), under the same tests."""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import hiredis
import pytest
import redis
from redis.exceptions import InvalidResponse, ResponseError

from kvstore.errors import DeadlinePassedError, StoreCommandError, StoreTimeoutError
from kvstore.net.connection import make_client, parse_url, translated_errors
from kvstore.net.transport import Transport
from kvstore.net.wire import (
    Oversize,
    ReplyReader,
    WireCore,
    native_available,
    pack_set,
    send_buffers,
)
from testing.scripted_server import ScriptedServer

CORES = [
    WireCore.PYTHON,
    pytest.param(
        WireCore.NATIVE,
        marks=pytest.mark.skipif(not native_available(), reason="the compiled core not built"),
    ),
]


@pytest.fixture(params=CORES, ids=lambda c: c.value)
def core(request: pytest.FixtureRequest) -> WireCore:
    return request.param  # type: ignore[no-any-return]


class ChunkedSocket:
    """A socket whose recv_into hands out a byte stream in the chunk sizes it was given."""

    def __init__(self, data: bytes, rng: random.Random) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.rng = rng

    def recv_into(self, view: memoryview) -> int:
        n = min(
            len(view), len(self.data) - self.pos, self.rng.choice([1, 2, 7, 100, 4096, 1 << 20])
        )
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


class Feeder:
    """A real socket whose peer sends a byte stream in random chunks, now and then pausing, so
    the compiled core's receives end mid-line and mid-value as ChunkedSocket's do."""

    def __init__(self, data: bytes, rng: random.Random, cut: bool = False) -> None:
        self.sock, self._peer = socket.socketpair()
        self._cut = cut
        self.sock.settimeout(10)
        chunks, pos = [], 0
        while pos < len(data):
            n = rng.choice([1, 2, 7, 100, 4096, 1 << 20])
            chunks.append((data[pos : pos + n], rng.random() < 0.05))
            pos += n
        self._thread = threading.Thread(target=self._send, args=(chunks,), daemon=True)
        self._thread.start()

    def _send(self, chunks: list[tuple[bytes, bool]]) -> None:
        try:
            for chunk, pause in chunks:
                self._peer.sendall(chunk)
                if pause:
                    time.sleep(0.001)
            if self._cut:  # the connection ends here, mid-reply
                self._peer.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader closed its end (a test that stops reading early)

    def close(self) -> None:
        self.sock.close()
        self._thread.join(10)
        self._peer.close()


@contextlib.contextmanager
def reading(
    stream: bytes, rng: random.Random, core: WireCore, cut: bool = False
) -> Iterator[ReplyReader]:
    """A reader of ``stream`` through ``core``: Python's over a fake socket (which ends where
    the stream does), the compiled core's over a real one (``cut``: the peer ends it there)."""
    if core is WireCore.PYTHON:
        yield ReplyReader(ChunkedSocket(stream, rng), core)  # type: ignore[arg-type]
        return
    feeder = Feeder(stream, rng, cut)
    try:
        reader = ReplyReader(feeder.sock, core)
        assert reader.native
        yield reader
    finally:
        feeder.close()


def random_reply(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.1:
        return b"$-1\r\n"
    if kind < 0.15:
        return b"_\r\n"
    if kind < 0.2:
        return b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    size = rng.choice([0, 1, 2, 13, 4095, 65536, 65537, 200_000])
    body = bytes(rng.getrandbits(8) for _ in range(min(size, 64))) * (size // 64 + 1)
    body = body[:size].replace(b"x", b"\r\n"[: rng.randint(0, 2)] or b"x")[:size]
    body = body.ljust(size, b"\n")
    return b"$%d\r\n%s\r\n" % (len(body), body)


@pytest.mark.parametrize("seed", range(40))
def test_random_reply_streams_parse_like_hiredis(seed: int, core: WireCore) -> None:
    rng = random.Random(seed)
    replies = [random_reply(rng) for _ in range(rng.randint(1, 30))]
    stream = b"".join(replies)
    reference = hiredis.Reader()
    reference.feed(stream)
    with reading(stream, rng, core) as reader:
        for _ in replies:
            want = reference.gets()
            capacity = rng.choice([0, 10, 4096, 70_000, 300_000])
            new = rng.random() < 0.3  # into a new buffer of its size (read_bulk_new)
            dest = memoryview(bytearray(capacity))

            def read(new: bool = new, dest: memoryview = dest, capacity: int = capacity) -> object:
                return reader.read_bulk_new(capacity) if new else reader.read_bulk_into(dest)

            if isinstance(want, hiredis.ReplyError):
                with pytest.raises(ResponseError, match="WRONGTYPE"):
                    read()
                continue
            got = read()
            if want is None:
                assert got is None
            elif len(want) > capacity:
                assert got == Oversize(len(want))
            elif new:
                assert isinstance(got, memoryview) and bytes(got) == want
            else:
                assert got == len(want) and bytes(dest[: len(want)]) == want
    assert reference.gets() is False  # both consumed the whole stream


@pytest.mark.parametrize(
    "garbage",
    [
        b"+OK\r\n",
        b":12\r\n",
        b"$abc\r\n",
        b"$3\r\nabcXY",
        b"*2\r\n",
        b"$99999999999999999999999\r\n",
        b"$ 3\r\nabc\r\n",  # forms Python's int() takes and no server sends: both refuse
        b"$+3\r\nabc\r\n",
        b"$1_0\r\n0123456789\r\n",
        b"$-\r\n",
        b"$" + b"9" * 5000,  # a line that never ends
    ],
)
def test_replies_other_than_bulk_strings_are_refused(garbage: bytes, core: WireCore) -> None:
    with reading(garbage, random.Random(0), core) as reader, pytest.raises(InvalidResponse):
        reader.read_bulk_into(memoryview(bytearray(16)))


@pytest.mark.parametrize("stream", [b"$100\r\n" + b"x" * 40, b"$10", b"$4\r\nabcd"])
def test_a_connection_cut_mid_reply_is_a_connection_error(stream: bytes, core: WireCore) -> None:
    cut = pytest.raises(redis.exceptions.ConnectionError, match="closed")
    with reading(stream, random.Random(1), core, cut=True) as reader, cut:
        reader.read_bulk_into(memoryview(bytearray(200)))


@pytest.mark.redis
def test_pipelined_gets_from_a_real_server_land_in_place(redis_url: str, core: WireCore) -> None:
    client = redis.Redis.from_url(redis_url)
    values = [bytes(random.Random(i).getrandbits(8) for _ in range(1000)) * i for i in range(6)]
    for i, v in enumerate(values):
        client.set(f"k{i}", v)
    client.lpush("list", "x")
    conn = client.connection_pool.get_connection()
    try:
        keys = [f"k{i}" for i in range(len(values))] + ["missing", "list"]
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        reader = ReplyReader(conn._sock, core)  # type: ignore[arg-type]
        assert reader.native == (core is WireCore.NATIVE)
        for v in values:
            dest = bytearray(len(v) + 5)
            assert reader.read_bulk_into(memoryview(dest)) == len(v) and dest[: len(v)] == v
        assert reader.read_bulk_into(memoryview(bytearray(8))) is None
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            reader.read_bulk_into(memoryview(bytearray(8)))
        assert conn.send_command("PING") is None and conn.read_response() == b"PONG"  # in sync
    finally:
        client.connection_pool.release(conn)


class TrickleSocket:
    """A socket whose sendmsg takes a random prefix of what it is offered (partial sends)."""

    def __init__(self, rng: random.Random) -> None:
        self.sent = bytearray()
        self.rng = rng

    def sendmsg(self, buffers: list[memoryview]) -> int:
        offered = b"".join(bytes(b) for b in buffers)
        n = self.rng.randint(1, len(offered))
        self.sent += offered[:n]
        return n


@pytest.mark.parametrize("seed", range(20))
def test_set_commands_sent_in_pieces_equal_redis_pys_packing(seed: int) -> None:
    """What ``pack_set`` + ``send_buffers`` put on the wire, through random partial sends, is
    byte for byte what redis-py sends for the same SET."""
    rng = random.Random(seed)
    conn = redis.Connection()
    sock = TrickleSocket(rng)
    want = b""
    buffers: list[object] = []
    for _ in range(rng.randint(1, 8)):
        key = b"kv:%d" % rng.getrandbits(32)
        parts = [
            bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 5, 300])))
            for _ in range(rng.randint(1, 40))
        ]
        px = rng.choice([None, 1, 3_600_000])
        args = ("SET", key, b"".join(parts)) + (() if px is None else ("PX", px))
        want += b"".join(conn.pack_command(*args))
        buffers += pack_set(key, [memoryview(p) for p in parts], px)
    send_buffers(sock, buffers)  # type: ignore[arg-type]
    assert bytes(sock.sent) == want


def test_status_replies_and_errors() -> None:
    stream = (
        b"+OK\r\n-OOM command not allowed when used memory > 'maxmemory'.\r\n+OK\r\n$1\r\nx\r\n"
    )
    reader = ReplyReader(ChunkedSocket(stream, random.Random(0)))  # type: ignore[arg-type]
    assert reader.read_status() == b"OK"
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # typed as redis-py types it
        reader.read_status()
    assert reader.read_status() == b"OK"  # the stream stays usable after an error reply
    with pytest.raises(InvalidResponse):
        reader.read_status()


def random_status(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.7:
        return b"+OK\r\n"
    if kind < 0.8:
        return b"+QUEUED\r\n"
    if kind < 0.9:
        return b"-MOVED 3999 127.0.0.1:6381\r\n"
    return b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"


@pytest.mark.parametrize("seed", range(60))
def test_skipping_ok_replies_reads_a_stream_as_hiredis_does(seed: int) -> None:
    # SET replies are consumed by skip_ok (runs of +OK) and read_status (anything else),
    # as the transport does; each must be what hiredis parses, and the stream must stay in step
    rng = random.Random(seed)
    replies = [random_status(rng) for _ in range(rng.randint(1, 60))]
    stream = b"".join(replies) + b"$1\r\nx\r\n"  # a marker after the replies: never consumed
    reference = hiredis.Reader()
    reference.feed(stream)
    want = [reference.gets() for _ in replies]
    reader = ReplyReader(ChunkedSocket(stream, rng))  # type: ignore[arg-type]
    got: list[object] = []
    while len(got) < len(replies):
        got.extend([b"OK"] * reader.skip_ok(len(replies) - len(got)))
        if len(got) < len(replies):
            try:
                got.append(reader.read_status())
            except ResponseError as exc:  # redis-py's classes drop a known code (OOM)
                got.append(("error", str(exc)))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, hiredis.ReplyError):
            assert isinstance(g, tuple) and str(w).endswith(g[1])
        else:
            assert g == w
    assert reader.read_bulk_into(memoryview(bytearray(4))) == 1  # the marker, in step


def random_claim_reply(rng: random.Random) -> bytes:
    """What a claim script answers: a table of numbers, a nil (its ``false``), or an error."""
    kind = rng.random()
    if kind < 0.1:
        return rng.choice([b"$-1\r\n", b"*-1\r\n", b"_\r\n"])
    if kind < 0.2:
        return rng.choice(
            [b"-NOSCRIPT No matching script. Please use EVAL.\r\n", b"-NOPERM no RENAME\r\n"]
        )
    values = [rng.choice([0, 1, 2, 3, -1, 65536, 2**40]) for _ in range(rng.randint(0, 40))]
    return b"*%d\r\n" % len(values) + b"".join(b":%d\r\n" % v for v in values)


@pytest.mark.parametrize("seed", range(40))
def test_claim_replies_read_as_hiredis_reads_them(seed: int) -> None:
    # each claim reply is followed by a GET's bulk reply, as a consuming read sends them:
    # the stream must stay in step
    rng = random.Random(seed)
    replies = [random_claim_reply(rng) for _ in range(rng.randint(1, 20))]
    stream = b"".join(r + b"$2\r\nok\r\n" for r in replies)
    reference = hiredis.Reader()
    reference.feed(stream)
    reader = ReplyReader(ChunkedSocket(stream, rng))  # type: ignore[arg-type]
    for _ in replies:
        want = reference.gets()
        if isinstance(want, hiredis.ReplyError):
            with pytest.raises(ResponseError) as raised:
                reader.read_int_array(40)
            assert str(want).endswith(str(raised.value))
        else:
            assert reader.read_int_array(40) == want
        assert reference.gets() == b"ok"
        dest = memoryview(bytearray(2))
        assert reader.read_bulk_into(dest) == 2 and bytes(dest) == b"ok"
    assert reference.gets() is False


@pytest.mark.parametrize(
    "garbage",
    [
        b"+OK\r\n",
        b"$3\r\nabc\r\n",
        b"*2\r\n:1\r\n$1\r\nx\r\n",
        b"*x\r\n",
        b"*1\r\n:z\r\n",
        # counts and integers Python's int() takes and Redis never sends
        b"*-7\r\n",
        b"* 2\r\n:1\r\n:1\r\n",
        b"*+2\r\n:1\r\n:1\r\n",
        b"*1_0\r\n",
        b"*1\r\n: 5\r\n",
        b"*1\r\n:1_0\r\n",
        b"*1\r\n:" + b"9" * 30 + b"\r\n",
    ],
)
def test_claim_replies_of_another_shape_are_refused(garbage: bytes) -> None:
    reader = ReplyReader(ChunkedSocket(garbage, random.Random(0)))  # type: ignore[arg-type]
    with pytest.raises(InvalidResponse):
        reader.read_int_array(40)


def test_a_claim_reply_longer_than_asked_for_is_refused_before_its_elements() -> None:
    # a count of a trillion, then integers for as long as the server likes: refused on its
    # header (the reader's memory grew with the count, up to its deadline, before)
    stream = b"*999999999999\r\n" + b":1\r\n" * 1000
    reader = ReplyReader(ChunkedSocket(stream, random.Random(0)))  # type: ignore[arg-type]
    with pytest.raises(InvalidResponse, match="at most 8"):
        reader.read_int_array(8)
    reader = ReplyReader(ChunkedSocket(b"*9\r\n" + b":1\r\n" * 9, random.Random(0)))  # type: ignore[arg-type]
    with pytest.raises(InvalidResponse):
        reader.read_int_array(8)
    reader = ReplyReader(ChunkedSocket(b"*8\r\n" + b":1\r\n" * 8, random.Random(0)))  # type: ignore[arg-type]
    assert reader.read_int_array(8) == [1] * 8


@pytest.mark.parametrize(
    "text", ["MOVED garbage", "ASK 12 nocolon", "MOVED x 1.2.3.4:5", "MOVED", "ASK "]
)
def test_a_malformed_redirect_is_a_plain_error_reply(text: str, core: WireCore) -> None:
    # redis-py parses MOVED / ASK into slot and address: a server's garbage there raised its
    # ValueError, which no typed handler caught
    stream = f"-{text}\r\n".encode() * 3 + b"$2\r\nok\r\n"
    with reading(stream, random.Random(0), core) as reader:
        for read in (
            lambda: reader.read_bulk_into(memoryview(bytearray(4))),
            reader.read_status,
            lambda: reader.read_int_array(4),
        ):
            with pytest.raises(ResponseError) as raised:
                read()
            assert type(raised.value) is ResponseError and str(raised.value) == text
        assert reader.read_bulk_into(memoryview(bytearray(4))) == 2  # the stream in step


# ---------------------------------------------------------------- dripping servers
def _commands(buf: bytearray) -> list[list[bytes]]:
    """Take the whole RESP commands (arrays of bulk strings) off the front of ``buf``."""
    out = []
    while True:
        pos, args = 0, []
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return out
        count, pos = int(buf[1:end]), end + 2
        for _ in range(count):
            end = buf.find(b"\r\n", pos)
            if end < 0:
                return out
            size = int(buf[pos + 1 : end])
            if len(buf) < end + 2 + size + 2:
                return out
            args.append(bytes(buf[end + 2 : end + 2 + size]))
            pos = end + 2 + size + 2
        del buf[:pos]
        out.append(args)


# what Redis answers to redis-py's handshake (RESP3); anything else gets +OK
_HANDSHAKE = {b"PING": b"+PONG\r\n", b"HELLO": b"%1\r\n$5\r\nproto\r\n:3\r\n"}


class DripServer:
    """A loopback server. To a GET or GETRANGE (or at once, with ``at_once``) it answers
    ``head``, then ``drip`` one byte every ``every_s`` seconds (over and over), for as long as
    the client listens; to redis-py's handshake what Redis answers. One connection at a
    time."""

    def __init__(
        self, head: bytes, *, at_once: bool = False, drip: bytes = b"x", every_s: float = 0.05
    ) -> None:
        self.head, self.at_once, self.drip, self.every_s = head, at_once, drip, every_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.dripping = threading.Event()  # set once a reply has started dripping
        self.thread = threading.Thread(target=self._serve, name="drip-server", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener was closed: stop
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        buf = bytearray()
        try:
            while not self.at_once:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                for command in _commands(buf):
                    name = command[0].upper()
                    if name in (b"GET", b"GETRANGE"):
                        self._drip(conn)
                        return
                    conn.sendall(_HANDSHAKE.get(name, b"+OK\r\n"))
            self._drip(conn)
        except OSError:  # the client hung up: what it should do
            return

    def _drip(self, conn: socket.socket) -> None:
        conn.sendall(self.head)
        self.dripping.set()
        i = 0
        while not self.stopped.wait(self.every_s):
            conn.sendall(self.drip[i % len(self.drip) : i % len(self.drip) + 1])
            i += 1

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def drip_server(request: pytest.FixtureRequest) -> Iterator[DripServer]:
    head, at_once, *drip = request.param
    server = DripServer(head, at_once=at_once, drip=drip[0] if drip else b"x")
    yield server
    server.close()


def _ends(call: Callable[[], object], within_s: float = 10.0) -> BaseException | object:
    """Run ``call`` on a thread and wait for it to end (the server's close ends it if the code
    under test would wait for ever); what it returned or raised."""
    done = threading.Event()
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=run, name="drip-reader", daemon=True)
    worker.start()
    try:
        assert done.wait(within_s), "the read did not end: a dripping server held it"
    finally:
        _ends.workers.append(worker)  # type: ignore[attr-defined]
    return outcome[0]


_ends.workers = []  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _no_leaked_reader_threads() -> Iterator[None]:
    yield
    while _ends.workers:  # type: ignore[attr-defined]
        worker = _ends.workers.pop()  # type: ignore[attr-defined]
        worker.join(10)
        assert not worker.is_alive()


def _connected(server: DripServer, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(timeout_s)  # as redis-py's socket_timeout
    return sock


@pytest.mark.parametrize(
    ("drip_server", "read"),
    [
        # a value that fits: received straight into its destination
        ((b"$100000\r\n", True), lambda r: r.read_bulk_into(memoryview(bytearray(200_000)))),
        ((b"$100000\r\n", True), lambda r: r.read_bulk_new(200_000)),
        # an oversized one: drained, not allocated
        ((b"$100000\r\n", True), lambda r: r.read_bulk_into(memoryview(bytearray(16)))),
        ((b"$100000\r\n", True), lambda r: r.read_bulk_new(16)),
        # status and array replies too
        ((b"+O", True), lambda r: r.read_status()),
        ((b"", True, b"+OK\r\n"), lambda r: r.skip_ok(1000)),
        ((b"*3\r\n:1\r\n", True), lambda r: r.read_int_array(6)),
    ],
    indirect=["drip_server"],
)
def test_a_reply_dripped_a_byte_at_a_time_ends_with_a_timeout(
    drip_server: DripServer, read: Callable[[ReplyReader], object], core: WireCore
) -> None:
    """Issue: the socket timeout bounded each recv, not the reply: a server sending a byte
    every 50 ms (under the 0.2 s timeout) held a 100 kB read for 80 minutes."""
    with _connected(drip_server, 0.2) as sock:
        reader = ReplyReader(sock, core)
        got = _ends(lambda: read(reader))
        # (whether the reply's deadline or, on a slow machine, one recv's timeout ended it)
        assert isinstance(got, redis.exceptions.TimeoutError), got
        assert sock.gettimeout() == 0.2  # its own timeout is back


@pytest.mark.parametrize("drip_server", [(b"$100000000\r\n", True)], indirect=True)
def test_a_bulk_reply_too_large_to_drain_fails_at_once_without_draining(
    drip_server: DripServer, core: WireCore
) -> None:
    with _connected(drip_server, 0.2) as sock:
        got = _ends(lambda: ReplyReader(sock, core).read_bulk_into(memoryview(bytearray(16))))
        assert isinstance(got, InvalidResponse) and "too large to drain" in str(got)


def _one_get_through_a_transport(drip_server: DripServer, dest: int) -> tuple[object, bool]:
    """One value GET into ``dest`` bytes through a Transport (0.2 s socket timeout): what it
    returned or raised, kvstore's errors typed, and whether every connection its pool holds
    was closed (none went back to the pool with a reply half read)."""
    address = parse_url(f"redis://127.0.0.1:{drip_server.port}/0")
    client = make_client(address, socket_timeout_s=0.2, connect_timeout_s=5)
    transport = Transport(client, threads=1)
    transport.owns_clients = True

    def read() -> object:
        with translated_errors(address.safe_url, "GET"):
            return transport.get_values([("GET", b"k")], [memoryview(bytearray(dest))])

    try:
        got = _ends(read)
        pool = client.connection_pool
        connections = pool.made()  # type: ignore[attr-defined]
        return got, bool(connections) and all(c._sock is None for c in connections)
    finally:
        transport.close()


@pytest.mark.parametrize("drip_server", [(b"$100000\r\n", False)], indirect=True)
@pytest.mark.parametrize("dest", [16, 200_000])  # oversized (drained) or fitting
def test_a_dripped_get_through_the_transport_is_a_typed_timeout_and_drops_the_connection(
    drip_server: DripServer, dest: int
) -> None:
    got, all_closed = _one_get_through_a_transport(drip_server, dest)
    assert drip_server.dripping.is_set()
    assert isinstance(got, StoreTimeoutError), got
    assert all_closed  # not returned to the pool mid-reply


@pytest.mark.parametrize(
    "drip_server", [(b"-MOVED 3999 127.0.0.1:1\r\n$100000000\r\n", False)], indirect=True
)
def test_a_standalone_server_answering_moved_is_a_protocol_error_not_followed(
    drip_server: DripServer,
) -> None:
    """Issue 52: a value GET answered with MOVED by a standalone server was sent again
    through redis-py, which read the reply whole, unbounded. A redirection is a Cluster's
    answer: from one server it is a protocol error that drops the connection, typed."""
    got, all_closed = _one_get_through_a_transport(drip_server, 16)
    assert isinstance(got, StoreCommandError) and "standalone server answered" in str(got)
    assert all_closed


class SlowRepliesServer:
    """A loopback server that answers every GET or GETRANGE with ``value``, whole, after
    ``every_s`` seconds: each reply well within its own deadline, a batch of them as long as
    their number says. One connection at a time (``ScriptedServer``)."""

    def __init__(self, value: bytes, every_s: float) -> None:
        self.reply = b"$%d\r\n%s\r\n" % (len(value), value)
        self.every_s = every_s
        self.answered = 0
        self.server = ScriptedServer(self._answer)
        self.port = self.server.port

    def _answer(self, name: bytes) -> bytes:
        if name not in (b"GET", b"GETRANGE"):
            return _HANDSHAKE.get(name, b"+OK\r\n")
        time.sleep(self.every_s)
        self.answered += 1
        return self.reply

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def slow_server() -> Iterator[SlowRepliesServer]:
    server = SlowRepliesServer(b"v" * 4096, every_s=0.1)
    yield server
    server.close()


_GETS = 40  # at 0.1 s a reply: 4 s for the batch, each reply in 0.1 s of its 1.0 s


def test_a_batch_answered_slowly_ends_at_its_deadline_whatever_each_reply_keeps_to(
    slow_server: SlowRepliesServer, core: WireCore
) -> None:
    """Each reply came within its own deadline (the socket timeout plus its size), so a batch
    of them was not bounded at all: a load of 16 values from a server answering each just in
    time held its loader thread for 16 times that, long after the load's own deadline (seen in
    a review, left open a session). The batch's deadline ends it, typed, on both
    paths."""
    with _connected(slow_server, 1.0) as sock:
        sock.sendall(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n" * _GETS)
        reader = ReplyReader(sock, core, deadline=time.monotonic() + 0.5)
        read: list[object] = []

        def batch() -> object:
            for _ in range(_GETS):
                read.append(reader.read_bulk_into(memoryview(bytearray(8192))))
            return read

        got = _ends(batch)
        assert isinstance(got, DeadlinePassedError), got
        assert len(read) < _GETS and all(n == 4096 for n in read)
        assert sock.gettimeout() == 1.0  # its own timeout is back


@pytest.mark.parametrize("drip_server", [(b"$100000\r\n", True)], indirect=True)
def test_a_reply_dripped_within_its_own_deadline_ends_at_the_batchs(
    drip_server: DripServer, core: WireCore
) -> None:
    """Mid-reply: a byte every 50 ms keeps each recv within the 30 s socket timeout and the
    reply within its own deadline for 30.1 s; the batch's deadline ends it at 0.3 s (in C
    too, not only between replies), well within the 10 s the test waits."""
    with _connected(drip_server, 30.0) as sock:
        reader = ReplyReader(sock, core, deadline=time.monotonic() + 0.3)
        got = _ends(lambda: reader.read_bulk_into(memoryview(bytearray(200_000))))
        assert isinstance(got, DeadlinePassedError), got


def test_the_batchs_deadline_passing_mid_reply_ends_both_paths_alike(core: WireCore) -> None:
    """Found by a review: the deadline passing once a reply's header was read, its bytes all
    at hand, ended the Python path (it checks before every recv) while the compiled core read
    on (it checked only before a wait)."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(1.0)
        a.sendall(b"$100000\r\n" + b"v" * 100_000 + b"\r\n")  # (more than one scratch fill)
        deadline = time.monotonic() + 0.05
        reader = ReplyReader(b, core, deadline=deadline)

        def allocate(n: int) -> memoryview:
            while time.monotonic() <= deadline:  # the header is read: now let it pass
                time.sleep(0.01)
            return memoryview(bytearray(n))

        with pytest.raises(DeadlinePassedError):
            reader.read_bulk_new(200_000, allocate)


def test_a_batch_past_its_deadline_through_the_transport_drops_its_connection(
    slow_server: SlowRepliesServer,
) -> None:
    address = parse_url(f"redis://127.0.0.1:{slow_server.port}/0")
    client = make_client(address, socket_timeout_s=1.0, connect_timeout_s=5)
    transport = Transport(client, threads=1)
    transport.owns_clients = True
    try:
        dests = [memoryview(bytearray(8192)) for _ in range(_GETS)]
        commands = [("GET", b"k%d" % i) for i in range(_GETS)]

        def read() -> object:
            with translated_errors(address.safe_url, "GET"):
                return transport.get_values(commands, dests, deadline=time.monotonic() + 0.5)

        got = _ends(read)
        assert isinstance(got, DeadlinePassedError), got
        assert slow_server.answered < _GETS
        connections = client.connection_pool.made()  # type: ignore[attr-defined]
        assert connections and all(c._sock is None for c in connections)  # not mid-reply
        # and without one the batch is read whole, as before
        whole = transport.get_values(commands[:3], dests[:3])
        assert whole == [4096] * 3
    finally:
        transport.close()


def _slow_transport(server: SlowRepliesServer, socket_timeout_s: float) -> tuple[Any, Transport]:
    address = parse_url(f"redis://127.0.0.1:{server.port}/0")
    client = make_client(address, socket_timeout_s=socket_timeout_s, connect_timeout_s=5)
    transport = Transport(client, threads=2)
    transport.owns_clients = True
    return address, transport


def test_parts_queued_behind_a_busy_executor_end_at_the_batchs_deadline(
    slow_server: SlowRepliesServer,
) -> None:
    """Found by a review: a batch over several connections queues its parts on the executor
    saves and other batches share; a part still queued was waited for without the deadline."""
    address, transport = _slow_transport(slow_server, socket_timeout_s=1.0)
    release = threading.Event()
    busy = [transport.shards._pool().submit(release.wait, 30) for _ in range(2)]
    try:
        dests = [memoryview(bytearray(8192)) for _ in range(8)]
        commands = [("GET", b"k%d" % i) for i in range(8)]

        def read() -> object:
            with translated_errors(address.safe_url, "GET"):
                return transport.get_values(
                    commands, dests, connections=4, deadline=time.monotonic() + 0.3
                )

        got = _ends(read)  # (the executor's threads are held for 30 s)
        assert isinstance(got, DeadlinePassedError), got
    finally:
        release.set()
        for f in busy:
            f.result(10)
        transport.close()


class SlowReadingSocket:
    """A peer that takes one byte per sendmsg, each just within the socket timeout."""

    def __init__(self) -> None:
        self.timeout: float | None = 0.05
        self.sent = 0
        self.closed = threading.Event()

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def sendmsg(self, buffers: list[memoryview]) -> int:
        if self.closed.wait(0.001):  # a slow peer: each call returns before the timeout
            raise OSError("closed")
        self.sent += 1
        return 1


def test_a_peer_reading_a_byte_at_a_time_ends_a_send_with_a_timeout() -> None:
    sock = SlowReadingSocket()
    buffers = pack_set(b"k", [memoryview(bytes(100_000))], None)
    try:
        got = _ends(lambda: send_buffers(sock, buffers))  # type: ignore[arg-type]
    finally:
        sock.closed.set()  # ends a send the code under test would not end
    assert isinstance(got, redis.exceptions.TimeoutError) and "dropped" in str(got)
    assert 0 < sock.sent < 100_000 and sock.timeout == 0.05


def test_the_core_is_chosen_by_the_environment_and_never_reads_tls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstore.net import wire

    a, b = socket.socketpair()
    with a, b:
        monkeypatch.setenv("KVSTORE_WIRE_CORE", "python")
        assert not ReplyReader(a).native
        monkeypatch.setenv("KVSTORE_WIRE_CORE", "fast")
        with pytest.raises(ValueError, match="auto, native or python"):
            ReplyReader(a)
        monkeypatch.setenv("KVSTORE_WIRE_CORE", "auto")
        assert ReplyReader(a).native == native_available()
        tls = ssl.create_default_context().wrap_socket(
            socket.socket(), server_hostname="x", do_handshake_on_connect=False
        )
        with tls:  # its fd carries TLS records: only the Python path (through ssl) reads it
            assert not ReplyReader(tls).native
        monkeypatch.setattr(wire, "_core", None)  # a machine without a C compiler
        assert not ReplyReader(a).native
        monkeypatch.setenv("KVSTORE_WIRE_CORE", "native")
        with pytest.raises(wire.WireCoreMissing, match="compiler"):
            ReplyReader(a)


def test_a_native_read_waits_out_a_socket_timeout_of_weeks() -> None:
    """A timeout past 24.8 days overflowed the core's int of milliseconds: the read gave up
    after 1 ms (found by a review)."""
    if not native_available():
        pytest.skip("the compiled core not built")
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(3e6)
        threading.Timer(0.3, lambda: b.sendall(b"$2\r\nok\r\n")).start()
        dest = memoryview(bytearray(8))
        assert ReplyReader(a, WireCore.NATIVE).read_bulk_into(dest) == 2 and dest[:2] == b"ok"


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("timeout", [3.0, None])
def test_a_signal_handler_that_raises_ends_a_waiting_read(
    core: WireCore, timeout: float | None
) -> None:
    """Ctrl-C (here an alarm whose handler raises) ends a read that waits, at once, as
    Python's own socket calls do: the compiled core once held it to the socket timeout or,
    without one, the reply's deadline (found by a review)."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    a, b = socket.socketpair()
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        with a, b:
            a.settimeout(timeout)
            reader = ReplyReader(a, core)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            started = time.monotonic()
            with pytest.raises(Interrupted):
                reader.read_bulk_into(memoryview(bytearray(8)))
            assert time.monotonic() - started < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_reader_whose_socket_was_closed_reads_nobody_elses_replies(core: WireCore) -> None:
    """The compiled core once kept the descriptor's number: after another thread closed the
    socket (a pool disconnecting on shutdown), the next connection got that number and the old
    reader read its replies (found by a review)."""
    a, b = socket.socketpair()
    reader = ReplyReader(a, core)
    a.close()
    b.close()
    c, d = socket.socketpair()  # (takes the freed numbers)
    with c, d:
        d.sendall(b"$6\r\nOTHERS\r\n")
        with pytest.raises(redis.exceptions.ConnectionError):
            reader.read_bulk_into(memoryview(bytearray(8)))
        assert c.recv(64) == b"$6\r\nOTHERS\r\n"  # left for its own reader
