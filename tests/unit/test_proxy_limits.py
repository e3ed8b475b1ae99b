"""What a client can make the proxy hold (issue 52): JSON that parses to many times its size,
bodies in flight at once, requests at once, bodies trickled in, and the presence rate limit's
key for IPv6 clients. The proxy runs in process (httpx's ASGI transport); the backend is a
small stand-in on loopback, no vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from connector.proxy import bodies
from connector.proxy import server as proxy
from connector.proxy.guards import (
    Limit,
    LimitExceeded,
    RequestLimits,
    check_json_shape,
    rate_limit_key,
)
from connector.proxy.http_protocol import http_protocol
from connector.proxy.server import ProxyConfig, build_app
from testing.proxy_servers import DOWN, assert_openai_error, proxy_server, run_server
from testing.stack import serve_in_thread

SMALL = {"prompt": "x", "max_tokens": 2}


@pytest.fixture
def backend() -> Iterator[tuple[str, list[dict]]]:
    """A stand-in pool server: answers every completion, records what it was sent."""
    app = FastAPI()
    seen: list[dict] = []

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse({"choices": [{"text": "ok"}]})

    gen = run_server(app)
    yield next(gen), seen
    next(gen, None)


@asynccontextmanager
async def proxy_client(
    cfg: ProxyConfig, client: tuple[str, int] = ("127.0.0.1", 40000)
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = build_app(cfg)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            yield app, c


async def held_body(
    first: bytes, rest: bytes, reading: asyncio.Event, gate: asyncio.Event
) -> AsyncIterator[bytes]:
    """``first``, then -- once the proxy asks for more, so it holds ``first`` -- nothing until
    ``gate`` opens, then ``rest``."""
    yield first
    reading.set()
    await gate.wait()
    yield rest


def refused_count(metrics_text: str, limit: Limit) -> float:
    prefix = f'vllm_redis_proxy_refused_total{{limit="{limit.label}"}} '
    (line,) = [line for line in metrics_text.splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


# -- JSON that parses to many times its size -----------------------------------------------------


def test_a_body_of_many_empty_containers_is_refused_before_it_is_parsed(
    backend: tuple[str, list[dict]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """15 MiB of ``{},`` (the issue's body: about 25x its size once parsed) gets 413 by the
    default --max-json-containers without json.loads seeing it; a normal body, and one whose
    strings hold brackets by the hundred thousand, pass."""
    url, seen = backend
    parsed: list[int] = []  # sizes of what the proxy gave json.loads

    def loads(raw: bytes | bytearray | str, **kw: object) -> object:
        parsed.append(len(raw))
        return json.loads(raw, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bodies, "json", types.SimpleNamespace(loads=loads, dumps=json.dumps))
    empties = b'{"prompt": "x", "n": [' + b"{}," * 5_000_000 + b"{}]}"
    deep = b'{"prompt": "x", "n": ' + b"[" * 200 + b"]" * 200 + b"}"
    bracketed = {"prompt": "[" * 300_000 + '\\"{' + "{" * 300_000, "max_tokens": 2}

    async def go() -> tuple[httpx.Response, ...]:
        async with proxy_client(ProxyConfig([], [url])) as (_, c):
            return (
                await c.post("/v1/completions", content=empties),
                await c.post("/v1/completions", content=deep),
                await c.post("/v1/completions", json=SMALL),
                await c.post("/v1/completions", json=bracketed),
                await c.get("/metrics"),
            )

    many, too_deep, small, strings, metrics = asyncio.run(go())
    assert "--max-json-containers" in assert_openai_error(many, 413)["message"]
    message = assert_openai_error(too_deep, 400)["message"]
    assert "nested too deeply" in message and "--max-json-depth" in message
    assert len(empties) not in parsed and len(deep) not in parsed  # refused unparsed
    assert small.status_code == 200 and strings.status_code == 200, (small.text, strings.text)
    assert [body["prompt"] for body in seen] == [SMALL["prompt"], bracketed["prompt"]]
    assert refused_count(metrics.text, Limit.JSON_CONTAINERS) == 1
    assert refused_count(metrics.text, Limit.JSON_DEPTH) == 1


def test_json_shape_counts_brackets_outside_strings_only() -> None:
    def refused_by(raw: bytes | bytearray, containers: int, depth: int) -> Limit | None:
        try:
            check_json_shape(raw, containers, depth)
        except LimitExceeded as exceeded:
            return exceeded.limit
        return None

    three_deep = b'{"a": [{"b": "]]]}}}\\"[[[[[["}]}'  # 3 containers, 3 levels
    assert refused_by(three_deep, 3, 3) is None
    assert refused_by(three_deep, 2, 3) is Limit.JSON_CONTAINERS
    assert refused_by(three_deep, 3, 2) is Limit.JSON_DEPTH
    assert refused_by(bytearray(b"[[], [], {}]"), 4, 2) is None  # 4 containers, 2 levels
    assert refused_by(b"[[], [], {}]", 3, 2) is Limit.JSON_CONTAINERS
    # unclosed brackets are as deep as the parser would recurse before failing
    assert refused_by(b"[" * 50, 100, 10) is Limit.JSON_DEPTH
    assert refused_by(b"]" * 50 + b"[" * 5, 100, 10) is None  # closes nothing: left to the parser
    # an escaped backslash ends before the quote it precedes: the string closes there
    assert refused_by(b'["\\\\", [[[]]]]', 5, 3) is Limit.JSON_DEPTH


def test_the_shape_check_takes_one_pass_over_a_hostile_body() -> None:
    """Past the bracket bounds, an unterminated string of escaped quotes: the one pattern for
    strings with their escapes backtracked from every quote (64 KB took 8 s; a 128 KB body
    froze the proxy's event loop for 32 s, a review's). 4 MiB of it now takes one pass. (In a
    child process: the regex engine holds the GIL, so no thread of this one could time it.)"""
    code = (
        "from connector.proxy.guards import check_json_shape, LimitExceeded\n"
        "hostile = b'[' * 400 + b'\"' + b'\\\\\"' * ((4 << 20) // 3)\n"
        "try:\n"
        "    check_json_shape(hostile, 100_000, 300)\n"
        "except LimitExceeded as exceeded:\n"
        "    print(exceeded.limit.name)\n"
    )
    # the bound is some 100x what one pass takes on a busy 2-core machine; before, days
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["JSON_DEPTH"]  # 400 brackets deep, none in a string


# -- requests and bytes in flight ----------------------------------------------------------------


def test_requests_over_the_concurrency_cap_get_503_until_a_slot_frees(
    backend: tuple[str, list[dict]],
) -> None:
    url, seen = backend

    async def go() -> tuple[list[httpx.Response], httpx.Response, httpx.Response, str, int]:
        cfg = ProxyConfig([], [url], max_concurrent_requests=2)
        async with proxy_client(cfg) as (app, c):
            gate = asyncio.Event()
            reading = [asyncio.Event(), asyncio.Event()]
            bodies = [held_body(b'{"prompt": "held",', b' "max_tokens": 2}', r, gate)
                      for r in reading]  # fmt: skip
            held = [asyncio.ensure_future(c.post("/v1/completions", content=b)) for b in bodies]
            await asyncio.gather(*(r.wait() for r in reading))  # both hold a slot now
            over = await c.post("/v1/completions", json=SMALL)
            gate.set()
            answers = list(await asyncio.gather(*held))
            after = await c.post("/v1/completions", json=SMALL)
            metrics = (await c.get("/metrics")).text
            return answers, over, after, metrics, app.state.guards.slots.in_flight

    answers, over, after, metrics, in_flight = asyncio.run(go())
    message = assert_openai_error(over, 503)["message"]
    assert "--max-concurrent-requests" in message and over.headers["retry-after"] == "1"
    assert [r.status_code for r in answers] == [200, 200] and after.status_code == 200
    assert [body["prompt"] for body in seen] == ["held", "held", "x"]  # the refused one: not sent
    assert in_flight == 0
    assert refused_count(metrics, Limit.CONCURRENT_REQUESTS) == 1


def test_a_declared_length_holds_nothing_of_the_budget_until_its_bytes_come(
    backend: tuple[str, list[dict]],
) -> None:
    """Found by a review: the budget was taken by a body's Content-Length before a byte came,
    so four connections that sent headers alone (Content-Length: 16 MiB) held the whole
    budget for the read deadline, and every other client got 503."""
    url, _ = backend
    body = json.dumps({"prompt": "y" * 869, "max_tokens": 2}).encode()

    async def nothing_until(gate: asyncio.Event) -> AsyncIterator[bytes]:
        await gate.wait()
        yield b'{"prompt": "x", "max_tokens": 1}'

    async def go() -> tuple[int, int]:
        cfg = ProxyConfig([], [url], max_body_bytes=1000, max_in_flight_body_bytes=1000)
        async with proxy_client(cfg) as (app, c):
            gate = asyncio.Event()
            stalled = asyncio.ensure_future(
                c.post(
                    "/v1/completions",
                    content=nothing_until(gate),
                    headers={"content-length": "1000", "content-type": "application/json"},
                )
            )
            await asyncio.sleep(0)  # (it has sent its headers, and declared 1000 bytes)
            passed = await c.post("/v1/completions", content=body)
            assert app.state.guards.bodies.in_flight == 0
            gate.set()
            with contextlib.suppress(httpx.HTTPError):
                await stalled
            return passed.status_code, app.state.guards.bodies.in_flight

    status, left = asyncio.run(go())
    assert status == 200 and left == 0


_CONTAINERS = "[" + "{}," * 200_000 + "{}]"
# found by a review: json.loads takes UTF-16 and UTF-32, whose bytes the shape check read as
# UTF-8, so 2 million containers in UTF-16 passed it. JSON is UTF-8 (RFC 8259). The last is
# the review's own body: in UTF-16 an escaped quote's backslash is followed by a NUL, so the
# shape check ended the string early and counted nothing after it
NOT_UTF8_BODIES = {
    "utf-16-le": _CONTAINERS.encode("utf-16-le"),
    "utf-16": _CONTAINERS.encode("utf-16"),
    "utf-32": _CONTAINERS.encode("utf-32"),
    "escaped-quote-utf-16-le": (
        '{"prompt": "\\"", "n": ' + _CONTAINERS + ', "max_tokens": 1}'
    ).encode("utf-16-le"),
}


@pytest.mark.parametrize("body", NOT_UTF8_BODIES.values(), ids=NOT_UTF8_BODIES.keys())
def test_a_body_that_is_not_utf8_is_never_parsed_as_another_encoding(
    backend: tuple[str, list[dict]], body: bytes
) -> None:
    """The body is parsed as the UTF-8 text it was checked as, never as UTF-16 or UTF-32."""
    url, seen = backend

    async def go() -> httpx.Response:
        async with proxy_client(ProxyConfig([], [url])) as (_, c):
            return await c.post("/v1/completions", content=body)

    answer = asyncio.run(go())
    # refused: not UTF-8 (a BOM), or containers counted as UTF-8 reads them (UTF-16-LE of
    # ASCII is valid UTF-8, its NULs invalid JSON)
    assert answer.status_code in (400, 413), answer.text
    assert seen == []


def test_bodies_over_the_in_flight_byte_budget_get_503_and_their_bytes_come_back(
    backend: tuple[str, list[dict]],
) -> None:
    """A budget of 1500 bytes: while 800 are held by a body still arriving, a 900-byte body
    is refused as its bytes pass the budget, whether it came with a Content-Length or
    chunked."""
    url, seen = backend
    nine_hundred = json.dumps({"prompt": "y" * 869, "max_tokens": 2}).encode()
    assert len(nine_hundred) == 900

    async def chunked(body: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(body), 300):
            yield body[start : start + 300]

    async def go() -> tuple[httpx.Response, ...]:
        cfg = ProxyConfig([], [url], max_body_bytes=1000, max_in_flight_body_bytes=1500)
        async with proxy_client(cfg) as (app, c):
            budget = app.state.guards.bodies
            gate, reading = asyncio.Event(), asyncio.Event()
            first = b'{"prompt": "' + b"h" * 788
            body = held_body(first, b'", "max_tokens": 2}', reading, gate)
            held = asyncio.ensure_future(c.post("/v1/completions", content=body))
            await reading.wait()
            assert budget.in_flight == len(first) == 800
            by_length = await c.post("/v1/completions", content=nine_hundred)
            by_chunks = await c.post("/v1/completions", content=chunked(nine_hundred))
            assert budget.in_flight == 800  # the refused bodies' bytes came back
            gate.set()
            answered = await held
            assert budget.in_flight == 0
            after = await c.post("/v1/completions", content=nine_hundred)
            metrics = await c.get("/metrics")
            return by_length, by_chunks, answered, after, metrics

    by_length, by_chunks, answered, after, metrics = asyncio.run(go())
    for refused in (by_length, by_chunks):
        message = assert_openai_error(refused, 503)["message"]
        assert "--max-in-flight-body-bytes" in message and refused.headers["retry-after"] == "1"
    assert answered.status_code == 200 and after.status_code == 200
    assert [len(body["prompt"]) for body in seen] == [788, 869]
    assert refused_count(metrics.text, Limit.IN_FLIGHT_BODY_BYTES) == 2
    with pytest.raises(ValueError, match="--max-in-flight-body-bytes must be at least"):
        build_app(ProxyConfig([], [url], max_body_bytes=1000, max_in_flight_body_bytes=999))


# -- bodies trickled in --------------------------------------------------------------------------


def test_a_trickled_body_is_cut_off_at_the_deadline_and_its_bytes_given_back(
    backend: tuple[str, list[dict]],
) -> None:
    url, seen = backend

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):  # 5 s in all, a byte at a time
            await asyncio.sleep(0.05)
            yield b"x"
        yield b'"}'

    async def go() -> tuple[httpx.Response, int, str]:
        cfg = ProxyConfig([], [url], body_read_timeout_s=0.2)
        async with proxy_client(cfg) as (app, c):
            answer = await c.post("/v1/completions", content=trickle())
            metrics = (await c.get("/metrics")).text
            return answer, app.state.guards.bodies.in_flight, metrics

    answer, in_flight, metrics = asyncio.run(go())
    assert "--body-read-timeout-s" in assert_openai_error(answer, 408)["message"]
    assert in_flight == 0 and seen == []
    assert refused_count(metrics, Limit.BODY_READ_TIMEOUT) == 1


def test_a_client_that_stalls_mid_body_gets_408_over_http() -> None:
    """The same through uvicorn: a client that sends part of its body and then nothing."""
    gen, url, app = proxy_server(ProxyConfig([], [DOWN], body_read_timeout_s=0.2))
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"prompt": "')  # fmt: skip
            answer = b""
            while b"\r\n\r\n" not in answer:
                piece = conn.recv(65536)
                if not piece:
                    break
                answer += piece
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert app.state.guards.bodies.in_flight == 0
    finally:
        next(gen, None)


# -- the presence rate limit's key ---------------------------------------------------------------


def test_a_client_trickling_its_headers_is_cut_off_at_the_head_deadline() -> None:
    """uvicorn bounds bodies and keep-alive gaps, not a request's head: a header line every
    so often held a connection for ever (a review's 1,100 ran the proxy out of descriptors).
    The proxy's protocol closes it at --header-read-timeout-s; kept-alive requests that come
    whole are untouched."""
    url, stop = serve_in_thread(
        build_app(ProxyConfig([DOWN], [DOWN])), log_level="error", http=http_protocol(0.3)
    )
    try:
        with httpx.Client(base_url=url) as client:  # one kept-alive connection
            assert client.get("/health").status_code in (200, 503)
            time.sleep(0.5)  # idle past the head deadline between requests: not a slow head
            assert client.get("/health").status_code in (200, 503)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.settimeout(20)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n")
            closed = False
            for _ in range(100):  # a header line every 0.1 s: never a whole head
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
                sock.setblocking(False)
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
                if closed:
                    break
            assert closed, "the connection outlived 10 s of trickled headers"
    finally:
        stop()


def test_the_head_deadline_never_cuts_the_rest_of_a_body_answered_early() -> None:
    """A body over --max-body-bytes is answered 413 before it all came; the client, still
    sending it, must get to read that answer: timed as the next request's head, its rest was
    cut off at the head deadline (a review's)."""
    url, stop = serve_in_thread(
        build_app(ProxyConfig([DOWN], [DOWN], max_body_bytes=1000)),
        log_level="error",
        http=http_protocol(0.3),
    )
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.settimeout(20)
            head = b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: 5000\r\n"
            sock.sendall(head + b"Content-Type: application/json\r\n\r\n")
            for _ in range(10):  # the body, over 1 s: past the head deadline
                sock.sendall(b"x" * 500)
                time.sleep(0.1)
            assert sock.recv(12) == b"HTTP/1.1 413"
    finally:
        stop()


def test_ipv6_clients_share_a_presence_bucket_per_network() -> None:
    """A limit of 1 query per 100 s, bursts of 2: three addresses of one /64 pass twice in all,
    another /64 has its own bucket, IPv4 stays per address and an IPv4-mapped IPv6 address
    counts as its IPv4 one."""
    cfg = ProxyConfig([DOWN], [DOWN], enable_kv_presence=True, kv_presence_rate=0.01,
                      kv_presence_burst=2)  # fmt: skip
    clients = ["2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:1:ffff::3",  # one /64
               "2001:db8:0:2::1",  # another
               "10.0.0.1", "10.0.0.1", "10.0.0.2", "::ffff:10.0.0.1"]  # fmt: skip

    async def go() -> list[int]:
        app = build_app(cfg)
        statuses = []
        async with app.router.lifespan_context(app):
            for host in clients:
                transport = httpx.ASGITransport(app=app, client=(host, 40000))
                async with httpx.AsyncClient(transport=transport, base_url="http://p") as c:
                    r = await c.post("/kv/presence", json={"token_ids": [1]})
                    statuses.append(r.status_code)
                    if r.status_code == 429:
                        assert "--kv-presence-ipv6-prefix" in assert_openai_error(r, 429)["message"]
        return statuses

    # 501: let through (no store is configured); 429: over the limit
    assert asyncio.run(go()) == [501, 501, 429, 501, 501, 501, 501, 429]


def test_rate_limit_keys() -> None:
    assert rate_limit_key("2001:db8:0:1::1") == rate_limit_key("2001:db8:0:1:a:b:c:d")
    assert rate_limit_key("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert rate_limit_key("2001:db8:0:1::1") != rate_limit_key("2001:db8:0:2::1")
    assert rate_limit_key("2001:db8:0:1::1", 48) == rate_limit_key("2001:db8:0:2::1", 48)
    assert rate_limit_key("2001:db8::1", 128) != rate_limit_key("2001:db8::2", 128)
    assert rate_limit_key("fe80::1%eth0") == "fe80::/64"
    assert rate_limit_key("10.0.0.1") == "10.0.0.1" != rate_limit_key("10.0.0.2")
    assert rate_limit_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert rate_limit_key("") == "" and rate_limit_key("testclient") == "testclient"


# -- the command ---------------------------------------------------------------------------------


def test_the_command_sets_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    started: dict = {}
    monkeypatch.setattr(proxy.uvicorn, "run", lambda app, **kw: started.update(app=app))
    assert proxy.main(["--pool", DOWN, "--max-body-bytes", "1000",
                       "--max-in-flight-body-bytes", "5000", "--max-concurrent-requests", "7",
                       "--body-read-timeout-s", "2.5", "--max-json-containers", "9",
                       "--max-json-depth", "4"]) == 0  # fmt: skip
    assert started["app"].state.guards.limits == RequestLimits(
        max_body_bytes=1000, max_in_flight_body_bytes=5000, max_concurrent_requests=7,
        body_read_timeout_s=2.5, max_json_containers=9, max_json_depth=4,
    )  # fmt: skip
    proxy.main(["--pool", DOWN, "--max-body-bytes", "1000"])
    assert started["app"].state.guards.limits.max_in_flight_body_bytes == 4000  # 4 bodies
    refused = (
        ["--max-concurrent-requests", "0"],
        ["--body-read-timeout-s", "0"],
        ["--max-in-flight-body-bytes", "10"],
        ["--kv-presence-ipv6-prefix", "129"],
        # (a review's: NaN passed "<= 0" and failed every completion; a bad level, a traceback)
        ["--timeout-s", "nan"],
        ["--timeout-s", "inf"],
        ["--kv-presence-rate", "nan"],
        ["--header-read-timeout-s", "0"],
        ["--log-level", "bogus"],
    )
    for bad in refused:
        with pytest.raises(SystemExit):
            proxy.main(["--pool", DOWN, *bad])


@pytest.mark.parametrize(
    "backend",
    ["http://127.0.0.1:99999", "http://127.0.0.1:8100/v1", "http://127.0.0.1:8100?x=1"],
)
def test_a_backend_url_the_proxy_cannot_use_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """A port out of range gave 502 on every request; a path was doubled (/v1/v1/...)."""
    monkeypatch.setattr(proxy.uvicorn, "run", lambda app, **kw: None)
    with pytest.raises(SystemExit):
        proxy.main(["--pool", backend])
    assert "backend URL" in capsys.readouterr().err


def test_an_events_option_is_split_before_its_endpoint_and_shows_no_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backend password holding "=" was split there: the error quoted its head."""
    started: dict = {}
    monkeypatch.setattr(proxy.uvicorn, "run", lambda app, **kw: started.update(app=app))
    server = "http://u:pa=SECRETTAIL@127.0.0.1:8100"
    assert proxy.main(["--pool", server, "--policy", "cache_aware",
                       "--events", f"{server}=tcp://127.0.0.1:5557"]) == 0  # fmt: skip
    with pytest.raises(SystemExit):
        proxy.main(["--pool", server, "--events", "http://u:pa=SECRET@127.0.0.1:8100"])
    err = capsys.readouterr().err
    assert "SECRET" not in err and "u:pa" not in err and "--events" in err
