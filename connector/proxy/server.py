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
the client's ``kv_transfer_params`` (but for the save mark alone), ``request_id`` and
``X-Request-Id`` never reach a backend;
backend credentials (``user:pass@`` in a URL) never reach a client or a log line. The proxy
listens on 127.0.0.1 unless ``--host``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import sys

import uvicorn

from connector.proxy.app import build_app

# names this module held before the proxy was split by job (issue 53), for code that imports
# them from here
from connector.proxy.backends import check_backend_url, scrub_credentials, split_credentials
from connector.proxy.completions import prefill_request
from connector.proxy.config import (
    DEFAULT_KV_PRESENCE_BURST,
    DEFAULT_KV_PRESENCE_MAX_TOKENS,
    DEFAULT_KV_PRESENCE_RATE,
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    ProxyConfig,
)
from connector.proxy.errors import BackendError, RequestRefused, openai_error
from connector.proxy.guards import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_IN_FLIGHT_BODIES,
    DEFAULT_KV_PRESENCE_IPV6_PREFIX,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_JSON_CONTAINERS,
    DEFAULT_MAX_JSON_DEPTH,
    TokenBuckets,
)
from connector.proxy.http_protocol import DEFAULT_HEADER_READ_TIMEOUT_S, http_protocol
from connector.proxy.kv_presence import PresenceService
from connector.proxy.routing import Pool
from kvstore.net.connection import redact_url

__all__ = [
    "BackendError",
    "Pool",
    "PresenceService",
    "ProxyConfig",
    "RequestRefused",
    "TokenBuckets",
    "build_app",
    "check_backend_url",
    "main",
    "openai_error",
    "prefill_request",
    "redact_url",
    "scrub_credentials",
    "split_credentials",
]

logger = logging.getLogger("vllm_redis_proxy")


def _server_endpoint(ap: argparse.ArgumentParser, arg: str) -> tuple[str, str]:
    # split at the "=" before the endpoint's scheme: a password may hold an "=" (split at the
    # first, the error quoted the password's head as "the URL")
    at = max(arg.rfind("=tcp://"), arg.rfind("=ipc://"), arg.rfind("=inproc://"))
    url, sep, endpoint = (arg[:at], "=", arg[at + 1 :]) if at > 0 else arg.partition("=")
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
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="seconds a backend has for a whole answer (a prefill's, one without stream) or "
        "for a stream's headers and then for each of its reads; past it the client gets 504 "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    ap.add_argument(
        "--redis-url",
        default=os.environ.get("KVSTORE_URL"),
        help="the store, for POST /kv/presence (default: $KVSTORE_URL, which keeps a password "
        "out of the process list)",
    )
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
        "--max-answer-bytes",
        type=int,
        default=DEFAULT_MAX_ANSWER_BYTES,
        help="a backend answer the proxy reads whole (prefill, no stream, /tokenize) may be "
        "this long, else the client gets 502 (default %(default)s: 64 MiB)",
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
        "--header-read-timeout-s",
        type=float,
        default=DEFAULT_HEADER_READ_TIMEOUT_S,
        help="seconds a request's line and headers may take to arrive (from the connection, or "
        "from their first byte on a kept-alive one), else the connection is closed: a client "
        "trickling headers holds nothing longer (default %(default)s)",
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
    if min(args.max_body_bytes, args.max_answer_bytes, args.kv_presence_max_tokens,
           args.kv_presence_burst) < 1:  # fmt: skip
        ap.error(
            "--max-body-bytes, --max-answer-bytes, --kv-presence-max-tokens and "
            "--kv-presence-burst must be >= 1"
        )
    for name in ("timeout_s", "body_read_timeout_s", "header_read_timeout_s"):
        if not 0 < getattr(args, name) < math.inf:  # (NaN fails every comparison)
            ap.error(f"--{name.replace('_', '-')} must be a number of seconds > 0")
    if not 0 <= args.kv_presence_rate < math.inf:
        ap.error("--kv-presence-rate must be a number >= 0 (0: no limit)")
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
        max_answer_bytes=args.max_answer_bytes,
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
        http=http_protocol(args.header_read_timeout_s),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
