"""Namespace resets: vLLM's ``reset_prefix_cache(reset_connector=True)`` (e.g. after a weight
update) invalidates every block of the namespace with one atomic increment of its generation,
and the older blocks are unlinked in the background once every load that may still read them
has ended (``deadline_max_s``). Scheduler side; nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from connector.config import RedisConnectorConfig
from connector.stats import StatsBuffer
from kvstore import KVStoreError, LookupBuffer
from kvstore.fleet.access import acl_rule

if TYPE_CHECKING:
    from connector.events import KVEventsEmitter

logger = logging.getLogger("connector.resets")


class NamespaceResets:
    def __init__(
        self,
        store: LookupBuffer,
        config: RedisConnectorConfig,
        stats: StatsBuffer,
        events: KVEventsEmitter | None,
    ) -> None:
        self._store = store
        self._config = config
        self._stats = stats
        self._events = events
        self._closing = threading.Event()
        self._sweeps: list[threading.Thread] = []

    def reset(self) -> bool:
        """A new generation for the namespace: no instance looks up an older block again once
        it has seen it (with its next lookup); older blocks are unlinked in the background.
        False when Redis refused or failed (vLLM then reports the reset failed)."""
        try:
            generation = self._store.reset()
        except KVStoreError as exc:
            self._stats.add(redis_errors=1)
            logger.error(
                "Redis: resetting namespace %r failed, so its blocks stay valid: %s (the ACL "
                "needs: %s)",
                self._config.namespace,
                exc,
                acl_rule(["generation", "reset", "sweep"], self._config.namespace),
            )
            return False
        self._stats.add(resets=1)
        if self._events is not None:
            self._events.cleared()
        logger.info(
            "Redis: namespace %r reset: blocks are now named in generation %d; older ones are "
            "unlinked in the background in %.0f s (deadline_max_s: loads under way finish)",
            self._config.namespace,
            generation,
            self._config.deadlines.max_s,
        )
        self._start_sweep(generation)
        return True

    def _start_sweep(self, generation: int) -> None:
        def sweep() -> None:
            # loads looked up before the reset (here or on another instance) may still be
            # reading older blocks: each ends within its deadline, at most deadline_max_s
            if self._closing.wait(self._config.deadlines.max_s):
                return
            try:
                n = self._store.sweep(generation, stop=self._closing.is_set)
                logger.info("Redis: unlinked %d blocks from before generation %d", n, generation)
            except Exception as exc:  # reported, never raised into a thread nobody joins
                self._stats.add(redis_errors=1)
                logger.warning(
                    "Redis: unlinking blocks from before generation %d stopped (%s); they are "
                    "never loaded, and expire with their TTL",
                    generation,
                    exc,
                )

        # its own thread: a long sweep never holds up the background calls lookups wait on;
        # it stops at close()
        thread = threading.Thread(target=sweep, name="redis-kv-sweep", daemon=True)
        self._sweeps.append(thread)
        thread.start()

    def close(self, timeout_s: float) -> None:
        """Stop sweeps (one under way stops between batches) and wait for them."""
        self._closing.set()
        for t in self._sweeps:
            t.join(timeout_s)
