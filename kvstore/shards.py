"""Which server holds a key: the one server behind a standalone or Sentinel URL, or, in a
Redis/Valkey Cluster, the master that serves the key's slot.

The lookup buffer reads and writes values on raw pooled connections (see ``wire``), so it must
route them itself: redis-py's cluster client routes only the commands it sends. A reply of
``MOVED`` / ``ASK`` (the slot moved, or is moving) marks the item :data:`REDIRECTED`; the
caller sends it again through redis-py, which follows redirections and relearns the slot map.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final

import redis
import redis.exceptions as rex
from redis.cluster import RedisCluster

logger = logging.getLogger("kvstore")


class _Redirected:
    def __repr__(self) -> str:
        return "REDIRECTED"


# An item the server said lives elsewhere (MOVED / ASK): to be sent again through redis-py.
REDIRECTED: Final = _Redirected()


def is_redirect(exc: BaseException) -> bool:
    return isinstance(exc, rex.AskError)  # MovedError is an AskError


class Shards:
    """Groups keys by the server that holds them, for fanning a batch out over shards."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)

    def split(self, keys: Sequence[str | bytes]) -> list[tuple[redis.Redis, list[int]]]:
        """The indexes of ``keys`` grouped by server (a client of that server each), in key
        order within a group. One group, the client itself, when this is not a Cluster."""
        if not self.cluster:
            return [(self.client, list(range(len(keys))))]
        cluster: Any = self.client
        nodes = cluster.nodes_manager
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        for i, key in enumerate(keys):
            node = nodes.get_node_from_slot(cluster.keyslot(key))
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (cluster.get_redis_connection(node), [])
            group[1].append(i)
        return list(groups.values())

    def slot(self, key: str | bytes) -> int:
        return int(self.client.keyslot(key)) if self.cluster else 0  # type: ignore[attr-defined]

    def relearn(self) -> None:
        """After a node failed: fetch the slot map again (a replica may have been promoted).
        Best effort; the next call fails typed if the cluster is still down."""
        if not self.cluster:
            return
        try:
            self.client.nodes_manager.initialize()  # type: ignore[attr-defined]
        except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
            logger.debug("kvstore: could not relearn the cluster's slot map yet: %s", exc)
