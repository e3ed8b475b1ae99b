"""Store URLs -> redis-py clients, and redis-py errors -> kvstore's typed errors.

Accepted: ``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS), ``unix:///path?db=N``
and the aliases ``valkey://`` / ``valkeys://``. TLS options come as keyword arguments or as
query parameters (``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``, ``tls_verify``).

A password holding ``/``, ``?``, ``#`` or ``@`` must be percent-encoded (``%2F``, ``%3F``,
``%23``, ``%40``); a URL where an ``@`` follows one of ``/?#`` is refused, since its password's
end cannot be told apart from its host's. A password may also come as ``?password=``.

Topologies, spelled as LMCache spells them so users can move over:
``redis-sentinel://[user:password@]host1:port1[,host2:port2...]/<service>[/db]`` (the
credentials are the master's; the sentinels are asked without them, or with the same ones given
``?sentinel_auth=url``: sentinels with ``requirepass``, set as most charts set it) and
``redis-cluster://[user:password@]host1:port1[,host2:port2...]`` (seed nodes); ``rediss-*`` for
TLS and ``valkey-*`` / ``valkeys-*`` as aliases.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.connection
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from kvstore.errors import (
    InvalidArgumentError,
    InvalidURLError,
    KVStoreError,
    StoreAuthenticationError,
    StoreBusyError,
    StoreCommandError,
    StoreOutOfMemoryError,
    StorePermissionError,
    StoreReplyTooLargeError,
    StoreTimeoutError,
    StoreTopologyError,
    StoreUnavailableError,
)
from kvstore.net.bounded_replies import (
    BoundedConnection,
    BoundedHiredisParser,
    BoundedSSLConnection,
    BoundedUnixConnection,
    ReplyTooLarge,
)
from kvstore.text import printable, without_echoed_args
from kvstore.values.keys import DEFAULT_KEY_PREFIX, NAME_RE

logger = logging.getLogger("kvstore")

# our aliases -> the scheme redis-py parses
_ALIASES = {"valkey": "redis", "valkeys": "rediss", "redis+unix": "unix", "valkey+unix": "unix"}
# URL schemes that speak TLS
_TLS_SCHEMES = frozenset(
    f"{name}s{topology}"
    for name in ("redis", "valkey")
    for topology in ("", "-sentinel", "-cluster")
)
_TLS_QUERY = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_verify")
# a Sentinel URL's own parameter: whether the sentinels take the URL's credentials too
SENTINEL_AUTH = "sentinel_auth"
_SENTINEL_AUTH_VALUES = ("none", "url")
_URL_PARTS = {"host", "port", "db", "username", "password", "path", "connection_class"}
# a "password=" query value ends where one of these parameters begins ("&name="), else at the
# URL's end: a raw "&" or "#" in the password must not leave its tail in a log
_QUERY_NAMES = (
    *_TLS_QUERY,
    SENTINEL_AUTH,
    *_URL_PARTS,
    *redis.connection.URL_QUERY_ARGUMENT_PARSERS,
)
# (each letter as written or percent-encoded: redis-py decodes parameter names, so
# "?pass%77ord=" sets the password too)
_QUERY_PASSWORD = re.compile(
    "[?&;]" + "".join(f"(?:{c}|%{ord(c):02x}|%{ord(c.upper()):02x})" for c in "password") + "=",
    re.IGNORECASE,
)
# the query parameters whose values are shown (the others' may be tokens)
_SHOWN_QUERY_VALUES = frozenset(n.lower() for n in _QUERY_NAMES) - {"password"}
_NEXT_QUERY_NAME = re.compile(
    "&(?:" + "|".join(re.escape(n) for n in sorted(set(_QUERY_NAMES))) + ")=", re.IGNORECASE
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}")
# <scheme> -> (topology, tls)
_TOPOLOGIES = {
    f"{name}{s}-{topology}": (topology, bool(s))
    for name in ("redis", "valkey")
    for s in ("", "s")
    for topology in ("cluster", "sentinel")
}


@dataclass(frozen=True)
class StoreAddress:
    """A parsed store URL. ``safe_url`` is the URL with any password replaced by ``***``."""

    transport: str  # "tcp" or "unix"
    tls: bool
    host: str
    port: int
    path: str
    db: int
    username: str | None
    password: str | None
    options: dict[str, str]
    safe_url: str
    topology: str = "standalone"  # "standalone", "sentinel" or "cluster"
    nodes: tuple[tuple[str, int], ...] = ()  # sentinels, or a cluster's seed nodes
    service: str = ""  # the Sentinel service (master) name

    def __repr__(self) -> str:  # never show the password, even in tracebacks' locals
        return f"StoreAddress({self.safe_url!r})"


def _bad(url_for_msg: str, why: str) -> InvalidURLError:
    return InvalidURLError(
        f"invalid store URL {url_for_msg!r}: {why}. Expected redis://[user:password@]host:port/db, "
        "rediss://... (TLS), unix:///path/to.sock?db=N, the valkey:// / valkeys:// aliases, "
        "redis-sentinel://host:port[,host:port...]/<service>[/db] or "
        "redis-cluster://host:port[,host:port...]"
    )


def redact_url(url: str) -> str:
    """``url`` safe for logs and answers, by the project's one rule (the proxy's backend and
    event URLs too): every text :func:`_redacted` takes for a password is masked, then the
    whole userinfo becomes ``***@`` -- a lone user name may be a token -- and the query and
    fragment are dropped (``?token=``). As in :func:`_redacted`, the userinfo ends at the
    URL's LAST ``@``. A URL that does not split at all is not shown. (``StoreAddress.safe_url``
    keeps a user name given with a password, which ACL errors name, and the known query
    options' values.)"""
    if not isinstance(url, str):
        return "<not a URL>"
    try:
        urlsplit(url)
    except ValueError:  # a bracketed host left open, say: no telling what is what
        return "<unparseable URL>"
    masked = _redacted(url)[0]
    scheme, sep, rest = masked.partition("://")
    if not sep:
        scheme, rest = "", masked
    _, at, after = rest.rpartition("@")
    ends = [i for i in (after.find("?"), after.find("#")) if i != -1]
    return f"{scheme}{sep}{'***@' if at else ''}{after[: min(ends, default=len(after))]}"


def _redacted(url: str) -> tuple[str, list[str]]:
    """``url`` with every text that may be a password replaced by ``***``, and those texts.

    The userinfo is taken to end at the URL's LAST ``@``, wherever it lies: a raw ``/``, ``?``
    or ``#`` in a password ends the authority for urlsplit (and redis-py), which then finds no
    password and shows it as host, port, path or query. Such URLs are refused by
    :func:`parse_url`; this masks them anyway, for the refusal's own message. The cost: an
    ``@`` in a path or query value (write ``%40``) masks the host too -- never the reverse.
    A ``password=`` query value is masked up to the next known parameter, else to the end."""
    if not isinstance(url, str):
        return "<not a URL>", []
    _, sep, rest = url.partition("://")
    base = len(url) - len(rest) if sep else 0
    spans: list[tuple[int, int]] = []  # [start, end) of url to mask
    userinfo, at, _ = url[base:].rpartition("@")
    if at:
        colon = userinfo.find(":")
        if colon >= 0:  # the user name is kept: ACL errors name it
            spans.append((base + colon + 1, base + len(userinfo)))
        else:  # a lone user name may be a password (redis://TOKEN@host, as Lettuce reads it)
            spans.append((base, base + len(userinfo)))
    for m in _QUERY_PASSWORD.finditer(url, base):
        following = _NEXT_QUERY_NAME.search(url, m.end())
        spans.append((m.end(), following.start() if following else len(url)))
    # any other parameter's value but the known ones' (``?token=``), and the fragment
    after = base + len(userinfo) + len(at)
    query_at, fragment_at = url.find("?", after), url.find("#", after)
    if fragment_at >= 0:
        spans.append((fragment_at + 1, len(url)))
    if query_at >= 0 and (fragment_at < 0 or query_at < fragment_at):
        start = query_at + 1
        for pair in re.split("[&;]", url[start : fragment_at if fragment_at >= 0 else None]):
            name, eq, value = pair.partition("=")
            shown = unquote(name).lower() in _SHOWN_QUERY_VALUES
            if shown and unquote(name).lower() == SENTINEL_AUTH:  # (a password put there by
                shown = unquote(value).lower() in _SENTINEL_AUTH_VALUES  # mistake: a review's)
            if eq and value and not shown:
                spans.append((start + len(name) + 1, start + len(pair)))
            start += len(pair) + 1
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:  # overlapping: their union is masked
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out, pos = [], 0
    for start, end in merged:
        out += [url[pos:start], "***"]
        pos = end
    out.append(url[pos:])
    return "".join(out), [url[a:b] for a, b in merged if b > a]


def _shown_names(names: set[str], secrets: list[str]) -> str:
    """Query parameter names for a message, less any that is part of a password (a raw ``&``
    in a ``password=`` value makes its tail a parameter name)."""
    texts = [*secrets, *(unquote(s) for s in secrets)]
    shown = sorted(n for n in names if not any(n in t for t in texts))
    hidden = len(names) - len(shown)
    return f"{shown}" + (f" and {hidden} not shown (part of the password?)" if hidden else "")


def parse_url(url: str) -> StoreAddress:
    """Parse and validate a store URL with redis-py's parser (plus the valkey aliases, TLS query
    options and stricter checks); raises :class:`InvalidURLError` with a redacted URL."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidURLError("the store URL is empty: set it, e.g. url=redis://127.0.0.1:6379/0")
    safe, secrets = _redacted(url.strip())
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        named = url.strip().partition(":")[0]  # only if it looks like one: it may be a password
        shown = repr(named) if _SCHEME.fullmatch(named) else "(none)"
        raise _bad(safe, f"unsupported scheme {shown}")
    userinfo, at, _ = rest.rpartition("@")
    if at and any(c in userinfo for c in "/?#"):
        # urlsplit would end the authority at that character and take the password's tail
        # for the host, port or path: refuse, without quoting any of it
        raise _bad(
            safe,
            "an '@' follows a '/', '?' or '#', so where the password ends is ambiguous: "
            "percent-encode '/', '?', '#' and '@' in the user name and password (%2F, %3F, "
            "%23, %40), and '@' in a path or query value (%40)",
        )
    if scheme.lower() in _TOPOLOGIES:
        return _parse_topology_url(scheme.lower(), rest, safe, secrets)
    scheme = _ALIASES.get(scheme.lower(), scheme.lower())
    if scheme not in ("redis", "rediss", "unix"):
        shown = repr(scheme) if _SCHEME.fullmatch(scheme) else "(not a scheme)"
        raise _bad(safe, f"unsupported scheme {shown}")
    try:
        kwargs = redis.connection.parse_url(f"{scheme}://{rest}")
        path = urlsplit(f"{scheme}://{rest}").path
    except ValueError as exc:
        # its messages name a port or a parameter; masked all the same, should one quote more
        raise _bad(safe, _scrubbed(str(exc), secrets)) from None
    options = {k: str(v) for k, v in kwargs.items() if k not in _URL_PARTS}
    unknown = set(options) - set(_TLS_QUERY)
    if unknown:
        raise _bad(safe, f"unknown query parameter(s) {_shown_names(unknown, secrets)}")
    _check_tls_options(options, scheme == "rediss", safe)
    transport = "unix" if scheme == "unix" else "tcp"
    if transport == "tcp" and not kwargs.get("host"):
        raise _bad(safe, "no host")
    if transport == "tcp" and path.strip("/") and "db" not in kwargs:  # redis-py ignores it
        got = _scrubbed(path.strip("/"), secrets)
        raise _bad(safe, f"database must be an integer, got {got!r}")
    if transport == "unix" and not kwargs.get("path"):
        raise _bad(safe, "no socket path")
    db = int(kwargs.get("db", 0))
    if db < 0:
        raise _bad(safe, "database must be >= 0")
    return StoreAddress(
        transport=transport,
        tls=scheme == "rediss",
        host=kwargs.get("host", ""),
        port=int(kwargs.get("port", 6379)),
        path=kwargs.get("path", ""),
        db=db,
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        options=options,
        safe_url=safe,
    )


def _scrubbed(text: str, secrets: list[str]) -> str:
    """``text`` with every password (as written, and percent-decoded) replaced by ``***``."""
    for secret in sorted({*secrets, *(unquote(s) for s in secrets)}, key=len, reverse=True):
        if len(secret) >= 3:  # shorter ones would mask letters of the message, not secrets
            text = text.replace(secret, "***")
    return text


_TLS_VERIFY_OFF = ("false", "0", "no", "none")
_TLS_VERIFY_VALUES = ("true", "1", "yes", *_TLS_VERIFY_OFF)


def _check_tls_options(options: dict[str, str], tls: bool, safe: str) -> None:
    """TLS options only where the scheme says TLS: on ``redis://`` they were ignored, and the
    connection -- the password with it -- went in clear (a review's); ``tls_verify`` only as
    a yes or a no (``off`` was taken for yes)."""
    given = sorted(k for k in options if k in _TLS_QUERY)
    if given and not tls:
        raise _bad(
            safe,
            f"{', '.join(given)} given on a plain (not TLS) URL, which would connect in clear: "
            "use the TLS scheme (rediss://, rediss-cluster://, rediss-sentinel://, valkeys://)",
        )
    if options.get("tls_verify", "true").lower() not in _TLS_VERIFY_VALUES:
        raise _bad(safe, f"tls_verify must be one of {', '.join(_TLS_VERIFY_VALUES)}")


def _parse_topology_url(scheme: str, rest: str, safe: str, secrets: list[str]) -> StoreAddress:
    """``redis-sentinel://`` / ``redis-cluster://`` (and their TLS and valkey spellings)."""
    topology, tls = _TOPOLOGIES[scheme]
    rest, _, query = rest.partition("?")  # also with no path: rediss-cluster://h:1?tls_...
    netloc, _, tail = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    if not at:
        creds, hosts = "", netloc
    user, _, password = creds.partition(":") if creds else ("", "", "")
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = item.strip(), "26379" if topology == "sentinel" else "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(safe, f"bad host:port {item.strip()!r}")
        nodes.append((host, int(port)))
    options = {}
    allowed = (*_TLS_QUERY, SENTINEL_AUTH) if topology == "sentinel" else _TLS_QUERY
    for pair in filter(None, query.split("&")):
        key, _, value = pair.partition("=")
        if key not in allowed:
            raise _bad(safe, f"unknown query parameter(s) {_shown_names({key}, secrets)}")
        # (sentinel_auth as written: its errors read it from the URL's shown form)
        options[key] = value if key == SENTINEL_AUTH else unquote(value)
    _check_tls_options(options, tls, safe)
    if options.get(SENTINEL_AUTH, "none") not in _SENTINEL_AUTH_VALUES:
        raise _bad(
            safe,
            f"{SENTINEL_AUTH} must be one of {', '.join(_SENTINEL_AUTH_VALUES)} (url: the "
            "sentinels take the URL's user name and password too)",
        )
    parts = [unquote(p) for p in tail.split("/") if p]
    service, db = "", 0
    if topology == "sentinel":
        if not parts:
            raise _bad(safe, "no Sentinel service name: redis-sentinel://host:port/<service>")
        service = parts[0]
        parts = parts[1:]
    if parts:
        if len(parts) > 1 or not parts[0].isdigit():
            raise _bad(safe, f"database must be an integer, got {'/'.join(parts)!r}")
        db = int(parts[0])
    if topology == "cluster" and db:
        raise _bad(safe, "a Redis/Valkey Cluster has only database 0")
    return StoreAddress(
        transport="tcp",
        tls=tls,
        host=nodes[0][0],
        port=nodes[0][1],
        path="",
        db=db,
        username=unquote(user) or None,
        password=unquote(password) if password else None,
        options=options,
        safe_url=safe,
        topology=topology,
        nodes=tuple(nodes),
        service=service,
    )


def make_client(
    address: StoreAddress,
    *,
    socket_timeout_s: float = 10.0,
    connect_timeout_s: float = 3.0,
    max_connections: int = 32,
    tls_ca_file: str | None = None,
    tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
    tls_verify: bool | None = None,
    password: str | None = None,
    username: str | None = None,
) -> redis.Redis:
    """A redis-py client (hiredis parser when installed) with a bounded, thread-safe pool."""
    check_timeouts(socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s)
    if not address.tls and (tls_ca_file or tls_cert_file or tls_key_file):
        raise InvalidArgumentError(
            f"{address.safe_url}: TLS files given for a plain (not TLS) URL, which would connect "
            "in clear: use the TLS scheme (rediss://, rediss-cluster://, rediss-sentinel://)"
        )
    kwargs: dict[str, Any] = {
        # One immediate retry on a broken connection (a pooled one the server dropped, e.g.
        # after a restart), none on a timeout: redis-py's default -- 10 retries with backoff on
        # timeouts too -- turns one hung server into many socket timeouts per call. Callers
        # own deadlines and retries above this.
        "retry": Retry(NoBackoff(), 1, supported_errors=(rex.ConnectionError,)),
        "db": address.db,
        "username": username or address.username,
        "password": password if password is not None else address.password,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "max_connections": max_connections,
        "health_check_interval": 30,
        # every reply redis-py parses for us bounded in size and time, a handshake reply of
        # the wrong shape a protocol error (``bounded_replies``): values are read by wire.py
        "parser_class": BoundedHiredisParser,
        "connection_class": BoundedConnection,
        **_NO_MAINT_NOTIFICATIONS,
    }
    if address.transport == "unix":
        kwargs["connection_class"] = BoundedUnixConnection
        kwargs["path"] = address.path
        pool = _WaitsForAConnection(**kwargs)
        return redis.Redis(connection_pool=pool)
    kwargs["host"] = address.host
    kwargs["port"] = address.port
    if address.tls:
        opts = address.options
        verify = tls_verify
        if verify is None:
            verify = opts.get("tls_verify", "true").lower() not in _TLS_VERIFY_OFF
        if not verify:
            _warn_unverified_tls(address.safe_url)
        kwargs["connection_class"] = BoundedSSLConnection
        kwargs.update(
            _tls_kwargs(
                tls_ca_file or opts.get("tls_ca_file"),
                tls_cert_file or opts.get("tls_cert_file"),
                tls_key_file or opts.get("tls_key_file"),
                verify,
            )
        )
    if address.topology == "sentinel":
        return _sentinel_client(address, kwargs)
    if address.topology == "cluster":
        return _cluster_client(address, kwargs)
    pool = _WaitsForAConnection(**kwargs)
    return redis.Redis(connection_pool=pool)


try:  # redis-py >= 7: a server's RESP3 push (MOVING) must not move a connection to a host the
    # URL does not name -- the default ("auto") followed one push to another address, sent it
    # the URL's password and swapped in redis-py's own 10 s timeouts (a review's)
    from redis.maint_notifications import MaintNotificationsConfig

    _NO_MAINT_NOTIFICATIONS: dict[str, Any] = {
        "maint_notifications_config": MaintNotificationsConfig(enabled=False)
    }
except ImportError:  # pragma: no cover - an older redis-py follows no such push
    _NO_MAINT_NOTIFICATIONS = {}


# the longest socket or connect timeout taken (seconds): every wait in kvstore is bounded by
# one, and 1e300 made redis-py's settimeout raise OverflowError at start-up (a review)
MAX_TIMEOUT_S = 3600.0
# how long a caller waits for a free pooled connection where no socket timeout says
DEFAULT_POOL_WAIT_S = 10.0


def check_timeouts(**timeouts: float) -> None:
    for name, value in timeouts.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not 0 < value <= MAX_TIMEOUT_S:  # (NaN fails both comparisons)
            raise InvalidArgumentError(
                f"{name} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
                f"got {value!r}: every wait on Redis is bounded by it"
            )


def _tls_kwargs(
    ca_file: str | None, cert_file: str | None, key_file: str | None, verify: bool
) -> dict[str, Any]:
    """redis-py's TLS arguments: the same for data connections, Cluster nodes, a Sentinel
    service's master and the sentinels themselves."""
    if key_file and not cert_file:  # (redis-py then failed each connect with a TypeError)
        raise InvalidArgumentError(
            "tls_key_file needs tls_cert_file, the certificate it goes with (one file holding "
            "both may be given as tls_cert_file alone)"
        )
    if cert_file:
        _check_key_loads(cert_file, key_file)
    return {
        "ssl_ca_certs": ca_file,
        "ssl_certfile": cert_file,
        "ssl_keyfile": key_file,
        # never a prompt: OpenSSL asks a terminal for an encrypted key's passphrase, and a
        # connect waited on it for ever (a review's)
        "ssl_password": "",
        "ssl_cert_reqs": "required" if verify else "none",
        "ssl_check_hostname": bool(verify),
    }


def _check_key_loads(cert_file: str, key_file: str | None) -> None:
    """The client certificate and key load, with no passphrase: refused now, saying why, not
    at each connect as "cannot reach ... Invalid argument"."""
    try:
        ssl.create_default_context().load_cert_chain(cert_file, key_file, "")
    except (ssl.SSLError, OSError) as exc:
        raise InvalidArgumentError(
            f"the TLS client key (tls_key_file) and certificate (tls_cert_file) do not load "
            f"({printable(exc)}): give a key without a passphrase (openssl pkey -in key.pem "
            "-out plain.pem), the certificate that matches it, and files this process can read"
        ) from None


_TLS_KEYS = tuple(_tls_kwargs(None, None, None, True))
_warned_unverified: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unverified_tls(safe_url: str) -> None:
    """Say once per URL and process that TLS checks nothing: it encrypts, but to anyone."""
    with _warned_lock:
        if safe_url in _warned_unverified:
            return
        _warned_unverified.add(safe_url)
    logger.warning(
        "kvstore: TLS to %s does not verify the server (tls_verify=false): any certificate, "
        "for any host name, is trusted, so whoever can reach the network path can pose as the "
        "server and read or change cached values. Give the CA that signed the server's "
        "certificate instead -- tls_ca_file=/path/to/ca.pem in the URL's query (or the "
        "tls_ca_file argument) -- and drop tls_verify=false.",
        safe_url,
    )


def close_client(client: redis.Redis) -> None:
    """Close every connection a client made by :func:`make_client` holds: its pool's, each
    Cluster node's, and a Sentinel pool's connections to the sentinels. redis-py's ``close()``
    leaves a pool it was given open until garbage collection."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        for node in client.get_nodes():
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
        client.close()
        return
    pool = client.connection_pool
    manager = getattr(pool, "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        sentinel.connection_pool.disconnect()
    pool.disconnect()
    client.close()


class _AskedNodeListed:
    """Where an ``ASK`` names a node the slot map does not list (the first slot moving to a
    master just added: ``CLUSTER SLOTS`` names it only once it serves one), redis-py looked the
    node up, got None and raised ``AttributeError`` -- past every typed handler, and a
    consuming read's give-back of its claims stopped at it, leaving 5 of 6 values under claim
    keys (a review's, on a real Cluster). It fails as a Cluster that cannot serve the key now:
    the slot map is learnt again, and the next call goes where it says."""

    def get_redis_connection(self, node: Any) -> redis.Redis:
        if node is None:
            raise rex.ClusterDownError(
                "a node redirected this key (ASK) to a node the Cluster's slot map does not "
                "list yet: a slot is moving to a master just added"
            )
        return super().get_redis_connection(node)  # type: ignore[misc]


class _ClusterPipeline(_AskedNodeListed, ClusterPipeline):
    pass


class _Cluster(_AskedNodeListed, RedisCluster):
    """redis-py's Cluster client and its pipelines, each :class:`_AskedNodeListed`."""

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = _ClusterPipeline  # (redis-py builds the pipeline class it knows)
        return pipe


def _cluster_client(address: StoreAddress, kwargs: dict[str, Any]) -> redis.Redis:
    """redis-py's ``RedisCluster`` over the seed nodes: it learns the slot map now (so a
    cluster URL that reaches a standalone server fails here, saying so), follows ``MOVED`` /
    ``ASK``, and relearns the map when a node fails."""
    del kwargs["host"], kwargs["port"], kwargs["db"], kwargs["retry"]
    # RedisCluster builds its node clients itself, and takes a connection class only in its
    # URL mode, through the node pools' class: there ``_BoundedNodePool`` gives every node
    # the bounded connections of the other topologies (``bounded_replies``). Before, a
    # Cluster's control replies were parsed by redis-py's own parser, unbounded. (The URL
    # names the first seed, without credentials: they travel as arguments, as elsewhere; its
    # scheme says TLS, which redis-py's URL mode takes from it, not from ``ssl``.)
    del kwargs["parser_class"], kwargs["connection_class"]
    if address.db:
        raise InvalidURLError(f"{address.safe_url}: a Cluster has only database 0")
    kwargs.pop("health_check_interval")
    (seed_host, seed_port), *more = address.nodes
    if ":" in seed_host:  # (IPv6)
        seed_host = f"[{seed_host}]"
    seed_url = f"{'rediss' if address.tls else 'redis'}://{seed_host}:{seed_port}/0"
    try:
        # per node a pool of max_connections (redis-py builds node pools itself): past
        # that a caller waits for one, then fails busy (``_WaitsForAConnection``)
        client = _Cluster(
            url=seed_url,
            connection_pool_class=_BoundedNodePool,
            startup_nodes=[ClusterNode(host, port) for host, port in more],
            # one more attempt after redis-py relearned the slot map: with none, loads
            # resumed after a failover only some of the time (tests/e2e/test_e2e_cluster.py failed
            # 3 of 7 runs, 2026-11-23). redis-py spends it on timeouts too, so the frequent
            # calls do not come through here: values and control pipelines go to each master's
            # own connection (transport.Transport), and a timeout there fails once
            # (tests/integration/test_cluster_errors.py); only redirects and rare calls use this
            # client
            retry=Retry(NoBackoff(), 1),
            **kwargs,
        )
    except (rex.RedisError, OSError):
        with translated_errors(address.safe_url, "CLUSTER SLOTS"):
            raise
    except rex.RedisClusterException as exc:  # learning the slot map failed: say what to check
        if "cluster mode is not enabled" in str(exc).lower():
            first = "{}:{}".format(*address.nodes[0])
            raise StoreTopologyError(
                f"{address.safe_url} reaches a standalone server, not a Cluster node: use "
                f"{'rediss' if address.tls else 'redis'}://{first} (or redis-sentinel:// when "
                "Sentinels watch it)"
            ) from None
        raise StoreUnavailableError(
            f"cannot learn the slot map of the Cluster at {address.safe_url} ({_strip(exc)}): "
            "check that the seed nodes run, are reachable and that every slot is served"
        ) from None
    return client  # type: ignore[return-value]


class _WaitsForAConnection(redis.ConnectionPool):
    """Every client's pool (standalone, a Cluster node's, Sentinel's): no more than
    ``max_connections``, and a caller past that waits for one to be given back -- up to its
    socket timeout, or its own deadline where sooner (``get_connection_by``) -- then gets
    :class:`StoreBusyError`. redis-py's pools either raise ``MaxConnectionsError`` at once (a
    ``ConnectionError`` that kvstore took for the server down: a review's eight lookups on a
    pool of two against a slow Cluster failed six "cannot reach ... check that the server
    runs" and opened the circuit breaker) or, blocking, wait their whole timeout whatever a
    load's deadline (a read with 0.2 s left waited 2 s for a connection, a review's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._given_back = threading.Condition()
        self._releases = 0  # (counted: one that lands before a waiter waits is not missed)
        timeout = kwargs.get("socket_timeout")
        self.wait_s = float(timeout) if timeout else DEFAULT_POOL_WAIT_S

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        return self.get_connection_by(math.inf, *args, **kwargs)

    def get_connection_by(self, deadline: float, *args: Any, **kwargs: Any) -> Any:
        """A connection, waited for until ``deadline`` (``time.monotonic()``) at most, and no
        longer than the pool's wait."""
        until = min(time.monotonic() + self.wait_s, deadline)
        while True:
            with self._given_back:
                seen = self._releases
            try:
                return super().get_connection(*args, **kwargs)
            except rex.MaxConnectionsError:
                left = until - time.monotonic()
                if left <= 0:
                    raise StoreBusyError(
                        f"all {self.max_connections} connections of this client to one server "
                        f"stayed in use for {self.wait_s:g} s: raise max_connections "
                        "(LookupBuffer.from_url), or run fewer calls at once"
                    ) from None
                with self._given_back:  # (polled besides: a reset after a fork frees all)
                    if self._releases == seen:
                        self._given_back.wait(min(left, 0.05))

    def release(self, connection: Any) -> None:
        super().release(connection)
        with self._given_back:
            self._releases += 1
            self._given_back.notify()

    def made(self) -> list[Any]:
        """Every connection this pool made and keeps, free or in use (for tests and
        debugging: whether they are connected)."""
        with self._lock:
            return [*self._available_connections, *self._in_use_connections]


class _BoundedNodePool(_WaitsForAConnection):
    """A Cluster node's pool, as redis-py's URL mode builds one per node: its connections are
    the bounded ones (``bounded_replies``), TLS or not as the URL said."""

    def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
        tls = issubclass(connection_class, redis.SSLConnection)
        bounded = BoundedSSLConnection if tls else BoundedConnection
        super().__init__(connection_class=bounded, **kwargs)


class _SentinelClient(redis.Redis):
    """A sentinel's client: a reply it cannot use (over the bound, malformed) makes redis-py's
    discovery ask the next sentinel, as a dead one does -- it moves on only past connection
    errors and timeouts, so one sentinel watching thousands of masters (or a hostile one)
    stopped the search for the master."""

    def sentinel_masters(self) -> Any:
        try:
            return super().sentinel_masters()
        except rex.InvalidResponse as exc:
            raise rex.ConnectionError(f"an unusable answer ({_strip(exc)})") from None


def _sentinel_client(address: StoreAddress, kwargs: dict[str, Any]) -> redis.Redis:
    """A client of the service's current master, found through the sentinels on connect and
    again whenever a connection fails (a failover): redis-py's ``SentinelConnectionPool``."""
    from redis.sentinel import Sentinel, SentinelConnectionPool

    del kwargs["host"], kwargs["port"]
    # (the master's connections are redis-py's Sentinel-managed ones, with our parser)
    ssl = kwargs.pop("connection_class", None) is BoundedSSLConnection
    sentinel_kwargs = {
        "socket_timeout": kwargs["socket_timeout"],
        "socket_connect_timeout": kwargs["socket_connect_timeout"],
        # (a sentinel's push moved no connection either: 300 pushes a reply made 3,000 threads)
        **_NO_MAINT_NOTIFICATIONS,
    }
    if address.options.get(SENTINEL_AUTH) == "url":  # sentinels with requirepass / ACL users
        sentinel_kwargs["username"] = kwargs.get("username")
        sentinel_kwargs["password"] = kwargs.get("password")
    if ssl:
        # the sentinels are checked as the master is: the same CA, client certificate, verify
        # mode and host name check, each set here rather than left to redis-py's defaults
        sentinel_kwargs["ssl"] = True
        kwargs["ssl"] = True
        for key in _TLS_KEYS:
            sentinel_kwargs[key] = kwargs[key]
    max_connections = kwargs.pop("max_connections")
    sentinel = Sentinel(list(address.nodes), sentinel_kwargs=sentinel_kwargs, **kwargs)
    # the sentinels' own connections, as bounded as the master's: redis-py makes them with its
    # own parser (a 300 MiB reply was read whole, then crashed untyped) and its default retry
    # (three more tries with backoff on a timeout: a hung sentinel cost 30 socket timeouts).
    # Redis() takes no connection class, so their clients are made here on our pools
    sentinel.sentinels = [
        _SentinelClient(
            connection_pool=redis.ConnectionPool(
                host=host,
                port=port,
                connection_class=BoundedSSLConnection if ssl else BoundedConnection,
                parser_class=BoundedHiredisParser,
                retry=kwargs["retry"],
                **{k: v for k, v in sentinel_kwargs.items() if k != "ssl"},
            )
        )
        for host, port in address.nodes
    ]

    class _SentinelPool(_WaitsForAConnection, SentinelConnectionPool):
        pass

    pool = _SentinelPool(address.service, sentinel, max_connections=max_connections, **kwargs)
    return redis.Redis(connection_pool=pool)


# Server error types (redis-py maps each error code to a class) -> what the user should do.
# A Cluster that is down (CLUSTERDOWN, a slot not served), resharding (TRYAGAIN past redis-py's
# redirect budget: "TTL exhausted") is unavailable for now, not misconfigured.
_UNAVAILABLE_CLUSTER_ERRORS = (
    rex.ClusterDownError,  # MasterDownError too
    rex.TryAgainError,
    rex.ClusterError,
    rex.RedisClusterException,  # SlotNotCoveredError, "TTL exhausted", no node reachable
)
# A redirect outside the cluster client: a plain URL pointed at a Cluster node.
_TOPOLOGY_ERRORS = (
    rex.AskError,  # MovedError too
    rex.ClusterCrossSlotError,
)


@contextlib.contextmanager
def translated_errors(
    safe_url: str, command: str | None = None, scope: AclScope | None = None
) -> Iterator[None]:
    """Re-raise redis-py errors (and socket errors it let through) as kvstore's typed errors,
    chosen by the error's type, with a message that says what to do.

    ``command`` names what was being run, for permission errors (e.g. ``"SET"``); ``scope``
    the namespace whose keys a permission error's hint grants (unknown: a placeholder).
    """
    try:
        yield
    except KVStoreError:
        raise  # already typed (a nested call's), and some are OSErrors
    except rex.NoPermissionError as exc:
        text = _strip(exc)
        # the server names the command it refused: more precise than what the caller ran (a
        # claim's request holds a script and GETs; the script itself runs RENAME)
        refused = _REFUSED_COMMAND.search(text)
        # a subcommand comes as "script|load": named as it is sent, SCRIPT LOAD
        refused_command = refused.group(1).upper().replace("|", " ") if refused else command
        raise permission_error(safe_url, refused_command, text, scope) from None
    except rex.AuthenticationError:
        raise StoreAuthenticationError(
            f"{safe_url} rejected the credentials: check the username/password in the URL "
            "(or the server's requirepass / ACL users)"
        ) from None
    except rex.OutOfMemoryError:
        raise StoreOutOfMemoryError(
            f"{safe_url} is full (used memory > maxmemory) and refuses writes: set "
            "maxmemory-policy to volatile-ttl (or allkeys-lru), raise maxmemory, or lower ttl_s"
        ) from None
    except rex.ReadOnlyError:
        raise StoreTopologyError(
            f"{safe_url} is a read-only replica: point the URL at the master (after a failover, "
            "use a redis-sentinel:// URL so the new master is found)"
        ) from None
    except _UNAVAILABLE_CLUSTER_ERRORS as exc:
        raise StoreUnavailableError(
            f"{safe_url}: the Cluster cannot serve this key now ({type(exc).__name__}: "
            f"{_strip(exc)}): a master is down and not yet replaced, or its slot is moving; "
            "calls fail fast until it answers again"
        ) from None
    except _TOPOLOGY_ERRORS as exc:
        if safe_url.split(":", 1)[0].lower().endswith("-cluster"):  # (the advice is followed)
            raise StoreUnavailableError(
                f"{safe_url}: a Cluster node redirected a call elsewhere ({type(exc).__name__}: "
                f"{_strip(exc)}): its slot is moving; calls go where the slot map says once "
                "it is learnt again"
            ) from None
        raise StoreTopologyError(
            f"{safe_url} is a Redis/Valkey Cluster node that does not serve this key "
            f"({type(exc).__name__}: {_strip(exc)}): use a redis-cluster:// URL"
        ) from None
    except rex.BusyLoadingError:
        raise StoreUnavailableError(
            f"{safe_url} is loading its dataset into memory: retry when it has finished"
        ) from None
    except rex.TimeoutError:
        tls = urlsplit(safe_url).scheme.lower() in _TLS_SCHEMES
        raise StoreTimeoutError(
            f"{safe_url} did not answer in time: check the server's load and the network, "
            "or raise the socket timeout (socket_timeout_s; the kvstore command's --timeout-s)"
            + (
                " -- or, if that port does not speak TLS, use the plain scheme (a TLS "
                "handshake with a plain server waits out the timeout)"
                if tls
                else ""
            )
        ) from None
    except rex.ResponseError as exc:
        raise StoreCommandError(f"{safe_url} answered an error: {_strip(exc)}") from None
    except MasterNotFoundError as exc:
        # (redis-py's text is the repr of every sentinel client: no help, and long)
        asked_auth = "Authentication" in str(exc)
        if asked_auth and f"{SENTINEL_AUTH}=url" in safe_url:
            raise StoreAuthenticationError(
                f"{safe_url}: the sentinels refused the URL's credentials: with "
                f"{SENTINEL_AUTH}=url their requirepass (or ACL user) must be the URL's; a "
                "password of the sentinels' own is not supported"
            ) from None
        said = "asked for a password" if asked_auth else "named none"
        raise StoreUnavailableError(
            f"{safe_url}: the sentinels {said} for the service's master: check that they run, "
            "watch the service named in the URL, and -- where they have requirepass -- add "
            f"?{SENTINEL_AUTH}=url (the sentinels then take the URL's credentials)"
        ) from None
    except rex.MaxConnectionsError:  # (a pool not ours: ours wait, then say so themselves)
        raise StoreBusyError(
            f"every connection of this client to {safe_url} is in use: raise max_connections "
            "(LookupBuffer.from_url), or run fewer calls at once"
        ) from None
    except rex.ConnectionError as exc:
        if "certificate verify failed" in str(exc).lower():  # (said as "cannot reach", a review's)
            raise StoreUnavailableError(
                f"{safe_url} answered with a TLS certificate this client does not trust "
                f"({_strip(exc)}): give the CA that signed it as tls_ca_file, and connect by a "
                "host name or address the certificate names"
            ) from None
        raise StoreUnavailableError(
            f"cannot reach {safe_url} ({_strip(exc)}): check that the server runs and the "
            "host, port, socket path and TLS settings are right"
        ) from None
    except ReplyTooLarge as exc:
        raise StoreReplyTooLargeError(f"{safe_url}: {_strip(exc)}") from None
    except rex.RedisError as exc:  # InvalidResponse, DataError, ...: a reply we cannot use
        raise StoreCommandError(
            f"{safe_url}: {type(exc).__name__}: {_strip(exc)} (a protocol or client error; "
            "check that the URL points at Redis/Valkey and not another service)"
        ) from None
    except OSError as exc:  # socket errors redis-py did not wrap
        raise StoreUnavailableError(f"cannot reach {safe_url} ({_strip(exc)})") from None


# "... no permissions to run the 'get' command" (Redis, Valkey), "... the 'script|load' command"
# (a subcommand), "... the RENAME command" (ours)
_REFUSED_COMMAND = re.compile(r"permissions to run the '?([A-Za-z]+(?:\|[A-Za-z]+)?)'? command")


_SOME_NAMESPACE = "<namespace>"  # a hint's placeholder where the namespace is not known


@dataclass(frozen=True)
class AclScope:
    """The one namespace (under one key prefix) whose keys a permission hint grants: a tenant's
    own keys, never every namespace's. The default namespace is a placeholder for where it is
    not known (a command run before any namespace is chosen)."""

    namespace: str = _SOME_NAMESPACE
    prefix: str = DEFAULT_KEY_PREFIX

    def __post_init__(self) -> None:
        # a namespace that is not a valid name (one read from a planted key: spaces, "+@all")
        # is never pasted into a rule an operator may run: the placeholder stands for it
        # (a review steered a hint into "+@all nopass")
        for attr, default in (("namespace", _SOME_NAMESPACE), ("prefix", DEFAULT_KEY_PREFIX)):
            value = getattr(self, attr)
            if value != default and not (isinstance(value, str) and NAME_RE.match(value)):
                object.__setattr__(self, attr, _SOME_NAMESPACE if attr == "namespace" else default)

    @property
    def known(self) -> bool:
        return self.namespace != _SOME_NAMESPACE

    @property
    def blocks(self) -> str:
        """The ACL key pattern of the namespace's block, claim, handoff and record keys; it does
        not match its generation counter."""
        return f"{_acl_literal(self.prefix)}:{_acl_literal(self.namespace)}:*:*"

    @property
    def generation(self) -> str:
        """The ACL key pattern of the namespace's generation counter."""
        return f"{_acl_literal(self.prefix)}:{_acl_literal(self.namespace)}:generation"


def _acl_literal(text: str) -> str:
    """``text`` matching only itself in an ACL key pattern: a namespace named ``a*`` must not
    grant other namespaces' keys."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class KeyUse(Enum):
    """What a command does to the keys it names: the ACL table grants reads as ``%R~``
    patterns, writes as ``~`` patterns, and keyless commands no pattern at all."""

    NONE = "names no keys"
    READ = "reads keys"
    WRITE = "writes keys"


# Every command kvstore sends, by what it does to its keys (``fleet.access.ACCESS``). FCALL
# (EVALSHA where a server has no functions): the claims rename and delete blocks; the reset's
# write of the generation counter is the admin's alone, named by ``fleet.access.acl_rule``
# where a reset fails.
_KEY_USE: dict[str, KeyUse] = {
    "PING": KeyUse.NONE,
    "TIME": KeyUse.NONE,
    "INFO": KeyUse.NONE,
    "SCAN": KeyUse.NONE,
    "SELECT": KeyUse.NONE,
    "SCRIPT LOAD": KeyUse.NONE,
    "FUNCTION LOAD": KeyUse.NONE,
    "CLUSTER SLOTS": KeyUse.NONE,
    "GET": KeyUse.READ,
    "EXISTS": KeyUse.READ,
    "STRLEN": KeyUse.READ,
    "PTTL": KeyUse.READ,
    "GETRANGE": KeyUse.READ,
    "SET": KeyUse.WRITE,
    "UNLINK": KeyUse.WRITE,
    "RENAME": KeyUse.WRITE,
    "PEXPIRE": KeyUse.WRITE,
    "PERSIST": KeyUse.WRITE,
    "EVALSHA": KeyUse.WRITE,
    "FCALL": KeyUse.WRITE,
}
# GET also reads the namespace's generation counter (every role does, read-only)
_READS_GENERATION = frozenset({"GET"})
# granted together, as in the ACL table: redis-py loads a script the server lost (SCRIPT LOAD)
_GRANTED_WITH = {"EVALSHA": ("SCRIPT LOAD",)}
_TWO_WORD_COMMANDS = frozenset(c for c in _KEY_USE if " " in c)


def _commands_in(text: str) -> list[str]:
    """The commands of ``text``: one (``"GET"``, ``"SCRIPT LOAD"``) or several, as a scripted
    probe names them (``"EVALSHA SCRIPT LOAD GET SET"``), with their companions. Text with a
    word kvstore never sends is one command (``"CLIENT SETINFO"``, refused at connect)."""
    words = text.upper().replace("|", " ").split()
    commands: list[str] = []
    at = 0
    while at < len(words):
        pair = " ".join(words[at : at + 2])
        if pair in _TWO_WORD_COMMANDS:
            commands.append(pair)
            at += 2
        else:
            commands.append(words[at])
            at += 1
    if not set(commands) <= set(_KEY_USE):
        return [" ".join(words)]
    with_companions = [
        c for command in commands for c in (command, *_GRANTED_WITH.get(command, ()))
    ]
    return list(dict.fromkeys(with_companions))


def permission_hint(command: str | None, scope: AclScope | None = None) -> str:
    """What to grant for a refused ``command`` (one, or several as a scripted probe names
    them): that command with the key patterns of ``scope``'s namespace alone, as the ACL table
    of docs/operations.md gives them -- never every namespace's keys, never a write on the
    generation counter (only a reset writes it, and ``fleet.access.acl_rule`` names that rule)."""
    scope = scope or AclScope()
    commands = _commands_in(command) if command else []
    uses = {_KEY_USE.get(c) for c in commands}
    perms = " ".join("+" + c.lower().replace(" ", "|") for c in commands) or "+<command>"
    patterns: list[str] = []
    if KeyUse.WRITE in uses:
        patterns.append(f"~{scope.blocks}")
    elif KeyUse.READ in uses:
        patterns.append(f"%R~{scope.blocks}")
    if any(c in _READS_GENERATION for c in commands):
        patterns.append(f"%R~{scope.generation}")
    unknown = None in uses or not commands
    where = f"namespace {scope.namespace!r}" if scope.known else "the namespace it works in"
    if patterns or unknown:
        grant = f"Grant it for {where} only: ACL SETUSER <user> {' '.join([perms, *patterns])}"
    else:
        grant = f"Grant it (it names no keys): ACL SETUSER <user> {perms}"
    if unknown:  # what it does to keys is not known here: both forms, the reader's first
        grant += f" and, where it names keys, %R~{scope.blocks} to read (~{scope.blocks} to write)"
    return f"{grant}. Each role's whole rule: the ACL table in docs/operations.md"


def permission_error(
    safe_url: str, command: str | None, server_text: str = "", scope: AclScope | None = None
) -> StorePermissionError:
    """The error for a refused command, with the grant that fixes it in ``scope``'s namespace
    (:func:`permission_hint`)."""
    what = f"run {command}" if command else "run a command or touch a key it needs"
    return StorePermissionError(
        f"{safe_url}: the ACL user may not {what} ({server_text or 'NOPERM'}). "
        f"{permission_hint(command, scope)}",
        command=command,
    )


def error_code(exc: BaseException) -> str | None:
    """The server's error code of an unmapped ``ResponseError`` (``WRONGTYPE``, ``ERR``, ...):
    redis-py keeps the first word for codes it has no class for."""
    if type(exc) is not rex.ResponseError:
        return None
    word = str(exc).split(" ", 1)[0]
    return word if word.isupper() else None


def _strip(exc: BaseException) -> str:
    """An exception's text for a message of ours: printable and cut (a server's error reply
    is in it, and redis-py's own words about the pipeline around it)."""
    return without_echoed_args(printable(str(exc).strip().rstrip("."))) or type(exc).__name__
