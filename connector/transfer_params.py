"""``kv_transfer_params`` between a producer and its consumer: what a producer returns for a
request it saved (:func:`producer_params`), and what a consumer accepts of what a proxy copied
in (:func:`read_handoff`): only params that are ours and match this instance and this prompt --
namespace, block size, how blocks are cut into KV-head slices, the namespace's generation, and
the chain's last hash. Anything else is a problem the caller counts and logs; the request then
computes its prompt. Nothing here imports vLLM.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from connector.chains import RequestChains
from connector.config import TRANSFER_PARAMS_KEY
from connector.layout import ChainNames, KVLayout
from kvstore.values.keys import NAME_RE, block_name


@dataclass
class Handoff:
    """A producer's handoff, read from validated ``kv_transfer_params``."""

    handoff_id: str
    num_blocks: int
    scoped: bool  # the chain is salted with the handoff id (consume mode): ours alone
    # the producer saw its "pending" record in Redis before it answered; if not, a missing
    # record may still come (its producer lags), and is waited for as "pending" is
    opened: bool = True
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)  # who claims it


@dataclass(frozen=True)
class ThisInstance:
    """What a producer's params must match here."""

    namespace: str
    block_size: int
    layout: KVLayout


def last_hash(chain: Sequence[str], num_blocks: int, generation: int) -> str:
    """What params name the last of a chain's ``num_blocks`` saved blocks by: its position's
    name in ``generation``, without a group (a model of one attention group's block name)."""
    return block_name(chain[num_blocks - 1], generation)


def read_handoff(
    params: Any, here: ThisInstance, chains: RequestChains, shared: ChainNames
) -> tuple[Handoff | None, ChainNames, str | None]:
    """The producer's handoff in a request's ``kv_transfer_params`` and the names of the chain
    it wrote, if the params are ours and match; else (None, the shared chain's, the problem --
    None when the request carries no params of ours)."""
    ours = params.get(TRANSFER_PARAMS_KEY) if isinstance(params, dict) else None
    if ours is None:
        return None, shared, None
    layout = here.layout
    problem: str
    if not isinstance(ours, dict):
        problem = "not a mapping"
    elif ours.get("namespace") != here.namespace:
        problem = f"namespace {ours.get('namespace')!r} is not {here.namespace!r}"
    elif ours.get("block_size") != here.block_size:
        problem = f"block size {ours.get('block_size')!r} is not {here.block_size}"
    elif ours.get("store_tp_size", layout.store_tp_size) != layout.store_tp_size:
        problem = (
            f"store_tp_size {ours.get('store_tp_size')!r} is not "
            f"{layout.store_tp_size}: set the same store_tp_size on producer and "
            "consumer to share blocks across TP sizes"
        )
    elif ours.get("generation", 0) != chains.generation:
        problem = (
            f"generation: the producer saved in generation {ours.get('generation', 0)!r}, "
            f"this instance names blocks in {chains.generation} (the namespace was reset "
            "in between; nothing saved before a reset is loaded)"
        )
    elif bool(ours.get("tp_shared", False)) != layout.tp_shared:
        problem = (
            f"tp_shared: the producer {'set' if ours.get('tp_shared') else 'left unset'} "
            f"store_tp_size, this instance {'set' if layout.tp_shared else 'left'} it"
            f"{'' if layout.tp_shared else ' unset'} (blocks are shared across TP sizes "
            "only between instances that both set it)"
        )
    elif ours.get("tp_scope", layout.tp_scope) != layout.tp_scope:
        problem = (
            f"tp_scope: the producer's blocks are for TP {ours.get('tp_scope')!r}, this "
            f"instance runs TP {layout.tp_size} (KV computed at another TP size is not "
            "bit-identical; set the same store_tp_size on both to share it anyway)"
        )
    else:
        handoff_id, n = ours.get("handoff"), ours.get("num_blocks")
        scoped = ours.get("scope") == "handoff"
        if not isinstance(handoff_id, str) or not NAME_RE.match(handoff_id):
            problem = "no valid handoff id"
        elif not isinstance(n, int) or not 0 < n <= len(shared):
            problem = f"num_blocks {n!r} does not fit a prompt of {len(shared)} blocks"
        else:
            chain = chains.handoff(handoff_id, n) if scoped else shared.chain
            if ours.get("last_hash") == last_hash(chain, n, chains.generation):
                handoff = Handoff(handoff_id, n, scoped, ours.get("opened") is not False)
                names = layout.chain_names(chain, chains.generation) if scoped else shared
                return handoff, names, None
            problem = "last_hash does not match this prompt (another model or prompt?)"
    return None, shared, problem


def producer_params(
    here: ThisInstance,
    *,
    handoff: str,
    consume: bool,
    saved: ChainNames,
    num_blocks: int,
    opened: bool,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer returns for the first ``num_blocks`` blocks of
    the chain ``saved`` saved."""
    layout = here.layout
    return {
        TRANSFER_PARAMS_KEY: {
            "handoff": handoff,
            "scope": "handoff" if consume else "shared",
            "num_blocks": num_blocks,
            "last_hash": last_hash(saved.chain, num_blocks, saved.generation),
            "namespace": here.namespace,
            "block_size": here.block_size,
            # how blocks are cut into KV-head slices: the consumer must read them so; and
            # the TP size they are kept apart for, if any
            "store_tp_size": layout.store_tp_size,
            "tp_scope": layout.tp_scope,
            "tp_shared": layout.tp_shared,
            # the namespace's generation its chain is named in (a reset between the two
            # makes the consumer compute the prompt)
            "generation": saved.generation,
            # whether the "pending" record was in Redis before this answer: if not, the
            # consumer waits for a record that is not there yet instead of taking it for
            # evicted (a one-step prefill answers before its background write lands)
            "opened": opened,
        }
    }
