"""Save planning: each scheduler step, which blocks of which requests the worker saves (the
``SaveSpec`` list of ``RedisConnectorMetadata.saves``).

It is apart from the request state machine (``scheduler.py``; the state, ``request_state.py``)
because it answers no vLLM callback about one request: it is one pass over every request a step
schedules, from their block tables and the tokens the step computes -- the prompt blocks the
step completes, and the states vLLM offers at block boundaries (state groups) -- and it decides
what is safe to put in the pool: nothing Redis holds already, nothing computed over a split
load that may have failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from connector.layout import NO_BLOCK, NULL_BLOCK_ID, KVGroup, KVLayout
from connector.metadata import LoadSpec, SaveSpec
from connector.request_state import RequestState
from connector.save_policy import SaveAllowance
from connector.stats import StatsBuffer
from kvstore import KVStoreError, LookupBuffer

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

# the scheduler side's log: its lines keep the name they are filtered by
logger = logging.getLogger("connector.scheduler")


class SavePlanner:
    """Plans each step's saves (``plan``) of the requests the scheduler keeps; what it reads of
    each, and records through its methods, is in its ``RequestState`` (``saved_blocks``,
    ``save_start``, ...), shared with the state machine, which answers from it and commits what
    was saved."""

    def __init__(
        self,
        layout: KVLayout,
        store: LookupBuffer,
        fingerprints: list[str],
        stats: StatsBuffer,
        background_io: Executor,
        on_background_done: Callable[[Future[Any]], None],
        allowance: SaveAllowance | None = None,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.store = store
        self.fingerprints = fingerprints
        self.stats = stats
        # "pending" records are written here, and each is handed to on_background_done once
        # written (a failure is logged and counted there)
        self._background_io = background_io
        self._on_background_done = on_background_done
        # how many leading blocks of a request the save policy lets it write (None: all)
        self._allowance = allowance
        # vLLM's group index -> the layout's, for state groups (saved from vLLM's offers)
        self._state_groups = {g.index: i for i, g in enumerate(layout.groups) if g.is_state}
        self._groups = range(len(layout.groups))
        self._attention = any(not g.is_state for g in layout.groups)
        # the requests of the last step planned whose saves wait for its output because they
        # ran on a split's blocks (``plan``)
        self.held_for_splits: set[str] = set()

    def plan(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, RequestState],
        progress: list[tuple[str, int]],
        held: set[str],
        loads: list[LoadSpec],
    ) -> list[SaveSpec]:
        """This step's saves: of each request the step runs (``progress``: the request, and
        the tokens it had computed before the step) that is running and not ``held``, the
        prompt blocks the step completes and Redis lacks; and the states vLLM offers (state
        groups). ``loads``: the step's loads (a split's readers are held too,
        ``_reading_splits``)."""
        reading_splits = self._reading_splits(progress, loads, requests)
        # (not one that runs on tainted blocks: those are rejected, never finished)
        self.held_for_splits = reading_splits - held
        held = held | reading_splits
        saves: list[SaveSpec] = []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for req_id, computed in progress:
            st = requests[req_id]
            if not st.running or req_id in held:
                continue
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            live = block_state.get_block_ids(req_id) if block_state is not None else None
            spec = self.plan_request(req_id, st, done, computed=computed, live=live)
            if spec is not None:
                saves.append(spec)
        if self._state_groups:
            saves += self._state_saves(scheduler_output, requests)
        return saves

    def plan_request(
        self,
        req_id: str,
        st: RequestState,
        done: int,
        *,
        computed: int = 0,
        live: Sequence[Sequence[int]] | None = None,
    ) -> SaveSpec | None:
        """The save of the prompt blocks a running request has completed with ``done``
        tokens computed (``computed`` before this step) that Redis lacks and it has not saved
        (None: none to save yet). ``live``: vLLM's block table of the request now, where it
        offers it (``kv_connector_block_state``)."""
        if not self._settle_presence(st, final=done >= st.num_tokens):
            return None
        full = min(done // self.block_size, len(st.save_names), self._positional_blocks(st))
        full = self._allowed(st, full)
        if full <= st.saved_blocks:
            return None
        self._open_saves(st)
        spec = SaveSpec(
            req_id=req_id,
            # a state group's blocks are saved only when vLLM offers them
            block_ids=[
                [NO_BLOCK] * (full - st.saved_blocks)
                if g.is_state
                else self._still_held(g, ids, live, computed)[st.saved_blocks : full]
                for g, ids in zip(self.layout.groups, st.block_ids, strict=True)
            ],
            names=st.save_names.span(st.saved_blocks, full),
            first_position=st.saved_blocks,
            handoff=st.save_handoff,
        )
        st.saved_up_to(full)
        return spec

    def _still_held(
        self,
        group: KVGroup,
        ids: list[int],
        live: Sequence[Sequence[int]] | None,
        computed: int,
    ) -> list[int]:
        """``ids`` (the request's blocks of ``group`` as the connector tracked them) with vLLM's
        null block wherever vLLM may have freed the block since: a windowed group's blocks
        that left the window. vLLM's table only grows in the connector's copy, but vLLM frees
        those blocks -- and may give them to another request in the same step -- so a save
        planned late (held for the presence lookup) read another request's KV under this
        one's key (a review's, sliding window + full attention). vLLM's own table where it
        offers it, else every block the window has passed by ``computed`` tokens."""
        if not group.windowed:
            return ids
        if live is not None and group.index < len(live):
            now = list(live[group.index])
            return [b if i < len(now) and now[i] == b else NULL_BLOCK_ID for i, b in enumerate(ids)]
        freed = min(len(ids), group.kind.freed_before(computed, self.block_size))
        return [NULL_BLOCK_ID] * freed + ids[freed:]

    def _allowed(self, st: RequestState, full: int) -> int:
        """``full`` blocks cut to what the save policy allows the request (``save_policy.py``),
        decided at its first planned save, when what Redis holds of its chain is known; the
        blocks past it are counted as skipped, once each."""
        if self._allowance is None or not st.same_chain:
            return full
        allowance = st.save_allowance
        if allowance is None:
            head = st.save_names.first_group(0, 1)[0] if len(st.save_names) else None
            in_redis = st.present_blocks >= 1 or st.saved_blocks >= 1
            allowance = self._allowance.blocks(head, in_redis, st.save_marked)
            st.saves_allowed(allowance)
        if full <= allowance:
            return full
        skipped = full - max(allowance, st.save_skipped_to)
        if skipped > 0:
            self.stats.add(blocks_save_skipped=skipped)
            st.saves_skipped_to(full)
        return allowance

    def _settle_presence(self, st: RequestState, final: bool) -> bool:
        """Whether the request's saves may be planned: what Redis holds of its chain is known
        (``saved_blocks`` then starts after it), or cannot be learned in time -- its deadline,
        or ``final``: this step computes the rest of its prompt, and it may finish with it --
        or at all (a failed lookup, a reset). Then everything is saved: a block written twice
        is only wasted, a block never written back is lost to every other instance."""
        lookup = st.presence
        if lookup is None:
            return True
        if not lookup.future.done() and not final and time.monotonic() < st.deadline:
            return False
        st.presence_settled()
        if not lookup.future.done() or lookup.future.cancelled():
            return True
        try:
            result = lookup.future.result()
        except Exception as exc:  # whatever it was, the saves go on (all of them)
            self.stats.add(redis_errors=1)
            if not isinstance(exc, KVStoreError):
                logger.warning("Redis lookup raised %r; saving the whole prompt", exc)
            return True
        if result.generation == st.generation and st.save_start is None:
            # (a save already planned -- a state group's offer -- started from the front:
            # its commit confirms from there, so everything is saved)
            st.found_in_redis(result.present)
        return True

    def _reading_splits(
        self,
        progress: list[tuple[str, int]],
        loads: list[LoadSpec],
        requests: Mapping[str, RequestState],
    ) -> set[str]:
        """This step's requests that run on blocks a split of this step loads (the split's
        own request, and any whose prefix-cache hit is on them): what they compute depends on
        the split landing, on every TP rank, which only the step's output says. Their blocks
        are saved a step later -- never to put KV computed over a failed load in the pool."""
        loading = {b for spec in loads if spec.layered for b in spec.block_ids[0]}
        if not loading:
            return set()
        bs = self.block_size
        out = set()
        for req_id, computed in progress:
            ids = requests[req_id].block_ids
            if ids and loading.intersection(ids[0][: computed // bs]):
                out.add(req_id)
        return out

    def _positional_blocks(self, st: RequestState) -> int:
        """The blocks every attention group's table holds (a state group's table is as long
        as the sequence, and is not read by position)."""
        if not st.block_ids:
            return 0
        groups = zip(self.layout.groups, st.block_ids, strict=True)
        return min((len(ids) for g, ids in groups if not g.is_state), default=0)

    def _open_saves(self, st: RequestState) -> None:
        """A request's first save: write its "pending" record, so a consumer that finds the
        blocks before the commit record knows to wait."""
        if st.save_start is None:
            opening = self._background_io.submit(
                self.store.open_handoff, st.save_handoff, self.fingerprints
            )
            st.saves_opened(opening)
            opening.add_done_callback(self._on_background_done)

    def _state_saves(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, RequestState]
    ) -> list[SaveSpec]:
        """The states vLLM committed this step at block boundaries (align mode), each saved at
        its chain position from the exact block vLLM names: a state table is rewritten in
        place, so no other block of it is safe to read. Only positions of the request's prompt
        chain, not in Redis already (a loaded state is offered again once cached) nor saved."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        specs = []
        for req_id, entries in offers.items():
            st = requests.get(req_id)
            if st is None or not st.running:
                continue
            for engine_group, block_id, boundary in entries:
                g = self._state_groups.get(engine_group)
                p = boundary // self.block_size - 1
                if (
                    g is None
                    or block_id == NULL_BLOCK_ID
                    or boundary % self.block_size
                    or not 0 <= p < len(st.save_names)
                    or (st.same_chain and p < st.present_blocks)
                    or (g, p) in st.states_saved
                ):
                    continue
                st.state_saved(g, p)
                self._open_saves(st)
                if not self._attention:  # a model of states alone: its chain is its states'
                    st.saved_up_to(p + 1)
                specs.append(
                    SaveSpec(
                        req_id=req_id,
                        block_ids=[[block_id if i == g else NO_BLOCK] for i in self._groups],
                        names=st.save_names.span(p, p + 1),
                        first_position=p,
                        handoff=st.save_handoff,
                    )
                )
        return specs
