"""What the scheduler side tells the worker side each step (shared by both sides)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connector.figures import StepShape
from connector.probes import ProbeSpec
from kvstore.values.keys import BlockName


@dataclass
class LoadSpec:
    """Load the block named ``names[g][i]`` into ``block_ids[g][i]`` of each KV-cache group ``g``
    (the layout's groups, in order; a null block id is skipped) within ``timeout_s`` (the rest of
    the request's deadline, counted from when the worker receives it). Consume mode: first
    claim handoff ``claim`` for ``owner`` -- another owner's claim means not ours: nothing is
    loaded. (The scheduler side deletes the chain once every rank has finished.)

    ``layered``: a split load (``load_policy.py``), synchronous: it lands during this step's
    forward pass, band of layers by band of layers, each before the layers that read it run
    (``wait_for_layer_load``); it ends with the step, whatever has not landed failed. Never
    reported finished: vLLM did not hold the request for it."""

    req_id: str
    block_ids: list[list[int]]
    names: list[list[BlockName]]
    timeout_s: float
    claim: str | None = None
    owner: str = ""
    layered: bool = False


@dataclass
class SaveSpec:
    """Save the KV of ``block_ids[g][i]`` of each KV-cache group ``g`` under the block name
    ``names[g][i]`` once this step's forward is done (a null block id, or ``NO_BLOCK`` -- a
    state group's place in an attention save, the attention groups' in a state's -- is
    skipped); position ``i`` is block ``first_position + i`` of the request's chain
    ``handoff``."""

    req_id: str
    block_ids: list[list[int]]
    names: list[list[BlockName]]
    first_position: int
    handoff: str


@dataclass
class CommitSpec:
    """The request finished: once its saves are acknowledged, publish how many leading blocks
    of the chain are in Redis. Blocks below ``present_blocks`` were there already (share mode)
    and were not saved again. ``holds_blocks``: vLLM keeps the request's blocks until the
    worker reports it finished sending (once it has taken this commit, every save of the
    request was staged); only for a request whose saves were planned and that is not
    loading."""

    req_id: str
    handoff: str
    num_blocks: int
    present_blocks: int
    holds_blocks: bool = True


@dataclass
class RedisConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    commits: list[CommitSpec] = field(default_factory=list)
    # what this step's forward pass computes, for the load policy's figures (figures.py)
    step: StepShape = field(default_factory=StepShape)
    # background reads that measure the store for the load policy (probes.py)
    probes: list[ProbeSpec] = field(default_factory=list)
    # the probes the workers run on their own while no step comes, from now on (``None``: the
    # ones they have; empty: none; ``idle_probes.py``)
    idle_probes: list[ProbeSpec] | None = None
    # blocks to report failed with this step's output: left wrong in vLLM's prefix cache by a
    # failed split, about to be read by this step's requests (taints.py)
    reject_blocks: list[int] = field(default_factory=list)
