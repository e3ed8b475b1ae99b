"""Keys matching a pattern, walked with SCAN a page at a time within the bound on control
replies (``bounded_replies.MAX_CONTROL_REPLY_BYTES``).

Anyone who may write keys under a pattern chooses their names' lengths: 600 names of 8 KiB made
every page of 1,000 a reply over the bound, and every sweep, ``ls``, ``stats`` and ``flush``
of the keyspace failed (a review). A page over the bound is asked for again, from the same
cursor, ten times smaller, down to one key; only a single key name over the bound stops the
walk, with a typed error that says how to remove it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from kvstore.errors import StoreReplyTooLargeError
from kvstore.net.bounded_replies import MAX_CONTROL_REPLY_BYTES, ReplyTooLarge

T = TypeVar("T")

# keys a SCAN page asks for: 100 names of up to ~40 KiB each fit the bound
SCAN_COUNT = 100
# how often a Cluster walk looks again for masters it has not walked (one added meanwhile)
_MAP_ROUNDS = 3


def _direct(command: str, fn: Callable[[], T]) -> T:
    return fn()


def scan_keys(
    client: redis.Redis,
    match: str | bytes,
    count: int = SCAN_COUNT,
    call: Callable[[str, Callable[[], Any]], Any] = _direct,
) -> Iterator[bytes]:
    """Each key matching ``match`` (its bytes), as SCAN finds them (a key may come twice, as
    SCAN promises), on every master of a Cluster. ``call(command, fn)`` runs each page's round
    trip (a ``Guard``'s, for typed errors and the circuit breaker). Raises
    :class:`StoreReplyTooLargeError` for a key name longer than the bound."""
    if not isinstance(client, RedisCluster):
        yield from _scan_node(client, None, match, count, call)
        return
    # the masters as they are now, not as the client learned them: a master added since
    # (scale-out) was never walked -- a review's reset sweep left its old generation there --
    # and again after the walk, for one added meanwhile
    walked: set[str] = set()
    for _ in range(_MAP_ROUNDS):
        call("CLUSTER SLOTS", client.nodes_manager.initialize)
        nodes = [node for node in client.get_primaries() if node.name not in walked]
        if not nodes:
            return
        for node in nodes:
            walked.add(node.name)
            yield from _scan_node(client, node, match, count, call)


def _scan_node(
    client: redis.Redis,
    node: Any,
    match: str | bytes,
    count: int,
    call: Callable[[str, Callable[[], Any]], Any],
) -> Iterator[bytes]:
    cursor, page = 0, count
    while True:
        try:
            cursor, keys = call("SCAN", functools.partial(_page, client, node, cursor, match, page))
        except (ReplyTooLarge, StoreReplyTooLargeError):
            if page == 1:
                shown = match if isinstance(match, str) else match.decode(errors="replace")
                raise StoreReplyTooLargeError(
                    f"a key name matching {shown!r} is longer than {MAX_CONTROL_REPLY_BYTES} "
                    "bytes (not one kvstore writes: someone with write access planted it), so "
                    "SCAN cannot walk past it here; find it with `redis-cli --scan --pattern "
                    f"'{shown}' | awk 'length > 1000000'` and UNLINK it"
                ) from None
            page = max(1, page // 10)
            continue
        for key in keys:
            yield key if isinstance(key, bytes) else str(key).encode()
        # back up to the full page slowly: long names come in runs, and each page over the
        # bound costs 4 MiB and a connection (going straight back cost 10x the names' bytes)
        page = min(count, page * 2)
        if int(cursor) == 0:
            return


def _page(
    client: redis.Redis, node: Any, cursor: int, match: str | bytes, count: int
) -> tuple[int, list]:
    if node is None:
        return client.scan(cursor, match=match, count=count)
    # (a Cluster answers with each node's cursor by name: one node here)
    cursors, keys = client.scan(cursor, match=match, count=count, target_nodes=node)
    named: dict[str, int] = cursors  # type: ignore[assignment]
    return next(iter(named.values())), keys
