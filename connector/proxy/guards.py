"""Bounds on what clients can make the proxy hold (issue 52). ``--max-body-bytes`` bounds one
body's bytes, not the proxy's memory: many bodies at once, bodies trickled in for ever, and JSON
that parses to ~25x its size (``[{},{},...]``) each went around it. Here:

- a budget of request-body bytes held across all requests (``--max-in-flight-body-bytes``):
  a body that would pass it is refused with 503 and ``Retry-After``, never queued;
- a cap on requests being proxied at once (``--max-concurrent-requests``): 503 over it;
- a deadline for a body to arrive (``--body-read-timeout-s``): 408, its bytes given back;
- a bound on the JSON objects and arrays a body holds and on their nesting
  (``--max-json-containers``, ``--max-json-depth``), counted on the raw bytes before
  ``json.loads`` builds anything;
- the presence rate limit's key: an IPv6 client's prefix (``--kv-presence-ipv6-prefix``), as one
  host usually holds a whole /64.

Each refusal is a :class:`LimitExceeded`: which :class:`Limit` was hit, and a message naming the
option that raises it; :func:`limit_refusal` is its answer, which the proxy (``app.py``) counts
in ``/metrics``.

Also here: who may call which path (:class:`ApiKeyGuard`, the outermost layer, which also keeps
every exception and traceback from clients), and the per-client token buckets that rate-limit
``/kv/presence`` (:class:`TokenBuckets`).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hmac
import ipaddress
import itertools
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from types import TracebackType

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from connector.proxy.errors import openai_error

logger = logging.getLogger("vllm_redis_proxy")

# a body may be as big as --max-body-bytes; this many of them may be read at once by default
DEFAULT_IN_FLIGHT_BODIES = 4
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
# a chat request holds a few containers per message; 100k empty ones parse to about 7 MiB
DEFAULT_MAX_JSON_CONTAINERS = 100_000
# json.loads recurses once per level: far below Python's recursion limit, far above real requests
DEFAULT_MAX_JSON_DEPTH = 100
DEFAULT_KV_PRESENCE_IPV6_PREFIX = 64
# a busy proxy frees bodies and slots as answers start: worth asking again soon
RETRY_AFTER_BUSY_S = 1

# JSON's escapes, then its strings: each pattern matches in one pass, whatever the bytes. (One
# pattern for strings with their escapes backtracked over an unterminated string full of \":
# 64 KB took 8 s, and a 128 KB body froze the event loop for 32 s -- a review's)
_JSON_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_JSON_STRING = re.compile(rb'"[^"]*"')
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = frozenset(b"[{")


class Limit(Enum):
    """A bound on a client's request: the label its refusals are counted under in /metrics,
    the status they are answered with, the option that raises it, and the error type."""

    BODY_BYTES = ("max_body_bytes", 413, "--max-body-bytes", "invalid_request_error")
    IN_FLIGHT_BODY_BYTES = (
        "max_in_flight_body_bytes", 503, "--max-in-flight-body-bytes", "overloaded",
    )  # fmt: skip
    CONCURRENT_REQUESTS = (
        "max_concurrent_requests", 503, "--max-concurrent-requests", "overloaded",
    )  # fmt: skip
    BODY_READ_TIMEOUT = ("body_read_timeout_s", 408, "--body-read-timeout-s", "timeout")
    JSON_CONTAINERS = ("max_json_containers", 413, "--max-json-containers", "invalid_request_error")
    JSON_DEPTH = ("max_json_depth", 400, "--max-json-depth", "invalid_request_error")

    def __init__(self, label: str, status: int, option: str, error_type: str) -> None:
        self.label = label
        self.status = status
        self.option = option
        self.error_type = error_type

    @property
    def busy(self) -> bool:
        """The proxy is busy, not the request wrong: the same request may pass later."""
        return self.status == 503


class LimitExceeded(Exception):
    """A request refused by ``limit``; ``message`` says which bound and how to pass it."""

    def __init__(self, limit: Limit, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message

    @property
    def retry_after_s(self) -> int | None:
        """Seconds for the ``Retry-After`` header: set when the proxy was only busy."""
        return RETRY_AFTER_BUSY_S if self.limit.busy else None


def limit_refusal(exceeded: LimitExceeded) -> JSONResponse:
    """The answer to a request over one of the limits: its status and error type, and
    ``Retry-After`` when the proxy was only busy."""
    answer = openai_error(exceeded.limit.status, exceeded.message, exceeded.limit.error_type)
    if exceeded.retry_after_s is not None:
        answer.headers["Retry-After"] = str(exceeded.retry_after_s)
    return answer


@dataclass(frozen=True)
class RequestLimits:
    """The bounds on clients' requests, one option each (the field's name, dashed)."""

    max_body_bytes: int
    max_in_flight_body_bytes: int
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_json_containers: int = DEFAULT_MAX_JSON_CONTAINERS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH

    def __post_init__(self) -> None:
        counts = (self.max_body_bytes, self.max_in_flight_body_bytes, self.max_concurrent_requests,
                  self.max_json_containers, self.max_json_depth)  # fmt: skip
        if min(counts) < 1:
            raise ValueError(
                "--max-body-bytes, --max-in-flight-body-bytes, --max-concurrent-requests, "
                "--max-json-containers and --max-json-depth must be >= 1"
            )
        if self.max_in_flight_body_bytes < self.max_body_bytes:
            raise ValueError(
                "--max-in-flight-body-bytes must be at least --max-body-bytes (else a body the "
                "proxy accepts could never be read)"
            )
        if not self.body_read_timeout_s > 0:
            raise ValueError("--body-read-timeout-s must be > 0")


class BodyHold:
    """The bytes of the in-flight budget one request's body holds; all given back on
    :meth:`release` (once), which leaving a ``with`` block does."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.held = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all, or raise :class:`LimitExceeded` (503) holding no more."""
        more = size - self.held
        if more <= 0:
            return
        budget = self._budget
        if budget.in_flight + more > budget.capacity:
            raise LimitExceeded(
                Limit.IN_FLIGHT_BODY_BYTES,
                f"the proxy is reading as many request bodies as it may hold at once "
                f"({budget.capacity} bytes in all, its --max-in-flight-body-bytes): retry after "
                f"the Retry-After seconds, or raise --max-in-flight-body-bytes",
            )
        budget.in_flight += more
        self.held = size

    def release(self) -> None:
        self._budget.in_flight -= self.held
        self.held = 0

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


class BodyBudget:
    """Request-body bytes held across all requests, at most ``capacity``. Used from the event
    loop only: no lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0

    def hold(self) -> BodyHold:
        return BodyHold(self)


class RequestSlots:
    """Requests being proxied now, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0

    def take(self) -> None:
        """One slot, or :class:`LimitExceeded` (503): over the cap a request is refused, not
        queued, so waiting clients cannot pile up."""
        if self.in_flight >= self.capacity:
            raise LimitExceeded(
                Limit.CONCURRENT_REQUESTS,
                f"the proxy is answering as many requests as it may at once ({self.capacity}, "
                f"its --max-concurrent-requests): retry after the Retry-After seconds, or raise "
                f"--max-concurrent-requests",
            )
        self.in_flight += 1

    def give_back(self) -> None:
        self.in_flight -= 1


class RequestGuards:
    """The limits, and what requests hold of them now (``app.state.guards``)."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self.bodies = BodyBudget(limits.max_in_flight_body_bytes)
        self.slots = RequestSlots(limits.max_concurrent_requests)

    def hold_body(self) -> BodyHold:
        return self.bodies.hold()

    async def read_json_text(self, request: Request, hold: BodyHold) -> str:
        """The body as text, whole, once it is known to be no bigger than
        ``--max-body-bytes``, to fit the in-flight budget (held in ``hold`` until the caller
        releases it), to have come within the deadline, to be UTF-8, and to hold no more JSON
        containers nor deeper nesting than allowed. Raises :class:`LimitExceeded`,
        :class:`NotUtf8`, or ``ClientDisconnect``."""
        limits = self.limits
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise _too_big(limits.max_body_bytes)  # refused before a byte is read
        # (only bytes that came count against the budget: a declared length reserved up front
        # let four idle connections that sent headers alone hold the whole budget -- a review)
        try:
            raw = await asyncio.wait_for(
                _read_body(request, hold, limits.max_body_bytes), limits.body_read_timeout_s
            )
        except asyncio.TimeoutError:
            raise LimitExceeded(
                Limit.BODY_READ_TIMEOUT,
                f"the request body did not arrive within {limits.body_read_timeout_s:g} s (the "
                f"proxy's --body-read-timeout-s): send it at once, or raise "
                f"--body-read-timeout-s",
            ) from None
        try:
            # RFC 8259: JSON between systems is UTF-8, and the text is what is parsed: json.loads
            # given bytes would detect UTF-16 and UTF-32, whose bytes the shape check below
            # cannot read (a review passed 2 million containers in UTF-16 through it)
            text = codecs.decode(raw, "utf-8", "strict")
        except UnicodeDecodeError:
            raise NotUtf8() from None
        check_json_shape(raw, limits.max_json_containers, limits.max_json_depth)
        return text


class NotUtf8(ValueError):
    """A request body that is not UTF-8 (the proxy answers 400)."""

    def __init__(self) -> None:
        super().__init__("the request body is not UTF-8: send JSON encoded as UTF-8 (RFC 8259)")


async def _read_body(request: Request, hold: BodyHold, max_bytes: int) -> bytearray:
    # one growing buffer, not a list of chunks: a body sent a byte at a time arrives as
    # millions of one-byte chunks, each a ~34-byte object
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            if len(body) + len(chunk) > max_bytes:
                raise _too_big(max_bytes)
            hold.grow_to(len(body) + len(chunk))
            body += chunk
    return body


def _too_big(max_bytes: int) -> LimitExceeded:
    return LimitExceeded(
        Limit.BODY_BYTES,
        f"the request body is larger than {max_bytes} bytes (the proxy's --max-body-bytes): "
        f"send a smaller one, or raise --max-body-bytes",
    )


def check_json_shape(raw: bytes | bytearray, max_containers: int, max_depth: int) -> None:
    """Raise :class:`LimitExceeded` if the JSON in ``raw`` holds more than ``max_containers``
    objects and arrays or nests them deeper than ``max_depth``, without building it: brackets
    are counted outside strings. Bodies that are not JSON are left to the parser."""
    opened = raw.count(b"[") + raw.count(b"{")
    if opened <= min(max_containers, max_depth):
        return  # even counting the brackets inside strings, both bounds hold
    # what json.loads would build a container for: the brackets outside strings, in order
    brackets = _JSON_STRING.sub(b"", _JSON_ESCAPE.sub(b"", raw)).translate(None, _NOT_A_BRACKET)
    depth = 0
    # within bounded work: as many brackets as max_containers containers have
    for bracket in itertools.islice(brackets, 2 * max_containers):
        if bracket in _OPENERS:
            depth += 1
            if depth > max_depth:
                raise LimitExceeded(
                    Limit.JSON_DEPTH,
                    f"the request body is nested too deeply: more than {max_depth} levels of "
                    f"JSON objects and arrays (the proxy's --max-json-depth): flatten it, or "
                    f"raise --max-json-depth",
                )
        else:
            depth -= 1
            if depth < 0:
                break  # a bracket closing nothing: the parser stops here, not JSON
    if brackets.count(b"[") + brackets.count(b"{") > max_containers:
        raise LimitExceeded(
            Limit.JSON_CONTAINERS,
            f"the request body holds more than {max_containers} JSON objects and arrays (the "
            f"proxy's --max-json-containers): send fewer, or raise --max-json-containers",
        )


class ConcurrencyCap:
    """ASGI middleware: a request to one of ``paths`` holds one of ``slots`` from its first
    byte to its answer's last (a stream included), or is refused with ``refuse``'s answer."""

    def __init__(
        self,
        app: ASGIApp,
        slots: RequestSlots,
        paths: Collection[str],
        refuse: Callable[[LimitExceeded], ASGIApp],
    ) -> None:
        self.app = app
        self.slots = slots
        self.paths = frozenset(paths)
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        try:
            self.slots.take()
        except LimitExceeded as refused:
            await self.refuse(refused)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.give_back()


def rate_limit_key(host: str, ipv6_prefix: int = DEFAULT_KV_PRESENCE_IPV6_PREFIX) -> str:
    """The key a client's requests are rate-limited under: an IPv4 address (an IPv4-mapped
    IPv6 one included) as it is, an IPv6 address by its ``ipv6_prefix`` network -- one host
    is usually given a whole /64, and could otherwise pass as 2**64 clients. Anything else
    (no address, a Unix socket) is its own key."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, ipv6_prefix), strict=False))
    return str(address)


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


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <key>``, compared in constant time."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # bytes: compare_digest refuses non-ASCII str, and a header may hold anything
    return hmac.compare_digest(given.strip().encode(), key.encode())


class ApiKeyGuard:
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
            if not bearer_matches(authorization, key):
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
