#!/usr/bin/env python3
"""OpenAI-compatible proxy for disaggregated prefill through Redis.

For each completion / chat request it sends a copy to a prefill server (``max_tokens`` 1, no
streaming), takes ``kv_transfer_params`` from that answer (how many blocks the prefill saved to
Redis, and the chain's last hash), and sends the original request with those params to a decode
server, streaming the answer back unchanged. The decode server loads the prompt's KV from Redis
instead of recomputing it.

    vllm-redis-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

With ``--pool`` servers instead (share-mode instances over one Redis, or servers without a
connector) there is no prefill leg: each request goes, whole, to one of them.

    vllm-redis-proxy --pool http://127.0.0.1:8100 --pool http://127.0.0.1:8101 --port 8000

Several ``--prefill`` / ``--decode`` servers are balanced round-robin, by fewest requests in
flight, or cache-aware (``--policy cache_aware``: to the server whose GPU cache holds the longest
prefix of the prompt, learned from the KV events it publishes -- ``--events URL=tcp://host:port``
per server, see ``routing.py`` -- else the least loaded). A backend that is down or errs gives
the client an OpenAI-style error with the right status (502/504, or the backend's own), never a
hang; malformed requests get 400.

Callers are not trusted: ``--api-key`` (or ``$VLLM_API_KEY``) guards every path but ``/health``,
``--kv-api-key`` (or ``$VLLM_REDIS_PROXY_KV_API_KEY``; else the API key) the ``/kv/*`` side
channels; ``/kv/presence`` is off unless ``--enable-kv-presence``, and rate- and size-limited;
bodies over ``--max-body-bytes`` are refused unread, and what bodies may hold of the proxy
(bytes at once, requests at once, time to arrive, JSON containers) is bounded (``guards.py``);
the client's ``kv_transfer_params``, ``request_id`` and ``X-Request-Id`` never reach a backend;
backend credentials (``user:pass@`` in a URL) never reach a client or a log line. The proxy
listens on 127.0.0.1 unless ``--host``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import logging
import math
import os
import re
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard
from urllib.parse import unquote, urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from connector.proxy.guards import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_IN_FLIGHT_BODIES,
    DEFAULT_KV_PRESENCE_IPV6_PREFIX,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_JSON_CONTAINERS,
    DEFAULT_MAX_JSON_DEPTH,
    BodyHold,
    ConcurrencyCap,
    LimitExceeded,
    NotUtf8,
    RequestGuards,
    RequestLimits,
    rate_limit_key,
)
from connector.proxy.metrics import ProxyMetrics
from connector.proxy.routing import CacheAwareChooser, EventFeed, PrefixIndex

logger = logging.getLogger("vllm_redis_proxy")

# A 1M-token prompt sent as token ids is ~7 MiB of JSON, a few base64 images some MiB more;
# prompt_embeds or many images need more (raise --max-body-bytes).
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_KV_PRESENCE_MAX_TOKENS = 131072
DEFAULT_KV_PRESENCE_RATE = 10.0  # per client address, per second
DEFAULT_KV_PRESENCE_BURST = 20
# the store hashes token ids as int64 (kvstore.values.hashing); a larger one cannot be a token
TOKEN_ID_LIMIT = 2**63
# a prompt string longer than this many characters per allowed token is refused untokenized
# (no tokenizer averages more than a few characters per token)
_MAX_CHARS_PER_TOKEN = 16
# fields of a client's body that are the proxy's to set: kv_transfer_params names a handoff (a
# client could load another request's KV with it, or pin a load policy); request_id would
# name the request at the backend as X-Request-Id does
_PROXY_OWNED_FIELDS = ("kv_transfer_params", "ec_transfer_params", "request_id")
# vLLM copies vllm_xargs into the request's extra args, where the same names would reach the
# connector
_XARGS = "vllm_xargs"
# a client's X-Request-Id is echoed back only if it looks like an id
_ECHOABLE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_USERINFO_IN_TEXT = re.compile(r"(?<=://)[^/\s@]+@")


def openai_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class BackendError(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("backend error")
        self.response = response


class RequestRefused(Exception):
    """The request is answered with ``response`` before it goes anywhere (too big, bad JSON)."""

    def __init__(self, response: Response) -> None:
        super().__init__("request refused")
        self.response = response


def redact_url(url: str) -> str:
    """``url`` without credentials, for responses and logs: ``user:pass@`` becomes ``***@``,
    and a query string (``?token=...``) is dropped."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    _, at, host = parts.netloc.rpartition("@")
    netloc = f"***@{host}" if at else parts.netloc
    return parts._replace(netloc=netloc, query="", fragment="").geturl()


def scrub_credentials(text: str) -> str:
    """``text`` (an exception's message, say) with the userinfo of any URL in it hidden."""
    return _USERINFO_IN_TEXT.sub("***@", text)


def _without_proxy_owned(body: dict[str, Any]) -> dict[str, Any]:
    """A client's body without the fields that are the proxy's to set, at the top level or in
    ``vllm_xargs``."""
    body = {k: v for k, v in body.items() if k not in _PROXY_OWNED_FIELDS}
    xargs = body.get(_XARGS)
    if isinstance(xargs, dict):
        body[_XARGS] = {k: v for k, v in xargs.items() if k not in _PROXY_OWNED_FIELDS}
    return body


def check_backend_url(url: str) -> str:
    """A backend URL the proxy can use, or ``ValueError`` saying why without quoting it: an
    ``@`` after a raw ``/ ? #`` leaves where its host starts to each parser's reading (a
    password with a raw ``/`` was sent to the host "user" and shown in errors)."""
    start = url.find("//") + 2 if "//" in url else 0
    ends = [i for i in (url.find(c, start) for c in "/?#") if i != -1]
    if ends and url.rfind("@") > min(ends):
        raise ValueError(
            "a backend URL has an '@' after a raw '/', '?' or '#': percent-encode them in its "
            "password (%2F %3F %23 %40)"
        )
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise ValueError(f"a backend URL does not parse: {redact_url(url)}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"a backend URL must be http(s)://host[:port]: {redact_url(url)}")
    return url


def split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """A backend URL without its ``user:pass@`` and those credentials, sent as basic auth: the
    URL the proxy routes, shows and logs (httpx logs each request's URL) holds no secret."""
    check_backend_url(url)
    parts = urlsplit(url.rstrip("/"))
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url.rstrip("/"), None
    user, _, password = userinfo.partition(":")
    return parts._replace(netloc=host).geturl(), httpx.BasicAuth(unquote(user), unquote(password))


def _bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <key>``, compared in constant time."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # bytes: compare_digest refuses non-ASCII str, and a header may hold anything
    return hmac.compare_digest(given.strip().encode(), key.encode())


class TokenBuckets:
    """Per-client token buckets: ``rate`` requests a second, up to ``burst`` at once. At most
    ``max_clients`` are remembered (the least recently seen is forgotten first), so a caller
    with many addresses costs bounded memory."""

    def __init__(
        self,
        rate: float,
        burst: int,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when

    def take(self, client: str) -> float:
        """0 when ``client`` may go ahead (one token taken), else seconds until it may."""
        now = self._clock()
        tokens, then = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


class _Guard:
    """The outermost layer: who may call which path, and no exception or traceback ever
    reaches a client (an OpenAI-style 500 instead; the traceback goes to the log)."""

    def __init__(self, app: ASGIApp, api_key: str | None, kv_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.kv_api_key = kv_api_key

    def key_for(self, path: str) -> str | None:
        """The key a path needs; None: anyone may call it. Everything but /health needs one
        (when set): a path the proxy does not serve is no reason to answer strangers."""
        if path == "/health":
            return None  # it answers what it shows by the caller's key
        if path == "/kv" or path.startswith("/kv/") or path == "/metrics":
            return self.kv_api_key  # (the metrics name every server)
        return self.api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = self.key_for(scope["path"])
        if key is not None:
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not _bearer_matches(authorization, key):
                refusal = openai_error(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    "authentication_error",
                )
                refusal.headers["WWW-Authenticate"] = "Bearer"
                await refusal(scope, receive, send)
                return
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception:
            if started:
                raise  # the answer is under way: all that is left is cutting the connection
            logger.exception("%s %s failed", scope["method"], scope["path"])
            await openai_error(500, "internal error in the proxy", "internal_error")(
                scope, receive, send
            )


@dataclass
class Pool:
    """One role's servers and how the next one is chosen."""

    role: str
    urls: list[str]
    policy: str = "round_robin"
    in_flight: dict[str, int] = field(default_factory=dict)
    chooser: CacheAwareChooser | None = None  # policy cache_aware
    # servers that refused a connection or did not accept one in time: sent nothing while
    # another is up, probed in the background until they answer (``build_app``)
    down: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in self.urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._rr = itertools.cycle(range(len(self.urls)))

    def order(self, token_ids: list[int] | None = None) -> list[str]:
        """Every server once, best first; servers marked down last (tried only when every
        other one failed too)."""
        if self.chooser is not None:
            chosen = self.chooser.order(self.urls, token_ids)
        elif self.policy == "least_loaded":
            chosen = sorted(self.urls, key=lambda u: self.in_flight[u])
        else:
            start = next(self._rr)
            chosen = self.urls[start:] + self.urls[:start]
        if not self.down:
            return chosen
        return [u for u in chosen if u not in self.down] + [u for u in chosen if u in self.down]


@dataclass
class ProxyConfig:
    prefill: list[str]  # empty: the decode servers are a pool that answers requests whole
    decode: list[str]
    policy: str = "round_robin"
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # the block-presence endpoint (``POST /kv/presence``): the store and the connector's layout
    redis_url: str | None = None
    layout_file: str | None = None
    # policy cache_aware: server URL -> the ZMQ endpoint of its KV events
    events: dict[str, str] = field(default_factory=dict)
    # None: no key asked for. The kv key defaults to the API key (repr=False: never printed)
    api_key: str | None = field(default=None, repr=False)
    kv_api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # what clients' requests may hold at once, and for how long (``guards.py``); None: the
    # budget of body bytes is DEFAULT_IN_FLIGHT_BODIES bodies of max_body_bytes
    max_in_flight_body_bytes: int | None = None
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_json_containers: int = DEFAULT_MAX_JSON_CONTAINERS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    # /kv/presence tells whoever asks whether a prompt was seen: off unless asked for
    enable_kv_presence: bool = False
    kv_presence_rate: float = DEFAULT_KV_PRESENCE_RATE  # 0: unlimited
    kv_presence_burst: int = DEFAULT_KV_PRESENCE_BURST
    kv_presence_max_tokens: int = DEFAULT_KV_PRESENCE_MAX_TOKENS
    # IPv6 clients are rate-limited by their network of this prefix length (IPv4: by address)
    kv_presence_ipv6_prefix: int = DEFAULT_KV_PRESENCE_IPV6_PREFIX
    # how often a server marked down is asked for /health
    probe_interval_s: float = 1.0


def build_app(cfg: ProxyConfig) -> FastAPI:
    if not cfg.decode:
        raise ValueError("the proxy needs decode servers (with prefill servers) or pool servers")
    if cfg.max_body_bytes < 1 or cfg.kv_presence_max_tokens < 1:
        raise ValueError("max_body_bytes and kv_presence_max_tokens must be positive")
    if cfg.kv_presence_rate < 0 or cfg.kv_presence_burst < 1:
        raise ValueError("kv_presence_rate must be >= 0 (0: unlimited), kv_presence_burst >= 1")
    if not 0 <= cfg.kv_presence_ipv6_prefix <= 128:
        raise ValueError("--kv-presence-ipv6-prefix must be in [0, 128]")
    in_flight_body_bytes = cfg.max_in_flight_body_bytes
    if in_flight_body_bytes is None:
        in_flight_body_bytes = DEFAULT_IN_FLIGHT_BODIES * cfg.max_body_bytes
    guards = RequestGuards(
        RequestLimits(
            max_body_bytes=cfg.max_body_bytes,
            max_in_flight_body_bytes=in_flight_body_bytes,
            max_concurrent_requests=cfg.max_concurrent_requests,
            body_read_timeout_s=cfg.body_read_timeout_s,
            max_json_containers=cfg.max_json_containers,
            max_json_depth=cfg.max_json_depth,
        )
    )
    # backend credentials go to httpx as basic auth, never into a URL it logs or we show
    credentials_of: dict[str, httpx.Auth] = {}
    for url in [*cfg.prefill, *cfg.decode]:
        bare, credentials = split_credentials(url)
        if credentials is not None:
            credentials_of[bare] = credentials

    def auth(url: str) -> httpx.Auth:
        return credentials_of.get(url) or _NO_AUTH

    prefill = Pool("prefill", [split_credentials(u)[0] for u in cfg.prefill], cfg.policy)
    decode = Pool(
        "decode" if cfg.prefill else "pool",
        [split_credentials(u)[0] for u in cfg.decode],
        cfg.policy,
    )
    indexes: dict[str, PrefixIndex] = {}
    feeds: dict[str, EventFeed] = {}  # server URL -> its events' feed
    events = {split_credentials(u)[0]: e for u, e in cfg.events.items()}
    if events and cfg.policy != "cache_aware":
        raise ValueError("--events is for --policy cache_aware")
    if cfg.policy == "cache_aware":
        for pool in (prefill, decode):
            for url in pool.urls:
                if url in events and url not in indexes:
                    indexes[url] = PrefixIndex()
            pool.chooser = CacheAwareChooser(indexes, pool.in_flight.__getitem__)
        unknown = sorted(redact_url(u) for u in set(events) - set(indexes))
        if unknown:
            raise ValueError(
                f"--events names servers the proxy does not send to (--prefill, --decode, "
                f"--pool): {unknown}"
            )
    api_key = cfg.api_key or None
    kv_api_key = cfg.kv_api_key or api_key  # no kv key of its own: the API key guards /kv/*

    timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
    state: dict[str, httpx.AsyncClient] = {}
    presence = PresenceService(cfg.redis_url, cfg.layout_file)
    presence_buckets = (
        TokenBuckets(cfg.kv_presence_rate, cfg.kv_presence_burst)
        if cfg.kv_presence_rate > 0
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["client"] = httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=512)
        )
        feeds.update({u: EventFeed(events[u], index) for u, index in indexes.items()})
        prober = asyncio.ensure_future(probe_down_servers())
        yield
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober
        for feed in feeds.values():
            feed.close()
        await state["client"].aclose()
        presence.close()

    # no /docs, /redoc, /openapi.json: nothing to show strangers
    app = FastAPI(
        title="vllm-redis-proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )  # fmt: skip
    app.state.pools = {"prefill": prefill, "decode": decode}
    app.state.guards = guards
    metrics = ProxyMetrics((prefill, decode))

    def refusal(exceeded: LimitExceeded) -> JSONResponse:
        """The answer to a request over one of the guards' limits, counted in /metrics."""
        metrics.refused[exceeded.limit] += 1
        answer = openai_error(exceeded.limit.status, exceeded.message, exceeded.limit.error_type)
        if exceeded.retry_after_s is not None:
            answer.headers["Retry-After"] = str(exceeded.retry_after_s)
        return answer

    # inside _Guard (added after it, so nearer the app): a caller without the key takes no slot
    app.add_middleware(ConcurrencyCap, slots=guards.slots, refuse=refusal,
                       paths=("/v1/completions", "/v1/chat/completions"))  # fmt: skip
    app.add_middleware(_Guard, api_key=api_key, kv_api_key=kv_api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """404 / 405 and the like, OpenAI-style like every other error."""
        answer = openai_error(exc.status_code, str(exc.detail), "invalid_request_error")
        answer.headers.update(exc.headers or {})  # a 405's Allow
        return answer

    async def read_json(request: Request, hold: BodyHold) -> Any:
        """The body as JSON, read no further than ``max_body_bytes`` (a bigger one is refused
        by its Content-Length, or, chunked, as soon as what came exceeds the limit), its bytes
        held in ``hold``, and parsed only within the guards' limits (``guards.py``).
        Raises :class:`RequestRefused`."""
        try:
            text = await guards.read_json_text(request, hold)
        except LimitExceeded as exceeded:
            raise RequestRefused(refusal(exceeded)) from None
        except NotUtf8 as exc:
            raise RequestRefused(openai_error(400, str(exc), "invalid_request_error")) from None
        except ClientDisconnect:
            raise RequestRefused(Response(status_code=499)) from None
        try:
            # NaN and +-Infinity are not JSON: refused here, they could not be forwarded
            return json.loads(text, parse_constant=_refuse_constant,
                              parse_float=_finite_float)  # fmt: skip
        except RecursionError:
            message = "request body is nested too deeply"
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a non-finite number
            message = f"request body is not valid JSON: {exc}"
        raise RequestRefused(openai_error(400, message, "invalid_request_error"))

    def mark_down(pool: Pool, url: str, why: str) -> None:
        """Send ``url`` nothing while another server is up, until a probe finds it back. Its
        GPU cache is gone or unknown by then: its routing index is dropped too."""
        if url in pool.down:
            return
        pool.down.add(url)
        metrics.marked_down[(pool.role, url)] += 1
        if url in indexes:
            indexes[url].clear()
        logger.warning("%s: marked down, probed every %.1f s", why, cfg.probe_interval_s)

    def mark_up(pool: Pool, url: str) -> None:
        pool.down.discard(url)
        logger.warning("%s server %s answers again: marked up", pool.role, url)

    async def probe_down_servers() -> None:
        """Ask each server marked down for /health, every ``probe_interval_s``; one that
        answers 200 is taken back. Runs for the proxy's lifetime; a failed probe is logged
        and the loop goes on."""
        while True:
            await asyncio.sleep(cfg.probe_interval_s)
            for pool in (prefill, decode):
                for url in sorted(pool.down):
                    try:
                        answer = await state["client"].get(
                            url + "/health", timeout=cfg.connect_timeout_s, auth=auth(url)
                        )
                    except httpx.HTTPError:
                        continue
                    except Exception:  # never let the prober die: servers would stay down
                        logger.exception("probing %s server %s failed", pool.role, url)
                        continue
                    if answer.status_code == 200:
                        mark_up(pool, url)

    async def send(
        pool: Pool,
        path: str,
        body: dict,
        req_id: str,
        stream: bool,
        token_ids: list[int] | None = None,
    ) -> tuple[httpx.Response, Callable[[], Awaitable[None]]]:
        """POST to the first server of the pool that answers. A refused connection falls
        through to the next server; a pooled keep-alive connection the server had closed
        (no response at all) is retried once on a fresh one; a timeout or an HTTP error is
        final. Returns the response and its ``finish``: the server counts as busy (for
        least_loaded) until ``finish`` is awaited, which also closes the response -- after
        the last byte of a stream. Whatever happens, cancellation included, the count is
        given back exactly once."""
        client = state["client"]
        try:  # once, whatever the retries (as httpx's json=, which this replaces)
            payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                                 allow_nan=False).encode()  # fmt: skip
        except (TypeError, ValueError, RecursionError) as exc:  # what JSON cannot carry
            raise BackendError(
                openai_error(
                    400, f"the request cannot be forwarded: {exc}", "invalid_request_error"
                )
            ) from None
        headers = {"Content-Type": "application/json", "X-Request-Id": req_id}
        last_error = "no server configured"
        for url in pool.order(token_ids):
            for attempt in (1, 2):
                pool.in_flight[url] += 1
                handed_off = False
                try:
                    req = client.build_request("POST", url + path, content=payload,
                                               headers=headers)  # fmt: skip
                    resp = await client.send(req, stream=stream, auth=auth(url))
                    if resp.status_code != 200:
                        content = await resp.aread()
                        await resp.aclose()
                        metrics.count(pool.role, url, "answered")  # (its error passed on)
                        raise BackendError(
                            _passthrough_error(resp.status_code, content, pool.role, url)
                        )
                    metrics.count(pool.role, url, "answered")
                    handed_off = True
                    if url in pool.down:  # tried as a last resort, and it answered
                        mark_up(pool, url)
                    return resp, _finisher(pool, url, resp)
                except _STALE_CONNECTION as exc:
                    metrics.count(pool.role, url, "failed")
                    last_error = f"{pool.role} server {url} dropped the connection ({_safe(exc)})"
                    logger.warning("%s (attempt %d)", last_error, attempt)
                    if attempt == 1:
                        continue  # most likely a keep-alive connection it had just closed
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    metrics.count(pool.role, url, "unreachable")
                    last_error = f"{pool.role} server {url} is unreachable ({_safe(exc)})"
                    mark_down(pool, url, last_error)
                    break
                except httpx.TimeoutException:
                    metrics.count(pool.role, url, "failed")
                    raise BackendError(
                        openai_error(
                            504,
                            f"{pool.role} server {url} timed out after {cfg.timeout_s}s",
                            "timeout",
                        )
                    ) from None
                except httpx.HTTPError as exc:
                    metrics.count(pool.role, url, "failed")
                    raise BackendError(
                        openai_error(
                            502, f"{pool.role} server {url} failed: {_safe(exc)}", "backend_error"
                        )
                    ) from None
                finally:
                    if not handed_off:
                        pool.in_flight[url] -= 1
        raise BackendError(
            openai_error(
                502, f"no {pool.role} server available: {last_error}", "backend_unavailable"
            )
        )

    async def relay(
        resp: httpx.Response, finish: Callable[[], Awaitable[None]], url: str
    ) -> AsyncIterator[bytes]:
        """The decode server's stream, then -- if it fails midway -- an OpenAI-style error
        event, so the client learns the answer is incomplete. The server is released when the
        stream ends, fails, or the client leaves (Starlette cancels this generator)."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("%s server %s failed mid-stream: %s", decode.role, url, _safe(exc))
            err = {
                "error": {
                    "message": f"{decode.role} server {url} failed mid-stream: {_safe(exc)}",
                    "type": "backend_error",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await finish()

    def transfer_params(resp: httpx.Response) -> dict | None:
        """The prefill answer's ``kv_transfer_params``; BackendError (502) if the answer is not
        what a prefill server sends."""
        url = str(resp.request.url)
        try:
            doc = json.loads(resp.content, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            raise BackendError(openai_error(
                502, f"prefill server {url} answered with something other than a JSON object",
                "backend_error",
            ))  # fmt: skip
        params = doc.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise BackendError(openai_error(
                502, f"prefill server {url} answered with kv_transfer_params that are not an "
                "object", "backend_error",
            ))  # fmt: skip
        return params or None

    async def pipeline(body: dict, path: str, req_id: str, stream: bool) -> Response:
        """Prefill, then decode (a pool: the answer alone): up to the answer's first byte."""
        token_ids = await routing_tokens(body, path) if indexes else None
        try:
            dec = dict(body)
            if prefill.urls:
                resp, finish = await send(prefill, path, prefill_request(body),
                                          req_id + "-prefill", stream=False,
                                          token_ids=token_ids)  # fmt: skip
                await finish()
                params = transfer_params(resp)
                if params:
                    dec["kv_transfer_params"] = params
            resp, finish = await send(decode, path, dec, req_id, stream=stream, token_ids=token_ids)
        except BackendError as err:
            return err.response
        if stream:
            return StreamingResponse(
                relay(resp, finish, str(resp.request.url)),
                media_type=resp.headers.get("content-type", "text/event-stream"),
            )
        try:
            content = await resp.aread()
        except httpx.TimeoutException:
            return openai_error(
                504, f"{decode.role} server timed out mid-answer after {cfg.timeout_s}s", "timeout"
            )
        except httpx.HTTPError as exc:
            return openai_error(
                502, f"{decode.role} server failed mid-answer: {_safe(exc)}", "backend_error"
            )
        finally:
            await finish()
        return Response(
            content=content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    async def handle(request: Request, path: str) -> Response:
        # the body counts against --max-in-flight-body-bytes until the answer starts: the
        # body, parsed and forwarded, is dropped by then
        with guards.hold_body() as hold:
            return await proxy_request(request, path, hold)

    async def proxy_request(request: Request, path: str, hold: BodyHold) -> Response:
        try:
            body = await read_json(request, hold)
        except RequestRefused as refused:
            return refused.response
        problem = _validate(body, path)
        if problem:
            return openai_error(400, problem[0], "invalid_request_error", problem[1])
        # the proxy names the request at the backends (the client's id could be another's) and
        # sets the transfer params itself, from the prefill answer
        body = _without_proxy_owned(body)
        req_id = f"proxy-{uuid.uuid4().hex}"
        client_id = request.headers.get("x-request-id")
        shown_id = client_id if client_id and _ECHOABLE_REQUEST_ID.fullmatch(client_id) else req_id
        work = asyncio.ensure_future(pipeline(body, path, req_id, bool(body.get("stream"))))
        gone = asyncio.ensure_future(_client_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            # the client left before the answer: stop the backends' work (closing the
            # connection makes vLLM abort the request) instead of computing for nobody
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            logger.info("request %s: the client left; cancelled", req_id)
            return Response(status_code=499)
        answer = work.result()
        answer.headers["x-request-id"] = shown_id
        return answer

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        client = state["client"]
        for url in decode.order():
            try:
                r = await client.get(url + "/v1/models", timeout=10, auth=auth(url))
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                return _passthrough_error(r.status_code, r.content, decode.role, url)
            return Response(r.content, status_code=200, media_type="application/json")
        return openai_error(502, f"no {decode.role} server available", "backend_unavailable")

    @app.post("/kv/presence")
    async def kv_presence(request: Request) -> Response:
        """``presence_query``, its body's bytes held of the in-flight budget until answered."""
        with guards.hold_body() as hold:
            return await presence_query(request, hold)

    async def presence_query(request: Request, hold: BodyHold) -> Response:
        """Which leading blocks of a prompt are in Redis (``connector.presence``): body
        ``{"token_ids": [...]}`` or ``{"prompt": "..."}`` (tokenized by a decode server), and
        the request's ``cache_salt`` / ``lora_name`` / ``lora_path`` where it has them. It
        tells whoever asks whether a prompt was seen: off unless --enable-kv-presence, and
        limited per client (an IPv6 one by its network) and in tokens per query."""
        if not cfg.enable_kv_presence:
            return openai_error(
                404,
                "block presence is off: start the proxy with --enable-kv-presence (it tells "
                "callers which prompts were seen; give /kv/* a key with --kv-api-key)",
                "not_found",
            )
        if presence_buckets is not None:
            host = request.client.host if request.client else ""
            wait = presence_buckets.take(rate_limit_key(host, cfg.kv_presence_ipv6_prefix))
            if wait:
                too_many = openai_error(
                    429, f"too many presence queries from this address (at most "
                    f"{cfg.kv_presence_rate:g}/s, --kv-presence-rate; IPv6 clients count by "
                    f"their /{cfg.kv_presence_ipv6_prefix}, --kv-presence-ipv6-prefix)",
                    "rate_limit_exceeded",
                )  # fmt: skip
                too_many.headers["Retry-After"] = str(max(1, math.ceil(wait)))
                return too_many
        try:
            body = await read_json(request, hold)
        except RequestRefused as refused:
            return refused.response
        token_ids = body.get("token_ids") if isinstance(body, dict) else None
        prompt = body.get("prompt") if isinstance(body, dict) else None
        limit = cfg.kv_presence_max_tokens
        if isinstance(token_ids, list) and len(token_ids) > limit:
            return _too_many_tokens(len(token_ids), limit)
        if token_ids is None and isinstance(prompt, str):
            if len(prompt) > limit * _MAX_CHARS_PER_TOKEN:  # refused untokenized
                return _too_many_tokens(None, limit)
            token_ids = await tokenize({"prompt": prompt})
            if isinstance(token_ids, Response):
                return token_ids
            if len(token_ids) > limit:
                return _too_many_tokens(len(token_ids), limit)
        if not _valid_token_ids(token_ids):
            return openai_error(
                400, 'give "token_ids" (a list of ints in [0, 2**63)) or "prompt" (a string)',
                "invalid_request_error", "token_ids",
            )  # fmt: skip
        assert isinstance(body, dict)  # token ids came from it
        salt_fields = {k: body.get(k) for k in ("cache_salt", "lora_name", "lora_path")}
        bad = [k for k, v in salt_fields.items() if v is not None and not isinstance(v, str)]
        if bad:
            return openai_error(400, f"{bad[0]} must be a string", "invalid_request_error", bad[0])
        from connector.presence import prompt_salt
        from kvstore import InvalidArgumentError

        try:
            salt = prompt_salt(
                lora_name=salt_fields["lora_name"],
                lora_path=salt_fields["lora_path"] or "",
                cache_salt=salt_fields["cache_salt"],
            )
        except InvalidArgumentError as exc:
            return openai_error(400, str(exc), "invalid_request_error", "lora_name")
        return await presence.answer(token_ids, salt)

    async def routing_tokens(body: dict, path: str) -> list[int] | None:
        """The prompt's token ids, to match against the servers' caches; None (route by load)
        when they cannot be had."""
        if not any(len(index) for index in indexes.values()):
            return None  # nothing learned yet: no /tokenize round trip
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str):
            tokens = await tokenize({"prompt": prompt})
        elif path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
            tokens = await tokenize({"messages": body["messages"]})
        else:
            return None
        return tokens if isinstance(tokens, list) else None

    @app.get("/kv/routing")
    async def kv_routing() -> JSONResponse:
        """What cache-aware routing knows: blocks indexed and each feed's health per server."""
        servers = {
            url: {
                "events": redact_url(feed.endpoint),
                "alive": feed.alive,
                "blocks": len(feed.index),
                "batches": feed.batches,
                "gaps": feed.gaps,
                "restarts": feed.restarts,
                "undecodable": feed.undecodable,
            }
            for url, feed in feeds.items()
        }
        routed = {p.role: p.chooser.routed_by_cache for p in (prefill, decode) if p.chooser}
        return JSONResponse({"policy": cfg.policy, "servers": servers, "routed_by_cache": routed})

    async def tokenize(payload: dict[str, Any]) -> list[int] | Response:
        client = state["client"]
        for url in decode.order():
            try:
                r = await client.post(url + "/tokenize", json=payload, timeout=30,
                                      auth=auth(url))  # fmt: skip
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                try:
                    tokens = json.loads(r.content, parse_constant=_refuse_constant).get("tokens")
                except (ValueError, AttributeError, RecursionError):  # not JSON, not an object
                    tokens = None
                if _valid_token_ids(tokens):
                    return tokens
                return openai_error(502, f"{decode.role} server {url} answered /tokenize oddly",
                                    "backend_error")  # fmt: skip
            return _passthrough_error(r.status_code, r.content, decode.role, url)
        return openai_error(
            502, f"no {decode.role} server available to tokenize", "backend_unavailable"
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text: requests per server and outcome, servers marked down, in flight
        (``proxy_metrics.py``); behind the /kv key, as it names every server."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Up and down counts per role for anyone (load balancers ask without a key); each
        server's URL and state only for callers who may use /kv/* (anyone, if no key is set)."""
        client = state["client"]

        async def check(url: str) -> bool:
            try:
                r = await client.get(url + "/health", timeout=3, auth=auth(url))
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        pools = (
            {"prefill": prefill.urls, "decode": decode.urls}
            if prefill.urls
            else {"pool": decode.urls}
        )
        results = {
            role: dict(zip(urls, await asyncio.gather(*(check(u) for u in urls)), strict=True))
            for role, urls in pools.items()
        }
        ok = all(any(r.values()) for r in results.values())
        doc: dict[str, Any] = {"status": "ok" if ok else "degraded"}
        pool_of = {"prefill": prefill, "decode": decode, "pool": decode}
        for role, r in results.items():
            up = sum(r.values())
            # marked_down: servers the proxy sends nothing to now (refused or timed out)
            doc[role] = {"up": up, "down": len(r) - up, "marked_down": len(pool_of[role].down)}
        if kv_api_key is None or _bearer_matches(request.headers.get("authorization"), kv_api_key):
            doc["servers"] = results
            doc["marked_down"] = sorted({*prefill.down, *decode.down})
        return JSONResponse(doc, status_code=200 if ok else 503)

    return app


class PresenceService:
    """The proxy's block-presence answers: one ``LookupBuffer`` opened on first use."""

    def __init__(self, redis_url: str | None, layout_file: str | None) -> None:
        self._url = redis_url
        self._layout_file = layout_file
        self._store: Any = None
        self._layout: Any = None
        self._opening = threading.Lock()  # requests run in threads: one store, opened once

    async def answer(self, token_ids: list[int], salt: str = "") -> Response:
        from kvstore import InvalidArgumentError, InvalidURLError, KVStoreError

        if not self._url or not self._layout_file:
            return openai_error(
                501,
                "block presence needs the store: start the proxy with --redis-url and "
                "--layout-file (the JSON the connector writes to $REDIS_KV_CONNECTOR_LAYOUT_FILE)",
                "not_configured",
            )
        try:
            found = await asyncio.to_thread(self._presence, token_ids, salt)
        except (InvalidArgumentError, InvalidURLError) as exc:  # the proxy's own configuration
            return openai_error(500, str(exc), "not_configured")
        except KVStoreError as exc:
            return openai_error(503, f"Redis: {exc}", "store_unavailable")
        return JSONResponse(found)

    def _presence(self, token_ids: list[int], salt: str) -> dict[str, Any]:
        from connector.presence import StoredLayout, prompt_presence
        from kvstore import LookupBuffer

        with self._opening:
            if self._store is None:
                assert self._url is not None and self._layout_file is not None
                self._layout = StoredLayout.from_file(self._layout_file)
                self._store = LookupBuffer.from_url(
                    self._url, namespace=self._layout.namespace, check=False
                )
        return prompt_presence(self._store, self._layout, token_ids, salt).as_dict()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


# Errors where the server sent no response at all on a connection: on a pooled keep-alive
# connection, usually one the server closed a moment ago. Worth one retry on a fresh one.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_NO_AUTH = httpx.Auth()  # sends the request as it is


def _safe(exc: BaseException) -> str:
    """An exception for a client or the log: its repr, any URL credentials hidden."""
    return scrub_credentials(repr(exc))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: Python reads it as inf, which JSON cannot carry
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _valid_token_ids(values: Any) -> TypeGuard[list[int]]:
    """A list of token ids: ints (not bools) in [0, 2**63)."""
    return isinstance(values, list) and all(
        type(t) is int and 0 <= t < TOKEN_ID_LIMIT for t in values
    )


def _too_many_tokens(count: int | None, limit: int) -> JSONResponse:
    said = f"{count} tokens" if count is not None else "a prompt that long"
    return openai_error(
        413, f"{said}: at most {limit} per presence query (--kv-presence-max-tokens)",
        "invalid_request_error", "token_ids",
    )  # fmt: skip


def _finisher(pool: Pool, url: str, resp: httpx.Response) -> Callable[[], Awaitable[None]]:
    """Close the response and give the server's in-flight slot back, once."""
    done = False

    async def finish() -> None:
        nonlocal done
        if done:
            return
        done = True
        try:
            await resp.aclose()
        finally:
            pool.in_flight[url] -= 1

    return finish


async def _client_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def prefill_request(body: dict) -> dict:
    """The copy of a request sent to a prefill server: one token, one sequence, no stream.
    Options that would make it invalid with one token (``min_tokens`` > 1) or repeat work
    (``n``, ``best_of``) are dropped; the decode server gets them unchanged."""
    pre = {
        k: v
        for k, v in body.items()
        if k not in ("stream", "stream_options", "min_tokens", "n", "best_of")
    }
    pre.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def _validate(body: Any, path: str) -> tuple[str, str | None] | None:
    if not isinstance(body, dict):
        return "request body must be a JSON object", None
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list", "messages"
    elif "prompt" not in body:
        return "'prompt' is required", "prompt"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            return f"'{key}' must be a positive integer", key
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
        # token ids, or a list of lists of them: ids no tokenizer has are refused here
        sequences = prompt if all(isinstance(p, list) for p in prompt) else [prompt]
        if not all(_valid_token_ids(s) for s in sequences):
            return "'prompt' token ids must be integers in [0, 2**63)", "prompt"
    return None


def _passthrough_error(status: int, content: bytes, role: str, url: str) -> Response:
    """The backend's own OpenAI error when it sent one, else a wrapped one; same status (a
    status that is not an error, a redirect say, is no answer: 502)."""
    if status < 400:
        return openai_error(502, f"{role} server {url} answered {status}", "backend_error")
    try:
        doc = json.loads(content)
        if isinstance(doc, dict) and ("error" in doc or "message" in doc or "detail" in doc):
            return JSONResponse(doc, status_code=status)
    except (ValueError, RecursionError):  # not JSON (JSONDecodeError, UnicodeDecodeError)
        pass
    text = content[:500].decode(errors="replace")
    return openai_error(status, f"{role} server {url} answered {status}: {text}", "backend_error")


def _server_endpoint(ap: argparse.ArgumentParser, arg: str) -> tuple[str, str]:
    url, sep, endpoint = arg.partition("=")
    if not sep or not url.startswith("http") or "://" not in endpoint:
        ap.error(f"--events {scrub_credentials(arg)!r}: give SERVER_URL=ENDPOINT, e.g. "
                 "http://127.0.0.1:8200=tcp://127.0.0.1:5557")  # fmt: skip
    return url, endpoint


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", action="append", default=[], help="prefill server URL")
    ap.add_argument("--decode", action="append", default=[], help="decode server URL")
    ap.add_argument(
        "--pool",
        action="append",
        default=[],
        help="a server that answers requests whole, no prefill leg (share mode, or no "
        "connector); instead of --prefill/--decode",
    )
    ap.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: /kv/* are side channels; give 0.0.0.0 "
        "to listen on every interface, behind --api-key)",
    )
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--policy", choices=["round_robin", "least_loaded", "cache_aware"], default="round_robin"
    )
    ap.add_argument(
        "--events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="cache_aware: a server's KV-event publisher, e.g. "
        "http://127.0.0.1:8200=tcp://127.0.0.1:5557 (vLLM's --kv-events-config endpoint)",
    )
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--redis-url", help="the store, for POST /kv/presence")
    ap.add_argument(
        "--layout-file", help="the connector's layout JSON ($REDIS_KV_CONNECTOR_LAYOUT_FILE)"
    )
    ap.add_argument(
        "--api-key",
        help="callers must send 'Authorization: Bearer KEY' (every path but /health); default "
        "$VLLM_API_KEY, as vLLM's server",
    )
    ap.add_argument(
        "--kv-api-key",
        help="the key for /kv/* (presence, routing); default $VLLM_REDIS_PROXY_KV_API_KEY, "
        "else the API key",
    )
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413, unread (default %(default)s: 16 MiB)",
    )
    ap.add_argument(
        "--max-in-flight-body-bytes",
        type=int,
        help="request-body bytes held across all requests at once; a body that would pass it "
        f"gets 503 with Retry-After (default {DEFAULT_IN_FLIGHT_BODIES}x --max-body-bytes)",
    )
    ap.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="completions being proxied at once, streams included; more get 503 with "
        "Retry-After (default %(default)s)",
    )
    ap.add_argument(
        "--body-read-timeout-s",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds a request body may take to arrive, else 408 (default %(default)s)",
    )
    ap.add_argument(
        "--max-json-containers",
        type=int,
        default=DEFAULT_MAX_JSON_CONTAINERS,
        help="JSON objects and arrays a body may hold, counted before it is parsed; more: 413 "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--max-json-depth",
        type=int,
        default=DEFAULT_MAX_JSON_DEPTH,
        help="levels of JSON objects and arrays a body may nest; deeper: 400 (default %(default)s)",
    )
    ap.add_argument(
        "--enable-kv-presence",
        action="store_true",
        help="serve POST /kv/presence (off by default: it tells callers which prompts were seen)",
    )
    ap.add_argument(
        "--kv-presence-rate",
        type=float,
        default=DEFAULT_KV_PRESENCE_RATE,
        help="presence queries per second per client address (default %(default)s; 0: no limit)",
    )
    ap.add_argument(
        "--kv-presence-burst",
        type=int,
        default=DEFAULT_KV_PRESENCE_BURST,
        help="presence queries a client address may send at once (default %(default)s)",
    )
    ap.add_argument(
        "--kv-presence-max-tokens",
        type=int,
        default=DEFAULT_KV_PRESENCE_MAX_TOKENS,
        help="longest prompt a presence query may ask about, in tokens (default %(default)s)",
    )
    ap.add_argument(
        "--kv-presence-ipv6-prefix",
        type=int,
        default=DEFAULT_KV_PRESENCE_IPV6_PREFIX,
        help="IPv6 clients share a presence rate limit per network of this prefix length "
        "(default /%(default)s: one host's usual allocation); IPv4 clients: per address",
    )
    ap.add_argument(
        "--forwarded-allow-ips",
        default="",
        help="addresses of gateways whose X-Forwarded-For is believed (comma-separated; "
        "default: none, the connection's own address counts)",
    )
    args = ap.parse_args(argv)
    if args.pool and (args.prefill or args.decode):
        ap.error("--pool servers answer requests whole: give either --pool or --prefill/--decode")
    if not args.pool and not (args.prefill and args.decode):
        ap.error("give --prefill and --decode servers (disaggregated), or --pool servers")
    if args.max_body_bytes < 1 or args.kv_presence_max_tokens < 1 or args.kv_presence_burst < 1:
        ap.error("--max-body-bytes, --kv-presence-max-tokens and --kv-presence-burst must be >= 1")
    if args.kv_presence_rate < 0:
        ap.error("--kv-presence-rate must be >= 0 (0: no limit)")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    kv_api_key = args.kv_api_key or os.environ.get("VLLM_REDIS_PROXY_KV_API_KEY") or None
    if not _is_loopback(args.host) and not api_key:
        logger.warning("listening on %s without an API key (--api-key or $VLLM_API_KEY): "
                       "anyone who reaches it may use it", args.host)  # fmt: skip
    if args.enable_kv_presence and not (kv_api_key or api_key):
        logger.warning("/kv/presence is on without a key (--kv-api-key): any caller may test "
                       "whether a prompt was seen")  # fmt: skip
    cfg = ProxyConfig(
        args.prefill,
        args.decode or args.pool,
        args.policy,
        args.timeout_s,
        redis_url=args.redis_url,
        layout_file=args.layout_file,
        events=dict(_server_endpoint(ap, e) for e in args.events),
        api_key=api_key,
        kv_api_key=kv_api_key,
        max_body_bytes=args.max_body_bytes,
        enable_kv_presence=args.enable_kv_presence,
        kv_presence_rate=args.kv_presence_rate,
        kv_presence_burst=args.kv_presence_burst,
        kv_presence_max_tokens=args.kv_presence_max_tokens,
        kv_presence_ipv6_prefix=args.kv_presence_ipv6_prefix,
        max_in_flight_body_bytes=args.max_in_flight_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        body_read_timeout_s=args.body_read_timeout_s,
        max_json_containers=args.max_json_containers,
        max_json_depth=args.max_json_depth,
    )
    try:
        app = build_app(cfg)
    except ValueError as exc:
        ap.error(str(exc))
    # X-Forwarded-For is believed only from --forwarded-allow-ips: uvicorn trusts loopback by
    # default, and a client could then give itself any address (the presence rate limit's key)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        proxy_headers=bool(args.forwarded_allow_ips),
        forwarded_allow_ips=args.forwarded_allow_ips or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
