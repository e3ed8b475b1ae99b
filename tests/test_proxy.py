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
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvstore.server import free_port
from scripts.proxy import ProxyConfig, build_app


def run_server(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


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
    async def go() -> httpx.Response:
        app = build_app(cfg)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                return await c.request(method, path, **kw)  # type: ignore[arg-type]

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
