"""Whole (asynchronous) loads on the worker side: each on a background thread, from its claim
to its report.

The mover receives a request's blocks a chunk at a time straight into staging
(``select_into``) and each chunk is scattered into the allocated blocks, slice by slice; vLLM
keeps scheduling other requests meanwhile. A block counts as loaded when every head slice
covering it arrived. Every load is reported finished -- with its failed blocks -- whatever
happens: an exception of any type, or its deadline passing while a thread is still stuck in a
socket read (the late thread then writes nothing). A failed load of a model with several
KV-cache groups is reported for the whole request: vLLM cannot map block ids back across
groups. In consume mode the handed-off chain is deleted after the copy (by the scheduler side,
once every rank has finished), so a dropped connection mid-fetch loses nothing.

The load's writes go after the step's compute fence (``BlockMover.compute_fence``). Each whole
load is a sample of the load policy's figures (``figures.py``): its bytes and seconds from its
first request to Redis (a wait for the compute fence does not count) and how long after its
step began that was; one that expired or failed is an upper bound.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from connector.load_claims import claim_handoff
from connector.metadata import LoadSpec
from connector.worker_context import WorkerContext
from datamover import LoadChunk, StagingBusyError
from kvstore import (
    DeadlinePassedError,
    KVStoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvstore.values.keys import BlockName

# A retry of a failed fetch is only worth it with this much of the deadline left.
_RETRY_MIN_LEFT_S = 0.1


@dataclass
class LoadJob:
    """One whole load in flight: its spec, its deadline, and what it has copied in so far."""

    spec: LoadSpec
    deadline: float
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (group, slice, block id) written into the KV cache (block ids are unique only within a
    # group; a block is loaded once every slice covering it is)
    copied: set[tuple[int, int, int]] = field(default_factory=set)
    nbytes: int = 0
    reported: bool = False  # once True, nothing touches this request's blocks any more
    # CUDA: the compute stream's work queued when the step began; the load's writes go
    # after it (``BlockMover.compute_fence``)
    after: Any = None
    step_started: float = 0.0  # perf_counter when vLLM bound the load's step
    first_byte: float | None = None  # perf_counter when its first request to Redis went out
    fenced_s: float = 0.0  # time it waited for the compute fence (not the store's)
    landed_before: int = 0  # this rank's bytes landed (every load's) at its first byte


class WholeLoads:
    def __init__(self, ctx: WorkerContext, io: ThreadPoolExecutor) -> None:
        self._ctx = ctx
        self._io = io  # the loads' threads
        # under ``ctx.lock``: loads in flight, and those reported since get_finished last took
        # them
        self.jobs: dict[str, LoadJob] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()  # loads failed as a whole (fails_per_request)

    def start(self, spec: LoadSpec, now: float, fence: Any, step_started: float) -> None:
        """Start ``spec``'s load on a thread of its own (asleep: reported at once, failed)."""
        ctx = self._ctx
        job = LoadJob(
            spec,
            deadline=now + spec.timeout_s,
            started=time.perf_counter(),
            after=fence,
            step_started=step_started,
        )
        with ctx.lock:
            asleep = ctx.asleep
            if not asleep:
                self.jobs[spec.req_id] = job
        if asleep:  # no KV cache to write into: the request recomputes (a handoff is
            self.report(job, cancelled=True)  # deleted by the scheduler side)
            return
        ctx.track(self._io.submit(self._load, job))

    def requests(self) -> set[str]:
        """Requests whose loads are in flight."""
        with self._ctx.lock:
            return set(self.jobs)

    def expire(self, now: float) -> None:
        """Report loads past their deadline now, every block not yet copied failed, even if
        their thread is still waiting on Redis."""
        with self._ctx.lock:
            expired = [job for job in self.jobs.values() if now >= job.deadline]
        for job in expired:
            try:
                self.report(job, expired=True)
            except Exception as exc:  # (reported: only its figures and warning were lost)
                self._ctx.bug("expire", exc, f"request {job.spec.req_id}: expiring its load")

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(loads reported finished, those failed as a whole -- among them) since the last
        call."""
        with self._ctx.lock:
            loads, self._finished = self._finished, set()
            failed, self._failed = self._failed, set()
        return loads, failed

    def _load(self, job: LoadJob) -> None:
        ctx = self._ctx
        spec = job.spec
        expired = store_failed = False
        try:
            job.first_byte = time.perf_counter()
            job.landed_before = ctx.landed_since(0, 0)
            if not claim_handoff(ctx, spec):
                return
            if job.reported:
                return  # cancelled (sleep), or found past its deadline: reported already
            if time.monotonic() >= job.deadline:
                # its thread started (or its claim ended) too late: an expiry all the same
                expired = True
                return
            try:
                self._receive(job)
            except (StoreUnavailableError, StoreTimeoutError):
                # once more for what is not copied yet, if the connection dropped and time is
                # left (the values are only deleted after they were copied: still there)
                if job.deadline - time.monotonic() < _RETRY_MIN_LEFT_S or not ctx.store.available:
                    raise
                self._receive(job)
        except DeadlinePassedError:
            expired = True  # its replies still coming at its deadline: the load ends there
        except KVStoreError as exc:
            store_failed = True
            ctx.redis_error(
                exc,
                "request %(req)s: loading from Redis failed (%(total)d so far): %(exc)s; "
                "recomputing",
                req=spec.req_id,
            )
        except StagingBusyError as exc:
            ctx.warn(
                "staging", "request %(req)s: %(exc)s (%(total)d so far)", req=spec.req_id, exc=exc
            )
        except Exception as exc:  # never leave the request waiting, whatever went wrong
            ctx.bug("load", exc, f"request {spec.req_id}: loading its blocks (recomputed)")
        finally:
            self.report(job, expired=expired, store_failed=store_failed)

    def _uncopied(self, job: LoadJob) -> list[tuple[int, int, list[int], list[BlockName]]]:
        """(group, slice, block ids, the store's block names) of each group's slices not copied
        yet; null blocks (a sliding window's past) are neither read nor written."""
        out = []
        spec = job.spec
        slices = self._ctx.slices
        for g, (group, ids, names) in enumerate(
            zip(self._ctx.layout.groups, spec.block_ids, spec.names, strict=True)
        ):
            for k in range(len(slices[g]) if slices else 1):
                pairs = [
                    (b, name)
                    for b, name in zip(ids, names, strict=True)
                    if group.holds(b) and (g, k, b) not in job.copied
                ]
                if pairs:
                    out.append((g, k, [b for b, _ in pairs], [n for _, n in pairs]))
        return out

    def _receive(self, job: LoadJob) -> None:
        """Receive and copy in chunk by chunk, slice by slice, what is not copied yet; stops as
        soon as the load was reported."""
        for g, k, block_ids, names in self._uncopied(job):
            chunks = self._ctx.slices[g][k].mover.receive(
                block_ids, names, timeout_s=max(0.0, job.deadline - time.monotonic())
            )
            try:
                for chunk in chunks:
                    if not self.copy_in(job, g, k, chunk):
                        return
            finally:
                chunks.close()  # releases the staging buffer at once

    def copy_in(self, job: LoadJob, group: int, head_slice: int, chunk: LoadChunk) -> bool:
        """Write a received chunk of ``job`` into the KV cache; False once the load was
        reported (its blocks are no longer ours)."""
        if job.after is not None:
            # the GPU work the load is ordered after (what was queued when its step began) is
            # waited for here, not under the lock: the model-runner thread takes the lock to
            # report a load whose deadline passed, and must not wait a step for it
            t0 = time.perf_counter()
            job.after.synchronize()
            job.fenced_s += time.perf_counter() - t0
        with job.lock:
            if job.reported:  # the deadline passed: these blocks are no longer ours
                return False
            copied, nbytes = chunk.copy_in(job.after)  # synchronous: done when it returns
            job.copied.update((group, head_slice, b) for b in copied)
            job.nbytes += nbytes
        self._ctx.count_landed(nbytes)
        if chunk.misfits:
            self._ctx.warn(
                "layout",
                "a stored block does not match this instance's KV layout; ignoring it "
                "(%(total)d so far). Is another model writing to namespace %(ns)r?",
                n=chunk.misfits,
                ns=self._ctx.config.namespace,
            )
        return True

    def report(
        self,
        job: LoadJob,
        expired: bool = False,
        cancelled: bool = False,
        store_failed: bool = False,
    ) -> None:
        """Report a load finished, exactly once; blocks not copied by now are failed."""
        ctx = self._ctx
        spec = job.spec
        bug: Exception | None = None
        with job.lock:
            if job.reported:
                return
            job.reported = True
            try:
                failed = self._uncopied(job)
            except Exception as exc:  # the load still ends, failed as a whole (a review set
                # ``reported`` and raised here: the request waited for its load for ever)
                failed, bug = [], exc
            # in the same critical section: once ``reported`` is set, the next get_finished
            # must see the load finished (it may be the call that found the deadline passed)
            with ctx.lock:
                if self.jobs.get(spec.req_id) is job:
                    del self.jobs[spec.req_id]
                if bug is not None or (failed and ctx.layout.fails_per_request):
                    # block ids are unique only within a group (and a windowed group's hit
                    # cannot be cut short at a failed block): vLLM takes these
                    # failure per request (and recomputes all of it)
                    self._failed.add(spec.req_id)
                else:
                    ctx.failed_block_ids.update(b for _, _, ids, _ in failed for b in ids)
                self._finished.add(spec.req_id)
        if bug is not None:
            ctx.bug("report", bug, f"request {spec.req_id}: reporting its load (recomputed)")
        # what the request got is counted by the scheduler side, once vLLM has heard from
        # every rank; a rank counts its own bytes and its own load's fate
        ctx.stats.add(
            loads_expired=int(expired), loads_cancelled=int(cancelled), bytes_loaded=job.nbytes
        )
        now = time.perf_counter()
        ctx.stats.observe("load_seconds", now - job.started)
        if job.first_byte is not None and not cancelled:
            # timed from its first request to Redis: queued behind other loads, or waiting
            # for the GPU, is not the store's time
            seconds = now - job.first_byte - job.fenced_s
            if (expired or store_failed) and seconds > 0:
                # the store gave at most this: the policy trusts no more until measured again
                ctx.stats.timed_sample("load_bounds", ctx.tp_rank, job.nbytes, seconds)
            elif not failed and bug is None and job.nbytes:  # a whole load: a bandwidth sample
                # from the step's start to vLLM's call that started it (late on some releases
                # and platforms), not to its first byte: the queue behind other loads is the
                # model's (``load_policy.LoadsInFlight``), and counted here too it said an
                # idle store's load starts seconds late once loads had queued
                lag = max(0.0, job.started - job.step_started)
                shared = ctx.landed_since(job.landed_before, job.nbytes)
                ctx.stats.timed_sample("load_samples", ctx.tp_rank, shared, seconds, lag)
        if expired:
            ctx.warn(
                "deadline",
                "request %(req)s: its deadline passed while loading from Redis (%(total)d so "
                "far); recomputing what was not loaded",
                req=spec.req_id,
            )
