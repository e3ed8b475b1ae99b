"""The vLLM servers behind the proxy: their URLs (credentials taken out and sent as basic auth,
so no URL the proxy shows or logs holds a secret), one HTTP client to reach them all, sending a
request to the first server of a pool that answers, marking servers that refuse connections
down and probing them until they answer, and the questions the proxy asks them on its own
(``/health``, ``/v1/models``, ``/tokenize``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlsplit

import anyio
import httpx
from fastapi.responses import JSONResponse, Response

from connector.presence import valid_token_ids
from connector.proxy.bodies import refuse_constant
from connector.proxy.config import ProxyConfig
from connector.proxy.errors import BackendError, openai_error, passthrough_error
from connector.proxy.metrics import ProxyMetrics
from connector.proxy.routing import Pool, PrefixIndex
from kvstore.net.connection import redact_url

logger = logging.getLogger("vllm_redis_proxy")
T = TypeVar("T")

_USERINFO_IN_TEXT = re.compile(r"(?<=://)[^/\s@]+@")
# Errors where the server sent no response at all on a connection: on a pooled keep-alive
# connection, usually one the server closed a moment ago. Worth one retry on a fresh one.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_NO_AUTH = httpx.Auth()  # sends the request as it is
# a backend's error answer is passed on, this much of it at most (vLLM's are a few hundred bytes)
MAX_ERROR_BODY_BYTES = 64 * 1024
# what the proxy's own questions (/health, the prober, /v1/models) may hold of connections: a
# client of their own, so requests in flight never starve them (a review: at 512 streams
# /health said every server was down)
CONTROL_CONNECTIONS = 16
# the longest a request waits for a free connection to a backend (seconds; at most half its
# --timeout-s): with a connection per request allowed in flight, a wait means connections were
# lost, and the client hears so rather than a timeout blamed on a server
POOL_WAIT_S = 10.0
# the decode servers' streams are relayed byte for byte (``aiter_raw``): a backend asked for
# compressed bytes would send the client a stream it cannot read (no Content-Encoding is passed)
_IDENTITY = {"Accept-Encoding": "identity"}


class UnusableAnswer(Exception):
    """A backend's answer the proxy does not read on."""


class AnswerTooLarge(UnusableAnswer):
    """A backend's answer is longer than the proxy takes whole."""


class AnswerCompressed(UnusableAnswer):
    """A backend's answer, read whole, came compressed although the proxy asked for none."""


# what ``_get_whole`` raises when a server gives no answer the proxy can use
_NO_ANSWER = (httpx.HTTPError, TimeoutError, UnusableAnswer)


class AnswerBroken(Exception):
    """A backend's answer broke off after its status came: final (the request ran there)."""


@dataclass
class BackendAnswer:
    """A backend's 200 answer: its response, its body (read whole for a request sent without
    ``stream``; None for a stream, relayed as it comes) and its ``finish``."""

    response: httpx.Response
    body: bytes | None
    finish: Callable[[], Awaitable[None]]


def _compressed(resp: httpx.Response) -> str | None:
    """The answer's content coding, where it has one (the proxy asks for none)."""
    coding = resp.headers.get("content-encoding", "").strip().lower()
    return coding if coding not in ("", "identity") else None


async def read_at_most(resp: httpx.Response, limit: int) -> bytes:
    """``resp``'s body; :class:`AnswerTooLarge` past ``limit`` bytes, read no further. The
    bytes are counted as they come, never inflated: an answer compressed although the proxy
    asked for none is refused (:class:`AnswerCompressed`), since 510 KiB of gzip inflated to
    512 MiB and httpx inflates each network chunk whole (a review: 142 MiB for a 1 MiB limit)."""
    coding = _compressed(resp)
    if coding is not None:
        raise AnswerCompressed(coding)
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge(f"{declared} bytes")
    parts, size = [], 0
    async for chunk in resp.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"more than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def read_head(resp: httpx.Response, limit: int) -> bytes:
    """The first ``limit`` bytes of ``resp``'s body (an error answer: what is passed on); of a
    compressed one, only that it was."""
    coding = _compressed(resp)
    if coding is not None:
        return f"(an answer compressed with {coding[:40]}, not read)".encode()
    parts, size = [], 0
    async for chunk in resp.aiter_raw():
        parts.append(chunk[: limit - size])
        size += len(parts[-1])
        if size >= limit:
            break
    return b"".join(parts)


def scrub_credentials(text: str) -> str:
    """``text`` (an exception's message, say) with the userinfo of any URL in it hidden."""
    return _USERINFO_IN_TEXT.sub("***@", text)


def safe_repr(exc: BaseException) -> str:
    """An exception for a client or the log: its repr, any URL credentials hidden."""
    return scrub_credentials(repr(exc))


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
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"a backend URL's port must be 1-65535: {redact_url(url)}")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        # (the proxy appends /v1/...: a path given here was doubled, /v1/v1/completions)
        raise ValueError(f"a backend URL is http(s)://host[:port], no path: {redact_url(url)}")
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


def bare_urls(urls: list[str], credentials_of: dict[str, httpx.Auth]) -> list[str]:
    """``urls`` without their credentials, which are added to ``credentials_of`` under the
    bare URL; ``ValueError`` (``check_backend_url``) at the first URL the proxy cannot use."""
    bare = []
    for url in urls:
        without, credentials = split_credentials(url)
        if credentials is not None:
            credentials_of[without] = credentials
        bare.append(without)
    return bare


class Backends:
    """The prefill and decode (or pool) servers, reached through one HTTP client that lives
    from :meth:`open` to :meth:`aclose` (the app's lifespan)."""

    def __init__(
        self,
        cfg: ProxyConfig,
        prefill: Pool,
        decode: Pool,
        credentials_of: dict[str, httpx.Auth],
        metrics: ProxyMetrics,
        indexes: dict[str, PrefixIndex],
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self._credentials_of = credentials_of
        self._metrics = metrics
        self._indexes = indexes  # cache_aware: dropped with a server marked down
        self._timeout_s = cfg.timeout_s
        self._connect_timeout_s = cfg.connect_timeout_s
        self._probe_interval_s = cfg.probe_interval_s
        # (a wait for a free connection is the proxy's own limit: it ends before the deadline,
        # with its own error)
        self._timeout = httpx.Timeout(
            cfg.timeout_s, connect=cfg.connect_timeout_s, pool=min(cfg.timeout_s / 2, POOL_WAIT_S)
        )
        self._max_answer_bytes = cfg.max_answer_bytes
        # a request holds one backend connection at a time (its prefill leg ends before its
        # decode leg starts), so as many as requests may be in flight, and a few spare
        self.connections = cfg.max_concurrent_requests + CONTROL_CONNECTIONS
        self._client: httpx.AsyncClient | None = None
        self._control: httpx.AsyncClient | None = None
        self._prober: asyncio.Future[None] | None = None
        # one /health round and one /v1/models call at a time: callers meanwhile share its
        # answer (anyone may ask, as often as they like)
        self._health_round = SharedCall(self._ask_health)
        self._models_call = SharedCall(self._ask_models)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the proxy's HTTP client is not open (the app has not started)")
        return self._client

    @property
    def control(self) -> httpx.AsyncClient:
        """The client of the proxy's own questions (/health, probes, /v1/models)."""
        if self._control is None:
            raise RuntimeError("the proxy's HTTP client is not open (the app has not started)")
        return self._control

    def open(self) -> None:
        """The HTTP clients, and the prober of servers marked down (on the running loop)."""
        self._client = httpx.AsyncClient(
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=self.connections),
            headers=_IDENTITY,
        )
        self._control = httpx.AsyncClient(
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=CONTROL_CONNECTIONS),
            headers=_IDENTITY,
        )
        self._prober = asyncio.ensure_future(self.probe_down_servers())

    async def aclose(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        for client in (self._client, self._control):
            if client is not None:
                await client.aclose()

    def auth(self, url: str) -> httpx.Auth:
        return self._credentials_of.get(url) or _NO_AUTH

    def mark_down(self, pool: Pool, url: str, why: str) -> None:
        """Send ``url`` nothing while another server is up, until a probe finds it back. Its
        GPU cache is gone or unknown by then: its routing index is dropped too."""
        if url in pool.down:
            return
        pool.down.add(url)
        self._metrics.marked_down[(pool.role, url)] += 1
        if url in self._indexes:
            self._indexes[url].clear()
        logger.warning("%s: marked down, probed every %.1f s", why, self._probe_interval_s)

    def mark_up(self, pool: Pool, url: str) -> None:
        pool.down.discard(url)
        logger.warning("%s server %s answers again: marked up", pool.role, url)

    async def probe_down_servers(self) -> None:
        """Ask each server marked down for /health, every ``probe_interval_s``; one that
        answers 200 is taken back. Runs for the proxy's lifetime; a failed probe is logged
        and the loop goes on."""
        while True:
            await asyncio.sleep(self._probe_interval_s)
            for pool in (self.prefill, self.decode):
                for url in sorted(pool.down):
                    try:
                        status, _ = await self._get_whole(
                            self.control, "GET", url, "/health", self._connect_timeout_s
                        )
                    except _NO_ANSWER:
                        continue
                    except Exception:  # never let the prober die: servers would stay down
                        logger.exception("probing %s server %s failed", pool.role, url)
                        continue
                    if status == 200:
                        self.mark_up(pool, url)

    async def send(
        self,
        pool: Pool,
        path: str,
        body: dict,
        req_id: str,
        stream: bool,
        token_ids: list[int] | None = None,
    ) -> BackendAnswer:
        """POST to the first server of the pool that answers. A refused connection falls
        through to the next server; a pooled keep-alive connection the server had closed
        (no response at all) is retried once on a fresh one; a timeout or an HTTP error is
        final. Without ``stream`` the whole answer comes within ``timeout_s`` (a server that
        drips it byte by byte does not hold the request longer) and no longer than
        ``max_answer_bytes``; a stream's headers come within ``timeout_s``, its bytes then
        each within it. The server counts as busy (for least_loaded) until the answer's
        ``finish`` is awaited, which also closes the response -- after the last byte of a
        stream. Whatever happens, cancellation included, the count is given back exactly
        once."""
        metrics = self._metrics
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
                answer: BackendAnswer | None = None
                try:
                    with anyio.fail_after(self._timeout_s):
                        answer = await self._post(pool, url, path, payload, headers, stream)
                    if url in pool.down:  # tried as a last resort, and it answered
                        self.mark_up(pool, url)
                    return answer
                except _STALE_CONNECTION as exc:
                    metrics.count(pool.role, url, "failed")
                    last_error = (
                        f"{pool.role} server {url} dropped the connection ({safe_repr(exc)})"
                    )
                    logger.warning("%s (attempt %d)", last_error, attempt)
                    if attempt == 1:
                        continue  # most likely a keep-alive connection it had just closed
                    break
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    metrics.count(pool.role, url, "unreachable")
                    last_error = f"{pool.role} server {url} is unreachable ({safe_repr(exc)})"
                    self.mark_down(pool, url, last_error)
                    break
                except httpx.PoolTimeout:
                    # every connection is in use: the proxy's limit, not the server's fault
                    raise BackendError(
                        openai_error(
                            503,
                            f"the proxy had no free connection to the {pool.role} servers "
                            f"({self.connections} in use); retry later, and report it: each "
                            "request in flight has one",
                            "proxy_busy",
                        )
                    ) from None
                except (httpx.TimeoutException, TimeoutError):
                    what = "its answer" if stream else "its whole answer"
                    raise self._failed(
                        pool, url, 504, f"timed out: {what} did not come within "
                        f"{self._timeout_s}s", "timeout",
                    ) from None  # fmt: skip
                except AnswerCompressed as exc:
                    raise self._failed(
                        pool, url, 502,
                        f"answered compressed ({exc}) although asked for no content coding",
                    ) from None  # fmt: skip
                except AnswerBroken as exc:
                    raise self._failed(pool, url, 502, f"broke off its answer: {exc}") from None
                except AnswerTooLarge as exc:
                    raise self._failed(
                        pool, url, 502, f"answered with {exc}, over the proxy's "
                        f"--max-answer-bytes ({self._max_answer_bytes})",
                    ) from None  # fmt: skip
                except httpx.HTTPError as exc:
                    raise self._failed(pool, url, 502, f"failed: {safe_repr(exc)}") from None
                finally:
                    if answer is None:
                        pool.in_flight[url] -= 1
        raise BackendError(
            openai_error(
                502, f"no {pool.role} server available: {last_error}", "backend_unavailable"
            )
        )

    def _failed(
        self, pool: Pool, url: str, status: int, what: str, type_: str = "backend_error"
    ) -> BackendError:
        """A request to ``url`` that failed: counted, and the client's answer ("<role> server
        <url> <what>")."""
        self._metrics.count(pool.role, url, "failed")
        return BackendError(openai_error(status, f"{pool.role} server {url} {what}", type_))

    async def _post(
        self, pool: Pool, url: str, path: str, payload: bytes, headers: dict, stream: bool
    ) -> BackendAnswer:
        """One POST of ``send``'s: its 200 answer (the response closed on any way out but
        that one), or BackendError with the server's own error answer."""
        client = self.client
        req = client.build_request("POST", url + path, content=payload, headers=headers)
        resp = await client.send(req, stream=True, auth=self.auth(url))
        try:
            if resp.status_code != 200:
                content = await read_head(resp, MAX_ERROR_BODY_BYTES)
                self._metrics.count(pool.role, url, "answered")  # (its error passed on)
                raise BackendError(passthrough_error(resp.status_code, content, pool.role, url))
            try:
                body = None if stream else await read_at_most(resp, self._max_answer_bytes)
            except (httpx.TransportError, httpx.DecodingError) as exc:
                # (after its status: not a stale keep-alive connection to retry -- a retry
                # ran the request twice on every server of the pool, a review found)
                raise AnswerBroken(safe_repr(exc)) from None
        except BaseException:
            await resp.aclose()  # (httpcore shields its close)
            raise
        self._metrics.count(pool.role, url, "answered")
        return BackendAnswer(resp, body, _finisher(pool, url, resp))

    async def relay(
        self, resp: httpx.Response, finish: Callable[[], Awaitable[None]], url: str
    ) -> AsyncIterator[bytes]:
        """The decode server's stream, then -- if it fails midway -- an OpenAI-style error
        event, so the client learns the answer is incomplete. The server is released when the
        stream ends, fails, or the client leaves (Starlette cancels this generator)."""
        role = self.decode.role
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("%s server %s failed mid-stream: %s", role, url, safe_repr(exc))
            err = {
                "error": {
                    "message": f"{role} server {url} failed mid-stream: {safe_repr(exc)}",
                    "type": "backend_error",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await finish()

    async def _get_whole(
        self,
        client: httpx.AsyncClient,
        method: str,
        url: str,
        path: str,
        timeout: float,
        **kw: Any,
    ) -> tuple[int, bytes]:
        """(status, body) of one request the proxy asks on its own: the whole answer within
        ``timeout`` and ``max_answer_bytes`` (an error answer: its head). Raises httpx's errors,
        TimeoutError and :class:`AnswerTooLarge`."""
        with anyio.fail_after(timeout):
            auth = self.auth(url)
            async with client.stream(method, url + path, timeout=timeout, auth=auth, **kw) as r:
                if r.status_code != 200:
                    return r.status_code, await read_head(r, MAX_ERROR_BODY_BYTES)
                return 200, await read_at_most(r, self._max_answer_bytes)

    @property
    def timeout_s(self) -> float:
        """The proxy's ``--timeout-s``: how long any one wait on a backend (or a client
        taking a stream's chunk) may take."""
        return self._timeout_s

    async def tokenize(
        self, payload: dict[str, Any], within_s: float | None = None
    ) -> list[int] | Response:
        """A decode server's ``/tokenize`` of ``payload``: the token ids, or the error answer.
        All servers tried within ``within_s`` in all (default: the proxy's ``--timeout-s``),
        each given an even share of what is left: a server whose /tokenize hung held each text
        request 30 s, whatever --timeout-s, before the next was asked (a review's); given all
        of a long budget, it would have kept the next from being asked at all (another's)."""
        role = self.decode.role
        try:  # encoded as the completions are (httpx's json= raised on a lone surrogate: 500)
            body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            return openai_error(
                400, f"the prompt cannot be tokenized: {exc}", "invalid_request_error"
            )
        until = time.monotonic() + (self._timeout_s if within_s is None else within_s)
        headers = {"Content-Type": "application/json"}
        servers = self.decode.order()
        for i, url in enumerate(servers):
            left = until - time.monotonic()
            if left <= 0:
                break
            # an even share of what is left: one hung server cannot take it all
            share = left / (len(servers) - i)
            try:
                status, content = await self._get_whole(
                    self.client, "POST", url, "/tokenize", share, content=body, headers=headers
                )
            except _NO_ANSWER:
                continue
            if status == 200:
                try:
                    tokens = json.loads(content, parse_constant=refuse_constant).get("tokens")
                except (ValueError, AttributeError, RecursionError):  # not JSON, not an object
                    tokens = None
                if valid_token_ids(tokens):
                    return tokens
                return openai_error(502, f"{role} server {url} answered /tokenize oddly",
                                    "backend_error")  # fmt: skip
            return passthrough_error(status, content, role, url)
        return openai_error(502, f"no {role} server available to tokenize", "backend_unavailable")

    async def models(self) -> Response:
        """The first decode server's ``/v1/models``, passed on. Callers while one is out share
        its answer: anyone may ask, and 64 callers of a slow server held every connection of
        the proxy's own questions, so /health said every server was down (a review)."""
        status, content = await self._models_call()
        return Response(content, status_code=status, media_type="application/json")

    async def _ask_models(self) -> tuple[int, bytes]:
        answer = await self._models()
        return answer.status_code, bytes(answer.body)

    async def _models(self) -> Response:
        role = self.decode.role
        for url in self.decode.order():
            try:
                status, content = await self._get_whole(self.control, "GET", url, "/v1/models", 10)
            except _NO_ANSWER:
                continue
            if status != 200:
                return passthrough_error(status, content, role, url)
            return Response(content, status_code=200, media_type="application/json")
        return openai_error(502, f"no {role} server available", "backend_unavailable")

    async def health(self, show_servers: bool) -> JSONResponse:
        """Each server asked for /health now: up and down counts per role, 503 when a role has
        none up; with ``show_servers``, each server's URL and state too. Callers while a round
        of questions is out share its answer: anyone may ask for /health, as often as they
        like, and the servers are asked once a round."""
        results = await self._health_round()
        return self._health_answer(results, show_servers)

    async def _ask_health(self) -> dict[str, dict[str, bool]]:
        async def answers(url: str) -> bool:
            # (whole within its time: a /health that trickled held every caller's round)
            try:
                status, _ = await self._get_whole(self.control, "GET", url, "/health", 3)
            except _NO_ANSWER:
                return False
            return status == 200

        prefill, decode = self.prefill, self.decode
        pools = (
            {"prefill": prefill.urls, "decode": decode.urls}
            if prefill.urls
            else {"pool": decode.urls}
        )
        return {
            role: dict(zip(urls, await asyncio.gather(*(answers(u) for u in urls)), strict=True))
            for role, urls in pools.items()
        }

    def _health_answer(
        self, results: dict[str, dict[str, bool]], show_servers: bool
    ) -> JSONResponse:
        prefill, decode = self.prefill, self.decode
        ok = all(any(r.values()) for r in results.values())
        doc: dict[str, Any] = {"status": "ok" if ok else "degraded"}
        pool_of = {"prefill": prefill, "decode": decode, "pool": decode}
        for role, r in results.items():
            up = sum(r.values())
            # marked_down: servers the proxy sends nothing to now (refused or timed out)
            doc[role] = {"up": up, "down": len(r) - up, "marked_down": len(pool_of[role].down)}
        if show_servers:
            doc["servers"] = results
            doc["marked_down"] = sorted({*prefill.down, *decode.down})
        return JSONResponse(doc, status_code=200 if ok else 503)


class SharedCall(Generic[T]):
    """``fn()`` run once for every caller that comes while it runs: they share its outcome. A
    caller that leaves does not cancel it for the others."""

    def __init__(self, fn: Callable[[], Awaitable[T]]) -> None:
        self._fn = fn
        self._running: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._fn())
        return await asyncio.shield(self._running)


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
