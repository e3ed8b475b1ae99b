"""The proxy's request handling and error paths, against backends that are down or that fail
(small real HTTP servers on loopback); the happy path runs against real vLLM servers in
test_e2e_serving.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from connector.proxy import ProxyConfig, build_app
from testing import stack
from testing.redis_server import free_port


def run_server(app: FastAPI) -> Iterator[str]:
    url, stop = stack.serve_in_thread(app, log_level="error")
    yield url
    stop()


SEEN: list[tuple[str | None, dict]] = []


@pytest.fixture
def echo_backend() -> Iterator[str]:
    """A stand-in vLLM: records requests, answers like a producer / consumer would."""
    app = FastAPI()
    SEEN.clear()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        SEEN.append((request.headers.get("x-request-id"), body))
        if body.get("min_tokens", 0) > body.get("max_tokens", 16):  # as vLLM answers
            return JSONResponse({"error": {"message": "min_tokens > max_tokens"}}, 400)
        return JSONResponse(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"redis_kv": {"num_blocks": 2}}}
        )

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    gen = run_server(app)
    yield next(gen)
    next(gen, None)


@pytest.fixture
def failing_backend() -> Iterator[str]:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse(
            {"error": {"message": "model overloaded", "type": "server_error", "code": 503}},
            status_code=503,
        )

    @app.post("/v1/chat/completions")
    async def chat() -> PlainTextResponse:
        return PlainTextResponse("internal failure", status_code=500)

    gen = run_server(app)
    yield next(gen)
    next(gen, None)


def call(cfg: ProxyConfig, method: str, path: str, **kw: object) -> httpx.Response:
    return call_in_turn(cfg, method, path, [kw])[0]


def call_in_turn(
    cfg: ProxyConfig, method: str, path: str, requests: list[dict]
) -> list[httpx.Response]:
    """The requests one after another through one proxy (keyword arguments of each)."""

    async def go() -> list[httpx.Response]:
        app = build_app(cfg)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                return [await c.request(method, path, **kw) for kw in requests]

    return asyncio.run(go())


DOWN = f"http://127.0.0.1:{free_port()}"


def test_prefill_then_decode_with_transfer_params(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [echo_backend])
    r = call(cfg, "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 7},
             headers={"x-request-id": "abc"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc"
    (pre_id, pre), (dec_id, dec) = SEEN
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "kv_transfer_params" not in pre
    assert dec["max_tokens"] == 7 and dec["kv_transfer_params"] == {"redis_kv": {"num_blocks": 2}}
    assert (pre_id, dec_id) == ("abc-prefill", "abc")


def test_a_pool_answers_requests_whole_in_turn(echo_backend: str) -> None:
    """--pool servers (share mode): no prefill leg, each request once, round robin."""
    app = FastAPI()
    other: list[dict] = []

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        other.append(await request.json())
        return JSONResponse({"choices": [{"text": "y"}]})

    gen = run_server(app)
    second = next(gen)
    try:
        cfg = ProxyConfig([], [echo_backend, second])
        bodies = [{"json": {"prompt": f"p{i}", "max_tokens": 5}} for i in range(4)]
        texts = call_in_turn(cfg, "POST", "/v1/completions", bodies)
    finally:
        next(gen, None)
    assert [r.json()["choices"][0]["text"] for r in texts] == ["x", "y", "x", "y"]
    assert [b["prompt"] for _, b in SEEN] == ["p0", "p2"] and [b["prompt"] for b in other] == [
        "p1",
        "p3",
    ]
    assert all(b["max_tokens"] == 5 and "kv_transfer_params" not in b for _, b in SEEN)
    r = call(ProxyConfig([], [echo_backend, DOWN]), "GET", "/health")
    assert r.status_code == 200 and r.json()["pool"] == {echo_backend: True, DOWN: False}
    r = call(ProxyConfig([], [DOWN]), "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and "no pool server" in r.json()["error"]["message"]


def test_a_proxy_with_no_server_to_answer_is_refused_when_built() -> None:
    for cfg in (ProxyConfig([], []), ProxyConfig([DOWN], [])):
        with pytest.raises(ValueError, match="decode servers"):
            build_app(cfg)


@pytest.mark.parametrize(
    "argv",
    [
        ["--pool", "http://a", "--prefill", "http://b"],
        ["--prefill", "http://b"],
        [],
    ],
)
def test_the_command_takes_a_pool_or_both_legs(argv: list[str]) -> None:
    from connector.proxy import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": "m"}', "'prompt' is required"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens"),
    ],
)
def test_malformed_requests_get_400_with_the_reason(body: bytes, reason: str) -> None:
    r = call(ProxyConfig([DOWN], [DOWN]), "POST", "/v1/completions", content=body)
    assert r.status_code == 400
    assert reason in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_chat_needs_messages() -> None:
    r = call(ProxyConfig([DOWN], [DOWN]), "POST", "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_backend_down_gives_502_quickly() -> None:
    t0 = time.monotonic()
    r = call(ProxyConfig([DOWN], [DOWN]), "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and time.monotonic() - t0 < 10
    err = r.json()["error"]
    assert err["type"] == "backend_unavailable" and "prefill" in err["message"]


def test_decode_down_gives_502(echo_backend: str) -> None:
    r = call(ProxyConfig([echo_backend], [DOWN]), "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and "decode" in r.json()["error"]["message"]


def test_a_down_server_is_skipped_for_a_live_one(echo_backend: str) -> None:
    cfg = ProxyConfig([DOWN, echo_backend], [DOWN, echo_backend])
    for _ in range(3):
        r = call(cfg, "POST", "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200


def test_backend_errors_keep_their_status(failing_backend: str) -> None:
    cfg = ProxyConfig([failing_backend], [failing_backend])
    r = call(cfg, "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "model overloaded"
    r = call(
        cfg, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 500 and "internal failure" in r.json()["error"]["message"]


def test_health_reports_each_backend(echo_backend: str) -> None:
    r = call(ProxyConfig([echo_backend], [DOWN]), "GET", "/health")
    assert r.status_code == 503
    assert r.json()["prefill"] == {echo_backend: True} and r.json()["decode"] == {DOWN: False}
    r = call(ProxyConfig([echo_backend], [echo_backend]), "GET", "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_models_without_decode_server_is_502() -> None:
    r = call(ProxyConfig([DOWN], [DOWN]), "GET", "/v1/models")
    assert r.status_code == 502 and json.loads(r.content)["error"]["code"] == 502


def test_least_loaded_counts_a_stream_until_it_ends(echo_backend: str) -> None:
    """A decode server busy streaming an answer is not chosen again while another is idle."""
    hits: list[str] = []

    def slow_stream_backend(name: str) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            hits.append(name)

            async def body() -> AsyncIterator[bytes]:
                for _ in range(10):
                    await asyncio.sleep(0.05)
                    yield b"data: {}\n\n"

            return StreamingResponse(body(), media_type="text/event-stream")

        return app

    gens = [run_server(slow_stream_backend(n)) for n in ("a", "b")]
    a, b = (next(g) for g in gens)
    cfg = ProxyConfig([echo_backend], [a, b], policy="least_loaded")
    proxy_gen = run_server(build_app(cfg))  # a real server: ASGITransport would buffer streams
    proxy = next(proxy_gen)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=proxy, timeout=30) as c:
            body = {"prompt": "x", "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as first:
                await first.aread()  # the first stream ends before the next request
            async with c.stream("POST", "/v1/completions", json=body) as second:
                await asyncio.sleep(0.1)  # second is streaming now ...
                third = await c.post("/v1/completions", json=body)  # ... pick the other
                assert third.status_code == 200
                await second.aread()

    asyncio.run(go())
    for g in [proxy_gen, *gens]:
        next(g, None)
    assert hits[1] != hits[2], hits


def proxy_server(cfg: ProxyConfig) -> tuple[Iterator[str], str, FastAPI]:
    app = build_app(cfg)
    gen = run_server(app)  # a real server: ASGITransport would buffer streams
    return gen, next(gen), app


def test_a_decode_server_failing_mid_stream_gives_an_error_event_and_frees_its_slot(
    echo_backend: str,
) -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            await asyncio.sleep(0.05)
            raise RuntimeError("the decode server crashed")  # the connection is cut

        return StreamingResponse(body(), media_type="text/event-stream")

    backend_gen = run_server(app)
    crashing = next(backend_gen)
    gen, proxy, proxy_app = proxy_server(ProxyConfig([echo_backend], [crashing], "least_loaded"))
    with httpx.Client(base_url=proxy, timeout=30) as c:
        text = c.post("/v1/completions", json={"prompt": "x", "stream": True}).text
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[0] == 'data: {"choices": [{"text": "a"}]}'
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 502
    assert events[-1] == "data: [DONE]"
    assert proxy_app.state.pools["decode"].in_flight == {crashing: 0}
    for g in (gen, backend_gen):
        next(g, None)


def test_a_client_that_leaves_cancels_its_request_at_the_backend(echo_backend: str) -> None:
    cancelled = threading.Event()
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        for _ in range(200):  # a long generation, watching for the caller to go away
            if await request.is_disconnected():
                cancelled.set()
                break
            await asyncio.sleep(0.02)
        return JSONResponse({"choices": [{"text": "late"}]})

    backend_gen = run_server(app)
    slow = next(backend_gen)
    gen, proxy, proxy_app = proxy_server(ProxyConfig([echo_backend], [slow], "least_loaded"))
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=proxy, timeout=0.3) as c:
        c.post("/v1/completions", json={"prompt": "x"})  # not streaming; gives up after 0.3 s
    assert cancelled.wait(3), "the backend kept generating for a client that had left"
    deadline = time.monotonic() + 3
    while proxy_app.state.pools["decode"].in_flight[slow] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy_app.state.pools["decode"].in_flight == {slow: 0}
    for g in (gen, backend_gen):
        next(g, None)


def test_a_stale_keep_alive_connection_is_retried_not_a_502() -> None:
    """A backend that closes an idle keep-alive connection as the next request arrives: the
    request gets no response at all on it, and must be sent again on a new connection."""
    import socket

    body = json.dumps({"choices": [{"text": "ok"}], "kv_transfer_params": None}).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_connection(conn: socket.socket) -> None:
        with conn:
            for n in range(2):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, rest = data.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(rest) < length:
                    rest += conn.recv(65536)
                if n == 1:
                    return  # the keep-alive connection is closed instead of answered
                conn.sendall(answer)

    def accept_forever() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_connection, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_forever, daemon=True).start()
    backend = f"http://127.0.0.1:{port}"
    gen, proxy, _ = proxy_server(ProxyConfig([backend], [backend]))
    with httpx.Client(base_url=proxy, timeout=10) as c:
        for _ in range(3):  # prefill then decode reuse the pooled connection every time
            r = c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 200, r.text
    listener.close()
    next(gen, None)


def test_min_tokens_and_n_are_not_sent_to_prefill(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [echo_backend])
    r = call(cfg, "POST", "/v1/completions",
             json={"prompt": "x", "max_tokens": 8, "min_tokens": 4, "n": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    (_, pre), (_, dec) = SEEN
    assert "min_tokens" not in pre and "n" not in pre and pre["max_tokens"] == 1
    assert dec["min_tokens"] == 4 and dec["n"] == 2 and dec["max_tokens"] == 8
