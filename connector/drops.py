"""Handoffs a consumer will not load (vLLM's local prefix cache had them, a deadline, an abort),
deleted once their producer has finished writing them.

Deleting a handoff while its producer still writes it leaves the late blocks behind for their
whole TTL. So a dropped handoff waits here until no producer rank's record says "pending" -- and,
when the producer could not confirm its record was in place before it answered, until a record
is there at all -- at most ``max_wait_s`` (a producer that died writing). Then it is claimed:
another request's claim (a retried request loading it) wins, and the chain is left to it;
otherwise its blocks and records are deleted (a failed delete is tried again at the next
ticks, then left to the TTLs). One thread checks every waiting handoff in one
round trip per tick, so a burst of drops never queues behind each other's waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import Claim, LookupBuffer
from kvstore.values.keys import BlockName

_POLL_S = 0.05
# a delete that failed (a timeout on a busy server, a failover) is tried again at the next
# ticks, this many times in all, before its chain is left to the TTLs
_DELETE_TRIES = 4


@dataclass
class _Drop:
    handoff_id: str
    owner: str
    names: list[BlockName]  # the handoff chain's blocks, every group's
    expect_record: bool  # a missing record may still come: wait for it as for "pending"
    give_up_at: float
    failed_deletes: int = 0
    not_before: float = 0.0  # kept until then whatever its producer's state (a probe reads it)


class HandoffDrops:
    def __init__(
        self,
        store: LookupBuffer,
        fingerprints: list[str],
        max_wait_s: float,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.store = store
        self.fingerprints = fingerprints
        self.max_wait_s = max_wait_s
        self.on_error = on_error
        self._waiting: list[_Drop] = []
        self._checking = 0  # drops of the batch being checked now
        self._batch: list[_Drop] = []  # ... themselves
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-kv-drop", daemon=True)
        self._thread.start()

    def drop(
        self,
        handoff_id: str,
        owner: str,
        names: list[BlockName],
        expect_record: bool,
        hold_s: float = 0.0,
    ) -> None:
        """Delete the handoff once its producer is done, and not before ``hold_s`` from now
        (its blocks are what a probe of the store is about to read)."""
        now = time.monotonic()
        give_up_at = now + max(self.max_wait_s, hold_s)
        with self._lock:
            self._waiting.append(
                _Drop(handoff_id, owner, names, expect_record, give_up_at, 0, now + hold_s)
            )
        self._wake.set()

    def release(self, handoff_id: str) -> None:
        """The probe no longer needs the held handoff: delete it once its producer is done."""
        with self._lock:
            for d in self._waiting + self._batch:
                if d.handoff_id == handoff_id:
                    d.not_before = 0.0
        self._wake.set()

    @property
    def waiting(self) -> int:
        """Drops not finished yet: waiting, or being checked and deleted right now."""
        with self._lock:
            return len(self._waiting) + self._checking

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(_POLL_S)
            self._wake.clear()
            with self._lock:
                batch, self._waiting = self._waiting, []
                self._checking = len(batch)
                self._batch = batch
            if not batch:
                continue
            try:
                keep = self._check(batch)
            except BaseException as exc:  # reported; they wait for the next tick or give up
                self.on_error(exc)
                now = time.monotonic()
                keep = [d for d in batch if now < d.give_up_at]
            with self._lock:
                self._waiting = keep + self._waiting
                self._checking = 0
                self._batch = []

    def _check(self, batch: list[_Drop]) -> list[_Drop]:
        """Delete the drops whose producer is done (or whose wait is over); the rest wait."""
        now = time.monotonic()
        keep = [d for d in batch if now < d.not_before]  # held for a probe
        batch = [d for d in batch if now >= d.not_before]
        if not batch:
            return keep
        states = self.store.read_handoffs(
            [(d.handoff_id, d.names[:1]) for d in batch], self.fingerprints
        )
        for d, state in zip(batch, states, strict=True):
            missing = state.committed is None and not state.taken and not state.pending
            writing = state.pending or (missing and d.expect_record)
            if writing and now < d.give_up_at:
                keep.append(d)
                continue
            try:
                self._delete(d)
            except BaseException as exc:  # reported; tried again, then left to the TTLs
                self.on_error(exc)
                d.failed_deletes += 1
                if d.failed_deletes < _DELETE_TRIES:
                    keep.append(d)
        return keep

    def _delete(self, d: _Drop) -> None:
        if self.store.claim_handoff(d.handoff_id, self.fingerprints, owner=d.owner) is Claim.TAKEN:
            return  # another request loads it, and deletes it when done
        self.store.delete(d.names, self.fingerprints)
        self.store.delete_handoff(d.handoff_id, self.fingerprints)

    def shutdown(self) -> None:
        self._closed.set()
        self._wake.set()

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for the thread's last round trip to end."""
        self._thread.join(timeout_s)
