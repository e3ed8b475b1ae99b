"""What a worker's commit records say: each request's saves, which of its blocks Redis
acknowledged, and -- once the request finished and no write is in flight -- how many leading
blocks a consumer can load.

Bookkeeping only (its own lock; no I/O): the worker stages and writes the blocks, and publishes
the record this ledger computes. A block counts for a group's position only when every head
slice this rank writes of it was acknowledged; a rank writing none confirms the whole chain
(another rank holding the same heads writes and confirms them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from connector.layout import KVLayout
from connector.metadata import CommitSpec

# KV events on: how long vLLM keeps a finished request's blocks waiting for its writes to be
# confirmed, so its event leaves with the step that frees it (writes take milliseconds; the
# engine steps empty meanwhile, which is what a slow Redis must not prolong)
EVENT_HOLD_S = 0.2

# (request, leading blocks confirmed in Redis, the hit lengths a load can end at (state models))
StoredReport = tuple[str, int, list[int]]


@dataclass
class _SaveTrack:
    """One request's saves: which chain positions were acknowledged, what is in flight."""

    ok: set[tuple[int, int, int]] = field(default_factory=set)  # (group, slice, position)
    pending: int = 0
    commit: CommitSpec | None = None
    publishing: bool = False
    # KV events: vLLM holds the request's blocks for us until this moment at most (monotonic)
    release_by: float | None = None


@dataclass(frozen=True)
class ReadyCommit:
    """A finished request whose writes are all done: its record says ``blocks``."""

    req_id: str
    commit: CommitSpec
    blocks: int


class SaveLedger:
    def __init__(self, layout: KVLayout, report_stored: bool) -> None:
        self.layout = layout
        # KV events: report each finished request's blocks confirmed in Redis (``events.py``)
        self.report_stored = report_stored
        # per group, the head slices (positions among those read) this rank writes
        self.slices_written: list[list[int]] = [[] for _ in layout.groups]
        self._lock = threading.Lock()
        self._tracks: dict[str, _SaveTrack] = {}
        self._finished: set[str] = set()  # vLLM may have these requests' blocks back
        self._reports: list[StoredReport] = []

    def opened(self, req_ids: Iterable[str]) -> None:
        """Saves of these requests are being staged."""
        with self._lock:
            for req_id in req_ids:
                self._tracks.setdefault(req_id, _SaveTrack())

    def writing(self, owners: Iterable[str]) -> None:
        """A write holding blocks of ``owners`` was submitted."""
        with self._lock:
            for owner in owners:
                self._tracks[owner].pending += 1

    def written(self, owners: Iterable[str], acked: Iterable[tuple[str, int, int, int]]) -> None:
        """That write ended; ``acked``: (owner, group, slice, position) Redis acknowledged
        (none if it failed)."""
        with self._lock:
            for owner in owners:
                track = self._tracks.get(owner)
                if track is not None:
                    track.pending -= 1
            for owner, group, head_slice, position in acked:
                track = self._tracks.get(owner)
                if track is not None:
                    track.ok.add((group, head_slice, position))

    def committed(self, commits: Iterable[CommitSpec]) -> None:
        """Finished requests' commits, from the scheduler side (every save of each was staged
        before it arrived: metadata comes in order)."""
        with self._lock:
            for commit in commits:
                track = self._tracks.setdefault(commit.req_id, _SaveTrack())
                track.commit = commit
                if not commit.holds_blocks:
                    continue  # vLLM did not hold it for us: never reported, it may be gone
                if self.report_stored:
                    # KV events: freed with its confirmed blocks (``ready``), so the step that
                    # frees it carries its event (an engine with nothing left to run takes no
                    # later step that could) -- but held EVENT_HOLD_S at most: a slow Redis
                    # must not keep the engine stepping; its event then comes later
                    track.release_by = time.monotonic() + EVENT_HOLD_S
                else:
                    # Its blocks were copied out: vLLM may reuse them now, whatever Redis does.
                    # (An engine that holds finished requests' blocks keeps stepping; holding
                    # them until a hung Redis answers burned a core for seconds.)
                    self._finished.add(commit.req_id)

    def ready(self, req_id: str) -> ReadyCommit | None:
        """The request's record, once it finished and no write of it is in flight (once: the
        caller publishes it, then calls ``published``). Also reports its confirmed blocks for
        KV events: known now, whatever the record's fate."""
        with self._lock:
            track = self._tracks.get(req_id)
            if track is None or track.commit is None or track.pending or track.publishing:
                return None
            track.publishing = True
            n = self._confirmed_blocks(track, track.commit)
            if self.report_stored:
                self._reports.append((req_id, n, self._loadable_ends(track, track.commit, n)))
                if track.release_by is not None:
                    track.release_by = None
                    self._finished.add(req_id)
            return ReadyCommit(req_id, track.commit, n)

    def published(self, req_id: str) -> None:
        """Its record was published (or failed to be): the request is done with."""
        with self._lock:
            self._tracks.pop(req_id, None)

    def take_finished(self, now: float) -> tuple[set[str], list[StoredReport]]:
        """(requests whose blocks vLLM may have back, their stored reports), taken together: a
        request is freed in the step carrying its report. A request held for KV events past its
        ``EVENT_HOLD_S`` goes now, its report later."""
        with self._lock:
            for req_id, track in self._tracks.items():
                if track.release_by is not None and now >= track.release_by:
                    track.release_by = None
                    self._finished.add(req_id)
            finished, self._finished = self._finished, set()
            reports, self._reports = self._reports, []
        return finished, reports

    def requests(self) -> set[str]:
        with self._lock:
            return set(self._tracks)

    def _confirmed_blocks(self, track: _SaveTrack, commit: CommitSpec) -> int:
        """The longest prefix a consumer can load: every needed block of every group written,
        in every slice this rank writes (each slice's record is this rank's to publish; a rank
        writing none confirms the whole chain)."""
        written = self.slices_written
        return self.layout.usable_prefix(
            lambda g, p: all((g, k, p) in track.ok for k in written[g]),
            commit.present_blocks,
            commit.num_blocks,
        )

    def _loadable_ends(self, track: _SaveTrack, commit: CommitSpec, n: int) -> list[int]:
        """A model with state groups: the hit lengths in (present, n] a load can end at --
        where every state group's state was confirmed written (in every slice this rank
        writes); the blocks before are confirmed by ``n``. Empty for other models (every
        length up to ``n`` is loadable)."""
        states = [g for g, group in enumerate(self.layout.groups) if group.is_state]
        if not states:
            return []
        written = self.slices_written
        return [
            end
            for end in range(commit.present_blocks + 1, n + 1)
            if all((g, k, end - 1) in track.ok for g in states for k in written[g])
        ]
