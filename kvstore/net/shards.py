"""Which server holds a key -- the one server behind a standalone or Sentinel URL, or, in a
Redis/Valkey Cluster, the master that serves the key's slot -- and running one batch over all
of them in parallel (:meth:`Shards.fan_out`).

The lookup buffer reads and writes values on raw pooled connections (see ``wire``), so it must
route them itself: redis-py's cluster client routes only the commands it sends. A reply of
``MOVED`` / ``ASK`` (the slot moved, or is moving) marks the item :data:`REDIRECTED`; the
caller sends it again through redis-py, which follows redirections and relearns the slot map.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Final, TypeVar

import redis
import redis.exceptions as rex
from redis.cluster import RedisCluster

from kvstore.net.wire import deadline_passed
from kvstore.text import printable

logger = logging.getLogger("kvstore")

T = TypeVar("T")


class _Redirected:
    def __repr__(self) -> str:
        return "REDIRECTED"


# An item the server said lives elsewhere (MOVED / ASK): to be sent again through redis-py.
REDIRECTED: Final = _Redirected()


def is_redirect(exc: BaseException) -> bool:
    return isinstance(exc, rex.AskError)  # MovedError is an AskError


class Shards:
    """Groups keys by the server that holds them, for fanning a batch out over shards."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        others: Sequence[redis.Redis] = (),
        threads: int = 8,
        name: str = "kvstore-fanout",
    ) -> None:
        self.client = client
        # clients of the same servers with their own slot maps (the control client)
        self._others = [c for c in others if c is not client]
        self.cluster = isinstance(client, RedisCluster)
        self._threads = threads
        self._name = name  # the threads' name prefix
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._relearning: threading.Event | None = None  # set when the relearn under way ends

    def fan_out(
        self,
        run: Callable[[redis.Redis, list[Any]], list[T]],
        work: Sequence[Any],
        *,
        key: Callable[[Any], str | bytes],
        connections: int = 1,
        deadline: float = math.inf,
    ) -> list[T]:
        """``run(server, part)`` over ``work`` grouped by the server holding each item's
        ``key`` (one group unless this is a Cluster), each group split in up to
        ``connections`` contiguous parts, all in parallel (the first on this thread); results
        in ``work``'s order. Every part finishes before the first error is raised (the caller's
        guard relearns the slot map after a failure: a replica may have taken over). A part
        still queued for a thread at ``deadline`` (``time.monotonic()``; the executor is
        shared with saves and other batches) never runs: ``DeadlinePassedError`` (one under
        way is the caller's ``run`` to end by then)."""
        units: list[tuple[redis.Redis, list[int]]] = []
        for server, indexes in self.split([key(w) for w in work]):
            n = max(1, min(connections, len(indexes)))
            bounds = [len(indexes) * c // n for c in range(n + 1)]
            units += [(server, indexes[a:b]) for a, b in itertools.pairwise(bounds)]
        if not units:
            return []

        def run_unit(unit: tuple[redis.Redis, list[int]]) -> list[T]:
            return run(unit[0], [work[i] for i in unit[1]])

        futures = [self._pool().submit(run_unit, u) for u in units[1:]]
        results: list[Any] = [None] * len(work)
        error: BaseException | None = None
        for unit, outcome in zip(units, [None, *futures], strict=True):
            try:
                got = run_unit(unit) if outcome is None else result_by(outcome, deadline)
            except BaseException as exc:  # re-raised below, once every part has finished
                error = error or exc
                continue
            for i, r in zip(unit[1], got, strict=True):
                results[i] = r
        if error is not None:
            raise error
        return results

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
            return self._executor

    def close(self) -> None:
        with self._lock:
            pool, self._executor = self._executor, None
        if pool is not None:
            pool.shutdown(wait=True)

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
        """After a node failed: fetch the slot map again (a replica may have been promoted), for
        every client. Best effort; the next call fails typed if the cluster is still down.
        redis-py's cluster client relearns by itself only when it retries, and kvstore's
        frequent calls do not go through it (see ``transport``)."""
        if not self.cluster:
            return
        for client in [self.client, *self._others]:
            try:
                client.nodes_manager.initialize()  # type: ignore[attr-defined]
            except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
                logger.debug(
                    "kvstore: could not relearn the cluster's slot map yet: %s", printable(exc)
                )
                return
            except Exception as exc:  # (redis-py's own failure: the relearn thread lives on)
                logger.warning(
                    "kvstore: relearning the Cluster's slot map failed unexpectedly: %s",
                    printable(repr(exc)),
                )
                return

    def relearn_by(self, deadline: float) -> bool:
        """:meth:`relearn`, waited for until ``deadline`` (``time.monotonic()``) at most: True
        once it ended. It runs on a thread of its own, one at a time (callers share it): redis-py
        asks the nodes in a random order, so a hung master -- even one holding none of the
        caller's keys -- costs a socket timeout per client (a review's loads with 0.5 s left
        took 3 s). Past the deadline it goes on for the next caller."""
        if not self.cluster or math.isinf(deadline):
            self.relearn()
            return True
        with self._lock:
            done = self._relearning
            if done is None or done.is_set():
                done = self._relearning = threading.Event()

                def run(ended: threading.Event = done) -> None:
                    try:
                        self.relearn()
                    finally:
                        ended.set()

                try:
                    threading.Thread(target=run, name=f"{self._name}-relearn", daemon=True).start()
                except BaseException:  # (no thread: no relearn is under way for the next one)
                    done.set()
                    raise
        return done.wait(max(0.0, deadline - time.monotonic()))


def result_by(outcome: Future[T], deadline: float) -> T:
    """``outcome``'s result; one not started by ``deadline`` is cancelled (never runs), and one
    under way is waited for (its part ends by the deadline itself)."""
    if math.isinf(deadline):
        return outcome.result()
    try:
        return outcome.result(timeout=max(0.0, deadline - time.monotonic()))
    except FuturesTimeout:
        if not outcome.done() and outcome.cancel():
            raise deadline_passed("while its part waited for a thread") from None
        return outcome.result()
