"""LookupBuffer: vLLM's lookup-buffer layer (insert / drop_select) implemented on Redis/Valkey.

Redis semantics, one line each:
- ``insert``: ``SET key value [PX ttl]``; batches are pipelined, ``insert_async`` returns a Future.
- ``drop_select``: a Lua script (EVALSHA) that gets and deletes a batch atomically, so each stored
  value reaches exactly one caller; it can wait until every key is present.
- ``select``: the same script without the delete, for shared prefix reuse.
- ``longest_prefix``: a Lua script counting leading present blocks in one round trip.

A value that fails validation is never returned: it is a counted miss, logged once per key.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import torch
import xxhash

from .codec import CODECS, FORMAT_VERSION, decode_value, encode_value
from .connection import StoreAddress, make_client, parse_url, translated_errors
from .errors import CorruptValueError, InvalidArgumentError

logger = logging.getLogger("kvstore")

DEFAULT_KEY_PREFIX = "kv"
DEFAULT_MAX_VALUE_BYTES = 512 << 20  # Redis' own proto-max-bulk-len default
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")

# Claims blocks for one caller, atomically: each present key is RENAMEd to a key private to
# this call (ARGV[3] is a fresh suffix), which then expires after ARGV[4] ms unless the caller
# reads it first (it reads with GETDEL right after). Values never pass through Lua: returning a
# multi-MiB string from a script costs ~4x a plain GET. ARGV[1]: max bytes, ARGV[2]: "all" (claim
# nothing unless every key is present; reply nil) or "any". Reply: a [status, length] pair per
# key; status 1 claimed, 0 missing, 2 over the size limit (left in place), 3 not a string.
_CLAIM_LUA = """
local maxlen = tonumber(ARGV[1])
local out = {}
local missing = false
for i, k in ipairs(KEYS) do
  local n = redis.pcall('STRLEN', k)
  if type(n) == 'table' then
    out[2 * i - 1] = 3; out[2 * i] = 0
  elseif n == 0 then
    out[2 * i - 1] = 0; out[2 * i] = 0; missing = true
  elseif n > maxlen then
    out[2 * i - 1] = 2; out[2 * i] = n
  else
    out[2 * i - 1] = 1; out[2 * i] = n
  end
end
if missing and ARGV[2] == 'all' then return false end
for i, k in ipairs(KEYS) do
  if out[2 * i - 1] == 1 then
    local claim = k .. ':claim:' .. ARGV[3]
    redis.call('RENAME', k, claim)
    redis.call('PEXPIRE', claim, ARGV[4])
  end
end
return out
"""
CLAIM_MARKER = ":claim:"
_CLAIM_TTL_MS = 60_000

# Keys come grouped by block (ARGV[1] keys per block, e.g. one per tensor-parallel rank); a block
# counts only when all its keys exist. Returns the number of leading complete blocks.
_LONGEST_PREFIX_LUA = """
local per = tonumber(ARGV[1])
local n = 0
for i = 1, #KEYS, per do
  for j = i, i + per - 1 do
    if redis.call('EXISTS', KEYS[j]) == 0 then return n end
  end
  n = n + 1
end
return n
"""


# Scratch memory kept per thread for framing values in insert_many (see there).
_SCRATCH_LIMIT = 64 << 20


def layout_fingerprint(layout: Mapping[str, Any] | None = None) -> str:
    """16 hex chars naming everything that makes stored bytes (in)compatible: model, dtype, KV
    geometry, tensor-parallel rank and size, ... plus the value format version."""
    doc = {"format": FORMAT_VERSION, **dict(layout or {})}
    return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True, default=str).encode())


@dataclass
class StoreStats:
    """Counters since the buffer was created (a snapshot; see ``LookupBuffer.stats``)."""

    inserts: int = 0
    insert_errors: int = 0
    hits: int = 0
    misses: int = 0
    bytes_out: int = 0  # written to Redis
    bytes_in: int = 0  # read from Redis (valid values only)
    corrupt: int = 0
    corrupt_by_reason: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
        compression: str = "none",
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        safe_url: str = "redis",
        io_threads: int = 4,
    ) -> None:
        for what, name in (("namespace", namespace), ("key_prefix", key_prefix)):
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise InvalidArgumentError(
                    f"{what} must be non-empty and use only letters, digits, '_', '.', '-': "
                    f"got {name!r}"
                )
        if compression not in CODECS:
            raise InvalidArgumentError(f"compression must be one of {CODECS}, got {compression!r}")
        if ttl_s is not None and ttl_s < 0:
            raise InvalidArgumentError(f"ttl_s must be >= 0 or None, got {ttl_s}")
        if max_value_bytes <= 0:
            raise InvalidArgumentError("max_value_bytes must be positive")
        if fingerprint is not None and layout is not None:
            raise InvalidArgumentError("give fingerprint or layout, not both")
        self._client = client
        self.namespace = namespace
        self.fingerprint = fingerprint or layout_fingerprint(layout)
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.compression = compression
        self.max_value_bytes = max_value_bytes
        self.key_prefix = key_prefix
        self.safe_url = safe_url
        self._claim = client.register_script(_CLAIM_LUA)
        self._longest = client.register_script(_LONGEST_PREFIX_LUA)
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._logged_bad: OrderedDict[str, None] = OrderedDict()
        self._local = threading.local()

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
        connect_timeout_s: float = 3.0,
        max_connections: int = 32,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_verify: bool | None = None,
        io_threads: int = 4,
        check: bool = True,
    ) -> LookupBuffer:
        """Connect to ``url``. With ``check`` (default) the server is pinged now, so a wrong URL,
        a server that is down or a wrong password fails here with a typed error."""
        address: StoreAddress = parse_url(url)
        client = make_client(
            address,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max(max_connections, io_threads + 2),
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            tls_verify=tls_verify,
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
        )
        if check:
            buf.ping()
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
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._client.close()

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for tools; prefer the methods above)."""
        return self._client

    def ping(self) -> None:
        with translated_errors(self.safe_url):
            self._client.ping()

    # ------------------------------------------------------------------ keys
    def key_pattern(self, fingerprint: str | None = None) -> str:
        """The SCAN/redis-cli pattern of this buffer's keys."""
        return f"{self.key_prefix}:{self.namespace}:{fingerprint or self.fingerprint}:*"

    def redis_key(self, block_hash: str, fingerprint: str | None = None) -> str:
        """The full Redis key of a block, e.g. for ``redis-cli GETRANGE <key> 0 400``."""
        if not isinstance(block_hash, str) or not block_hash or not _NAME_RE.match(block_hash):
            raise InvalidArgumentError(
                f"a block hash must be a non-empty str of letters/digits, got {block_hash!r}"
            )
        return f"{self.key_prefix}:{self.namespace}:{fingerprint or self.fingerprint}:{block_hash}"

    def _keys(self, hashes: Sequence[str], fingerprint: str | None = None) -> list[str]:
        if isinstance(hashes, str) or not isinstance(hashes, Sequence):
            raise InvalidArgumentError(
                f"expected a list of block hashes, got {type(hashes).__name__}"
            )
        if not hashes:
            raise InvalidArgumentError("the list of block hashes is empty")
        return [self.redis_key(h, fingerprint) for h in hashes]

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
        self.redis_key(block_hash)  # validates the hash
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
        """Pipelined ``SET`` of several blocks in one round trip.

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

    def insert_encoded(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Pipelined ``SET`` of values made by :meth:`encode`."""
        encoded = [(self.redis_key(h), v) for h, v in items]
        if not encoded:
            return
        nbytes = sum(len(v) for _, v in encoded)
        try:
            with translated_errors(self.safe_url):
                if len(encoded) == 1:
                    self._client.set(encoded[0][0], encoded[0][1], px=self.ttl_ms)
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for key, value in encoded:
                        pipe.set(key, value, px=self.ttl_ms)
                    pipe.execute()
        except Exception:
            with self._lock:
                self._stats.insert_errors += len(encoded)
            raise
        with self._lock:
            self._stats.inserts += len(encoded)
            self._stats.bytes_out += nbytes

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
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kvstore")
            return self._executor

    # ------------------------------------------------------------------ lookups
    def select(
        self, hashes: Sequence[str], *, copy: bool = True
    ) -> list[dict[str, torch.Tensor] | None]:
        """Read blocks without deleting them. ``None`` where a block is missing or invalid.

        Each read is a ``GETRANGE key 0 max_value_bytes``, so an oversized value is never
        allocated in full. With ``copy=False`` uncompressed tensors are read-only views on the
        received bytes.
        """
        keys = self._keys(hashes)
        with translated_errors(self.safe_url):
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.getrange(k, 0, self.max_value_bytes)
            replies = pipe.execute(raise_on_error=False)
        raw: list[Any] = []
        for r in replies:
            if isinstance(r, Exception):
                if not str(r).startswith("WRONGTYPE"):
                    with translated_errors(self.safe_url):
                        raise r
                raw.append(-1)
            elif not r:
                raw.append(None)
            elif len(r) > self.max_value_bytes:
                raw.append(len(r))
            else:
                raw.append(r)
        return self._decode_all(hashes, keys, raw, copy)

    def drop_select(
        self, hashes: Sequence[str], timeout_s: float = 0.0, *, copy: bool = True
    ) -> list[dict[str, torch.Tensor] | None]:
        """Atomically get and delete blocks; each stored value is delivered to exactly one caller.

        A Lua script claims the present keys for this call (atomic ``RENAME`` to a private key),
        then one pipelined ``GETDEL`` fetches them. With ``timeout_s > 0`` it waits (polling with
        backoff up to 20 ms) until *every* key is present and claims them all at once; when the
        time runs out it takes what is there.
        """
        keys = self._keys(hashes)
        if timeout_s < 0:
            raise InvalidArgumentError(f"timeout_s must be >= 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        suffix = uuid.uuid4().hex
        with translated_errors(self.safe_url):
            while True:
                waiting = time.monotonic() < deadline
                claimed = self._claim(
                    keys=keys,
                    args=[self.max_value_bytes, "all" if waiting else "any", suffix, _CLAIM_TTL_MS],
                )
                if claimed is not None:
                    break
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, 0.02)
            statuses = claimed[0::2]
            pipe = self._client.pipeline(transaction=False)
            for k, status in zip(keys, statuses, strict=True):
                if status == 1:
                    pipe.getdel(k + CLAIM_MARKER + suffix)
            values = iter(pipe.execute() if any(s == 1 for s in statuses) else [])
        raw: list[Any] = []
        for status, length in zip(statuses, claimed[1::2], strict=True):
            if status == 1:
                raw.append(next(values))
            elif status == 2:
                raw.append(int(length))
            elif status == 3:
                raw.append(-1)
            else:
                raw.append(None)
        return self._decode_all(hashes, keys, raw, copy)

    def longest_prefix(
        self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` are present, in one round trip.

        With ``fingerprints`` (e.g. one per tensor-parallel rank) a block counts only when it is
        present under every fingerprint. An empty ``hashes`` gives 0.
        """
        if not hashes:
            return 0
        fps = list(fingerprints) if fingerprints else [self.fingerprint]
        keys = [self.redis_key(h, fp) for h in hashes for fp in fps]
        with translated_errors(self.safe_url):
            return int(self._longest(keys=keys, args=[len(fps)]))

    def contains(self, hashes: Sequence[str]) -> list[bool]:
        keys = self._keys(hashes)
        with translated_errors(self.safe_url):
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]

    def delete(self, hashes: Sequence[str], fingerprints: Sequence[str] | None = None) -> int:
        """Delete blocks (under each of ``fingerprints``, default this buffer's); returns how many
        keys existed."""
        fps: Sequence[str | None] = list(fingerprints) if fingerprints else [None]
        keys = [k for fp in fps for k in self._keys(hashes, fp)]
        with translated_errors(self.safe_url):
            return int(self._client.unlink(*keys))

    # ------------------------------------------------------------------ counters
    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{**asdict(self._stats)})
            snap.corrupt_by_reason = dict(self._stats.corrupt_by_reason)
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
                        f"{value} bytes exceeds max_value_bytes={self.max_value_bytes}",
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
