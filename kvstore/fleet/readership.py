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

What the idle times do not survive: a restart resets them unless the policy is an LRU one
(only then does the RDB keep them), so blocks older than the server's uptime are not counted
there; and a replica's count from when it applied each write (reads on the master are not
replicated), so after a failover every block looks unread until it is read again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rex
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


def readership(
    idle_s: object, age_s: float | None, kept_since_s: float | None = None
) -> Readership:
    """A block's readership from ``OBJECT IDLETIME``'s reply and its age in seconds; unknown
    when older than ``kept_since_s``, how long the server has kept idle times (its uptime,
    when a restart did not keep them; None: always)."""
    if not isinstance(idle_s, int) or isinstance(idle_s, bool) or age_s is None:
        return Readership.UNKNOWN
    # (the uptime is whole seconds and the age the writer's clock: a block written within a
    # second of the start was taken for one written before it -- a review's -- so the same
    # slack as below)
    if kept_since_s is not None and age_s > kept_since_s + LRU_SLACK_S:
        return Readership.UNKNOWN  # written before a restart that reset its idle time
    return Readership.READ if idle_s < age_s - LRU_SLACK_S else Readership.UNREAD


class NoTouch(enum.Enum):
    """Whether a server kept a listing's own reads off its LRU clocks."""

    KEPT = "kept"
    UNSUPPORTED = "unsupported"  # Redis before 7.2: the keys read look read now
    REFUSED = "refused"  # this user may not run CLIENT NO-TOUCH: the same


@dataclass(frozen=True)
class ServerReplies:
    """One server's part of a listing's batch."""

    indexes: list[int]  # of the keys it answered for, in the batch
    replies: list[Any]  # what ``fill`` asked for, key by key (exceptions in place of errors)
    now_s: float | None  # the server's clock when it answered (None: TIME refused)
    no_touch: NoTouch
    # how long the server has kept idle times: its uptime unless its policy is an LRU one
    # (the RDB keeps them then); None: for good, or not known (INFO refused)
    kept_since_s: float | None


@dataclass
class Listed:
    """A batch's replies per server, and the keys whose slot moved away until the end."""

    parts: list[ServerReplies]
    moved: list[int]


# a Cluster's slot map refreshed and the moved keys asked again at most this often per batch
REDIRECT_PASSES = 3


def untouched_pipelines(
    client: redis.Redis, keys: Sequence[bytes], fill: Callable[[Any, bytes], None], per_key: int
) -> Listed:
    """For each server holding some of ``keys`` (one for a standalone or Sentinel client, each
    master's for a Cluster), the ``per_key`` replies ``fill(pipe, key)`` asked for, sent after
    ``CLIENT NO-TOUCH ON``. The pipeline runs on one connection, so the setting covers exactly
    its own commands; ages are measured on the server's clock, as its idle times are. A
    Cluster key whose slot moved (MOVED, ASK) is asked again after the slot map is refreshed."""
    out = Listed([], [])
    pending = list(range(len(keys)))
    for _ in range(REDIRECT_PASSES):
        out.moved = []
        for node_client, indexes in _by_server(client, keys, pending):
            part, moved = _ask(node_client, keys, indexes, fill, per_key)
            out.parts.append(part)
            out.moved += moved
        if not out.moved or not isinstance(client, RedisCluster):
            break
        client.nodes_manager.initialize()  # where the slots are now
        pending = out.moved
    return out


def _by_server(
    client: redis.Redis, keys: Sequence[bytes], indexes: list[int]
) -> list[tuple[redis.Redis, list[int]]]:
    if not isinstance(client, RedisCluster):
        return [(client, indexes)]
    groups: dict[int, tuple[redis.Redis, list[int]]] = {}
    for i in indexes:
        node = client.get_node_from_key(keys[i])
        node_client = node.redis_connection if node is not None else None
        if node_client is None:  # (a node not yet connected: redis-py connects it)
            node_client = client.get_redis_connection(node)
        groups.setdefault(id(node_client), (node_client, []))[1].append(i)
    return list(groups.values())


def _ask(
    node_client: redis.Redis,
    keys: Sequence[bytes],
    indexes: list[int],
    fill: Callable[[Any, bytes], None],
    per_key: int,
) -> tuple[ServerReplies, list[int]]:
    pipe = node_client.pipeline(transaction=False)
    pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
    pipe.time()
    pipe.info("server")
    pipe.info("memory")
    for i in indexes:
        fill(pipe, keys[i])
    pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")  # the pooled connection as it was
    replies = pipe.execute(raise_on_error=False)
    switch, clock, server, memory = replies[:4]
    body = replies[4:-1]
    kept, answered, moved = [], [], []
    for n, i in enumerate(indexes):
        mine = body[per_key * n : per_key * (n + 1)]
        if any(isinstance(r, rex.MovedError | rex.AskError) for r in mine):
            moved.append(i)
        else:
            kept.append(i)
            answered += mine
    if not isinstance(switch, Exception):
        no_touch = NoTouch.KEPT
    elif isinstance(switch, rex.NoPermissionError):
        no_touch = NoTouch.REFUSED
    else:
        no_touch = NoTouch.UNSUPPORTED
    now_s = clock[0] + clock[1] / 1e6 if isinstance(clock, tuple | list) else None
    kept_since_s = None
    if isinstance(server, dict) and isinstance(memory, dict):
        policy = str(memory.get("maxmemory_policy", ""))
        uptime = server.get("uptime_in_seconds")
        if "lru" not in policy and isinstance(uptime, int | float):
            kept_since_s = float(uptime)
    return ServerReplies(kept, answered, now_s, no_touch, kept_since_s), moved
