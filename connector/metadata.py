"""What the scheduler side tells the worker side each step (shared by both sides)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load ``hashes[i]`` into ``block_ids[i]``; in consume mode also delete ``drop_hashes``."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    consume: bool
    drop_hashes: list[str] = field(default_factory=list)


@dataclass
class SaveSpec:
    """Save the KV of ``block_ids[i]`` under ``hashes[i]`` once this step's forward is done."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]


@dataclass
class RedisConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
