"""LookupBuffer: vLLM's lookup-buffer layer (insert / drop_select) implemented on Redis/Valkey.

Redis semantics, one line each:
- ``insert``: ``SET key value [PX ttl]``; batches are pipelined, ``insert_async`` returns a Future.
  Blocks later in a chain get a slightly shorter TTL (1/36,000 of it per position), so under
  ``volatile-ttl`` eviction a prompt's tail goes before its head (a head without its tail is
  still useful; not vice versa).
- ``drop_select``: a Lua script claims a batch atomically (each stored value reaches exactly one
  caller; see ``claims``), a pipelined ``GET`` fetches it, and the claimed keys are deleted only
  after the values arrived and were verified: a lost reply or a dropped connection loses nothing.
- ``select``: pipelined ``GETRANGE`` without deleting, for shared prefix reuse.
- ``longest_prefix``: pipelined ``EXISTS``, counting leading present blocks in one round trip.
- handoffs: a producer's commit record says how many leading blocks of a chain it really wrote
  (``publish_handoff``); a consumer reads it (``read_handoff``) and takes it once
  (``claim_handoff``).

On a Redis/Valkey Cluster (``redis-cluster://``) a batch fans out to the masters holding its
keys, in parallel; round trips above are then one per master. Claims are made per slot.

A value that fails validation is never returned: it is a counted miss, logged once per key.
Every Redis call goes through one circuit breaker: when the server is refusing, hung or gone,
calls fail at once with :class:`StoreCircuitOpenError` until a background probe sees it answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import redis
import torch
import xxhash

from .claims import Claimer
from .codec import CODECS, FORMAT_VERSION, decode_value, encode_value, lz4_block
from .connection import (
    StoreAddress,
    close_client,
    error_code,
    make_client,
    parse_url,
    permission_error,
)
from .counters import StoreStats
from .errors import (
    CorruptValueError,
    InvalidArgumentError,
    StoreCommandError,
    StorePermissionError,
    StoreTimeoutError,
    StoreTopologyError,
    StoreUnavailableError,
)
from .guard import Guard
from .handoff import (
    HANDOFF_PENDING,
    HANDOFF_TAKEN,
    HANDOFF_TTL_MS,
    TAKEN_TTL_MS,
    Claim,
    HandoffState,
    Records,
    claim_outcome,
    leading_present,
)
from .keys import DEFAULT_KEY_PREFIX, KeySpace
from .shards import REDIRECTED, Shards, is_redirect
from .wire import (
    Oversize,
    ReplyReader,
    pack_set,
    parsed_reply_into,
    raw_socket,
    send_buffers,
)

logger = logging.getLogger("kvstore")

T = TypeVar("T")

DEFAULT_MAX_VALUE_BYTES = 512 << 20  # Redis' own proto-max-bulk-len default

# The permission probe's key: it lives for the few milliseconds check_access takes; a role
# that may not delete leaves it to expire.
_PROBE_TTL_MS = 1_000

# Reads: replies in flight per connection, and connections per server for a public select /
# drop_select (select_into takes its own). Chosen from scripts/bench_paths.py --sweep across
# value sizes; see docs/benchmarks.md, "How reads are shaped".
READ_DEPTH = 4
READ_CONNECTIONS = 1

# Scratch memory kept per thread for framing values in insert_many (see there).
_SCRATCH_LIMIT = 64 << 20

# What each operation needs the ACL user to be allowed, for check_access / the README.
ACCESS: dict[str, tuple[str, ...]] = {
    "ping": ("PING",),
    "insert": ("SET",),
    "select": ("GET",),
    "lookup": ("EXISTS",),
    "delete": ("UNLINK",),
    "handoff_read": ("GET",),
    "handoff_claim": ("SET",),
    "drop_select": ("EVALSHA", "SCRIPT LOAD", "STRLEN", "RENAME", "EXISTS", "GET", "UNLINK"),
    "block_info": ("STRLEN", "PTTL"),
    "renew": ("PEXPIRE", "PERSIST"),
}


@dataclass(frozen=True)
class BlockInfo:
    """A stored block as ``block_info`` sees it (summed / the minimum over fingerprints)."""

    present: bool
    size: int  # bytes stored
    ttl_s: float | None  # seconds left; None: no expiry (or not present)


def acl_rule(operations: Iterable[str], key_pattern: str = "kv:*") -> str:
    """The least-privilege ``ACL SETUSER`` rule for these operations (keys of :data:`ACCESS`)."""
    commands = dict.fromkeys(c for op in operations for c in ACCESS[op])
    perms = " ".join("+" + c.lower().replace(" ", "|") for c in commands)
    return f"{perms} ~{key_pattern}"


def layout_fingerprint(layout: Mapping[str, Any] | None = None) -> str:
    """16 hex chars naming everything that makes stored bytes (in)compatible: model, dtype, KV
    geometry, tensor-parallel rank and size, ... plus the value format version."""
    doc = {"format": FORMAT_VERSION, **dict(layout or {})}
    return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True, default=str).encode())


class LookupBuffer:
    """A keyed KV-cache store on Redis/Valkey. Thread-safe; share one per process."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str = "default",
        fingerprint: str | None = None,
        layout: Mapping[str, Any] | None = None,
        ttl_s: float | None = None,
        ttl_step_ms: int | None = None,
        compression: str = "none",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        safe_url: str = "redis",
        io_threads: int = 4,
        control_client: redis.Redis | None = None,
        breaker_failures: int = 3,
        breaker_probe_s: float = 0.5,
        read_depth: int = READ_DEPTH,
        read_connections: int = READ_CONNECTIONS,
    ) -> None:
        if compression not in CODECS:
            raise InvalidArgumentError(f"compression must be one of {CODECS}, got {compression!r}")
        if compression == "lz4":
            lz4_block()  # not installed: say so now, not at the first write
        if ttl_s is not None and ttl_s < 0:
            raise InvalidArgumentError(f"ttl_s must be >= 0 or None, got {ttl_s}")
        if ttl_step_ms is not None and ttl_step_ms < 0:
            raise InvalidArgumentError(f"ttl_step_ms must be >= 0, got {ttl_step_ms}")
        if max_value_bytes <= 0:
            raise InvalidArgumentError("max_value_bytes must be positive")
        if fingerprint is not None and layout is not None:
            raise InvalidArgumentError("give fingerprint or layout, not both")
        if read_depth < 1 or read_connections < 1:
            raise InvalidArgumentError("read_depth and read_connections must be >= 1")
        self.read_depth = read_depth
        self.read_connections = read_connections
        self.keys = KeySpace(key_prefix, namespace, fingerprint or layout_fingerprint(layout))
        self.namespace = namespace
        self.fingerprint = self.keys.fingerprint
        self.key_prefix = key_prefix
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        # 0.1 s per chain position at a 1 h TTL: measured (scripts/eviction.py) to cut the dead
        # weight left by volatile-ttl eviction 2-3x when prompts arrive over time
        self.ttl_step_ms = ttl_step_ms if ttl_step_ms is not None else (self.ttl_ms or 0) // 36_000
        self.compression = compression
        self.max_value_bytes = max_value_bytes
        self.safe_url = safe_url
        self._client = client
        # small, latency-critical calls (lookups, handoffs, deletes) use their own connection
        # pool, with a shorter socket timeout when made by from_url: they never queue behind
        # multi-MiB transfers on a slow server
        self._control = control_client or client
        # the clients' pools are closed by close() only when from_url made them
        self._owns_clients = False
        # runs the parts of one call spread over connections and shards; separate from
        # _executor, whose tasks (insert_async) spread too and must not wait on their own pool
        self._shards = Shards(client, others=[self._control], threads=max(8, 2 * io_threads))
        self.guard = Guard(
            self._probe_after_failures,
            safe_url=safe_url,
            failures=breaker_failures,
            probe_s=breaker_probe_s,
            # a failed call may be a master its replica replaced: every client learns the map
            # again (redis-py's cluster client does so itself only when it retries)
            on_unavailable=self._shards.relearn,
        )
        self.breaker = self.guard.breaker
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._logged_bad: OrderedDict[str, None] = OrderedDict()
        self.address: StoreAddress | None = None  # set by from_url
        self._local = threading.local()
        self._claims = Claimer(
            client,
            self._control,
            self._shards,
            self.guard,
            exists=self._exists,
            max_value_bytes=max_value_bytes,
            on_retry=self._count_redirect,
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "default",
        fingerprint: str | None = None,
        layout: Mapping[str, Any] | None = None,
        ttl_s: float | None = None,
        compression: str = "none",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        socket_timeout_s: float = 10.0,
        control_timeout_s: float | None = None,
        connect_timeout_s: float = 3.0,
        max_connections: int = 32,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_verify: bool | None = None,
        io_threads: int = 4,
        breaker_failures: int = 3,
        breaker_probe_s: float = 0.5,
        read_depth: int = READ_DEPTH,
        read_connections: int = READ_CONNECTIONS,
        check: bool = True,
    ) -> LookupBuffer:
        """Connect to ``url``. With ``check`` (default) the server is pinged now, so a wrong URL,
        a server that is down or a wrong password fails here with a typed error.

        ``control_timeout_s`` (default: ``socket_timeout_s``) is the socket timeout of the
        small calls (lookups, handoff records, deletes, pings), which never move values.
        """
        address: StoreAddress = parse_url(url)
        common: dict[str, Any] = {
            "connect_timeout_s": connect_timeout_s,
            "tls_ca_file": tls_ca_file,
            "tls_cert_file": tls_cert_file,
            "tls_key_file": tls_key_file,
            "tls_verify": tls_verify,
        }
        client = make_client(
            address,
            socket_timeout_s=socket_timeout_s,
            max_connections=max(max_connections, io_threads + 2, 4 * read_connections),
            **common,
        )
        control = make_client(
            address,
            socket_timeout_s=control_timeout_s or socket_timeout_s,
            max_connections=max_connections,
            **common,
        )
        buf = cls(
            client,
            namespace=namespace,
            fingerprint=fingerprint,
            layout=layout,
            ttl_s=ttl_s,
            compression=compression,
            max_value_bytes=max_value_bytes,
            key_prefix=key_prefix,
            safe_url=address.safe_url,
            io_threads=io_threads,
            control_client=control,
            breaker_failures=breaker_failures,
            breaker_probe_s=breaker_probe_s,
            read_depth=read_depth,
            read_connections=read_connections,
        )
        buf.address = address
        buf._owns_clients = True
        if check:
            buf.ping()
            buf.check_topology()
        return buf

    def __repr__(self) -> str:
        return (
            f"LookupBuffer({self.safe_url!r}, namespace={self.namespace!r}, "
            f"fingerprint={self.fingerprint!r})"
        )

    def __enter__(self) -> LookupBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the breaker's probe and the threads, and close the connections of the clients
        ``from_url`` made (a client passed in is its owner's to close)."""
        self.guard.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor = None
        self._shards.close()
        if self._owns_clients:
            for client in dict.fromkeys((self._client, self._control)):
                close_client(client)

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for tools; prefer the methods above)."""
        return self._client

    @property
    def cluster(self) -> bool:
        """True when the store is a Redis/Valkey Cluster (keys spread over its masters)."""
        return self._shards.cluster

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open: calls would fail at once."""
        return self.breaker.allow()

    # ------------------------------------------------------------------ every call
    def _probe(self) -> object:
        """Is the store serving? Every master of a Cluster must answer (one that is down and not
        yet replaced makes a third of the keys fail), else the one server."""
        if self._shards.cluster:
            from redis.cluster import RedisCluster

            return self._control.ping(target_nodes=RedisCluster.PRIMARIES)
        return self._control.ping()

    def _probe_after_failures(self) -> object:
        """The breaker's probe: the slot map is learned again first (on a Cluster, the failures
        may have been a master that its replica has replaced since)."""
        self._shards.relearn()
        return self._probe()

    def ping(self) -> None:
        self.guard.call("PING", self._probe)

    def check_topology(self) -> None:
        """Fail now, naming the right URL form, when the URL's kind does not match the server:
        a plain URL that reaches a Cluster node (most keys would be refused with MOVED) or a
        Sentinel (which holds no data). Skipped when the ACL user may not run ``INFO`` or the
        server has no such command."""
        address = self.address
        if address is None or address.topology != "standalone":
            return
        try:
            info = self.guard.call("INFO", lambda: self._control.info("server"))
        except (StorePermissionError, StoreCommandError) as exc:  # NOPERM, or no INFO at all
            logger.debug("kvstore: the URL's topology is not checked (INFO: %s)", exc)
            return
        mode = str(info.get("redis_mode", "standalone"))
        where = f"{address.host}:{address.port}"
        if mode == "cluster":
            raise StoreTopologyError(
                f"{self.safe_url} is a node of a Redis/Valkey Cluster: use a cluster URL, "
                f"redis-cluster://{where} (rediss-cluster:// with TLS)"
            )
        if mode == "sentinel":
            raise StoreTopologyError(
                f"{self.safe_url} is a Sentinel, which holds no data: use "
                f"redis-sentinel://{where}/<service> (the master's name in sentinel.conf)"
            )

    def check_access(self, operations: Iterable[str]) -> None:
        """Run each operation's commands once against a short-lived probe key, so a missing ACL
        permission fails now, naming the command, instead of as misses later.

        ``operations``: keys of :data:`ACCESS`. Raises :class:`StorePermissionError` (or the
        usual typed errors when the server cannot be reached).
        """
        ops = list(dict.fromkeys(operations))
        unknown = set(ops) - set(ACCESS)
        if unknown:
            raise InvalidArgumentError(f"unknown operations {sorted(unknown)}; known: {ACCESS}")
        if "drop_select" in ops and "insert" not in ops:
            ops.append("insert")  # the claim script only runs its commands on a present key
        probe = self.keys.probe(uuid.uuid4().hex)
        c, ctl = self._client, self._control
        steps: dict[str, Callable[[], object]] = {
            "ping": ctl.ping,
            "insert": lambda: c.set(probe, b"probe", px=_PROBE_TTL_MS),
            "select": lambda: c.get(probe),
            "lookup": lambda: ctl.exists(probe),
            "handoff_read": lambda: ctl.get(probe),
            "handoff_claim": lambda: ctl.set(
                probe, HANDOFF_TAKEN, xx=True, px=_PROBE_TTL_MS, get=True
            ),
            "drop_select": lambda: self._claims.check_scripts(probe),
            "delete": lambda: ctl.unlink(probe),
        }
        # operations of several commands outside a script: each command probed on its own, so
        # the error names the one refused
        commands: dict[str, list[tuple[str, Callable[[], object]]]] = {
            "block_info": [
                ("STRLEN", lambda: ctl.strlen(probe)),
                ("PTTL", lambda: ctl.pttl(probe)),
            ],
            "renew": [
                ("PEXPIRE", lambda: ctl.pexpire(probe, _PROBE_TTL_MS)),
                ("PERSIST", lambda: ctl.persist(probe)),
                ("PEXPIRE", lambda: ctl.pexpire(probe, _PROBE_TTL_MS)),  # never left forever
            ],
        }
        order = ["ping", "insert", "select", "lookup", "handoff_read", "handoff_claim"]
        order += ["block_info", "renew", "drop_select", "delete"]
        assert set(order) == set(ACCESS), "every operation has a probe"
        for op in (o for o in order if o in ops):
            if op in commands:
                for command, step in commands[op]:
                    self.guard.call(command, step)
                continue
            command = " ".join(ACCESS[op]) if op == "drop_select" else ACCESS[op][0]
            try:
                self.guard.call(command, steps[op])
            except StoreCommandError as exc:
                if op != "drop_select":
                    raise
                # inside a script a refused command is a plain script error (no NOPERM code)
                raise permission_error(self.safe_url, command, str(exc)) from None

    # ------------------------------------------------------------------ keys
    def key_pattern(self, fingerprint: str | None = None) -> str:
        """The SCAN/redis-cli pattern of this buffer's keys."""
        return self.keys.pattern(fingerprint)

    def redis_key(self, block_hash: str, fingerprint: str | None = None) -> str:
        """The full Redis key of a block, e.g. for ``redis-cli GETRANGE <key> 0 400``."""
        return self.keys.block(block_hash, fingerprint)

    def _keys(self, hashes: Sequence[str], fingerprint: str | None = None) -> list[str]:
        if isinstance(hashes, str) or not isinstance(hashes, Sequence):
            raise InvalidArgumentError(
                f"expected a list of block hashes, got {type(hashes).__name__}"
            )
        if not hashes:
            raise InvalidArgumentError("the list of block hashes is empty")
        return [self.keys.block(h, fingerprint) for h in hashes]

    def _ttl_ms(self, position: int) -> int | None:
        """The TTL of the block at ``position`` in its chain: one ``ttl_step_ms`` shorter per
        position (never below half the TTL), so tails expire and get evicted first."""
        if self.ttl_ms is None:
            return None
        return max(self.ttl_ms // 2, self.ttl_ms - position * self.ttl_step_ms)

    # ------------------------------------------------------------------ insert
    def encode(
        self,
        block_hash: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> memoryview:
        """The bytes ``insert`` would store, for callers that stage values in reusable buffers
        (``out``) and write them later with :meth:`insert_encoded`."""
        self.keys.block(block_hash)  # validates the hash
        return encode_value(
            tensors,
            fingerprint=self.fingerprint,
            block_hash=block_hash,
            metadata=metadata,
            compression=self.compression,
            max_value_bytes=self.max_value_bytes,
            out=out,
        )

    def insert(
        self,
        block_hash: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """``SET`` one block (overwriting any previous value), with the buffer's TTL."""
        self.insert_many([(block_hash, tensors)], metadata=metadata)

    def insert_many(
        self,
        items: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Pipelined ``SET`` of several blocks in one round trip; ``items`` in chain order.

        Values are framed in per-thread scratch buffers that are reused by the next call (fresh
        multi-MiB buffers cost a page fault per 4 KiB and made insert ~30% slower than plain
        ``SET``); buffers beyond ``_SCRATCH_LIMIT`` bytes per thread are not kept.
        """
        encoded = [
            (h, self.encode(h, t, metadata, out=self._scratch(i, t)))
            for i, (h, t) in enumerate(items)
        ]
        self.insert_encoded(encoded)

    def _scratch(self, slot: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """This thread's reusable buffer number ``slot``, big enough for ``tensors``; None when
        compressing, when the value is not valid (encode then says why) or too big to keep."""
        if self.compression != "none":
            return None
        try:
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            need += 4096 + 256 * len(tensors)  # room for the JSON header
        except (AttributeError, TypeError):
            return None
        bufs: list[torch.Tensor] = self._local.__dict__.setdefault("scratch", [])
        if slot < len(bufs) and bufs[slot].numel() >= need:
            return bufs[slot]
        kept = sum(b.numel() for j, b in enumerate(bufs) if j != slot)
        if kept + need > _SCRATCH_LIMIT:
            return None
        buf = torch.empty(need, dtype=torch.uint8)
        if slot < len(bufs):
            bufs[slot] = buf
        else:
            bufs.append(buf)
        return buf

    def insert_encoded(
        self,
        items: Sequence[tuple[str, bytes | memoryview]],
        *,
        positions: Sequence[int] | None = None,
    ) -> None:
        """Pipelined ``SET`` of values made by :meth:`encode`.

        ``positions``: each block's index in its chain (default: the order of ``items``); later
        blocks get slightly shorter TTLs (see the module docstring).
        """
        self.insert_parts([(h, [v]) for h, v in items], positions=positions)

    def insert_parts(
        self,
        items: Sequence[tuple[str, Sequence[Any]]],
        *,
        positions: Sequence[int] | None = None,
        connections: int = 1,
    ) -> None:
        """``SET`` values given as lists of buffers (see ``codec.frame_parts``): each value's
        parts are sent from where they lie with ``sendmsg``, never joined, and the batch is
        spread over ``connections`` pooled connections so writes overlap. ``positions`` as in
        :meth:`insert_encoded`."""
        encoded = [(self.keys.block(h).encode(), parts) for h, parts in items]
        if not encoded:
            return
        where = list(positions) if positions is not None else list(range(len(encoded)))
        if len(where) != len(encoded):
            raise InvalidArgumentError("positions must have one entry per item")
        if connections < 1:
            raise InvalidArgumentError(f"connections must be >= 1, got {connections}")
        commands = [
            (key, parts, self._ttl_ms(pos))
            for (key, parts), pos in zip(encoded, where, strict=True)
        ]
        nbytes = sum(memoryview(p).nbytes for _, parts in encoded for p in parts)

        def send() -> None:
            sent = self._shards.fan_out(
                self._send_on_one, commands, key=lambda c: c[0], connections=connections
            )
            for (key, parts, px), outcome in zip(commands, sent, strict=True):
                if outcome is REDIRECTED:  # the slot moved: redis-py finds its new master
                    self._count_redirect()
                    value = b"".join(memoryview(p).cast("B") for p in parts)
                    self._client.set(key, value, px=px)

        try:
            self.guard.call("SET", send)
        except Exception:
            with self._lock:
                self._stats.insert_errors += len(encoded)
            raise
        with self._lock:
            self._stats.inserts += len(encoded)
            self._stats.bytes_out += nbytes

    def _send_on_one(
        self, server: redis.Redis, commands: list[tuple[bytes, Sequence[Any], int | None]]
    ) -> list[object]:
        """SETs on one connection to ``server``; per command None, or REDIRECTED."""
        refused: Exception | None = None
        out: list[object] = []
        with self._pooled_connection(server) as conn:
            conn.connect()
            sock = raw_socket(conn)
            if sock is None:  # a client without a socket (fakeredis): plain SETs
                pipe = server.pipeline(transaction=False)
                for key, parts, px in commands:
                    pipe.set(key, b"".join(memoryview(p).cast("B") for p in parts), px=px)
                pipe.execute()
                return [None] * len(commands)
            send_buffers(sock, [b for c in commands for b in pack_set(*c)])
            reader = ReplyReader(sock)
            for _ in commands:
                try:
                    reader.read_status()
                    out.append(None)
                except redis.exceptions.ResponseError as exc:
                    if is_redirect(exc):
                        out.append(REDIRECTED)
                        continue
                    refused = refused or exc  # read the rest, then say so
                    out.append(None)
        if refused is not None:
            raise refused
        return out

    @contextlib.contextmanager
    def _pooled_connection(self, server: redis.Redis) -> Iterator[Any]:
        """A connection of ``server``'s transfer pool, for reading replies ourselves. If the
        body raises before every reply was read, the connection's place in the reply stream is
        lost: it is dropped, not returned to the pool as it is."""
        pool = server.connection_pool
        conn = pool.get_connection()
        try:
            yield conn
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def insert_async(
        self,
        block_hash: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> Future[None]:
        """Insert on a background thread; the Future carries any error.

        The tensors are read when the thread runs: do not modify them until the Future is done.
        """
        return self._pool().submit(self.insert, block_hash, tensors, metadata)

    def insert_many_async(
        self,
        items: Sequence[tuple[str, Mapping[str, torch.Tensor]]],
        metadata: Mapping[str, str] | None = None,
    ) -> Future[None]:
        return self._pool().submit(self.insert_many, items, metadata)

    def _count_redirect(self) -> None:
        with self._lock:
            self._stats.redirects += 1

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvstore")
            return self._executor

    # ------------------------------------------------------------------ lookups
    def select(
        self, hashes: Sequence[str], *, copy: bool = True
    ) -> list[dict[str, torch.Tensor] | None]:
        """Read blocks without deleting them. ``None`` where a block is missing or invalid.

        Each reply is received into a buffer of exactly its size (a value over
        ``max_value_bytes`` is drained, never allocated). With ``copy=False`` uncompressed
        tensors are views on those buffers.
        """
        keys = self._keys(hashes)
        return self._read(hashes, keys, None, consume=False, timeout_s=0.0, copy=copy)

    def drop_select(
        self, hashes: Sequence[str], timeout_s: float = 0.0, *, copy: bool = True
    ) -> list[dict[str, torch.Tensor] | None]:
        """Atomically take blocks; each stored value is delivered to exactly one caller.

        The present keys are claimed for this call (``claims``: renamed to private keys,
        atomically), read -- retried once if the connection drops, the claimed keys are still
        there -- and deleted after they arrived and were verified; if they cannot be read, they
        are given back. With ``timeout_s > 0`` it waits (polling with backoff up to 20 ms) until
        *every* key is present and claims them all at once; when the time runs out it takes
        what is there.
        """
        keys = self._keys(hashes)
        return self._read(hashes, keys, None, consume=True, timeout_s=timeout_s, copy=copy)

    def select_into(
        self,
        hashes: Sequence[str],
        buffers: Sequence[torch.Tensor],
        *,
        consume: bool = False,
        timeout_s: float = 0.0,
        connections: int = 1,
    ) -> list[dict[str, torch.Tensor] | None]:
        """Read blocks straight into ``buffers``: one CPU ``uint8`` tensor per key (pinned or
        not). Each reply is received from the socket into its buffer (``recv_into``): no
        intermediate ``bytes``, no second host copy. Returns, aligned with the keys, the
        verified tensors as views into the buffers (lz4 values decompress into new memory), or
        None for a miss or a bad value. A value larger than its buffer is a counted miss and is
        never allocated. ``consume=True`` takes the blocks exactly once, as ``drop_select``
        (a consumed value too large for its buffer is lost). ``connections`` spreads the batch
        over that many pooled connections, so socket reads overlap.
        """
        if len(buffers) != len(hashes):
            raise InvalidArgumentError(f"{len(hashes)} keys but {len(buffers)} buffers")
        for b in buffers:
            if b.dtype != torch.uint8 or b.device.type != "cpu" or not b.is_contiguous():
                raise InvalidArgumentError("buffers must be contiguous CPU uint8 tensors")
        if connections < 1:
            raise InvalidArgumentError(f"connections must be >= 1, got {connections}")
        keys = self._keys(hashes)
        views = [memoryview(b.numpy()).cast("B") for b in buffers]  # type: ignore[arg-type]
        return self._read(
            hashes,
            keys,
            views,
            consume=consume,
            timeout_s=timeout_s,
            copy=False,
            connections=connections,
        )

    def _read(
        self,
        hashes: Sequence[str],
        keys: list[str],
        views: list[memoryview] | None,
        *,
        consume: bool,
        timeout_s: float,
        copy: bool,
        connections: int | None = None,
    ) -> list[dict[str, torch.Tensor] | None]:
        """The one read path: claim (when consuming), receive each value into its view (or a
        buffer of its own size when ``views`` is None), verify, and delete the claims."""
        dests: list[memoryview | int] = (
            list(views) if views is not None else [self.max_value_bytes] * len(keys)
        )
        conns = connections or self.read_connections
        if not consume:
            commands: list[tuple[Any, ...]] = [("GET", k) for k in keys]
            received = self.guard.call("GET", lambda: self._receive(commands, dests, conns))
            raw = [self._as_raw(got, dests[i]) for i, got in enumerate(received)]
            return self._decode_all(hashes, keys, raw, copy)
        batch = self._claims.claim(keys, timeout_s)
        targets = [i for i, st in enumerate(batch.statuses) if st == 1]
        commands = [("GET", k) for k in batch.claim_keys]
        target_dests = [dests[i] for i in targets]

        def fetch() -> list[Any]:
            return self._receive(commands, target_dests, conns) if commands else []

        try:
            try:
                received = self.guard.call("GET", fetch)
            except (StoreUnavailableError, StoreTimeoutError):
                received = self.guard.call("GET", fetch)  # the claims are still there: once more
            fetched = [
                self._as_raw(got, dests[i]) for i, got in zip(targets, received, strict=True)
            ]
            out = self._decode_all(hashes, keys, batch.raw_values(fetched), copy)
        except BaseException:  # nothing was delivered: give the values back
            self._claims.release(batch)
            raise
        self._claims.finish(batch)
        return out

    @staticmethod
    def _as_raw(got: Any, dest: memoryview | int) -> Any:
        """A received reply as ``_decode_all`` takes it: the value's bytes, None (missing), a
        length (oversize) or -1 (wrong type)."""
        if isinstance(got, Oversize):
            return got.length
        if isinstance(got, int) and isinstance(dest, memoryview) and got >= 0:
            return dest[:got]
        return got  # bytes-like, None or -1

    def _receive(
        self, commands: list[tuple[Any, ...]], dests: list[memoryview | int], connections: int
    ) -> list[Any]:
        """Send ``commands`` (each ``(name, key, ...)``, bulk-string replies) and receive each
        reply into its destination -- a view, or for an int a new buffer of the reply's size up
        to that many bytes -- the batch split over the servers holding the keys and over up to
        ``connections`` connections per server, at most ``read_depth`` replies in flight on
        each. A key whose slot moved is read again through redis-py, which follows redirects."""
        work = list(zip(commands, dests, strict=True))
        got = self._shards.fan_out(
            self._receive_on_one, work, key=lambda w: w[0][1], connections=connections
        )
        for i, reply in enumerate(got):
            if reply is REDIRECTED:
                self._count_redirect()
                command, dest = work[i]
                got[i] = parsed_reply_into(self._client.execute_command(*command), dest)
        return got

    def _receive_on_one(
        self, server: redis.Redis, work: list[tuple[tuple[Any, ...], memoryview | int]]
    ) -> list[Any]:
        out: list[Any] = []
        refused: Exception | None = None
        depth = self.read_depth
        with self._pooled_connection(server) as conn:
            conn.connect()
            sock = raw_socket(conn)
            reader = ReplyReader(sock) if sock is not None else None
            sent = 0
            for i, (_, dest) in enumerate(work):
                upto = min(len(work), i + depth)  # keep up to `depth` commands in flight
                if upto > sent:
                    conn.send_packed_command(conn.pack_commands([c for c, _ in work[sent:upto]]))
                    sent = upto
                try:
                    if reader is None:  # a client without a socket (fakeredis): parsed reply
                        out.append(parsed_reply_into(conn.read_response(), dest))
                    elif isinstance(dest, memoryview):
                        out.append(reader.read_bulk_into(dest))
                    else:
                        out.append(reader.read_bulk_new(dest))
                except redis.exceptions.ResponseError as exc:
                    if is_redirect(exc):
                        out.append(REDIRECTED)
                        continue
                    if error_code(exc) != "WRONGTYPE":
                        refused = refused or exc  # read the rest, then say so
                    out.append(-1)
        if refused is not None:
            raise refused
        return out

    def longest_prefix(
        self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` are present, in one round trip.

        With ``fingerprints`` (e.g. one per tensor-parallel rank) a block counts only when it is
        present under every fingerprint. An empty ``hashes`` gives 0.
        """
        return self.longest_prefixes([hashes], fingerprints)[0]

    def longest_prefixes(
        self, chains: Sequence[Sequence[str]], fingerprints: Sequence[str] | None = None
    ) -> list[int]:
        """``longest_prefix`` of many chains (e.g. every document of a corpus) in one round trip."""
        fps = list(fingerprints) if fingerprints else [self.fingerprint]
        keys = [self.keys.block(h, fp) for chain in chains for h in chain for fp in fps]
        exists = self._exists(keys) if keys else []
        out, at = [], 0
        for chain in chains:
            span = len(chain) * len(fps)
            out.append(leading_present(exists[at : at + span], len(fps)))
            at += span
        return out

    def contains(self, hashes: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._exists(self._keys(hashes))]

    def block_info(
        self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> list[BlockInfo]:
        """Per block, in one round trip (``STRLEN`` and ``PTTL`` per key): whether it is present
        under every fingerprint, its stored bytes summed over them, and the shortest TTL left."""
        fps = list(fingerprints) if fingerprints else [self.fingerprint]
        keys = [self.keys.block(h, fp) for h in hashes for fp in fps]

        def read() -> list[Any]:
            pipe = self._control.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
                pipe.pttl(k)
            return list(pipe.execute())

        replies = self.guard.call("STRLEN", read) if keys else []
        out = []
        for i in range(len(hashes)):
            span = replies[2 * i * len(fps) : 2 * (i + 1) * len(fps)]
            sizes, pttls = [int(x) for x in span[0::2]], [int(x) for x in span[1::2]]
            present = all(p != -2 for p in pttls)  # -2: no such key (an empty value is -1/>=0)
            ttls = [p / 1000 for p in pttls if p >= 0]
            out.append(BlockInfo(present, sum(sizes), min(ttls) if ttls else None))
        return out

    def renew(self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None) -> int:
        """Give a chain's blocks this buffer's TTL again, counted from now, each a little shorter
        than its parent's as ``insert`` sets them (``PERSIST`` when the buffer has no TTL).
        Moves no data; returns how many keys' TTL changed (a missing key's never does)."""
        fps = list(fingerprints) if fingerprints else [self.fingerprint]

        def send() -> list[Any]:
            pipe = self._control.pipeline(transaction=False)
            for pos, h in enumerate(hashes):
                ttl = self._ttl_ms(pos)
                for fp in fps:
                    key = self.keys.block(h, fp)
                    if ttl is None:
                        pipe.persist(key)
                    else:
                        pipe.pexpire(key, ttl)
            return list(pipe.execute())

        if not hashes:
            return 0
        return sum(int(bool(r)) for r in self.guard.call("PEXPIRE", send))

    def _exists(self, keys: Sequence[str]) -> list[int]:
        """``EXISTS`` per key, pipelined: one round trip (on a Cluster, one per master, sent to
        all masters before any reply is read)."""

        def exists() -> list[int]:
            pipe = self._control.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [int(x) for x in pipe.execute()]

        return self.guard.call("EXISTS", exists)

    def delete(self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None) -> int:
        """Delete blocks (under each of ``fingerprints``, default this buffer's); returns how many
        keys existed."""
        fps: Sequence[str | None] = list(fingerprints) if fingerprints else [None]
        keys = [k for fp in fps for k in self._keys(hashes, fp)]
        return int(self.guard.call("UNLINK", lambda: self._control.unlink(*keys)))

    # ------------------------------------------------------------------ handoffs
    def open_handoff(self, handoff_id: str, fingerprints: Sequence[str] | None = None) -> None:
        """Mark a handoff as being written (``SET ... NX``: never over a final count), so a
        consumer knows to wait for its commit record."""
        fps = list(fingerprints) if fingerprints else [self.fingerprint]
        ttl = min(self.ttl_ms or HANDOFF_TTL_MS, HANDOFF_TTL_MS)

        def mark() -> None:
            pipe = self._control.pipeline(transaction=False)
            for fp in fps:
                pipe.set(self.keys.handoff(handoff_id, fp), HANDOFF_PENDING, nx=True, px=ttl)
            pipe.execute()

        self.guard.call("SET", mark)

    def publish_handoff(self, handoff_id: str, num_blocks: int) -> None:
        """Record that the first ``num_blocks`` blocks of a handoff's chain are written (call it
        after their SETs were acknowledged); expires with the blocks, or after 10 minutes."""
        if num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, got {num_blocks}")
        key = self.keys.handoff(handoff_id)
        ttl = min(self.ttl_ms or HANDOFF_TTL_MS, HANDOFF_TTL_MS)
        self.guard.call("SET", lambda: self._control.set(key, str(num_blocks), px=ttl))

    def read_handoff(
        self, handoff_id: str, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> HandoffState:
        """One round trip: every rank's commit record, and how many leading blocks of ``hashes``
        are present under every fingerprint."""
        return self.read_handoffs([(handoff_id, hashes)], fingerprints)[0]

    def read_handoffs(
        self,
        handoffs: Sequence[tuple[str, Sequence[str]]],
        fingerprints: Sequence[str] | None = None,
    ) -> list[HandoffState]:
        """``read_handoff`` of many (handoff id, chain) pairs in one round trip."""
        fps = list(fingerprints) if fingerprints else [self.fingerprint]

        def read() -> list[Any]:
            pipe = self._control.pipeline(transaction=False)
            for handoff_id, hashes in handoffs:
                for fp in fps:
                    pipe.get(self.keys.handoff(handoff_id, fp))
                for h in hashes:
                    for fp in fps:
                        pipe.exists(self.keys.block(h, fp))
            return list(pipe.execute())

        replies = self.guard.call("GET", read) if handoffs else []
        out, at = [], 0
        for _, hashes in handoffs:
            records = Records(replies[at : at + len(fps)])
            at += len(fps)
            span = len(hashes) * len(fps)
            present = leading_present(replies[at : at + span], len(fps))
            at += span
            out.append(HandoffState(records.committed, records.taken, present, records.pending))
        return out

    def claim_handoff(
        self, handoff_id: str, fingerprints: Sequence[str] | None = None, *, owner: str = ""
    ) -> Claim:
        """Take a committed handoff for ``owner`` (``SET ... XX PX GET`` on every rank's
        record): ``Claim.WON`` for exactly one owner, also when its claim is sent again;
        ``Claim.TAKEN`` when another owner took it first; ``Claim.UNCOMMITTED`` when a record is
        missing or still pending (nothing to take exclusively). A taken record says so for a
        minute, then expires."""
        fps = list(fingerprints) if fingerprints else [self.fingerprint]
        mark = HANDOFF_TAKEN + b":" + owner.encode()

        def claim() -> list[Any]:
            pipe = self._control.pipeline(transaction=False)
            for fp in fps:
                pipe.set(
                    self.keys.handoff(handoff_id, fp), mark, xx=True, px=TAKEN_TTL_MS, get=True
                )
            return list(pipe.execute())

        return claim_outcome(self.guard.call("SET", claim), own=mark)

    def delete_handoff(self, handoff_id: str, fingerprints: Sequence[str] | None = None) -> int:
        fps = list(fingerprints) if fingerprints else [self.fingerprint]
        keys = [self.keys.handoff(handoff_id, fp) for fp in fps]
        return int(self.guard.call("UNLINK", lambda: self._control.unlink(*keys)))

    # ------------------------------------------------------------------ counters
    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{**asdict(self._stats)})
            snap.corrupt_by_reason = dict(self._stats.corrupt_by_reason)
        snap.breaker_opens = self.breaker.opens
        return snap

    def _decode_all(
        self, hashes: Sequence[str], keys: list[str], raw: list[Any], copy: bool
    ) -> list[dict[str, torch.Tensor] | None]:
        out: list[dict[str, torch.Tensor] | None] = []
        hits = misses = nbytes = 0
        bad: list[tuple[str, CorruptValueError]] = []
        for h, key, value in zip(hashes, keys, raw, strict=True):
            if value is None:
                misses += 1
                out.append(None)
                continue
            try:
                if isinstance(value, int):
                    if value < 0:
                        raise CorruptValueError("wrong-type", "the key does not hold a string")
                    raise CorruptValueError(
                        "oversize",
                        f"{value} bytes exceeds max_value_bytes={self.max_value_bytes} "
                        "or the buffer it was read into",
                    )
                _, tensors = decode_value(
                    value,
                    fingerprint=self.fingerprint,
                    block_hash=h,
                    max_value_bytes=self.max_value_bytes,
                    copy=copy,
                )
            except CorruptValueError as exc:
                bad.append((key, exc))
                misses += 1
                out.append(None)
                continue
            hits += 1
            nbytes += len(value)
            out.append(tensors)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.bytes_in += nbytes
            for key, err in bad:
                self._stats.corrupt += 1
                reasons = self._stats.corrupt_by_reason
                reasons[err.reason] = reasons.get(err.reason, 0) + 1
                first_time = key not in self._logged_bad
                self._logged_bad[key] = None
                if len(self._logged_bad) > 4096:
                    self._logged_bad.popitem(last=False)
                if first_time:
                    logger.warning(
                        "kvstore: ignoring invalid value at %s (%s); counted as a miss. "
                        "Delete it with `redis-cli UNLINK %s` if it keeps appearing.",
                        key,
                        err,
                        key,
                    )
        return out
