"""Lookups of prompts' blocks and producers' handoff records, batched.

A lookup is one question to Redis: how many leading blocks of this chain are there (and, for a
handoff, what its producer's commit record says); the namespace's generation comes back with
every answer, so a reset is seen by the next lookup. Asked one by one, a burst of new requests
against a distant Redis costs one round trip each, queued behind a few threads: 64 requests
20 ms away took 465 ms to be admitted. Here each of a few threads takes *every* lookup queued
when it is free and asks about all of them in one pipelined round trip, so a burst costs a few
round trips, however many requests it holds.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from connector.layout import KVLayout
from connector.stats import StatsBuffer
from kvstore import LookupBuffer
from kvstore.values.keys import BlockName

MAX_BATCH = 256  # lookups in one round trip


@dataclass
class LookupResult:
    present: int  # leading blocks present (absolute index)
    committed: int | None = None  # handoff: blocks the producer committed, None if not yet
    taken: bool = False  # handoff: another consumer claimed it
    pending: bool = False  # handoff: the producer is writing it (its record says so)
    generation: int = 0  # the namespace's generation, read in the same round trip


@dataclass
class Trip:
    """One round trip to Redis, shared by the lookups of a batch."""

    sent_at: float  # time.monotonic()
    reported_hung: bool = False  # counted as a failure already (once per round trip)


@dataclass
class Lookup:
    """One lookup: its answer (``future``), and the round trip it went in (None while queued)."""

    # the block names asked about, position by position, every group's at each
    # (``ChainNames.by_position``)
    names: list[BlockName]
    start: int  # the chain position of the first of them
    handoff_id: str | None
    future: Future[LookupResult] = field(default_factory=Future)
    trip: Trip | None = None

    def out_for(self, now: float) -> float:
        """Seconds Redis has had this lookup (0 while it waits in the queue)."""
        return 0.0 if self.trip is None else now - self.trip.sent_at


class LookupBatcher:
    def __init__(
        self,
        store: LookupBuffer,
        fingerprints: list[str],
        threads: int,
        stats: StatsBuffer,
        layout: KVLayout,
    ) -> None:
        self.store = store
        self.fingerprints = fingerprints
        self.stats = stats
        # a position's names: one per KV-cache group; which of them a hit needs is the layout's
        self._layout = layout
        self._queue: queue.SimpleQueue[Lookup | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"redis-kv-lookup-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, names: list[BlockName], start: int, handoff_id: str | None = None) -> Lookup:
        """Ask how many leading positions of ``names`` (chain positions ``start`` on, every
        group's name at each, ``ChainNames.by_position``) are present; with ``handoff_id``,
        also read that handoff's commit records."""
        job = Lookup(names, start, handoff_id)
        if self._closed:
            job.future.cancel()
        else:
            self._queue.put(job)
        return job

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # for this thread, after the batch
                    break
                batch.append(more)
            self._answer([j for j in batch if j.future.set_running_or_notify_cancel()])

    def _answer(self, batch: list[Lookup]) -> None:
        """One round trip per kind of lookup in the batch; every job gets its answer or the
        error, whatever happens."""
        t0 = time.perf_counter()
        trip = Trip(time.monotonic())
        for j in batch:
            j.trip = trip
        try:
            pool = [j for j in batch if j.handoff_id is None]
            handoffs = [j for j in batch if j.handoff_id is not None]
            found = self.store.survey(
                [j.names for j in pool],
                [(j.handoff_id or "", j.names) for j in handoffs],
                self.fingerprints,
            )
            gen = found.generation
            for j, present in zip(pool, found.presences, strict=True):
                j.future.set_result(LookupResult(self._usable(j, present), generation=gen))
            for j, s in zip(handoffs, found.handoffs, strict=True):
                usable = self._usable(j, list(s.blocks))
                j.future.set_result(
                    LookupResult(usable, s.committed, s.taken, s.pending, generation=gen)
                )
        except BaseException as exc:  # every waiting request must hear back
            for j in batch:
                if not j.future.done():
                    j.future.set_exception(exc)
        finally:
            took = time.perf_counter() - t0
            for _ in batch:
                self.stats.observe("lookup_seconds", took)

    def _usable(self, job: Lookup, present: list[bool]) -> int:
        """The longest hit (absolute, in blocks) the names found present make loadable."""
        groups = len(self._layout.groups)
        end = job.start + len(job.names) // groups
        return self._layout.usable_prefix(
            lambda g, p: present[(p - job.start) * groups + g], job.start, end
        )

    def shutdown(self) -> None:
        self._closed = True
        while True:  # cancel what is queued
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        for _ in self._threads:
            self._queue.put(None)

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for the lookup threads' last round trips to end."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
