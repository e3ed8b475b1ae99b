"""Saves on the worker side: each step's new full blocks staged and written to Redis, and each
finished request's commit record published once its writes are acknowledged.

``wait_for_save`` hands the step's new full blocks, every request's together, to the mover,
which starts copying them into staging (CUDA: gathered and copied device-to-host on side
streams; it never waits) and returns; writer threads wait for the copy, then frame and ``SET``
them. When no staging is free (Redis slower than the model) or the store is unavailable, blocks
are shed and counted. A group's null blocks (a sliding window's past) are never written; each
head slice this rank writes is staged by its own mover (none on a rank whose heads an earlier
rank holds too: ``slice_movers.py``). When a request has finished and its writes are
acknowledged, a commit record is published per slice written, saying how many leading blocks
really made it (``commits.py``'s ledger). Its blocks go back to vLLM (finished sending) as soon
as it has finished: the compute stream waits for the gathers, so nothing reads them after the
next forward pass starts.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from connector.commits import SaveLedger, StoredReport
from connector.metadata import CommitSpec, SaveSpec
from connector.slice_movers import slices_written
from connector.worker_context import WorkerContext
from datamover import BlockMover, SaveChunk, SaveItem
from kvstore import KVStoreError


class SaveWrites:
    def __init__(self, ctx: WorkerContext, io: ThreadPoolExecutor, report_stored: bool) -> None:
        self._ctx = ctx
        self._io = io  # the writer threads (commit records too)
        # each request's saves and what its commit record will say (and, KV events, report)
        self._ledger = SaveLedger(ctx.layout, report_stored)
        # under ``ctx.lock``: commits taken from the step's metadata, not acted on yet
        self._commits_received: list[CommitSpec] = []
        self._reports_out: list[StoredReport] = []  # taken with the finished saves

    def registered(self) -> None:
        """The KV caches were (re)registered: the head slices this rank writes now."""
        self._ledger.slices_written = slices_written(self._ctx.slices)

    def commits_received(self, commits: list[CommitSpec]) -> None:
        """Finished requests' commits, from this step's metadata: acted on after this step's
        saves are staged (``take_commits``)."""
        with self._ctx.lock:
            self._commits_received.extend(commits)

    def take_commits(self) -> None:
        """Finished requests: publish each one's commit record once its writes are done. (A
        finished request is never scheduled again, so its last saves were staged in an
        earlier step's ``wait_for_save``.)"""
        with self._ctx.lock:
            commits, self._commits_received = self._commits_received, []
        self._ledger.committed(commits)
        for commit in commits:
            self._maybe_publish(commit.req_id)

    def take_finished(self, now: float) -> set[str]:
        """Requests whose saves are finished (vLLM may have their blocks back); their stored
        reports are kept for ``take_stored_reports``."""
        # taken with the finished saves: a request is freed in the step carrying its report
        saves, reports = self._ledger.take_finished(now)
        with self._ctx.lock:
            self._reports_out += reports
        return saves

    def take_stored_reports(self) -> list[StoredReport]:
        """(request, leading blocks confirmed in Redis, loadable ends of a state model) of
        finished requests, for the scheduler side's KV events: those ``take_finished`` took."""
        with self._ctx.lock:
            reports, self._reports_out = self._reports_out, []
        return reports

    def requests(self) -> set[str]:
        """Requests whose saves are still tracked."""
        return self._ledger.requests()

    def _save_items(self, specs: list[SaveSpec]) -> list[list[SaveItem]]:
        """Each group's blocks to save (null blocks skipped), in the layout's group order."""
        return [
            [
                SaveItem(block_id, name, spec.first_position + i, spec.req_id)
                for spec in specs
                for i, (block_id, name) in enumerate(
                    zip(spec.block_ids[g], spec.names[g], strict=True)
                )
                if group.holds(block_id)
            ]
            for g, group in enumerate(self._ctx.layout.groups)
        ]

    def stage_and_submit(self, specs: list[SaveSpec]) -> None:
        """Start copying this step's saves into staging and hand them to the writer threads."""
        self._ledger.opened(spec.req_id for spec in specs)
        for g, items in enumerate(self._save_items(specs)):
            if items:
                self._stage_group(g, items)

    def _stage_group(self, group: int, items: list[SaveItem]) -> None:
        """Stage ``items`` of every head slice this rank writes of ``group`` (none: another
        rank holding the same heads writes them)."""
        for k, sm in enumerate(self._ctx.slices[group]):
            if sm.writes:
                self._stage_slice(group, k, items)

    def _stage_slice(self, group: int, head_slice: int, items: list[SaveItem]) -> None:
        ctx = self._ctx
        chunks: list[SaveChunk] = []
        shed = items  # Redis is down or hung (or the KV cache asleep): do not even copy
        if ctx.store.available and not ctx.asleep:
            try:
                chunks, shed = ctx.slices[group][head_slice].mover.stage_saves(items)
            except Exception as exc:  # the step goes on; these blocks are not saved (and counted)
                ctx.bug("stage", exc, f"copying {len(items)} block(s) out for saving")
        if shed:
            ctx.stats.add(blocks_shed=len(shed))
            ctx.warn(
                "shed",
                "%(n)d block(s) of request(s) %(req)s not saved: staging full or Redis "
                "unavailable (%(total)d shed so far; if Redis is up it is slower than the model: "
                "raise max_inflight_bytes)",
                n=len(shed),
                req=", ".join(sorted({item.owner for item in shed})),
            )
        for chunk in chunks:
            self._ledger.writing(chunk.owners)
            # the mover that staged it writes it: a register_kv_caches meanwhile (sleep mode)
            # replaces the movers, and the chunk's buffer belongs to this one's staging
            mover = ctx.slices[group][head_slice].mover
            ctx.track(self._io.submit(self._write, group, head_slice, mover, chunk), "a save")

    def _write(self, group: int, head_slice: int, mover: BlockMover, chunk: SaveChunk) -> None:
        ctx = self._ctx
        t0 = time.perf_counter()
        ok = False
        nbytes = 0
        try:
            nbytes = mover.write(chunk)
            ok = True
        except KVStoreError as exc:
            ctx.redis_error(
                exc,
                "request(s) %(req)s: saving %(blocks)d block(s) failed (%(total)d Redis errors "
                "so far): %(exc)s",
                req=", ".join(sorted(chunk.owners)),
                blocks=len(chunk.items),
            )
        except Exception as exc:
            ctx.bug(
                "save",
                exc,
                f"request(s) {sorted(chunk.owners)}: saving {len(chunk.items)} block(s)",
            )
        finally:
            acked = [(i.owner, group, head_slice, i.position) for i in chunk.items] if ok else []
            self._ledger.written(chunk.owners, acked)
            ctx.stats.add(
                saves=1,
                blocks_saved=len(chunk.items) if ok else 0,
                bytes_saved=nbytes if ok else 0,
                blocks_save_failed=0 if ok else len(chunk.items),
            )
            ctx.stats.observe("save_seconds", time.perf_counter() - t0)
            for owner in chunk.owners:
                self._maybe_publish(owner)

    def _maybe_publish(self, req_id: str) -> None:
        """Once a finished request has no write in flight, publish its commit record."""
        ready = self._ledger.ready(req_id)
        if ready is None:
            return
        try:
            fut = self._io.submit(self._publish, req_id, ready.commit, ready.blocks)
        except RuntimeError:  # shut down: a write that outlived it has nothing to publish on
            self._ledger.published(req_id)
            self._ctx.warn(
                "unpublished",
                "request %(req)s: its commit record is not published: the connector shut down "
                "while its writes ran (%(total)d so far); a consumer waiting for it recomputes",
                req=req_id,
            )
            return
        self._ctx.track(fut, "a commit record")

    def _publish(self, req_id: str, commit: CommitSpec, n: int) -> None:
        ctx = self._ctx
        stores = [sm.store for sm in ctx.slices[0] if sm.writes] if ctx.slices else []
        try:
            for store in stores:  # (none: another rank holding these heads writes them)
                store.publish_handoff(commit.handoff, n)
                ctx.stats.add(handoffs_published=1)
        except KVStoreError as exc:
            ctx.redis_error(
                exc,
                "request %(req)s: publishing its commit record failed (%(total)d Redis errors "
                "so far): %(exc)s; its consumer recomputes by its deadline",
                req=req_id,
            )
        finally:
            self._ledger.published(req_id)
