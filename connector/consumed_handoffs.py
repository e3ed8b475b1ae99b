"""Consume mode leaves nothing behind: a handoff chain is salted for its one request, which
deletes it (chain and record) once done with it. A handoff it loads is claimed by the worker as
it reads (the claim's id goes with the load) and deleted once vLLM reports every rank finished
reading it -- several ranks may read one value; one it will not load (a local hit, a deadline,
an abort) is claimed and deleted off the request's path (``drops.py``). Share mode's chains are
the pool's: none of this applies.
"""

from __future__ import annotations

from collections.abc import Callable

from connector.drops import HandoffDrops
from connector.request_state import RequestState
from connector.transfer_params import Handoff
from kvstore.values.keys import BlockName


class ConsumedHandoffs:
    def __init__(self, consume: bool, drops: HandoffDrops) -> None:
        self._consume = consume
        self._drops = drops
        # request -> the handoff it is loading (and its block names), deleted once every rank
        # is done
        self.loading: dict[str, tuple[Handoff, list[BlockName]]] = {}
        # request -> its dropped handoff held for the store's probe (``probes.py``)
        self.held: dict[str, str] = {}

    def owns(self, st: RequestState) -> bool:
        """A consume-mode handoff chain is this request's alone: it deletes it when done."""
        return self._consume and st.handoff is not None and st.handoff.scoped

    def claim_for_load(self, req_id: str, st: RequestState) -> str | None:
        """The request loads its handoff: the claim its worker makes (None: nothing to claim)."""
        if not self.owns(st):
            return None
        claim = st.handoff_claimed()
        assert st.handoff is not None
        self.loading[req_id] = (st.handoff, st.load_names.by_position())
        return claim

    def drop_unloaded(self, req_id: str, st: RequestState, hold_s: float = 0.0) -> None:
        """Claim a handoff this request will not load (e.g. vLLM's local prefix cache had its
        blocks) and delete its blocks and record, once its producer is done writing them and
        ``hold_s`` has passed or :meth:`release_unneeded` let it go (a probe of the store reads
        them meanwhile)."""
        handoff = st.handoff
        if handoff is None or not self.owns(st) or not st.handoff_waiting:
            return
        st.handoff_dropped()
        if hold_s > 0:
            self.held[req_id] = handoff.handoff_id
        self._drops.drop(
            handoff.handoff_id,
            handoff.owner,
            st.load_names.by_position(),
            expect_record=not handoff.opened,
            hold_s=hold_s,
        )

    def release_unneeded(self, needed: Callable[[str], bool]) -> None:
        """Let the held handoffs go whose requests' blocks the probes no longer need."""
        for req_id, handoff_id in list(self.held.items()):
            if not needed(req_id):
                del self.held[req_id]
                self._drops.release(handoff_id)

    def loaded(self, req_id: str) -> None:
        """Every rank is done loading the request's handoff (aborted or not): delete it."""
        consumed = self.loading.pop(req_id, None)
        if consumed is not None:
            handoff, names = consumed
            self._drops.drop(handoff.handoff_id, handoff.owner, names, expect_record=False)
