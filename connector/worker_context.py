"""What the worker side's parts share (``worker.py`` holds it and hands it to each): the store,
the movers of the registered KV caches, the stats, one lock, whether the KV cache is asleep,
the blocks to report failed with the step's output, the bytes this rank received, and how the
parts warn of failures and track their background tasks.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from connector.config import RedisConnectorConfig
from connector.layout import KVLayout
from connector.logs import FailureCounts, log_bug
from connector.slice_movers import SliceMover
from connector.stats import StatsBuffer
from datamover import BlockMover
from kvstore import KVStoreError, LookupBuffer

logger = logging.getLogger("connector.worker")


class WorkerContext:
    def __init__(
        self,
        config: RedisConnectorConfig,
        layout: KVLayout,
        store: LookupBuffer,
        tp_rank: int,
    ) -> None:
        self.config = config
        self.layout = layout
        self.store = store
        self.tp_rank = tp_rank
        self.stats = StatsBuffer()
        # one lock for the parts' shared state and their requests: a load's report changes
        # several of them at once, and the next get_finished must see all of it
        self.lock = threading.Lock()
        # per KV-cache group (the layout's order), the head slices this rank reads; replaced
        # by each register_kv_caches
        self.slices: list[list[SliceMover]] = []
        self.asleep = False  # vLLM sleep mode: the KV cache is released, nothing touches it
        # block ids to report failed with this step's output (vLLM recomputes them)
        self.failed_block_ids: set[int] = set()
        # bytes every load, split and probe of this rank received so far: over one load's
        # time, what the store gave the rank (loads side by side share it), not that load
        self.landed = 0
        self._pending: set[Future[Any]] = set()
        self._failures = FailureCounts()  # never reset (stats are): drives sparse logging

    @property
    def movers(self) -> list[BlockMover]:
        """Every data mover, group by group, head slice by head slice."""
        return [sm.mover for movers in self.slices for sm in movers]

    def count_landed(self, nbytes: int) -> None:
        with self.lock:
            self.landed += nbytes

    def landed_since(self, before: int, own: int) -> int:
        """What the store gave this rank since it had given ``before`` (at least ``own``)."""
        with self.lock:
            return max(own, self.landed - before)

    def warn(self, cause: str, msg: str, n: int = 1, **fields: Any) -> None:
        """A warning at 1, 2, 4, 8, ... occurrences of a cause, not one per block or request;
        ``msg`` uses ``%(total)d`` for the running total and ``%(name)s`` for ``fields``."""
        total = self._failures.add(cause, n)
        if total:
            logger.warning(msg, {**fields, "n": n, "total": total})

    def redis_error(self, exc: KVStoreError, msg: str, **fields: Any) -> None:
        """Count a failed Redis call and warn sparsely, per error type."""
        self.stats.add(redis_errors=1)
        self.warn(f"redis:{type(exc).__name__}", msg, exc=exc, **fields)

    def bug(self, where: str, exc: BaseException, what: str) -> None:
        """An unexpected exception (``logs.log_bug``): counted, and logged sparsely."""
        self.stats.add(internal_errors=1)
        log_bug(self._failures, logger, where, exc, what)

    def track(self, fut: Future[Any], what: str = "a load") -> None:
        """A background task, waited for at shutdown; an exception it did not catch is
        logged."""
        with self.lock:
            self._pending.add(fut)

        def done(f: Future[Any]) -> None:
            with self.lock:
                self._pending.discard(f)
            if f.cancelled():  # cancelled at shutdown
                return
            exc = f.exception()
            if exc is not None:  # the tasks catch what they can; anything else is said here
                self.bug("background", exc, f"RedisConnector background task ({what})")

        fut.add_done_callback(done)

    def pending(self) -> list[Future[Any]]:
        """The background tasks still running."""
        with self.lock:
            return list(self._pending)
