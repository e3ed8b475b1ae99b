"""Which stored blocks were read since they were written, as the server itself knows it.

A save pays only if some instance loads the block before it expires or is evicted. No
instance can tell that of the fleet, but the server can: a key's LRU clock (``OBJECT
IDLETIME``) moves on every read (``GET``, ``GETRANGE``) and not on the lookups' ``EXISTS`` or
on ``PTTL``, and a value's header says when it was written. A block idle for about its whole
age was never read; one idle for less was. ``kvstore ls`` counts both per namespace, and the
bytes held by blocks nobody read.

Looking must not count as reading: the listing reads each value's header, so its pipelines
first send ``CLIENT NO-TOUCH ON`` (Redis 7.2+, Valkey), which keeps its own reads off the
LRU clocks, and with them off LRU eviction's order. An older server refuses it: the figures of
that listing are still right (each key's idle time is asked before its header is read), but
the keys it read then look freshly read to the next listing and to LRU eviction, which the
listing says. Under an LFU policy the server keeps no idle times, and nothing is counted.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

# The LRU clock counts whole seconds and is refreshed ten times a second, so a block never
# read can show up to ~1.1 s less idle time than its age; 2 s more than covers it (and a few
# ms of clock difference between the writer's host and the server). The price: a block read
# within 2 s of being written counts as unread, which a prefix worth keeping outlives.
LRU_SLACK_S = 2.0


class Readership(enum.Enum):
    READ = "read"  # read at least once since written (a load, a probe, a warm renewal)
    UNREAD = "unread"  # idle for its whole age: nobody read it
    UNKNOWN = "unknown"  # no idle time (LFU policy, refused) or no creation time in its header


def readership(idle_s: object, age_s: float | None) -> Readership:
    """A block's readership from ``OBJECT IDLETIME``'s reply and its age in seconds."""
    if not isinstance(idle_s, int) or isinstance(idle_s, bool) or age_s is None:
        return Readership.UNKNOWN
    return Readership.READ if idle_s < age_s - LRU_SLACK_S else Readership.UNREAD


@dataclass(frozen=True)
class ServerReplies:
    """One server's part of a listing's batch."""

    indexes: list[int]  # of the keys it holds, in the batch
    replies: list[Any]  # what ``fill`` asked for, key by key (exceptions in place of errors)
    now_s: float | None  # the server's clock when it answered (None: TIME refused)
    touched: bool  # it refused CLIENT NO-TOUCH: the keys read look read now


def untouched_pipelines(
    client: redis.Redis, keys: Sequence[bytes], fill: Callable[[Any, bytes], None]
) -> Iterator[ServerReplies]:
    """For each server holding some of ``keys`` (one for a standalone or Sentinel client, each
    master's for a Cluster), the replies ``fill(pipe, key)`` asked for, sent after ``CLIENT
    NO-TOUCH ON``. The pipeline runs on one connection, so the setting covers exactly its own
    commands; ages are measured on the server's clock, as its idle times are."""
    groups: dict[int, tuple[redis.Redis, list[int]]] = {}
    if isinstance(client, RedisCluster):
        for i, key in enumerate(keys):
            node = client.get_node_from_key(key)
            node_client = node.redis_connection if node is not None else None
            if node_client is None:  # (a node not yet connected: redis-py connects it)
                node_client = client.get_redis_connection(node)
            groups.setdefault(id(node_client), (node_client, []))[1].append(i)
    else:
        groups[0] = (client, list(range(len(keys))))
    for node_client, indexes in groups.values():
        pipe = node_client.pipeline(transaction=False)
        pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
        pipe.time()
        for i in indexes:
            fill(pipe, keys[i])
        pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")  # the pooled connection as it was
        replies = pipe.execute(raise_on_error=False)
        clock = replies[1]
        now_s = clock[0] + clock[1] / 1e6 if isinstance(clock, tuple | list) else None
        yield ServerReplies(indexes, replies[2:-1], now_s, isinstance(replies[0], Exception))
