"""Consume mode, worker side: a load (whole or split) claims its request's handoff before it
reads, so exactly one request loads one handoff. (The scheduler side deletes the chain once
every rank has finished loading it: ``consumed_handoffs.py``.)
"""

from __future__ import annotations

from connector.metadata import LoadSpec
from connector.worker_context import WorkerContext
from kvstore import Claim


def claim_handoff(ctx: WorkerContext, spec: LoadSpec) -> bool:
    """Claim the load's handoff for it (True with nothing to claim); False when another
    request took it first. Raises the store's errors."""
    if spec.claim is None:
        return True
    claim = ctx.store.claim_handoff(spec.claim, ctx.layout.all_fingerprints(), owner=spec.owner)
    if claim is Claim.TAKEN:  # another request took it first: not ours to touch
        ctx.stats.add(handoffs_lost=1)
        ctx.warn(
            "claim",
            "request %(req)s: its handoff was taken by another request (a retried "
            "request?); recomputing (%(total)d so far)",
            req=spec.req_id,
        )
        return False
    return True
