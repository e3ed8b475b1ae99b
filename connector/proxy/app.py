"""The proxy's FastAPI app (``build_app``): its configuration checked, its parts put together
(backends and their pools, the guards, the routing indexes, the metrics) and its routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (``completions.py``),
- ``GET /v1/models`` (a decode server's), ``GET /health`` (every server asked now),
- ``POST /kv/presence`` (``kv_presence.py``), ``GET /kv/routing`` (``routing.py``),
- ``GET /metrics`` (``metrics.py``).

Every error is OpenAI-style (``errors.py``), 404 and 405 included; keys and limits are the
guards' (``guards.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from connector.proxy.backends import Backends, bare_urls, split_credentials
from connector.proxy.completions import CompletionProxy
from connector.proxy.config import ProxyConfig
from connector.proxy.errors import openai_error
from connector.proxy.guards import (
    DEFAULT_IN_FLIGHT_BODIES,
    ApiKeyGuard,
    ConcurrencyCap,
    LimitExceeded,
    RequestGuards,
    RequestLimits,
    bearer_matches,
    limit_refusal,
)
from connector.proxy.kv_presence import PresenceQueries
from connector.proxy.metrics import ProxyMetrics
from connector.proxy.routing import EventFeed, Pool, PrefixIndex, index_servers, routing_report


def build_app(cfg: ProxyConfig) -> FastAPI:
    """The proxy for ``cfg``; ``ValueError`` (saying which option) if it cannot be one."""
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
    prefill = Pool("prefill", bare_urls(cfg.prefill, credentials_of), cfg.policy)
    decode = Pool("decode" if cfg.prefill else "pool", bare_urls(cfg.decode, credentials_of),
                  cfg.policy)  # fmt: skip
    events = {split_credentials(u)[0]: e for u, e in cfg.events.items()}
    if events and cfg.policy != "cache_aware":
        raise ValueError("--events is for --policy cache_aware")
    indexes: dict[str, PrefixIndex] = (
        index_servers((prefill, decode), events) if cfg.policy == "cache_aware" else {}
    )
    feeds: dict[str, EventFeed] = {}  # server URL -> its events' feed, while the app runs
    api_key = cfg.api_key or None
    kv_api_key = cfg.kv_api_key or api_key  # no kv key of its own: the API key guards /kv/*

    metrics = ProxyMetrics((prefill, decode))

    def refusal(exceeded: LimitExceeded) -> JSONResponse:
        """The answer to a request over one of the guards' limits, counted in /metrics."""
        metrics.refused[exceeded.limit] += 1
        return limit_refusal(exceeded)

    backends = Backends(cfg, prefill, decode, credentials_of, metrics, indexes)
    completion_proxy = CompletionProxy(backends, guards, refusal, indexes)
    presence = PresenceQueries(cfg, backends, guards, refusal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backends.open()
        feeds.update({u: EventFeed(events[u], index) for u, index in indexes.items()})
        yield
        await backends.aclose()
        for feed in feeds.values():
            feed.close()
        presence.close()

    # no /docs, /redoc, /openapi.json: nothing to show strangers
    app = FastAPI(
        title="vllm-redis-proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )  # fmt: skip
    app.state.pools = {"prefill": prefill, "decode": decode}
    app.state.backends = backends
    app.state.guards = guards

    # inside ApiKeyGuard (added after it, so nearer the app): a caller without the key takes
    # no slot
    app.add_middleware(ConcurrencyCap, slots=guards.slots, refuse=refusal,
                       paths=("/v1/completions", "/v1/chat/completions"))  # fmt: skip
    app.add_middleware(ApiKeyGuard, api_key=api_key, kv_api_key=kv_api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """404 / 405 and the like, OpenAI-style like every other error."""
        answer = openai_error(exc.status_code, str(exc.detail), "invalid_request_error")
        answer.headers.update(exc.headers or {})  # a 405's Allow
        return answer

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion_proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion_proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await backends.models()

    @app.post("/kv/presence")
    async def kv_presence(request: Request) -> Response:
        """Which leading blocks of a prompt are in Redis (``kv_presence.py``)."""
        return await presence.answer(request)

    @app.get("/kv/routing")
    async def kv_routing() -> JSONResponse:
        """What cache-aware routing knows: blocks indexed and each feed's health per server."""
        return JSONResponse(routing_report(cfg.policy, feeds, (prefill, decode)))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text: requests per server and outcome, servers marked down, in flight
        (``metrics.py``); behind the /kv key, as it names every server."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Up and down counts per role for anyone (load balancers ask without a key); each
        server's URL and state only for callers who may use /kv/* (anyone, if no key is set)."""
        show_servers = kv_api_key is None or bearer_matches(
            request.headers.get("authorization"), kv_api_key
        )
        return await backends.health(show_servers)

    return app
