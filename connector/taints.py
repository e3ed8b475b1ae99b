"""Blocks with wrong KV left in vLLM's prefix cache by a failed split, and the screen that keeps
every request off them until they are computed again.

vLLM caches a split's blocks when it allocates them and, under kv_load_failure_policy=recompute,
does not evict them when the split fails: their KV is wrong -- not loaded, or computed over what
was not -- and so is what any request of the same step computed over them. The split's own
request computes them again; until a request has, a request that would run on them is made to
compute them again too, its step reported as failed on them (the same path as a failed load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.metadata import LoadSpec
from connector.request_state import RequestState
from connector.stats import StatsBuffer

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass(frozen=True)
class StepBlocks:
    """One request's blocks in one step (first KV-cache group): what it runs on, computed
    before the step; what it completes from their first token on; the full blocks it computes
    (vLLM caches them as it allocates them)."""

    context: list[int]
    whole: list[int]
    cached: list[int]


def step_blocks(
    scheduler_output: SchedulerOutput,
    progress: list[tuple[str, int]],
    requests: Mapping[str, RequestState],
    block_size: int,
) -> dict[str, StepBlocks]:
    """What each scheduled request's step runs on and computes, in block ids (first KV-cache
    group), from (request, tokens computed before the step)."""
    bs = block_size
    rows: dict[str, StepBlocks] = {}
    for req_id, computed in progress:
        ids = requests[req_id].block_ids
        table = ids[0] if ids else []
        done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        rows[req_id] = StepBlocks(
            context=table[: computed // bs],
            whole=table[-(-computed // bs) : done // bs],
            cached=table[computed // bs : done // bs],
        )
    return rows


class TaintedBlocks:
    """The block ids (first KV-cache group) vLLM's prefix cache holds with wrong KV after a
    failed split (``blocks``), and what each request of the running splits' step ran on and
    computed (``step``): a failed split taints what its same-step readers computed too."""

    def __init__(self, block_size: int, stats: StatsBuffer) -> None:
        self.block_size = block_size
        self.stats = stats
        self.blocks: set[int] = set()
        self.step: dict[str, StepBlocks] = {}

    def remember_step(self, rows: dict[str, StepBlocks]) -> None:
        """The blocks of the step that runs splits: what their failure would taint."""
        self.step = rows

    def forget_step(self) -> None:
        """The splits' step is over (its output came in, or the next step is built)."""
        self.step = {}

    def taint(self, st: RequestState, position: int) -> None:
        """A split of this request failed from chain position ``position``: vLLM keeps its
        blocks from there on in its prefix cache (it allocated them cached, and under
        kv_load_failure_policy=recompute does not evict them) holding KV that is wrong -- not
        loaded, or computed over what was not. Its request computes them again; until a
        request has, no other may run on them (``screen``)."""
        if st.block_ids:  # (only full blocks are cached)
            self.blocks.update(st.block_ids[0][position : st.computed_tokens // self.block_size])

    def taint_readers(self, failed: set[int]) -> None:
        """A split of the step whose output came in failed on ``failed``. vLLM caches a
        split's blocks when it allocates them, so a request admitted after it in the same
        step may have run on them as a local hit: vLLM rewinds such a request, but the full
        blocks it computed over them stay in its prefix cache with wrong KV until it computes
        them again -- which it never does if it is aborted or preempted first. Taint them
        (``screen`` then keeps everyone off them), and what any request of the step computed
        over those, settled until nothing changes."""
        bad = set(failed)
        rows = self.step
        while True:
            more = {b for row in rows.values() if bad.intersection(row.context) for b in row.cached}
            if more <= bad:
                break
            bad |= more
        self.blocks |= bad

    def screen(
        self,
        rows: dict[str, StepBlocks],
        fresh: dict[str, list[int]],
        loads: list[LoadSpec],
    ) -> tuple[list[int], set[str]]:
        """The tainted blocks this step's requests (``rows``) would run on: reported as failed
        blocks with this step's output, so vLLM drops those requests' tokens and computes the
        blocks again -- the same path as a failed load. A block is clean again once vLLM handed
        it out afresh (``fresh``: its old prefix-cache entry is gone), a load of this step
        (``loads``) writes it whole, or a request whose own context is clean computed all of
        it. A request whose context holds a tainted block taints what it computes too (vLLM
        caches it when it allocates it, so another request of the same step may read it):
        settled until nothing changes. Returns the blocks to report and the requests that run
        on them (nothing they compute now is saved)."""
        context = {r: row.context for r, row in rows.items()}
        whole = {r: row.whole for r, row in rows.items()}
        cached = {r: row.cached for r, row in rows.items()}
        for handed_out in fresh.values():  # out of the prefix cache: what it held is gone
            self.blocks.difference_update(handed_out)
        for spec in loads:  # written whole by a load (a failed one taints anew)
            self.blocks.difference_update(spec.block_ids[0] if spec.block_ids else [])
        bad: set[str] = set()
        while True:
            cleaned = {b for r, ids in whole.items() if r not in bad for b in ids}
            tainted = (self.blocks | {b for r in bad for b in cached[r]}) - cleaned
            now_bad = {r for r, ids in context.items() if any(b in tainted for b in ids)}
            if now_bad <= bad:
                break
            bad |= now_bad
        rejected = {b for r in bad for b in context[r] if b in tainted}
        self.blocks = tainted
        if rejected:
            self.stats.add(tainted_blocks_rejected=len(rejected))
        return sorted(rejected), bad
