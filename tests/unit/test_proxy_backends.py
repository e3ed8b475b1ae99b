"""What a backend can do to the proxy: answers that drip, that never end, that are huge or
compressed, prefill params that are not the connector's, and clients that leave while the
proxy closes a backend's answer. Each backend is a small real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpcore
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from connector.proxy import backends as proxy_backends
from connector.proxy.server import ProxyConfig
from testing.proxy_servers import assert_openai_error, proxy_server, run_server

PARAMS = {"redis_kv": {"handoff": "h1", "num_blocks": 2, "opened": True, "generation": 0}}


class Backend:
    """A stand-in vLLM whose prefill answer (``max_tokens`` 1, no stream) and decode answer
    are the test's ``prefill`` and ``decode`` (bodies -> responses); it records the decode
    requests' bodies and headers."""

    def __init__(
        self,
        prefill: Callable[[dict], Response] | None = None,
        decode: Callable[[dict], Response] | None = None,
    ) -> None:
        self.prefill = prefill or (lambda body: JSONResponse({"kv_transfer_params": PARAMS}))
        self.decode = decode or (lambda body: JSONResponse({"choices": [{"text": "ok"}]}))
        self.decoded: list[dict] = []
        self.headers: list[dict[str, str]] = []
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = json.loads(await request.body())
            self.headers.append(dict(request.headers))
            if body.get("max_tokens") == 1 and not body.get("stream"):
                return self.prefill(body)
            self.decoded.append(body)
            return self.decode(body)

        @app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("ok")

        self._gen = run_server(app)
        self.url = next(self._gen)

    def stop(self) -> None:
        next(self._gen, None)


@pytest.fixture
def backends() -> Iterator[Callable[..., Backend]]:
    made: list[Backend] = []

    def make(**kw: Any) -> Backend:
        made.append(Backend(**kw))
        return made[-1]

    yield make
    for b in made:
        b.stop()


@pytest.fixture
def proxies() -> Iterator[Callable[..., tuple[str, Any]]]:
    """``proxies(cfg)``: (URL, app) of a proxy served until the test ends."""
    gens: list[Iterator[str]] = []

    def make(cfg: ProxyConfig) -> tuple[str, Any]:
        gen, url, app = proxy_server(cfg)
        gens.append(gen)
        return url, app

    yield make
    for g in gens:
        next(g, None)


def dripping(body: bytes, every_s: float, done: threading.Event) -> StreamingResponse:
    async def drip() -> AsyncIterator[bytes]:
        for i in range(len(body)):
            yield body[i : i + 1]
            await asyncio.sleep(every_s)
        done.set()

    return StreamingResponse(drip(), media_type="application/json")


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_an_answer_dripped_within_each_read_timeout_still_ends_at_the_deadline(
    backends: Callable[..., Backend], proxies: Callable[..., tuple[str, Any]], leg: str
) -> None:
    """``--timeout-s`` was httpx's per-read timeout: a server sending a byte more often held
    the client, its slot and its body's budget for as long as it liked (a review: 15.6 s at
    2 s). A whole answer now comes within it, or the client gets 504."""
    done = threading.Event()
    doc = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode()
    slow = lambda body: dripping(b" " * 40 + doc, 0.1, done)  # noqa: E731
    backend = backends(**{leg: slow})
    proxy, _ = proxies(ProxyConfig([backend.url], [backend.url], timeout_s=1.0))
    r = httpx.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
    err = assert_openai_error(r, 504)
    assert "within 1.0s" in err["message"]
    assert not done.is_set(), "the proxy waited for the whole drip"


def test_answers_over_the_limit_are_refused_unread_and_their_errors_cut_short(
    backends: Callable[..., Backend], proxies: Callable[..., tuple[str, Any]]
) -> None:
    """A prefill answer, a decode answer without stream and an error answer were read whole,
    however long: 100 MiB of params cost the proxy 400 MiB and were sent on to the decode
    server (a review)."""
    big = b'{"kv_transfer_params": {"redis_kv": {"handoff": "' + b"h" * (2 << 20) + b'"}}}'
    huge_prefill = backends(prefill=lambda body: Response(big, media_type="application/json"))
    cfg = ProxyConfig([huge_prefill.url], [huge_prefill.url], max_answer_bytes=1 << 20)
    proxy, _ = proxies(cfg)
    err = assert_openai_error(httpx.post(proxy + "/v1/completions", json={"prompt": "x"}), 502)
    assert "--max-answer-bytes" in err["message"]
    assert huge_prefill.decoded == []  # nothing went on

    answer = b'{"choices": [{"text": "' + b"t" * (2 << 20) + b'"}]}'
    huge_decode = backends(decode=lambda body: Response(answer, media_type="application/json"))
    proxy, _ = proxies(ProxyConfig([huge_decode.url], [huge_decode.url], max_answer_bytes=1 << 20))
    assert_openai_error(httpx.post(proxy + "/v1/completions", json={"prompt": "x"}), 502)

    error = b'{"error": {"message": "' + b"e" * (2 << 20) + b'"}}'
    failing = backends(prefill=lambda body: Response(error, 500, media_type="application/json"))
    proxy, _ = proxies(ProxyConfig([failing.url], [failing.url]))
    r = httpx.post(proxy + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and len(r.content) <= proxy_backends.MAX_ERROR_BODY_BYTES + 512


@pytest.mark.parametrize(
    ("params", "passed_on"),
    [
        ({**PARAMS, "other_connector": {"x": [1, 2]}}, PARAMS),  # only the connector's own
        ({"other_connector": {"x": 1}}, None),
        ({"redis_kv": {"handoff": {"nested": 1}}}, 502),
        ({"redis_kv": {"handoff": "h" * 300}}, 502),
        ({"redis_kv": {f"k{i}": i for i in range(40)}}, 502),
        ({"redis_kv": {"num_blocks": 2**70}}, 502),
        ({"redis_kv": [1]}, 502),
    ],
)
def test_a_prefill_servers_params_reach_the_decode_server_only_as_the_connectors(
    backends: Callable[..., Backend],
    proxies: Callable[..., tuple[str, Any]],
    params: dict,
    passed_on: Any,
) -> None:
    backend = backends(prefill=lambda body: JSONResponse({"kv_transfer_params": params}))
    proxy, _ = proxies(ProxyConfig([backend.url], [backend.url]))
    r = httpx.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
    if passed_on == 502:
        assert_openai_error(r, 502)
        assert backend.decoded == []
    else:
        assert r.status_code == 200, r.text
        assert backend.decoded[0].get("kv_transfer_params") == passed_on


def test_a_number_out_of_range_in_a_prefill_answer_is_the_servers_fault_not_the_clients(
    backends: Callable[..., Backend], proxies: Callable[..., tuple[str, Any]]
) -> None:
    """1e400 parsed as inf, which JSON cannot carry on: the client got 400 for it."""
    doc = b'{"kv_transfer_params": {"redis_kv": {"num_blocks": 1e400}}}'
    backend = backends(prefill=lambda body: Response(doc, media_type="application/json"))
    proxy, _ = proxies(ProxyConfig([backend.url], [backend.url]))
    assert_openai_error(httpx.post(proxy + "/v1/completions", json={"prompt": "x"}), 502)


def test_a_compressed_stream_reaches_the_client_readable(
    backends: Callable[..., Backend], proxies: Callable[..., tuple[str, Any]]
) -> None:
    """Streams are relayed byte for byte: a server (or a gateway before it) that compressed
    one sent the client gzip without saying so. The proxy asks for none, and passes the
    encoding on where a server sends one anyway."""
    events = b'data: {"choices": [{"text": "hello"}]}\n\ndata: [DONE]\n\n'

    def gzipped(body: dict) -> Response:
        async def once() -> AsyncIterator[bytes]:
            yield gzip.compress(events)

        return StreamingResponse(
            once(), media_type="text/event-stream", headers={"Content-Encoding": "gzip"}
        )

    backend = backends(decode=gzipped)
    proxy, _ = proxies(ProxyConfig([backend.url], [backend.url]))
    r = httpx.post(proxy + "/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.content == events  # (httpx decodes what it is told)
    assert {h.get("accept-encoding") for h in backend.headers} == {"identity"}


def test_a_client_that_leaves_while_an_answer_is_closed_leaves_no_connection_in_use(
    backends: Callable[..., Backend],
    proxies: Callable[..., tuple[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy stopped a request whose client left with ``Task.cancel``, which httpcore's
    shielded close of a response does not hold off: a cancel landing there left the pooled
    connection in use for ever (a review: 5 of 5; once the pool was used up every request
    waited ``timeout_s`` and failed). Here each close of an answer takes until the client has
    left; with two connections in all, two such leaks would leave the third request none."""
    monkeypatch.setattr(proxy_backends, "CONTROL_CONNECTIONS", 1)
    closing, left = threading.Event(), threading.Event()
    real_closed = httpcore.AsyncHTTP11Connection._response_closed

    async def slow_close(self: Any) -> None:  # the close in progress as the client leaves
        closing.set()
        until = time.monotonic() + 10
        while not left.is_set() and time.monotonic() < until:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # (for the proxy to see the client gone and cancel)
        await real_closed(self)

    backend = backends()
    cfg = ProxyConfig([backend.url], [backend.url], max_concurrent_requests=1, timeout_s=3)
    proxy, app = proxies(cfg)
    monkeypatch.setattr(httpcore.AsyncHTTP11Connection, "_response_closed", slow_close)
    host, port = proxy.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "x", "max_tokens": 4}).encode()
    for _ in range(2):
        closing.clear()
        left.clear()
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert closing.wait(10)
        left.set()  # the client left while the prefill answer was being closed
        deadline = time.monotonic() + 10  # its slot comes back once the proxy has ended it
        while app.state.guards.slots.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
    monkeypatch.setattr(httpcore.AsyncHTTP11Connection, "_response_closed", real_closed)
    r = httpx.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text


def test_health_is_answered_while_requests_hold_every_connection(
    backends: Callable[..., Backend],
    proxies: Callable[..., tuple[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/health shared the requests' connection pool: at 512 streams it said every server was
    down, and new requests waited ``timeout_s`` and blamed an idle server (a review). The
    proxy's own questions have connections of their own, and requests as many as may be in
    flight."""
    monkeypatch.setattr(proxy_backends, "CONTROL_CONNECTIONS", 1)
    release = threading.Event()

    def endless(body: dict) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            yield b"data: {}\n\n"
            while not release.is_set():
                await asyncio.sleep(0.02)

        return StreamingResponse(stream(), media_type="text/event-stream")

    backend = backends(decode=endless)
    cfg = ProxyConfig([backend.url], [backend.url], max_concurrent_requests=2, timeout_s=5)
    proxy, app = proxies(cfg)
    assert app.state.backends.connections >= cfg.max_concurrent_requests
    body = {"prompt": "x", "stream": True}
    with (
        httpx.Client(base_url=proxy, timeout=10) as a,
        httpx.Client(base_url=proxy, timeout=10) as b,
        a.stream("POST", "/v1/completions", json=body) as s1,
        b.stream("POST", "/v1/completions", json=body) as s2,
    ):
        assert s1.status_code == s2.status_code == 200
        for _ in range(20):
            health = httpx.get(proxy + "/health", timeout=5)
            assert health.status_code == 200, health.text
        busy = httpx.post(proxy + "/v1/completions", json={"prompt": "x"}, timeout=5)
        assert_openai_error(busy, 503)  # the guard's limit, at once: not a hang
        release.set()


def test_an_answer_compressed_anyway_is_refused_not_inflated(
    backends: Callable[..., Backend], proxies: Callable[..., tuple[str, Any]]
) -> None:
    """httpx inflates each network chunk whole before anything counts it: 510 KiB of gzip
    that inflates to 512 MiB cost 142 MiB under a 1 MiB limit (a review). An answer read whole
    that comes compressed -- the proxy asks for none -- is a 502, read no further."""
    bomb = gzip.compress(b"{" + b" " * (64 << 20) + b"}")

    def compressed(body: dict) -> Response:
        return Response(bomb, media_type="application/json", headers={"Content-Encoding": "gzip"})

    backend = backends(prefill=compressed)
    proxy, _ = proxies(ProxyConfig([backend.url], [backend.url], max_answer_bytes=1 << 20))
    err = assert_openai_error(httpx.post(proxy + "/v1/completions", json={"prompt": "x"}), 502)
    assert "compressed" in err["message"] and backend.decoded == []


def test_an_answer_that_breaks_off_after_its_status_is_not_sent_again(
    proxies: Callable[..., tuple[str, Any]],
) -> None:
    """A broken-off body was taken for a stale keep-alive connection: the request ran twice on
    the server, then on every other server of the pool (a review)."""
    asked: list[int] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    asked.append(1)
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b'content-length: 100\r\n\r\n{"choices": '
                    )

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    proxy, _ = proxies(ProxyConfig([], [url, url]))
    try:
        err = assert_openai_error(httpx.post(proxy + "/v1/completions", json={"prompt": "x"}), 502)
    finally:
        listener.close()
    assert "broke off" in err["message"] and len(asked) == 1


def test_a_relayed_stream_gives_its_server_back_even_if_it_never_starts() -> None:
    """The relay's ``finally`` gave the server back only once its generator had started:
    Starlette under an ASGI 2.4 server never starts it when the client is gone before the
    first byte (a review), and the backend's connection and slot stayed held."""
    from connector.proxy.completions import RelayedStream

    finished = []

    async def relay() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"

    async def finish() -> None:
        finished.append(1)

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise OSError("the client hung up")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    stream = RelayedStream(relay(), finish, 30.0, media_type="text/event-stream")
    with contextlib.suppress(Exception):
        asyncio.run(stream(scope, gone, send))
    assert finished == [1], "the backend was never given back"


def test_a_client_that_stops_reading_a_stream_is_dropped_at_the_timeout() -> None:
    """A client that keeps its socket open and reads nothing: each chunk's send waits on it
    for ever (the transport's flow control), holding the request's slot and the backend's
    connection (a review's). It is given the proxy's timeout per chunk, then dropped, and the
    backend given back."""
    from connector.proxy.completions import RelayedStream

    finished, sent = [], []

    async def relay() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"data: {}\n\n"

    async def finish() -> None:
        finished.append(1)

    async def receive() -> dict:
        await asyncio.Event().wait()  # (the client says nothing, and does not leave)
        return {}

    async def send(message: dict) -> None:
        if len(sent) >= 2:  # the head and a chunk went; then the client's window is full
            await asyncio.Event().wait()
        sent.append(message)

    async def go() -> None:
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        stream = RelayedStream(relay(), finish, 0.2, media_type="text/event-stream")
        await asyncio.wait_for(stream(scope, receive, send), 30)

    asyncio.run(go())
    assert finished == [1] and len(sent) == 2
