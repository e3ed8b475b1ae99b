"""What a request finds in Redis, as the scheduler asks while vLLM schedules it: its lookup
(batched with others', ``lookups.py``) polled within the one short wait each scheduler step
shares among all its requests, a producer's commit record waited for, and giving up -- the
request recomputes -- at its deadline, with the store's circuit breaker open, or on an error.
The scheduler's thread never waits on Redis beyond that shared wait.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait

from connector.config import RedisConnectorConfig
from connector.load_tracking import LoadTracker
from connector.logs import FailureCounts, log_bug
from connector.lookups import LookupBatcher, LookupResult
from connector.request_state import CountedOnce, RequestState
from connector.stats import StatsBuffer
from kvstore import KVStoreError, LookupBuffer

# the scheduler side's log: its lines keep the name they are filtered by
logger = logging.getLogger("connector.scheduler")
# How often a request waiting for a producer's commit record re-checks Redis.
_POLL_INTERVAL_S = 0.01


class LookupPolls:
    def __init__(
        self,
        config: RedisConnectorConfig,
        store: LookupBuffer,
        lookups: LookupBatcher,
        loads: LoadTracker,
        stats: StatsBuffer,
        failures: FailureCounts,
    ) -> None:
        self.config = config
        self.store = store
        self._lookups = lookups
        self._loads = loads  # share mode: a request waits for another's load of its blocks
        self.stats = stats
        self.failures = failures
        # this step's lookups wait together until this moment (None: no wait yet this step)
        self._step_wait_until: float | None = None

    def new_step(self) -> None:
        """The step is over: the next one may wait again."""
        self._step_wait_until = None

    def start(self, st: RequestState, start: int, end: int) -> None:
        """Ask Redis about blocks ``[start, end)`` of the request's chain."""
        handoff_id = st.handoff.handoff_id if st.handoff is not None else None
        names = st.load_names.by_position(start, end)
        st.lookup_sent(self._lookups.submit(names, start, handoff_id), start)
        self.stats.add(lookups=1)

    def wait_in_step(self, fut: Future[LookupResult]) -> None:
        """Wait for a lookup, within the one ``lookup_wait_s`` this step shares among all its
        requests: a fast answer is used in this step, a slow one by a later call, so many
        new requests never add up to a long step."""
        now = time.monotonic()
        if self._step_wait_until is None:
            self._step_wait_until = now + self.config.lookup_wait_s
        left = self._step_wait_until - now
        if left > 0:
            wait([fut], timeout=left)

    def present_blocks(self, st: RequestState, rid: str, start: int, end: int) -> int | None:
        """LOOKING_UP: the leading blocks vLLM may load (absolute), or None while unknown."""
        now = time.monotonic()
        held, answer = self._held_back(st, rid, start, end, now)
        if held:
            return answer
        if st.lookup is None and now < st.next_poll:
            return None  # polled Redis a moment ago; do not hammer it while waiting
        result = self._poll(st, start, end)
        if result is None:
            return None
        if result.present < 0:
            return self._give_up(st, rid, "lookup failed")
        if st.handoff is None:
            return result.present
        if result.taken:
            st.handoff_taken()
            return self._give_up(st, rid, "handoff already taken by another request")
        waited = now - st.first_seen
        if result.committed is None and (
            result.pending or not st.handoff.opened or waited < self.config.handoff_grace_s
        ):
            # the producer is still writing (or its first write, or its record, is just landing)
            st.poll_again_at(now + _POLL_INTERVAL_S)
            return None
        self.stats.observe("handoff_wait_seconds", waited)
        if result.committed is not None:
            return min(result.present, result.committed)  # the rest was shed, failed or is gone
        return result.present  # no record at all (evicted, never written): load what is there

    def still_present(self, st: RequestState, rid: str, start: int, end: int) -> int | None:
        """WAITING_A_PASS, asked again: the blocks its lookup found (absolute), unless Redis is
        no longer for it (``_held_back``), as for a lookup."""
        held, answer = self._held_back(st, rid, start, end, time.monotonic())
        return answer if held else st.present_blocks

    def _held_back(
        self, st: RequestState, rid: str, start: int, end: int, now: float
    ) -> tuple[bool, int | None]:
        """Whether the request may not read Redis now, and if so its answer: 0 (given up: its
        deadline passed, or the breaker is open) or None (another request is loading these
        blocks: it waits for that)."""
        if now >= st.deadline:
            return True, self._give_up(st, rid, "deadline passed")
        if not self.store.available:
            return True, self._give_up(st, rid, "Redis unavailable (circuit breaker open)")
        if not self.config.consume and self._loads.loading_elsewhere(
            st.load_names.first_group(start, end), rid
        ):
            return True, None
        return False, None

    def ask(self, st: RequestState, start: int, end: int) -> int:
        """Ask Redis about the request's blocks from ``start`` (unless asked already), without
        waiting for the answer; returns the block the question starts at."""
        ask_from = 0 if self.config.saves and st.same_chain else start
        if st.lookup is not None and st.lookup_start > ask_from:
            st.lookup_dropped()  # it asks about fewer blocks than vLLM now needs: ask again
        if st.lookup is None:
            self.start(st, ask_from, end)
        return ask_from

    def _poll(self, st: RequestState, start: int, end: int) -> LookupResult | None:
        """The answer of a lookup covering ``start``, started now if needed; None while out.
        A failed lookup answers ``present=-1``. A request that loads and saves one chain
        (share mode, an instance that saves) always asks from the chain's first block: what
        Redis lacks of vLLM's local hit is what it must write back, and a load or announcement
        may only follow a head that is there."""
        ask_from = self.ask(st, start, end)
        lookup = st.lookup
        assert lookup is not None
        fut = lookup.future
        if not fut.done():
            self.wait_in_step(fut)
        if not fut.done():  # tell a slow answer from an error by done(), never by exception type
            trip = lookup.trip
            hung = lookup.out_for(time.monotonic()) > self.config.control_timeout_s + 0.25
            if hung and trip is not None and not trip.reported_hung:
                # Redis has had it beyond its socket timeout (time queued behind other lookups
                # does not count): one failure per round trip, so a hung server opens the
                # breaker and a slow one does not
                trip.reported_hung = True
                self.store.breaker.record_failure("a lookup did not come back in time")
            return None
        st.lookup_dropped()
        try:
            result = fut.result()
        except KVStoreError as exc:
            self.stats.add(redis_errors=1)
            total = self.failures.add(f"lookup:{type(exc).__name__}")
            if total:
                logger.warning("Redis lookup failed (%d so far); recomputing: %s", total, exc)
            return LookupResult(present=-1)
        except Exception as exc:  # whatever it was, the request must not wait for it
            self.stats.add(internal_errors=1)
            log_bug(self.failures, logger, "lookup", exc, "a Redis lookup (recomputed)")
            return LookupResult(present=-1)
        if result.generation != st.generation:
            # a reset: the request is named again and asks again (the scheduler's ``_state``)
            return None
        if result.present < start and st.lookup_start < start and ask_from == start:
            # it stopped before vLLM's local hit: the blocks after it are still unknown
            self.start(st, start, end)
            return None
        return result

    def _give_up(self, st: RequestState, rid: str, why: str) -> int:
        """Stop waiting on Redis for this request: it recomputes (whatever it had not loaded).
        Counted once an admission (a request whose local hits shrank is asked about again)."""
        if not st.count_once(CountedOnce.GIVE_UP):
            return 0
        self.stats.add(requests_given_up=1)
        total = self.failures.add(f"give-up:{why}")
        if total:
            logger.warning(
                "request %s: not loading from Redis (%s); recomputing (%d so far)", rid, why, total
            )
        return 0
