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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .routing import CacheAwareChooser, EventFeed, PrefixIndex

logger = logging.getLogger("vllm_redis_proxy")


def openai_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class BackendError(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("backend error")
        self.response = response


@dataclass
class Pool:
    """One role's servers and how the next one is chosen."""

    role: str
    urls: list[str]
    policy: str = "round_robin"
    in_flight: dict[str, int] = field(default_factory=dict)
    chooser: CacheAwareChooser | None = None  # policy cache_aware

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in self.urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._rr = itertools.cycle(range(len(self.urls)))

    def order(self, token_ids: list[int] | None = None) -> list[str]:
        """Every server once, best first (later ones are fallbacks when one is down)."""
        if self.chooser is not None:
            return self.chooser.order(self.urls, token_ids)
        if self.policy == "least_loaded":
            return sorted(self.urls, key=lambda u: self.in_flight[u])
        start = next(self._rr)
        return self.urls[start:] + self.urls[:start]


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


def build_app(cfg: ProxyConfig) -> FastAPI:
    if not cfg.decode:
        raise ValueError("the proxy needs decode servers (with prefill servers) or pool servers")
    prefill = Pool("prefill", cfg.prefill, cfg.policy)
    decode = Pool("decode" if cfg.prefill else "pool", cfg.decode, cfg.policy)
    indexes: dict[str, PrefixIndex] = {}
    feeds: dict[str, EventFeed] = {}  # server URL -> its events' feed
    events = {u.rstrip("/"): e for u, e in cfg.events.items()}
    if events and cfg.policy != "cache_aware":
        raise ValueError("--events is for --policy cache_aware")
    if cfg.policy == "cache_aware":
        for pool in (prefill, decode):
            for url in pool.urls:
                if url in events and url not in indexes:
                    indexes[url] = PrefixIndex()
            pool.chooser = CacheAwareChooser(indexes, pool.in_flight.__getitem__)
        unknown = sorted(set(events) - set(indexes))
        if unknown:
            raise ValueError(
                f"--events names servers the proxy does not send to (--prefill, --decode, "
                f"--pool): {unknown}"
            )

    timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
    state: dict[str, httpx.AsyncClient] = {}
    presence = PresenceService(cfg.redis_url, cfg.layout_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["client"] = httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=512)
        )
        feeds.update({u: EventFeed(events[u], index) for u, index in indexes.items()})
        yield
        for feed in feeds.values():
            feed.close()
        await state["client"].aclose()
        presence.close()

    app = FastAPI(title="vllm-redis-proxy", lifespan=lifespan)
    app.state.pools = {"prefill": prefill, "decode": decode}

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
        last_error = "no server configured"
        for url in pool.order(token_ids):
            for attempt in (1, 2):
                pool.in_flight[url] += 1
                handed_off = False
                try:
                    req = client.build_request(
                        "POST", url + path, json=body, headers={"X-Request-Id": req_id}
                    )
                    resp = await client.send(req, stream=stream)
                    if resp.status_code != 200:
                        content = await resp.aread()
                        await resp.aclose()
                        raise BackendError(
                            _passthrough_error(resp.status_code, content, pool.role, url)
                        )
                    handed_off = True
                    return resp, _finisher(pool, url, resp)
                except _STALE_CONNECTION as exc:
                    last_error = f"{pool.role} server {url} dropped the connection ({exc!r})"
                    logger.warning("%s (attempt %d)", last_error, attempt)
                    if attempt == 1:
                        continue  # most likely a keep-alive connection it had just closed
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    last_error = f"{pool.role} server {url} is unreachable ({exc})"
                    logger.warning("%s", last_error)
                    break
                except httpx.TimeoutException:
                    raise BackendError(
                        openai_error(
                            504,
                            f"{pool.role} server {url} timed out after {cfg.timeout_s}s",
                            "timeout",
                        )
                    ) from None
                except httpx.HTTPError as exc:
                    raise BackendError(
                        openai_error(
                            502, f"{pool.role} server {url} failed: {exc}", "backend_error"
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
            logger.warning("%s server %s failed mid-stream: %r", decode.role, url, exc)
            err = {
                "error": {
                    "message": f"{decode.role} server {url} failed mid-stream: {exc!r}",
                    "type": "backend_error",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await finish()

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
                params = resp.json().get("kv_transfer_params")
                if params:
                    dec["kv_transfer_params"] = params
            resp, finish = await send(decode, path, dec, req_id, stream=stream, token_ids=token_ids)
        except BackendError as err:
            return err.response
        headers = {"x-request-id": req_id}
        if stream:
            return StreamingResponse(
                relay(resp, finish, str(resp.request.url)),
                media_type=resp.headers.get("content-type", "text/event-stream"),
                headers=headers,
            )
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            return openai_error(
                502, f"{decode.role} server failed mid-answer: {exc!r}", "backend_error"
            )
        finally:
            await finish()
        return Response(
            content=content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
            headers=headers,
        )

    async def handle(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return openai_error(
                400, f"request body is not valid JSON: {exc}", "invalid_request_error"
            )
        problem = _validate(body, path)
        if problem:
            return openai_error(400, problem[0], "invalid_request_error", problem[1])
        req_id = request.headers.get("x-request-id") or f"proxy-{uuid.uuid4().hex}"
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
        return work.result()

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
                r = await client.get(url + "/v1/models", timeout=10)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return openai_error(502, f"no {decode.role} server available", "backend_unavailable")

    @app.post("/kv/presence")
    async def kv_presence(request: Request) -> Response:
        """Which leading blocks of a prompt are in Redis (``kvstore.presence``): body
        ``{"token_ids": [...]}`` or ``{"prompt": "..."}`` (tokenized by a decode server), and
        the request's ``cache_salt`` / ``lora_name`` / ``lora_path`` where it has them."""
        try:
            body = await request.json()
        except ValueError:
            return openai_error(400, "the body must be JSON", "invalid_request_error")
        token_ids = body.get("token_ids") if isinstance(body, dict) else None
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if token_ids is None and isinstance(prompt, str):
            token_ids = await tokenize({"prompt": prompt})
            if isinstance(token_ids, Response):
                return token_ids
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            return openai_error(
                400, 'give "token_ids" (a list of ints) or "prompt" (a string)',
                "invalid_request_error", "token_ids",
            )  # fmt: skip
        salt_fields = {k: body.get(k) for k in ("cache_salt", "lora_name", "lora_path")}
        bad = [k for k, v in salt_fields.items() if v is not None and not isinstance(v, str)]
        if bad:
            return openai_error(400, f"{bad[0]} must be a string", "invalid_request_error", bad[0])
        from kvstore import InvalidArgumentError
        from kvstore.presence import prompt_salt

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
                "events": feed.endpoint,
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
                r = await client.post(url + "/tokenize", json=payload, timeout=30)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                try:
                    tokens = r.json().get("tokens")
                except (ValueError, AttributeError):  # not JSON, or not an object
                    tokens = None
                if isinstance(tokens, list):
                    return tokens
                return openai_error(502, f"{decode.role} server {url} answered /tokenize oddly",
                                    "backend_error")  # fmt: skip
            return _passthrough_error(r.status_code, r.content, decode.role, url)
        return openai_error(
            502, f"no {decode.role} server available to tokenize", "backend_unavailable"
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        client = state["client"]

        async def check(url: str) -> bool:
            try:
                return (await client.get(url + "/health", timeout=3)).status_code == 200
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
        return JSONResponse(
            {"status": "ok" if ok else "degraded", **results}, status_code=200 if ok else 503
        )

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
        from kvstore import LookupBuffer
        from kvstore.presence import StoredLayout, prompt_presence

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
    return None


def _passthrough_error(status: int, content: bytes, role: str, url: str) -> Response:
    """The backend's own OpenAI error when it sent one, else a wrapped one; same status."""
    try:
        doc = json.loads(content)
        if isinstance(doc, dict) and ("error" in doc or "message" in doc or "detail" in doc):
            return JSONResponse(doc, status_code=status)
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    text = content[:500].decode(errors="replace")
    return openai_error(status, f"{role} server {url} answered {status}: {text}", "backend_error")


def _server_endpoint(ap: argparse.ArgumentParser, arg: str) -> tuple[str, str]:
    url, sep, endpoint = arg.partition("=")
    if not sep or not url.startswith("http") or "://" not in endpoint:
        ap.error(f"--events {arg!r}: give SERVER_URL=ENDPOINT, e.g. "
                 "http://127.0.0.1:8200=tcp://127.0.0.1:5557")  # fmt: skip
    return url, endpoint


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
    ap.add_argument("--host", default="0.0.0.0")
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
    args = ap.parse_args(argv)
    if args.pool and (args.prefill or args.decode):
        ap.error("--pool servers answer requests whole: give either --pool or --prefill/--decode")
    if not args.pool and not (args.prefill and args.decode):
        ap.error("give --prefill and --decode servers (disaggregated), or --pool servers")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    cfg = ProxyConfig(
        args.prefill,
        args.decode or args.pool,
        args.policy,
        args.timeout_s,
        redis_url=args.redis_url,
        layout_file=args.layout_file,
        events=dict(_server_endpoint(ap, e) for e in args.events),
    )
    uvicorn.run(build_app(cfg), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
