"""LookupBuffer: the store's API on Redis/Valkey, shaped after vLLM's lookup-buffer layer
(insert / drop_select).

Redis semantics, one line each:
- ``insert``: ``SET key value [PX ttl]``; batches are pipelined, ``insert_async`` returns a Future.
  Blocks later in a chain get a slightly shorter TTL (``ttl``), so under ``volatile-ttl``
  eviction a prompt's tail goes before its head.
- ``drop_select``: a Lua script claims a batch atomically (each stored value reaches exactly one
  caller; see ``values/drop_select.py``), a pipelined ``GET`` fetches it, and the claimed keys
  are deleted only after the values arrived and were verified: a lost reply or a dropped
  connection loses nothing.
- ``select``: pipelined ``GET`` without deleting, for shared prefix reuse.
- ``longest_prefix``: pipelined ``EXISTS``, counting leading present blocks in one round trip.
- handoffs: a producer's commit record says how many leading blocks of a chain it really wrote
  (``publish_handoff``); a consumer reads it (``read_handoff``) and takes it once
  (``claim_handoff``).

What the connector calls (``connector/``, ``datamover/``): neither ``insert`` nor
``drop_select``.

- saves: ``frame_parts`` / ``insert_parts`` (the write path under ``insert``, values sent from
  the data mover's staging memory), and the handoff record (``open_handoff``,
  ``publish_handoff``);
- lookups: ``survey`` (chains' presences, handoff records and the namespace's generation in one
  round trip);
- loads: ``select_into``, and ``select_head_into`` / ``select_tensors_into`` for split loads;
  reads that delete nothing;
- consume mode's exactly-once take is the handoff claim, not the values': the worker claims the
  handoff as it reads (``claim_handoff``); the scheduler side deletes the chain and its record
  once every rank has read it, and claims and deletes one that will not be loaded
  (``read_handoffs``, ``claim_handoff``, ``delete``, ``delete_handoff``);
- resets: ``reset``, ``sweep``, ``read_generation``; ``connector.warm`` also uses
  ``longest_prefixes``, ``renew``, ``block_info`` and ``read_handoff``.

``drop_select`` is the design's lookup buffer, an atomic get-and-delete. With ``insert`` /
``insert_many`` / ``insert_async``, ``select`` and ``longest_prefix`` it stays the store's
public API for callers that use ``kvstore`` alone (``scripts/demo_store.py``, the benchmarks).
``select_into(consume=True)`` is the same take into the caller's buffers.

This class is a facade: it checks arguments and hands each call to the part that does one job.
Where to look:

- which server holds a key, running a batch over servers: ``shards``;
- where values are sent and replies received, redirects re-sent: ``transport`` (bytes on the
  socket: ``wire``);
- the error policy every round trip goes through (breaker, typed errors, counting): ``guard``;
- where a claim is made and given back: ``values/drop_select.py``;
- reading and verifying values: ``reads``; framing and writing them: ``writes``, ``codec``;
- presence, sizes, TTLs, deletes: ``inventory``; lookups and the generation in one round
  trip: ``survey``; resets: ``generations``; TTL policy: ``ttl``;
- handoff records: ``handoff``; URL / ACL checks at startup: ``access``.

On a Redis/Valkey Cluster (``redis-cluster://``) a batch fans out to the masters holding its
keys, in parallel; round trips above are then one per master. Claims are made per slot.

A value that fails validation is never returned: it is a counted miss, logged once per key.
Every Redis call goes through one circuit breaker: when the server is refusing, hung or gone,
calls fail at once with :class:`StoreCircuitOpenError` until a background probe sees it answer.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis
import torch
import xxhash

from kvstore.counters import Counters, StoreStats
from kvstore.errors import InvalidArgumentError
from kvstore.fleet.access import ACCESS, acl_rule, check_access, check_topology
from kvstore.fleet.functions import LIBRARY
from kvstore.fleet.generations import Generations
from kvstore.fleet.handoff import Claim, HandoffRecords, HandoffState
from kvstore.fleet.inventory import BlockInfo, Inventory
from kvstore.fleet.survey import Survey, survey
from kvstore.net.connection import (
    AclScope,
    StoreAddress,
    check_timeouts,
    make_client,
    parse_url,
)
from kvstore.net.guard import Guard
from kvstore.net.server_code import ScriptMode, ServerCode
from kvstore.net.transport import READ_DEPTH, Transport
from kvstore.values.codec import (
    CODECS,
    FORMAT_VERSION,
    TensorEntry,
    ValueHeader,
    frame_parts,
    lz4_block,
)
from kvstore.values.drop_select import Claimer, ClaimReleaser, ServerClock
from kvstore.values.keys import DEFAULT_KEY_PREFIX, KeySpace
from kvstore.values.reads import READ_CONNECTIONS, Reader
from kvstore.values.tensor_reads import HeadMiss, TensorReader
from kvstore.values.ttl import ChainTtl
from kvstore.values.value_auth import ValueKey
from kvstore.values.writes import Writer

__all__ = [
    "ACCESS",
    "DEFAULT_MAX_VALUE_BYTES",
    "READ_CONNECTIONS",
    "READ_DEPTH",
    "BlockInfo",
    "LookupBuffer",
    "acl_rule",
    "layout_fingerprint",
]

DEFAULT_MAX_VALUE_BYTES = 512 << 20  # Redis' own proto-max-bulk-len default
CLOSE_WAIT_S = 10.0  # the least close() waits for a clock reading or a probe under way


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
        read_depth: int | None = None,
        read_connections: int = READ_CONNECTIONS,
        secret: bytes | None = None,
        epoch: str = "",
        lua: ScriptMode | str = ScriptMode.AUTO,
    ) -> None:
        if isinstance(client, (str, bytes)):  # the easiest mistake: it failed deep inside
            raise InvalidArgumentError(
                "LookupBuffer() takes a redis-py client; for a URL use "
                "LookupBuffer.from_url(url, ...)"
            )
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
        if (read_depth is not None and read_depth < 1) or read_connections < 1:
            raise InvalidArgumentError("read_depth and read_connections must be >= 1")
        self.keys = KeySpace(key_prefix, namespace, fingerprint or layout_fingerprint(layout))
        # signs every value written and takes only values signed with it (value_auth.py)
        # (and, with an epoch, only values of that epoch: no rollback of a reset)
        if epoch and secret is None:
            raise InvalidArgumentError(
                "an epoch needs the namespace's secret: it keys the values' MACs, and without a "
                "secret values are not authenticated (give secret_file or secret_env)"
            )
        self.value_key = ValueKey(secret, namespace, epoch) if secret is not None else None
        self.namespace = namespace
        self.fingerprint = self.keys.fingerprint
        self.key_prefix = key_prefix
        self.ttl = ChainTtl.from_seconds(ttl_s, ttl_step_ms)
        self.compression = compression
        self.max_value_bytes = max_value_bytes
        self.safe_url = safe_url
        self.address: StoreAddress | None = None  # set by from_url
        self._counters = Counters()
        # the transport's fan-out threads are separate from _executor, whose tasks
        # (insert_async) fan out too and must not wait on their own pool
        self._transport = Transport(
            client,
            control_client,
            read_depth=read_depth,
            threads=max(8, 2 * io_threads),
            on_redirect=lambda: self._counters.add(redirects=1),
        )
        self.guard = Guard(
            self._probe_after_failures,
            safe_url=safe_url,
            failures=breaker_failures,
            probe_s=breaker_probe_s,
            # a failed call may be a master its replica replaced: every client learns the map
            # again (redis-py's cluster client does so itself only when it retries)
            on_unavailable=self._transport.relearn,
            scope=AclScope(namespace, key_prefix),
        )
        self.breaker = self.guard.breaker
        # the Lua every view runs: the admin's functions, or scripts where a server has none
        self.server_code = ServerCode(LIBRARY, ScriptMode.parse(lua), safe_url)
        self._read_connections = read_connections
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._owner: LookupBuffer | None = None  # set on a view made by for_fingerprint
        # how long close() waits for a clock reading or a probe under way (from_url: one
        # connect and one control round trip's timeouts, if longer)
        self.close_wait_s = CLOSE_WAIT_S
        # the namespace's: every fingerprint's view shares it
        self._generations = Generations(
            self._transport,
            self.guard,
            self.keys,
            self.server_code,
            signed=self.value_key is not None,
        )
        # what drop_select's claims share over every view: the thread giving claimed blocks
        # back after a failed call, and the server's clock (values/drop_select.py)
        self._releaser = ClaimReleaser(
            lambda given, stranded: self._counters.add(
                claims_given_back=given, claims_stranded=stranded
            )
        )
        self._clock = ServerClock(lambda: self._claims.server_offset())
        self._bind_keys()

    def _bind_keys(self) -> None:
        """(Re)build the parts that name keys or check values' fingerprints, over the shared
        transport, guard and counters."""
        self._inventory = Inventory(self._transport, self.guard, self.keys, self.ttl)
        self._claims = Claimer(
            self._transport,
            self.guard,
            exists=self._inventory.exists,
            max_value_bytes=self.max_value_bytes,
            on_retry=lambda: self._counters.add(redirects=1),
            releaser=self._releaser,
            clock=self._clock,
            code=self.server_code,
        )
        self._reader = Reader(
            self._transport,
            self.guard,
            self._claims,
            self._counters,
            fingerprint=self.fingerprint,
            max_value_bytes=self.max_value_bytes,
            connections=self._read_connections,
            value_key=self.value_key,
        )
        self._tensor_reader = TensorReader(
            self._transport,
            self.guard,
            self._counters,
            fingerprint=self.fingerprint,
            max_value_bytes=self.max_value_bytes,
            log_bad=self._reader.log_bad,
            value_key=self.value_key,
        )
        self._writer = Writer(
            self._transport,
            self.guard,
            self.keys,
            self.ttl,
            self._counters,
            compression=self.compression,
            max_value_bytes=self.max_value_bytes,
            value_key=self.value_key,
        )
        self._handoffs = HandoffRecords(
            self._transport, self.guard, self.keys, self.ttl, self.server_code
        )

    def for_fingerprint(self, fingerprint: str) -> LookupBuffer:
        """A view of this buffer whose keys and values are under ``fingerprint`` (e.g. another
        slice of a model's KV heads) in the same namespace: the same connections, circuit
        breaker and counters, no new sockets. Closing the view does nothing; close this one."""
        if fingerprint == self.fingerprint:
            return self
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.keys = KeySpace(self.key_prefix, self.namespace, fingerprint)
        view.fingerprint = view.keys.fingerprint
        view._owner = self._owner or self
        view._bind_keys()
        return view

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
        read_depth: int | None = None,
        read_connections: int = READ_CONNECTIONS,
        secret: bytes | None = None,
        epoch: str = "",
        lua: ScriptMode | str = ScriptMode.AUTO,
        check: bool = True,
    ) -> LookupBuffer:
        """Connect to ``url``. With ``check`` (default) the server is pinged now, so a wrong URL,
        a server that is down or a wrong password fails here with a typed error.

        ``control_timeout_s`` (default: ``socket_timeout_s``) is the socket timeout of the
        small calls (lookups, handoff records, deletes, pings), which never move values.
        """
        address: StoreAddress = parse_url(url)
        if control_timeout_s is None:
            control_timeout_s = socket_timeout_s
        check_timeouts(
            socket_timeout_s=socket_timeout_s,
            control_timeout_s=control_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
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
            socket_timeout_s=control_timeout_s,
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
            secret=secret,
            epoch=epoch,
            lua=lua,
        )
        buf.address = address
        buf._transport.owns_clients = True
        buf.close_wait_s = max(CLOSE_WAIT_S, connect_timeout_s + (control_timeout_s) + 1.0)
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
        if self._owner is not None:  # a view (for_fingerprint): its owner holds everything
            return
        self._releaser.close()  # claims being given back go first (bounded)
        self.guard.stop(self.close_wait_s)
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._clock.close(self.close_wait_s)  # a reading under way ends before its connection
        self.guard.closed = True  # (after what close itself sends: claims given back)
        self._transport.close()

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for tools; prefer the methods above)."""
        return self._transport.client

    @property
    def cluster(self) -> bool:
        """True when the store is a Redis/Valkey Cluster (keys spread over its masters)."""
        return self._transport.cluster

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open: calls would fail at once."""
        return self.breaker.allow()

    @property
    def ttl_ms(self) -> int | None:
        """The TTL of a chain's first block, in ms; None: blocks never expire."""
        return self.ttl.ttl_ms

    @property
    def read_depth(self) -> int | None:
        """Replies in flight per connection on reads, as given; None (the default): by the
        values' size, ``READ_DEPTH`` for large ones and up to 1 MiB of smaller ones
        (``transport.READ_BYTES_IN_FLIGHT``)."""
        return self._transport.read_depth

    @property
    def read_connections(self) -> int:
        return self._reader.connections

    # ------------------------------------------------------------------ checks
    def _probe_after_failures(self) -> object:
        """The breaker's probe: the slot map is learned again first (on a Cluster, the failures
        may have been a master that its replica has replaced since)."""
        self._transport.relearn()
        return self._transport.ping()

    def ping(self) -> None:
        self.guard.call("PING", self._transport.ping)

    def probe(self) -> bool:
        """Ask the server now whether it answers, instead of waiting for the circuit breaker's
        next background probe (every ``breaker_probe_s``, each bounded by the connect and
        socket timeouts): True if the breaker is closed afterwards. After a restart, a caller
        that must not miss the first calls probes once before them."""
        return self.breaker.probe_now()

    def wait_given_back(self, timeout_s: float) -> bool:
        """Wait until the blocks that failed ``drop_select`` / ``select_into(consume=True)``
        calls had claimed are back under their keys (or given up on, counted as
        ``claims_stranded``); True if nothing is pending."""
        return self._claims.wait_given_back(timeout_s)

    def check_topology(self) -> None:
        """Fail now, naming the right URL form, when the URL's kind does not match the server
        (see ``access.check_topology``)."""
        check_topology(self.address, self._transport, self.guard)

    def check_access(self, operations: Iterable[str]) -> None:
        """Run each operation's commands once against a short-lived probe key, so a missing ACL
        permission fails now, naming the command, instead of as misses later.

        ``operations``: keys of :data:`ACCESS`. Raises :class:`StorePermissionError` (or the
        usual typed errors when the server cannot be reached).
        """
        parts = (self._claims, self._handoffs, self._generations, self.server_code)
        check_access(operations, self._transport, self.guard, self.keys, *parts)

    # ------------------------------------------------------------------ keys
    def key_pattern(self, fingerprint: str | None = None) -> str:
        """The SCAN/redis-cli pattern of this buffer's keys."""
        return self.keys.pattern(fingerprint)

    def redis_key(self, block_hash: str, fingerprint: str | None = None) -> str:
        """The full Redis key of a block, e.g. for ``redis-cli GETRANGE <key> 0 400``."""
        return self.keys.block(block_hash, fingerprint)

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
        return self._writer.encode(block_hash, tensors, metadata, out=out)

    def insert(
        self,
        block_hash: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """``SET`` one block (overwriting any previous value), with the buffer's TTL."""
        self._writer.insert_many([(block_hash, tensors)], metadata)

    def insert_many(
        self,
        items: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Pipelined ``SET`` of several blocks in one round trip; ``items`` in chain order.
        From a list or tuple, CPU tensors are sent from their own memory: do not change them
        until this returns. From an iterator, each value is copied as it is produced (it may
        reuse one tensor for every item). See ``writes.Writer.insert_many``."""
        self._writer.insert_many(items, metadata)

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
        self._writer.insert_parts([(h, [v]) for h, v in items], positions=positions)

    def frame_parts(
        self, entries: Sequence[TensorEntry], pieces: Sequence[Any], block_hash: str
    ) -> list[Any]:
        """One value of this store (its fingerprint, compression and secret) as buffers for
        :meth:`insert_parts`, around ``pieces`` where they lie (``codec.frame_parts``)."""
        return frame_parts(
            entries,
            pieces,
            fingerprint=self.fingerprint,
            block_hash=block_hash,
            compression=self.compression,
            value_key=self.value_key,
        )

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
        self._writer.insert_parts(items, positions=positions, connections=connections)

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

    def _pool(self) -> ThreadPoolExecutor:
        owner = self._owner or self  # a view's tasks run on its owner's threads
        with owner._lock:
            if owner._executor is None:
                owner._executor = ThreadPoolExecutor(
                    owner._io_threads, thread_name_prefix="kvstore"
                )
            return owner._executor

    # ------------------------------------------------------------------ reads
    def select(
        self, hashes: Sequence[str], *, copy: bool = True
    ) -> list[dict[str, torch.Tensor] | None]:
        """Read blocks without deleting them. ``None`` where a block is missing or invalid.

        Each reply is received into a new buffer of exactly its size, which the returned
        tensors own (a value over ``max_value_bytes`` is drained, never allocated): there is no
        second copy, and ``copy`` (kept for compatibility) changes nothing. A block's tensors
        share that one buffer: keeping one keeps the block's memory (``.clone()`` it to keep it
        alone), and they cannot be resized.
        """
        keys = self.keys.blocks(hashes)
        return self._reader.read(hashes, keys, None, consume=False)

    def drop_select(
        self, hashes: Sequence[str], timeout_s: float = 0.0, *, copy: bool = True
    ) -> list[dict[str, torch.Tensor] | None]:
        """Atomically take blocks; each stored value is delivered to exactly one caller.

        The present keys are claimed for this call (``values/drop_select.py``: renamed to
        private keys, atomically), read -- retried once if the connection drops, the claimed
        keys are still there -- and deleted after they arrived and were verified; if they cannot
        be read, they are given back. With ``timeout_s > 0`` it waits (polling with backoff up
        to 20 ms) until *every* key is present and claims them all at once; when the time runs
        out it takes what is there. Values are received as by :meth:`select`.

        Bounds: the claim is over within ``timeout_s`` plus one socket timeout (a lost reply is
        sent again only within that); a claim the server runs after that -- queued behind
        ``CLIENT PAUSE``, ``DEBUG SLEEP`` or a long script -- takes nothing. The reads take at
        most two read deadlines. What a failed call had claimed is given back in the
        background (:meth:`wait_given_back`), never while the caller waits.
        """
        keys = self.keys.blocks(hashes)
        return self._reader.read(hashes, keys, None, consume=True, timeout_s=timeout_s)

    def select_into(
        self,
        hashes: Sequence[str],
        buffers: Sequence[torch.Tensor],
        *,
        consume: bool = False,
        timeout_s: float = 0.0,
        connections: int = 1,
        deadline: float = math.inf,
    ) -> list[dict[str, torch.Tensor] | None]:
        """Read blocks straight into ``buffers``: one CPU ``uint8`` tensor per key (pinned or
        not). Each reply is received from the socket into its buffer (``recv_into``): no
        intermediate ``bytes``, no second host copy. Returns, aligned with the keys, the
        verified tensors as views into the buffers (lz4 values decompress into new memory), or
        None for a miss or a bad value. A value larger than its buffer is a counted miss and is
        never allocated. ``consume=True`` takes the blocks exactly once, as ``drop_select``
        (a consumed value too large for its buffer is lost). ``connections`` spreads the batch
        over that many pooled connections, so socket reads overlap. No value is waited for past
        ``deadline`` (``time.monotonic()``: a load's own), however well each reply keeps to its
        own: :class:`DeadlinePassedError`, the connection dropped.
        """
        views = self._views(hashes, buffers, connections)
        keys = self.keys.blocks(hashes)
        return self._reader.read(
            hashes,
            keys,
            views,
            consume=consume,
            timeout_s=timeout_s,
            connections=connections,
            deadline=deadline,
        )

    def select_head_into(
        self,
        hashes: Sequence[str],
        buffers: Sequence[torch.Tensor],
        *,
        header_bytes: int,
        entries: Sequence[TensorEntry],
        tensors: int,
        connections: int = 1,
        deadline: float = math.inf,
    ) -> list[ValueHeader | HeadMiss]:
        """The first part of each block's value, by ``GETRANGE``, straight into ``buffers``
        (CPU ``uint8`` tensors at least ``header_bytes`` + those tensors' bytes long): its
        header, expected to be ``header_bytes`` long, then tensors ``[0, tensors)`` of
        ``entries`` (the layout expected, offsets included), verified against the header's
        per-tensor checksums. Per block: the header, to read later tensors with
        :meth:`select_tensors_into`, or why not (``HeadMiss``: a counted miss, or ``WHOLE``:
        a value to read whole with :meth:`select_into`). See ``tensor_reads.py``. ``deadline``
        as :meth:`select_into`'s."""
        views = self._views(hashes, buffers, connections)
        return self._tensor_reader.read_head(
            hashes,
            self.keys.blocks(hashes),
            views,
            header_bytes=header_bytes,
            entries=entries,
            tensors=tensors,
            connections=connections,
            deadline=deadline,
        )

    def select_tensors_into(
        self,
        hashes: Sequence[str],
        headers: Sequence[ValueHeader],
        buffers: Sequence[torch.Tensor],
        first: int,
        end: int,
        *,
        connections: int = 1,
        deadline: float = math.inf,
    ) -> list[bool]:
        """Tensors ``[first, end)`` of each block, back to back at the start of its buffer,
        by ``GETRANGE`` where ``headers`` (from :meth:`select_head_into`) place them, each
        verified against its header's checksum. Per block: whether they arrived intact (a
        value gone or replaced since its head was read does not). ``deadline`` as
        :meth:`select_into`'s."""
        if len(headers) != len(hashes):
            raise InvalidArgumentError(f"{len(hashes)} keys but {len(headers)} headers")
        views = self._views(hashes, buffers, connections)
        return self._tensor_reader.read_tensors(
            hashes,
            self.keys.blocks(hashes),
            headers,
            views,
            first,
            end,
            connections=connections,
            deadline=deadline,
        )

    @staticmethod
    def _views(
        hashes: Sequence[str], buffers: Sequence[torch.Tensor], connections: int
    ) -> list[memoryview]:
        """``buffers`` as the byte views replies are received into (checked)."""
        if len(buffers) != len(hashes):
            raise InvalidArgumentError(f"{len(hashes)} keys but {len(buffers)} buffers")
        for b in buffers:
            if b.dtype != torch.uint8 or b.device.type != "cpu" or not b.is_contiguous():
                raise InvalidArgumentError("buffers must be contiguous CPU uint8 tensors")
        if connections < 1:
            raise InvalidArgumentError(f"connections must be >= 1, got {connections}")
        return [memoryview(b.numpy()).cast("B") for b in buffers]  # type: ignore[arg-type]

    # ------------------------------------------------------------------ what is stored
    def longest_prefix(
        self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` are present, in one round trip.

        With ``fingerprints`` (e.g. one per slice of a model's KV heads) a block counts only
        when it is present under every fingerprint. An empty ``hashes`` gives 0.
        """
        return self._inventory.longest_prefixes([hashes], fingerprints)[0]

    def longest_prefixes(
        self, chains: Sequence[Sequence[str]], fingerprints: Sequence[str] | None = None
    ) -> list[int]:
        """``longest_prefix`` of many chains (e.g. every document of a corpus) in one round trip."""
        return self._inventory.longest_prefixes(chains, fingerprints)

    def presences(
        self, chains: Sequence[Sequence[str]], fingerprints: Sequence[str] | None = None
    ) -> list[list[bool]]:
        """Per chain, each block's presence under every fingerprint, in one round trip (for
        callers that need more than the leading run, e.g. a window at a chain's end)."""
        return self._inventory.presences(chains, fingerprints)

    def contains(self, hashes: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._inventory.exists(self.keys.blocks(hashes))]

    def block_info(
        self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> list[BlockInfo]:
        """Per block, in one round trip (``STRLEN`` and ``PTTL`` per key): whether it is present
        under every fingerprint, its stored bytes summed over them, and the shortest TTL left."""
        return self._inventory.block_info(hashes, fingerprints)

    def renew(self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None) -> int:
        """Give a chain's blocks this buffer's TTL again, counted from now, each a little shorter
        than its parent's as ``insert`` sets them (``PERSIST`` when the buffer has no TTL).
        Moves no data; returns how many keys' TTL changed (a missing key's never does)."""
        return self._inventory.renew(hashes, fingerprints)

    def survey(
        self,
        chains: Sequence[Sequence[str]],
        handoffs: Sequence[tuple[str, Sequence[str]]] = (),
        fingerprints: Sequence[str] | None = None,
    ) -> Survey:
        """``presences`` of ``chains``, ``read_handoffs`` of ``handoffs`` and the namespace's
        generation, all in one round trip."""
        parts = (self._inventory, self._handoffs, self._generations)
        return survey(self._transport, self.guard, self.keys, parts, chains, handoffs, fingerprints)

    # ------------------------------------------------------------------ generations
    @property
    def generation(self) -> int:
        """The namespace's generation as this buffer last read it (``read_generation``,
        ``survey``) or made it (``reset``): name blocks in it (``keys.block_name``)."""
        return self._generations.known

    def read_generation(self) -> int:
        """Read the namespace's generation (one round trip)."""
        return self._generations.read()

    def reset(self) -> int:
        """Invalidate every block of the namespace at once, every fingerprint's (O(1): one
        atomic increment of its generation); returns the new generation. Readers that name
        blocks by generation never look up an older block again; ``sweep`` reclaims them."""
        return self._generations.bump()

    def sweep(self, below: int | None = None, stop: Callable[[], bool] = lambda: False) -> int:
        """UNLINK the namespace's blocks of generations before ``below`` (default: the known
        generation) in bounded SCAN batches, never blocking the server; returns how many."""
        return self._generations.sweep(self.generation if below is None else below, stop)

    def delete(self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None) -> int:
        """Delete blocks (under each of ``fingerprints``, default this buffer's); returns how many
        keys existed."""
        fps: Sequence[str | None] = list(fingerprints) if fingerprints else [None]
        return self._inventory.delete([k for fp in fps for k in self.keys.blocks(hashes, fp)])

    # ------------------------------------------------------------------ handoffs
    def open_handoff(self, handoff_id: str, fingerprints: Sequence[str] | None = None) -> None:
        """Mark a handoff as being written (``SET ... NX``: never over a final count), so a
        consumer knows to wait for its commit record."""
        self._handoffs.open(handoff_id, fingerprints)

    def publish_handoff(self, handoff_id: str, num_blocks: int) -> None:
        """Record that the first ``num_blocks`` blocks of a handoff's chain are written (call it
        after their SETs were acknowledged); expires with the blocks, or after 10 minutes."""
        if num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, got {num_blocks}")
        self._handoffs.publish(handoff_id, num_blocks)

    def read_handoff(
        self, handoff_id: str, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> HandoffState:
        """One round trip: every rank's commit record, and how many leading blocks of ``hashes``
        are present under every fingerprint."""
        return self._handoffs.read([(handoff_id, hashes)], fingerprints)[0]

    def read_handoffs(
        self,
        handoffs: Sequence[tuple[str, Sequence[str]]],
        fingerprints: Sequence[str] | None = None,
    ) -> list[HandoffState]:
        """``read_handoff`` of many (handoff id, chain) pairs in one round trip."""
        return self._handoffs.read(handoffs, fingerprints)

    def claim_handoff(
        self, handoff_id: str, fingerprints: Sequence[str] | None = None, *, owner: str = ""
    ) -> Claim:
        """Take a committed handoff for ``owner`` (``SET ... XX PX GET`` on every rank's
        record): ``Claim.WON`` for exactly one owner, also when its claim is sent again;
        ``Claim.TAKEN`` when another owner took it first; ``Claim.UNCOMMITTED`` when a record is
        missing or still pending (nothing to take exclusively). A taken record says so for a
        minute, then expires."""
        return self._handoffs.claim(handoff_id, fingerprints, owner=owner)

    def delete_handoff(self, handoff_id: str, fingerprints: Sequence[str] | None = None) -> int:
        return self._handoffs.delete(handoff_id, fingerprints)

    # ------------------------------------------------------------------ counters
    def stats(self) -> StoreStats:
        snap = self._counters.snapshot()
        snap.breaker_opens = self.breaker.opens
        snap.recycled_buffers = self._transport.buffers.reused
        return snap
