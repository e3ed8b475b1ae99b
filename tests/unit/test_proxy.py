"""The proxy's request handling and error paths, against backends that are down or that fail
(small real HTTP servers on loopback); the happy path runs against real vLLM servers in
test_e2e_serving.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from connector.proxy.errors import passthrough_error
from connector.proxy.server import ProxyConfig, build_app
from testing import stack
from testing.proxy_servers import DOWN, assert_openai_error, proxy_server, run_server
from testing.redis_server import free_port

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


def test_prefill_then_decode_with_transfer_params(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [echo_backend])
    r = call(cfg, "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 7},
             headers={"x-request-id": "abc"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc"  # the client's, echoed
    (pre_id, pre), (dec_id, dec) = SEEN
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "kv_transfer_params" not in pre
    assert dec["max_tokens"] == 7 and dec["kv_transfer_params"] == {"redis_kv": {"num_blocks": 2}}
    # the backends see the proxy's own id (the client's could be another client's)
    assert dec_id is not None and dec_id.startswith("proxy-") and pre_id == dec_id + "-prefill"


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
    assert r.status_code == 200 and r.json()["pool"] == {"up": 1, "down": 1, "marked_down": 0}
    assert r.json()["servers"]["pool"] == {echo_backend: True, DOWN: False}
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
    from connector.proxy.server import main

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
    assert r.json()["prefill"] == {"up": 1, "down": 0, "marked_down": 0}
    assert r.json()["decode"] == {"up": 0, "down": 1, "marked_down": 0}
    assert r.json()["servers"] == {"prefill": {echo_backend: True}, "decode": {DOWN: False}}
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


# -- hostile callers -----------------------------------------------------------------------------

KEY = "sk-proxy-0123456789"
KV_KEY = "sk-kv-9876543210"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_api_key_guards_every_path_but_health(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [echo_backend], api_key=KEY)
    assert KEY not in repr(cfg)
    body = {"prompt": "x", "max_tokens": 2}
    refused = call_in_turn(cfg, "POST", "/v1/completions", [
        {"json": body},
        {"json": body, "headers": bearer("wrong")},
        {"json": body, "headers": {"Authorization": KEY}},  # no scheme
        {"json": body, "headers": {"Authorization": f"Basic {KEY}"}},
        {"json": body, "headers": bearer(KEY + "x")},
    ])  # fmt: skip
    for r in refused:
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer" and KEY not in r.text
    assert SEEN == []  # nothing reached a backend
    for method, path in (("GET", "/v1/models"), ("GET", "/kv/routing"), ("GET", "/nope"),
                         ("POST", "/kv/presence"), ("GET", "/docs")):  # fmt: skip
        assert_openai_error(call(cfg, method, path), 401)
    r = call(cfg, "POST", "/v1/completions", json=body, headers=bearer(KEY))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x"
    assert call(cfg, "GET", "/kv/routing", headers=bearer(KEY)).status_code == 200  # no kv key
    assert call(cfg, "GET", "/health").status_code == 200  # load balancers ask without a key


def test_the_kv_key_guards_kv_paths_apart_from_the_api_key(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [echo_backend], api_key=KEY, kv_api_key=KV_KEY)
    assert KV_KEY not in repr(cfg)
    assert_openai_error(call(cfg, "GET", "/kv/routing", headers=bearer(KEY)), 401)
    assert call(cfg, "GET", "/kv/routing", headers=bearer(KV_KEY)).status_code == 200
    r = call(cfg, "POST", "/v1/completions", json={"prompt": "x"}, headers=bearer(KV_KEY))
    assert_openai_error(r, 401)
    # a kv key alone: the OpenAI endpoints stay open, as vLLM's without --api-key
    cfg = ProxyConfig([echo_backend], [echo_backend], kv_api_key=KV_KEY)
    assert call(cfg, "POST", "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert_openai_error(call(cfg, "GET", "/kv/routing"), 401)


def test_health_shows_counts_to_anyone_and_servers_to_kv_callers(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [DOWN], api_key=KEY, kv_api_key=KV_KEY)
    anyone, with_api_key, with_kv_key = call_in_turn(
        cfg, "GET", "/health", [{}, {"headers": bearer(KEY)}, {"headers": bearer(KV_KEY)}]
    )
    assert anyone.status_code == 503
    assert anyone.json() == {
        "status": "degraded",
        "prefill": {"up": 1, "down": 0, "marked_down": 0},
        "decode": {"up": 0, "down": 1, "marked_down": 0},
    }  # fmt: skip
    assert "127.0.0.1" not in anyone.text and with_api_key.json() == anyone.json()
    servers = with_kv_key.json()["servers"]
    assert servers == {"prefill": {echo_backend: True}, "decode": {DOWN: False}}


def test_the_command_reads_keys_like_vllm_and_listens_on_loopback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from connector.proxy import server as proxy

    started: dict = {}
    monkeypatch.setattr(proxy.uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setenv("VLLM_REDIS_PROXY_KV_API_KEY", KV_KEY)
    caplog.set_level(logging.DEBUG)
    assert proxy.main(["--prefill", DOWN, "--decode", DOWN]) == 0
    assert started["host"] == "127.0.0.1"
    assert started["proxy_headers"] is False  # a client's X-Forwarded-For is not believed

    async def ask(app: FastAPI, path: str, key: str | None) -> int:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                return (await c.get(path, headers=bearer(key) if key else {})).status_code

    app = started["app"]
    assert asyncio.run(ask(app, "/v1/models", None)) == 401
    assert asyncio.run(ask(app, "/v1/models", KEY)) == 502  # let in; no decode server
    assert asyncio.run(ask(app, "/kv/routing", KEY)) == 401
    assert asyncio.run(ask(app, "/kv/routing", KV_KEY)) == 200
    monkeypatch.delenv("VLLM_REDIS_PROXY_KV_API_KEY")
    proxy.main(["--pool", DOWN, "--api-key", "from-the-flag", "--host", "0.0.0.0",
                "--enable-kv-presence"])  # fmt: skip
    app = started["app"]
    assert started["host"] == "0.0.0.0"
    assert asyncio.run(ask(app, "/v1/models", KEY)) == 401  # the flag wins over the env
    assert asyncio.run(ask(app, "/kv/routing", "from-the-flag")) == 200  # no kv key: the API key
    assert KEY not in caplog.text and KV_KEY not in caplog.text
    assert "from-the-flag" not in caplog.text


def test_presence_is_off_unless_enabled() -> None:
    r = call(ProxyConfig([DOWN], [DOWN]), "POST", "/kv/presence", json={"token_ids": [1, 2]})
    assert "--enable-kv-presence" in assert_openai_error(r, 404)["message"]
    r = call(ProxyConfig([DOWN], [DOWN], enable_kv_presence=True), "POST", "/kv/presence",
             json={"token_ids": [1, 2]})  # fmt: skip
    assert "--redis-url" in assert_openai_error(r, 501)["message"]  # on, but not configured


def test_presence_is_rate_limited_per_client() -> None:
    cfg = ProxyConfig([DOWN], [DOWN], enable_kv_presence=True, kv_presence_rate=0.01,
                      kv_presence_burst=2)  # fmt: skip
    answers = call_in_turn(cfg, "POST", "/kv/presence", [{"json": {"token_ids": [1]}}] * 3)
    assert [r.status_code for r in answers] == [501, 501, 429]
    assert_openai_error(answers[2], 429)
    assert int(answers[2].headers["retry-after"]) >= 1


def test_token_buckets_refill_and_keep_clients_apart() -> None:
    from connector.proxy.guards import TokenBuckets

    now = [0.0]
    buckets = TokenBuckets(rate=2.0, burst=2, max_clients=2, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(2)] == [0, 0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token comes back in 1/2 s
    assert buckets.take("b") == 0  # another address has its own
    now[0] = 0.5
    assert buckets.take("a") == 0
    buckets.take("c")  # a third address: the least recently seen ("b") is forgotten
    assert set(buckets._buckets) == {"a", "c"}


def test_presence_refuses_a_huge_query_before_tokenizing_or_asking_redis() -> None:
    tokenized: list[dict] = []
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        tokenized.append(await request.json())
        return JSONResponse({"tokens": list(range(5))})

    gen = run_server(app)
    backend = next(gen)
    try:
        # a store that is not there: any Redis work would answer 503, not 413
        store = f"redis://127.0.0.1:{free_port()}/0"
        cfg = ProxyConfig([DOWN], [backend], enable_kv_presence=True, redis_url=store,
                          layout_file="/none")  # fmt: skip
        million = call(cfg, "POST", "/kv/presence", json={"token_ids": [7] * 1_000_000})
        assert "131072" in assert_openai_error(million, 413)["message"]  # the default limit
        long_text = call(cfg, "POST", "/kv/presence", json={"prompt": "a" * (131072 * 16 + 1)})
        assert_openai_error(long_text, 413)
        assert tokenized == []
        cfg.kv_presence_max_tokens = 4  # a prompt of 5 tokens, known once tokenized
        assert_openai_error(call(cfg, "POST", "/kv/presence", json={"prompt": "hello"}), 413)
        assert len(tokenized) == 1
    finally:
        next(gen, None)


def test_a_body_over_the_limit_is_refused_by_its_content_length(echo_backend: str) -> None:
    cfg = ProxyConfig([echo_backend], [echo_backend], max_body_bytes=1000)
    r = call(cfg, "POST", "/v1/completions", json={"prompt": "x" * 2000})
    assert "--max-body-bytes" in assert_openai_error(r, 413)["message"]
    assert SEEN == []
    assert call(cfg, "POST", "/v1/completions", json={"prompt": "x" * 900}).status_code == 200


def test_a_chunked_body_is_read_no_further_than_the_limit() -> None:
    """64 MiB sent without a Content-Length: refused once a bit more than the default 16 MiB
    has come, the rest never read."""
    mib = b"x" * (1 << 20)
    pulled = [0]

    async def body() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64):
            pulled[0] += 1
            yield mib

    r = call(ProxyConfig([DOWN], [DOWN]), "POST", "/v1/completions", content=body())
    assert_openai_error(r, 413)
    assert pulled[0] <= 17


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"prompt": [9223372036854775808]}', "token ids"),  # 2**63
        (b'{"prompt": [[1, 2], [3, -1]]}', "token ids"),
        (b'{"prompt": [1, true]}', "token ids"),
        (b'{"prompt": [1e400]}', "out of range"),
        (b'{"prompt": "x", "temperature": NaN}', "not a JSON number"),
        (b'{"prompt": "x", "top_p": -Infinity}', "not a JSON number"),
        (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (b'{"prompt": "x", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_numbers_no_backend_could_take_are_400_not_500(body: bytes, reason: str) -> None:
    r = call(ProxyConfig([DOWN], [DOWN]), "POST", "/v1/completions", content=body)
    assert reason in assert_openai_error(r, 400)["message"]


@pytest.mark.parametrize(
    "prefill_answer",
    [b"not json", b"[1, 2]", b'{"kv_transfer_params": "a string"}', b'{"x": NaN'],
)
def test_a_prefill_answer_that_is_not_a_json_object_is_a_502(prefill_answer: bytes) -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> Response:
        return Response(prefill_answer, media_type="application/json")

    gen = run_server(app)
    backend = next(gen)
    try:
        r = call(ProxyConfig([backend], [DOWN]), "POST", "/v1/completions", json={"prompt": "x"})
    finally:
        next(gen, None)
    assert "prefill server" in assert_openai_error(r, 502)["message"]


def test_a_tokenize_answer_with_impossible_token_ids_is_a_502() -> None:
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize() -> JSONResponse:
        return JSONResponse({"tokens": [2**64, 1]})

    gen = run_server(app)
    backend = next(gen)
    try:
        cfg = ProxyConfig([DOWN], [backend], enable_kv_presence=True)
        r = call(cfg, "POST", "/kv/presence", json={"prompt": "hello"})
    finally:
        next(gen, None)
    assert "/tokenize" in assert_openai_error(r, 502)["message"]


def test_a_prompt_that_cannot_be_tokenized_is_the_clients_400() -> None:
    """A lone surrogate in a text prompt: httpx's json= raised encoding it for /tokenize, and
    /kv/presence (and cache-aware routing) answered 500 (a review's)."""
    cfg = ProxyConfig([DOWN], [DOWN], enable_kv_presence=True)
    r = call(cfg, "POST", "/kv/presence", content=b'{"prompt": "abc \\ud800 def"}',
             headers={"content-type": "application/json"})  # fmt: skip
    assert "tokenized" in assert_openai_error(r, 400)["message"]


def test_a_hung_tokenize_holds_a_request_no_longer_than_the_proxys_timeout() -> None:
    """Decode servers' /tokenize asked one after another, 30 s each, whatever --timeout-s (a
    review's two requests took 30 s at --timeout-s 5): now all of them within it."""
    app = FastAPI()
    release = asyncio.Event()

    @app.post("/tokenize")
    async def tokenize() -> JSONResponse:
        await release.wait()  # (never set: the server hangs)
        return JSONResponse({"tokens": [1]})

    gen = run_server(app)
    backend = next(gen)
    try:
        cfg = ProxyConfig([DOWN], [backend, backend], enable_kv_presence=True, timeout_s=0.5)
        t0 = time.monotonic()
        r = call(cfg, "POST", "/kv/presence", json={"prompt": "hello"})
        waited = time.monotonic() - t0
    finally:
        next(gen, None)
    assert_openai_error(r, 502)
    assert waited < 20, waited  # (0.5 s and the round trips; before, 60 s)


@pytest.mark.parametrize("status", [499, 520, 999])
def test_a_backend_status_http_does_not_define_is_answered_502(status: int) -> None:
    """uvicorn has no status line for 499 or 520: passed through, it cut the client's
    connection without an answer (a review's)."""
    r = passthrough_error(status, b'{"error": {"message": "edge"}}', "decode", "http://d")
    assert r.status_code == 502
    r = passthrough_error(status, b"gateway says no", "decode", "http://d")
    assert r.status_code == 502 and f"answered {status}" in bytes(r.body).decode()
    assert passthrough_error(503, b"x", "decode", "http://d").status_code == 503


def test_no_error_is_a_bare_500_or_shows_a_traceback(
    echo_backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from connector.proxy import completions

    def broken(body: dict) -> dict:
        raise RuntimeError("internal detail 42")

    monkeypatch.setattr(completions, "prefill_request", broken)
    r = call(ProxyConfig([echo_backend], [echo_backend]), "POST", "/v1/completions",
             json={"prompt": "x"})  # fmt: skip
    err = assert_openai_error(r, 500)
    assert "internal detail 42" not in r.text and "Traceback" not in r.text
    assert err["message"] == "internal error in the proxy"
    assert "internal detail 42" in caplog.text  # the operator gets the traceback
    assert_openai_error(call(ProxyConfig([DOWN], [DOWN]), "GET", "/nope"), 404)
    wrong_method = call(ProxyConfig([DOWN], [DOWN]), "GET", "/v1/completions")
    assert_openai_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"


def test_backend_credentials_reach_no_client_and_no_log(caplog: pytest.LogCaptureFixture) -> None:
    """A backend URL with user:password: the proxy authenticates with it, and shows it
    nowhere -- errors, /health, /kv/routing, its own and httpx's log lines."""
    import base64

    secret = "hunter2-secret"
    expected = "Basic " + base64.b64encode(f"proxy:{secret}".encode()).decode()
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != expected:
            return JSONResponse({"error": {"message": "who are you"}}, status_code=401)
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": {"a": 1}})

    gen = run_server(app)
    backend = next(gen)
    caplog.set_level(logging.DEBUG)
    try:
        with_secret = backend.replace("http://", f"http://proxy:{secret}@")
        down = DOWN.replace("http://", f"http://proxy:{secret}@")
        cfg = ProxyConfig([with_secret], [down])
        failed, health, routing = (
            call(cfg, "POST", "/v1/completions", json={"prompt": "x"}),
            call(cfg, "GET", "/health"),
            call(cfg, "GET", "/kv/routing"),
        )
        ok = call(ProxyConfig([with_secret], [with_secret]), "POST", "/v1/completions",
                  json={"prompt": "x"})  # fmt: skip
    finally:
        next(gen, None)
    assert "decode server" in assert_openai_error(failed, 502)["message"]  # prefill let us in
    assert ok.status_code == 200, ok.text
    assert health.json()["servers"] == {"prefill": {backend: False}, "decode": {DOWN: False}}
    for text in (failed.text, health.text, routing.text, caplog.text):
        assert secret not in text
    assert "127.0.0.1" in caplog.text  # the log did name the servers


def test_urls_are_shown_without_credentials() -> None:
    from connector.proxy.backends import scrub_credentials, split_credentials
    from kvstore import redact_url  # the project's one rule, the store's URLs' too

    assert redact_url("http://u:p@h:8100/x?token=t") == "http://***@h:8100/x"
    assert redact_url("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert redact_url("http://only-a-token@h") == "http://***@h"
    assert redact_url("http://u:pa/ss@h:1/x#f") == "http://***@h:1/x"  # its last '@' ends it
    assert scrub_credentials("failed on http://u:p@h:1/v1 and tcp://x@y") == (
        "failed on http://***@h:1/v1 and tcp://***@y"
    )
    url, auth = split_credentials("http://us%40er:p%3Ass@h:81/")
    assert url == "http://h:81" and auth is not None
    assert split_credentials("http://h:81/") == ("http://h:81", None)


def test_client_transfer_params_and_request_ids_never_reach_a_backend(echo_backend: str) -> None:
    """kv_transfer_params name a handoff: a client's would make the decode server load another
    request's KV. The proxy sets them from the prefill answer only, and names requests itself."""
    stolen = {"redis_kv": {"handoff": "someone-elses", "num_blocks": 9}, "redis_kv_load": "split"}
    body = {
        "prompt": "x",
        "kv_transfer_params": stolen,
        "ec_transfer_params": stolen,
        "request_id": "victim-id",
        # vLLM copies vllm_xargs into the request's extra args, where the connector looks too
        "vllm_xargs": {"kv_transfer_params": "stolen", "ec_transfer_params": "x", "keep": 1},
    }
    r = call(ProxyConfig([echo_backend], [echo_backend]), "POST", "/v1/completions", json=body,
             headers={"X-Request-Id": "victim-id"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "victim-id"  # echoed only
    (pre_id, pre), (dec_id, dec) = SEEN
    assert "kv_transfer_params" not in pre and "ec_transfer_params" not in pre
    assert pre["vllm_xargs"] == dec["vllm_xargs"] == {"keep": 1}
    assert dec["kv_transfer_params"] == {"redis_kv": {"num_blocks": 2}}  # the prefill's
    assert "request_id" not in pre and "request_id" not in dec
    assert "victim" not in f"{pre_id} {dec_id}"
    SEEN.clear()
    r = call(ProxyConfig([], [echo_backend]), "POST", "/v1/completions", json=body,
             headers={"X-Request-Id": "bad id\twith odd bytes"})  # fmt: skip
    ((pool_id, pooled),) = SEEN
    assert "kv_transfer_params" not in pooled and "request_id" not in pooled
    assert r.headers["x-request-id"] == pool_id  # an id it would not echo: the proxy's own


def test_a_clients_save_mark_and_nothing_else_of_its_transfer_params_reaches_the_pool(
    echo_backend: str,
) -> None:
    """The marked save policy: a client (or a router in front of the proxy) asks the pool to
    write a prompt with kv_transfer_params {"redis_kv_save": true}. The proxy stripped all of a
    client's kv_transfer_params, so the policy could not be used through it; the mark alone
    passes now, never a handoff beside it, and only a real true."""
    stolen = {"redis_kv": {"handoff": "someone-elses", "num_blocks": 9}, "redis_kv_load": "split"}
    for params, passed in (
        ({**stolen, "redis_kv_save": True}, {"redis_kv_save": True}),
        ({"redis_kv_save": "true"}, None),
        ({"redis_kv_save": 1}, None),
        ("redis_kv_save", None),
    ):
        SEEN.clear()
        body = {"prompt": "x", "kv_transfer_params": params}
        r = call(ProxyConfig([], [echo_backend]), "POST", "/v1/completions", json=body)
        ((_, pooled),) = SEEN
        assert r.status_code == 200 and pooled.get("kv_transfer_params") == passed, params


@pytest.mark.parametrize("password", ["1234/s3cret", "pa?ss", "pa#ss"])
def test_a_backend_url_with_a_raw_slash_in_its_password_is_refused_unshown(
    password: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """urlsplit ends the host at a raw '/', '?' or '#': the prompt went to the host "admin"
    and the password came back in 502s, /health and the log. Refused at startup, unquoted."""
    from connector.proxy import server as proxy

    url = f"http://admin:{password}@127.0.0.1:9"
    with pytest.raises(ValueError, match="percent-encode") as info:
        build_app(ProxyConfig([url], [DOWN]))
    assert password not in str(info.value)
    monkeypatch.setattr(proxy.uvicorn, "run", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(SystemExit):
        proxy.main(["--prefill", url, "--decode", DOWN])
    assert password not in capsys.readouterr().err
    encoded = urllib.parse.quote(password, safe="")  # percent-encoded, it is taken
    build_app(ProxyConfig([f"http://admin:{encoded}@127.0.0.1:9"], [DOWN]))


def test_a_server_that_refuses_is_sent_nothing_until_a_probe_finds_it_back(
    echo_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A dead server kept its turn: round robin and least-loaded sent it a request first, each
    paying the connect timeout. Marked down on its first refusal, it is sent nothing while
    another server is up, and taken back once it answers /health."""
    port = free_port()
    revived = f"http://127.0.0.1:{port}"
    app = FastAPI()
    got: list[dict] = []

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        got.append(await request.json())
        return JSONResponse({"choices": [{"text": "y"}]})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    async def go() -> tuple[list[int], dict, dict, list[int]]:
        proxy_app = build_app(ProxyConfig([], [revived, echo_backend], probe_interval_s=0.05))
        async with proxy_app.router.lifespan_context(proxy_app):
            transport = httpx.ASGITransport(app=proxy_app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                body = {"prompt": "p", "max_tokens": 1}
                first = [(await c.post("/v1/completions", json=body)).status_code for _ in range(6)]
                marked = (await c.get("/health")).json()
                metrics_down = (await c.get("/metrics")).text
                _, stop = stack.serve_in_thread(app, log_level="error", port=port)
                try:
                    deadline = time.monotonic() + 30  # the event: the probe takes it back
                    while proxy_app.state.pools["decode"].down and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    back = (await c.get("/health")).json()
                    later = [
                        (await c.post("/v1/completions", json=body)).status_code for _ in range(4)
                    ]
                    metrics_back = (await c.get("/metrics")).text
                finally:
                    stop()
        return first, marked, back, later, metrics_down, metrics_back

    with caplog.at_level(logging.WARNING, logger="vllm_redis_proxy"):
        first, marked, back, later, metrics_down, metrics_back = asyncio.run(go())
    # the metrics say the same: down, then up again, and how each server's requests went
    labels = f'role="pool",server="{revived}"'
    assert f"vllm_redis_proxy_server_down{{{labels}}} 1.0" in metrics_down
    assert f'vllm_redis_proxy_requests_total{{outcome="unreachable",{labels}}} 1.0' in metrics_down
    assert f"vllm_redis_proxy_server_down{{{labels}}} 0.0" in metrics_back
    assert f"vllm_redis_proxy_marked_down_total{{{labels}}} 1.0" in metrics_back
    assert f'vllm_redis_proxy_requests_total{{outcome="answered",{labels}}} 2.0' in metrics_back
    assert first == [200] * 6
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(unreachable) == 1  # tried once, then never again while the other was up
    assert marked["pool"]["marked_down"] == 1 and marked["marked_down"] == [revived]
    assert back["pool"]["marked_down"] == 0 and back["marked_down"] == []
    assert later == [200] * 4 and len(got) == 2  # round robin again: it takes its turns
    assert len(SEEN) == 6 + 2
