"""Tensor parallelism on the worker side: which stored head slices of each KV-cache group this
rank reads and writes, and a data mover for each over the cache heads the slice covers.

A block is stored as ``store_tp_size`` head slices (``KVLayout``), each under its own
fingerprint, so ranks with different head counts (or a different TP size on the other side)
meet in the same values. A rank reads every slice that overlaps its heads; it writes the slices
within its heads, unless an earlier rank holding the same heads writes them already.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from connector.config import RedisConnectorConfig
from connector.cpu_cores import usable_cores
from connector.kv_views import group_kv_views
from connector.layout import HeadSlice, KVLayout
from datamover import BlockMover
from kvstore import LookupBuffer

logger = logging.getLogger("connector.worker")


@dataclass
class SliceMover:
    """One stored head slice of a group: the mover over the cache heads it covers, the store
    under its fingerprint, and whether this rank writes it."""

    head_slice: HeadSlice
    mover: BlockMover
    store: LookupBuffer
    writes: bool


def build_slice_movers(
    kv: Mapping[str, torch.Tensor],
    layout: KVLayout,
    store: LookupBuffer,
    config: RedisConnectorConfig,
    tp_rank: int,
    prefetch: Executor,
) -> list[list[SliceMover]]:
    """Per KV-cache group (the layout's order), a mover for each head slice this rank reads.
    The staging budget is shared by the groups by their share of the layers, then by the
    slices a group reads."""
    total = len(layout.layer_names)
    groups = []
    for group in layout.groups:
        caches = group_kv_views(kv, group, layout.block_size)
        reads = layout.slices_read(tp_rank, group.num_kv_heads)
        written = {sl.index for sl in layout.slices_written(tp_rank, group.num_kv_heads)}
        budget = config.max_inflight_bytes * len(group.layer_names) // total
        movers = []
        for sl in reads:
            a, b = sl.cache_heads
            mover = BlockMover(
                {name: t[:, a:b] for name, t in caches.items()},
                store.for_fingerprint(layout.fingerprint(sl.index)),
                max_inflight_bytes=max(1, budget // len(reads)),
                connections=config.connections,
                value_rows=(sl.value_heads, *sl.value_range),
                prefetch=prefetch,
                read_ahead=config.read_ahead_chunks,
            )
            movers.append(SliceMover(sl, mover, mover.store, sl.index in written))
        groups.append(movers)
    return groups


def slices_written(groups: list[list[SliceMover]]) -> list[list[int]]:
    """Per group, the positions (among the slices it reads) of those this rank writes."""
    return [[k for k, sm in enumerate(movers) if sm.writes] for movers in groups]


def log_slice_movers(groups: list[list[SliceMover]], layout: KVLayout, tp_rank: int) -> None:
    """One line per mover: what an operator needs to see what this rank moves, and where."""
    for group, movers in zip(layout.groups, groups, strict=True):
        for m in movers:
            logger.info(
                "RedisConnector worker (tp rank %d): group %d (%s): %d layers, head slice "
                "%d of %d (%s), block %s %s on %s, value %d bytes, chunks of %d blocks, "
                "%d MiB staging, %d connection(s) per batch, its threads on %d core(s), keys %s",
                tp_rank,
                group.index,
                group.kind,
                len(group.layer_names),
                m.head_slice.index,
                layout.store_tp_size,
                "reads and writes" if m.writes else "reads",
                list(m.mover.value_shape),
                m.mover.kv.dtype,
                m.mover.kv.device,
                m.mover.raw_bytes,
                m.mover.chunk_blocks,
                m.mover.staging_bytes >> 20,
                m.mover.connections,
                # (vLLM pins a CPU worker to its cores: the connector's threads inherit that)
                usable_cores(),
                m.store.key_pattern(),
            )
