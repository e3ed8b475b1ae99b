"""The loads this instance has planned, from their plan until vLLM reports them finished: which
chain blocks each is writing (share mode: a request needing them waits for that load, and then
finds them in vLLM's own prefix cache), which block ids (so a failed block vLLM reports is traced
to its request and chain position), and what each delivered -- counted once per request, when
vLLM says every rank has finished (a worker's own count would add up over TP ranks).
"""

from __future__ import annotations

from connector.request_state import RequestState
from connector.stats import StatsBuffer
from kvstore.values.keys import BlockName


class LoadTracker:
    def __init__(self, block_size: int, stats: StatsBuffer) -> None:
        self.block_size = block_size
        self.stats = stats
        # a position's block name (its first group's) -> the request loading it now (share mode)
        self.loading: dict[BlockName, str] = {}
        # block id -> (request, chain position) of blocks being loaded, to repair failed loads
        self.blocks: dict[int, tuple[str, int]] = {}
        # request -> [first, end, first failed] chain positions of its load
        self.outcomes: dict[str, list[int]] = {}
        # a request finished while its load runs -> its traced block ids, kept until vLLM says
        # the load finished: the load's failed blocks come until then (``release``)
        self._traced_after_finish: dict[str, list[int]] = {}

    def loading_elsewhere(self, names: list[BlockName], req_id: str) -> bool:
        """Whether another request of this instance is loading any of these positions (named by
        their first group's blocks) now."""
        return any(self.loading.get(n, req_id) != req_id for n in names)

    def planned(
        self,
        req_id: str,
        st: RequestState,
        *,
        others_wait: bool,
        traces_blocks: bool,
    ) -> None:
        """The load of ``st.load_range`` is planned. ``others_wait``: other requests wait for
        its blocks (share mode, an asynchronous load); ``traces_blocks``: vLLM reports its
        failed blocks one by one (else it hears of the whole request)."""
        start, end = st.load_range
        if others_wait:
            for name in st.load_names.first_group(start, end):
                self.loading[name] = req_id
        if traces_blocks:
            for pos in range(start, end):
                self.blocks[st.block_ids[0][pos]] = (req_id, pos)
        self.outcomes[req_id] = [start, end, end]

    def block_failed(self, block_id: int) -> tuple[str, int] | None:
        """vLLM reports this block invalid: the (request, chain position) it was loaded for, if
        any; its load counts as failed from there on (vLLM recomputes from it)."""
        owner = self.blocks.get(block_id)
        if owner is None:
            return None
        outcome = self.outcomes.get(owner[0])
        if outcome is not None:
            outcome[2] = min(outcome[2], owner[1])
        return owner

    def load_failed(self, req_id: str) -> None:
        """The request's load failed as a whole (several groups, or a windowed one): vLLM
        recomputes the whole prompt."""
        outcome = self.outcomes.get(req_id)
        if outcome is not None:
            outcome[2] = outcome[0]

    def count(self, req_id: str) -> None:
        """A load vLLM reports finished on every rank: what it delivered, once per request."""
        for block_id in self._traced_after_finish.pop(req_id, ()):
            if self.blocks.get(block_id, ("",))[0] == req_id:
                del self.blocks[block_id]
        outcome = self.outcomes.pop(req_id, None)
        if outcome is None:
            return
        start, end, failed = outcome
        self.stats.add(
            loads=1,
            blocks_loaded=failed - start,
            tokens_loaded=(failed - start) * self.block_size,
            blocks_load_failed=end - failed,
            tokens_load_failed=(end - failed) * self.block_size,
        )

    def release(self, req_id: str, st: RequestState, *, load_runs: bool = False) -> None:
        """Forget the blocks this request was loading (share mode: others stop waiting).
        ``load_runs``: the request finished while its load runs -- vLLM holds its blocks and
        reports the load's failed ones until the load finishes, so their trace stays until
        ``count`` (released at once, a load that failed as its request was aborted, or under
        ``kv_load_failure_policy=fail``, which ends the request first, was counted loaded)."""
        start, end = st.load_range
        for name in st.load_names.first_group(start, end):
            if self.loading.get(name) == req_id:
                del self.loading[name]
        traced = list(st.block_ids[0][start:end]) if st.block_ids else []
        if load_runs and req_id in self.outcomes:
            self._traced_after_finish[req_id] = traced
        else:
            for block_id in traced:
                if self.blocks.get(block_id, ("",))[0] == req_id:
                    del self.blocks[block_id]
        st.load_released()
