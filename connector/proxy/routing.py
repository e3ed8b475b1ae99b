"""Cache-aware routing for the proxy: which instance likely holds a prompt's prefix in its GPU
cache, learned from the KV events each instance publishes (vLLM's ``--kv-events-config``
ZMQ publisher), with least-loaded as the fallback. Redis covers the rest: an instance that
misses in its GPU cache loads what the store has. Each role's servers are a :class:`Pool`, which
orders them for a request by its policy (round-robin, least-loaded or cache-aware).

An instance's index maps (parent block hash, block tokens, LoRA and extra keys) to the block's
hash, so a plain-text prompt is matched by walking its blocks from the first: no need to
recompute vLLM's hashes (which depend on its hash algorithm and seed). A prompt with a LoRA,
a cache salt or images keys its blocks differently and is not matched (routed by load). Only
GPU-medium events of the first KV-cache group count (a hybrid model's other groups have other
block sizes); the connector's own events (``medium="CPU"``, ``locality="REMOTE"``) name blocks
every instance of the namespace can load, so they say nothing about where to route. The index
is a hint: bounded (oldest blocks dropped first); a missed event (a sequence gap) is counted, a
publisher that restarted (its sequence went back) empties the index, and a message that does
not decode is counted and skipped.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from connector.logs import FailureCounts, log_bug
from kvstore.net.connection import redact_url

logger = logging.getLogger(__name__)
_BUGS = FailureCounts()  # unexpected exceptions, logged sparsely (``logs.log_bug``)

_GPU_MEDIA = (None, "GPU")


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one published ``KVEventBatch`` (msgpack: ``[ts, events, dp_rank]``, each
    event a map tagged ``"type"``), decoded without vLLM: a router need not install it."""
    batch = msgspec.msgpack.decode(payload)
    events = batch[1] if isinstance(batch, list) and len(batch) > 1 else []
    return [e for e in events if isinstance(e, dict) and "type" in e]


def _key(h: Any) -> Hashable:
    """A hash or extra key as decoded from msgpack, made hashable (lists become tuples). Only
    what vLLM's events hold: a map passed through unhashable, was indexed, and every later
    request whose prompt reached it failed with a TypeError (a review's poisoned feed)."""
    if isinstance(h, (bytes, bytearray)):
        return bytes(h)
    if isinstance(h, (list, tuple)):
        return tuple(_key(x) for x in h)
    if h is None or isinstance(h, (int, float, str)):
        return h
    raise ValueError(f"a block hash or key of type {type(h).__name__}")


_BlockKey = tuple[Hashable, tuple[int, ...], Hashable]  # (parent hash, tokens, LoRA + extras)


class PrefixIndex:
    """One instance's GPU-cached blocks."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._hash_of: OrderedDict[_BlockKey, Hashable] = OrderedDict()
        self._key_of: dict[Hashable, _BlockKey] = {}
        self.block_size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._hash_of)

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        with self._lock:
            if kind == "AllBlocksCleared":
                self._hash_of.clear()
                self._key_of.clear()
            elif event.get("medium") not in _GPU_MEDIA or event.get("group_idx") not in (None, 0):
                return
            elif kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for h in [_key(h) for h in event["block_hashes"]]:
                    self._forget(h)

    def _forget(self, h: Hashable) -> None:
        key = self._key_of.pop(h, None)
        if key is not None and self._hash_of.get(key) == h:  # not re-stored under another hash
            del self._hash_of[key]

    def _stored(self, event: dict[str, Any]) -> None:
        # all of it checked before any of it is indexed (an event that fails is dropped whole)
        bs = int(event["block_size"])
        tokens = event["token_ids"]
        hashes = [_key(h) for h in event["block_hashes"]]
        extras = [_key(e) for e in event.get("extra_keys") or []]
        lora = event.get("lora_name")
        parent = _key(event.get("parent_block_hash"))
        if bs <= 0 or not isinstance(tokens, list) or not isinstance(lora, (str, type(None))):
            raise ValueError("a BlockStored event of the wrong shape")
        if not all(isinstance(t, int) for t in tokens):
            raise ValueError("a BlockStored event whose token ids are not integers")
        if bs < self.block_size:
            # a partial block: vLLM caches a KV block's first tokens at its (finer) hash block
            # size and says so with this block's token count. A lookup counts whole blocks
            # only, so it is not indexed, and the index keeps its block size
            return
        if bs > self.block_size:
            # whole blocks are the largest an instance announces: what came before was
            # partial blocks, indexed under a size no lookup uses
            self._hash_of.clear()
            self._key_of.clear()
            self.block_size = bs
        for i, h in enumerate(hashes):
            extra = extras[i] if i < len(extras) else None
            key: _BlockKey = (parent, tuple(tokens[i * bs : (i + 1) * bs]), (lora, extra))
            parent = h
            old = self._hash_of.get(key)
            if old is not None and old != parent:
                self._key_of.pop(old, None)
            self._hash_of[key] = parent
            self._hash_of.move_to_end(key)
            self._key_of[parent] = key
        while len(self._hash_of) > self.max_blocks:
            oldest, h = self._hash_of.popitem(last=False)
            if self._key_of.get(h) == oldest:
                del self._key_of[h]

    def clear(self) -> None:
        with self._lock:
            self._hash_of.clear()
            self._key_of.clear()

    def cached_blocks(self, token_ids: Sequence[int]) -> int:
        """How many leading blocks of ``token_ids`` the instance holds, as far as it said."""
        bs = self.block_size
        if not bs:
            return 0
        parent: Hashable = None
        with self._lock:
            for n in range(len(token_ids) // bs):
                key: _BlockKey = (parent, tuple(token_ids[n * bs : (n + 1) * bs]), (None, None))
                h = self._hash_of.get(key)
                if h is None:
                    return n
                parent = h
            return len(token_ids) // bs


class EventFeed:
    """Subscribes to one instance's ZMQ KV-event publisher and applies each batch to its
    index, on a thread of its own. A gap in the sequence numbers (events dropped by a slow
    subscriber, or published before it joined) is counted in ``gaps``."""

    def __init__(self, endpoint: str, index: PrefixIndex, topic: str = "") -> None:
        self.endpoint = endpoint
        self.index = index
        self.topic = topic
        self.gaps = 0
        self.batches = 0
        self.undecodable = 0
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.connect(self.endpoint)
            sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
            last = -1
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    seq = int.from_bytes(frames[1], "big")
                    events = decode_batch(frames[2])
                    for event in events:
                        self.index.apply(event)
                except Exception as exc:  # one bad message never stops the feed
                    self.undecodable += 1
                    if self.undecodable & (self.undecodable - 1) == 0:  # 1, 2, 4, ...
                        logger.warning(
                            "KV events from %s: %d message(s) skipped, e.g. %r",
                            self.endpoint,
                            self.undecodable,
                            exc,
                        )
                    continue
                if last >= 0 and seq <= last:  # the publisher restarted: its cache is new
                    self.restarts += 1
                    self.index.clear()
                    for event in events:
                        self.index.apply(event)
                elif last >= 0 and seq != last + 1:
                    self.gaps += 1
                last = seq
                self.batches += 1
        except Exception:  # reported: routing falls back to least-loaded for this instance
            logger.exception("KV events from %s: the feed stopped", self.endpoint)
        finally:
            self.index.clear()  # nothing more is learned: a frozen index would mislead
            sock.close(linger=0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


class CacheAwareChooser:
    """Orders a pool's servers for one prompt: the one holding the longest prefix first,
    unless it is busier than the least-loaded by more than ``max_imbalance`` requests; ties
    and misses go to the least loaded."""

    def __init__(
        self,
        indexes: dict[str, PrefixIndex],
        in_flight: Callable[[str], int],
        max_imbalance: int = 4,
    ) -> None:
        self.indexes = indexes
        self.in_flight = in_flight
        self.max_imbalance = max_imbalance
        self.routed_by_cache = 0

    def order(self, urls: list[str], token_ids: Sequence[int] | None) -> list[str]:
        by_load = sorted(urls, key=self.in_flight)
        if not token_ids:
            return by_load
        cached = {
            u: self.indexes[u].cached_blocks(token_ids) if u in self.indexes else 0 for u in urls
        }
        best = max(by_load, key=lambda u: cached[u])  # the least loaded among the best
        if (
            cached[best] == 0
            or self.in_flight(best) - self.in_flight(by_load[0]) > self.max_imbalance
        ):
            return by_load
        self.routed_by_cache += 1
        return [best] + [u for u in by_load if u != best]


@dataclass
class Pool:
    """One role's servers and how the next one is chosen."""

    role: str
    urls: list[str]
    policy: str = "round_robin"
    in_flight: dict[str, int] = field(default_factory=dict)
    chooser: CacheAwareChooser | None = None  # policy cache_aware
    # servers that refused a connection or did not accept one in time: sent nothing while
    # another is up, probed in the background until they answer (``backends.py``)
    down: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in self.urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._rr = itertools.cycle(range(len(self.urls)))

    def order(self, token_ids: list[int] | None = None) -> list[str]:
        """Every server once, best first; servers marked down last (tried only when every
        other one failed too)."""
        chosen = self._by_policy(token_ids)
        if not self.down:
            return chosen
        return [u for u in chosen if u not in self.down] + [u for u in chosen if u in self.down]

    def _by_policy(self, token_ids: list[int] | None) -> list[str]:
        if self.chooser is not None:
            try:
                return self.chooser.order(self.urls, token_ids)
            except Exception as exc:  # a bug: routed by load instead, never a failed request
                log_bug(_BUGS, logger, "cache-aware", exc, "choosing a server by its cache")
        if self.chooser is not None or self.policy == "least_loaded":
            return sorted(self.urls, key=lambda u: self.in_flight[u])
        start = next(self._rr)
        return self.urls[start:] + self.urls[:start]


def index_servers(pools: Iterable[Pool], events: dict[str, str]) -> dict[str, PrefixIndex]:
    """Policy cache_aware: a prefix index for each server that publishes ``events`` (server
    URL -> endpoint), and each pool's chooser reading them. ``ValueError`` if ``events`` names
    a server no pool sends to."""
    indexes: dict[str, PrefixIndex] = {}
    for pool in pools:
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
    return indexes


def routing_report(
    policy: str, feeds: dict[str, EventFeed], pools: Iterable[Pool]
) -> dict[str, Any]:
    """What cache-aware routing knows (``GET /kv/routing``): blocks indexed and each feed's
    health per server, and the requests each role routed by cache."""
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
    routed = {p.role: p.chooser.routed_by_cache for p in pools if p.chooser}
    return {"policy": policy, "servers": servers, "routed_by_cache": routed}
