"""The views of vLLM's KV caches the data movers read and write: one row per block the
scheduler names, ``[blocks, heads, tokens, content]``, whatever kernel block size the attention
backend split the cache into. Worker side; imports torch and the layout only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from connector.layout import KVGroup


def group_kv_views(
    kv: Mapping[str, torch.Tensor], group: KVGroup, block_size: int
) -> dict[str, torch.Tensor]:
    """The group's per-layer caches as ``[blocks, heads, ...]`` views, one row per block
    vLLM's scheduler names. A cache vLLM split into kernel blocks (its attention kernel
    takes smaller blocks than the manager's: ``prepare_kernel_block_sizes``) holds block
    ``b`` in kernel blocks ``[b * r, (b + 1) * r)``: viewed as ``[blocks, heads, r, kernel
    tokens, content]``, a block's bytes are its logical ``[heads, tokens, content]`` ones,
    so split and unsplit instances store the same values."""
    caches = {name: kv[name] for name in group.layer_names}
    first = next(iter(caches.values()))
    shape = tuple(first.shape[1:])
    for name, t in caches.items():
        if tuple(t.shape[1:]) != shape or t.dtype != first.dtype:
            raise ValueError(f"RedisConnector: layer {name} has a different KV block shape")
    tokens = group.block_tokens or block_size
    split = tokens // shape[1] if len(shape) == 3 and shape[1] and tokens % shape[1] == 0 else 0
    if (
        shape[0] != group.num_kv_heads
        or not split
        or first.shape[0] % split
        or (group.is_state and shape[1:] != (1, group.head_size))
    ):
        raise ValueError(
            f"RedisConnector: unexpected per-layer KV view {tuple(first.shape)}; expected "
            f"[blocks, {group.num_kv_heads}, {tokens}, "
            f"{group.head_size if group.is_state else 'content'}] (or kernel blocks of a "
            "whole fraction of its tokens)"
        )
    if split > 1:
        caches = {
            name: t.unflatten(0, (t.shape[0] // split, split)).transpose(1, 2)
            for name, t in caches.items()
        }
    return caches
