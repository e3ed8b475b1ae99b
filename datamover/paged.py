"""A paged KV cache as the data mover sees it: one tensor per layer, ``[num_blocks,
*block_shape]``, any strides (the logical view an engine presents over its physical layout).
Blocks move in batches with one op per layer, never one per block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class PagedKV:
    def __init__(self, caches: Mapping[str, torch.Tensor]) -> None:
        if not caches:
            raise ValueError("no KV cache tensors given")
        self.caches = dict(caches)
        self.names = tuple(self.caches)
        first = next(iter(self.caches.values()))
        self.num_blocks = int(first.shape[0])
        self.block_shape = tuple(int(s) for s in first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"KV caches on {self.device.type} are not supported: the data mover copies "
                "blocks on CUDA or CPU caches only"
            )
        for name, t in self.caches.items():
            if (
                tuple(t.shape[1:]) != self.block_shape
                or t.dtype != self.dtype
                or t.device != self.device
            ):
                shape = ", ".join(map(str, self.block_shape))
                raise ValueError(
                    f"layer {name} is {t.dtype} {list(t.shape)} on {t.device}; every layer "
                    f"must be {self.dtype} [blocks, {shape}] on {self.device}"
                )
        numel = 1
        for s in self.block_shape:
            numel *= s
        self.layer_bytes = numel * self.dtype.itemsize  # one block of one layer
        self.block_bytes = self.layer_bytes * len(self.names)  # one block, every layer
        # one-byte float caches (fp8) move as bytes: the same bits, and index_copy_ (the CUDA
        # scatter) has no fp8 kernel on every torch build (none on the CPU in torch 2.13)
        self._moved_as = torch.uint8 if self.dtype.itemsize == 1 else self.dtype
        # the views each device's copies use: torch ops on CUDA, numpy on the CPU (_host_copy)
        self._moved = [t.view(self._moved_as) for t in self.caches.values()] if self.on_cuda else []
        self._host = [] if self.on_cuda else [_bits(t) for t in self.caches.values()]

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out``, a contiguous
        ``[layers, n, *block_shape]`` tensor on the cache's device (or, for a CPU cache, in
        host staging): one ``index_select`` per layer, on the current stream; on the CPU one
        copy per run of consecutive ids (``_host_copy``)."""
        if not self.on_cuda:
            staged = _bits(out)
            runs = self._host_runs(block_ids)
            for layer, cache in enumerate(self._host):
                for first, at, n in runs:
                    _host_copy(staged[layer, at : at + n], cache[first : first + n])
            return
        out = out.view(self._moved_as)
        for layer, cache in enumerate(self._moved):
            torch.index_select(cache, 0, block_ids, out=out[layer])

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor, first_layer: int = 0) -> None:
        """Write ``src`` (``[n, layers, *block_shape]``, any strides, on the cache's device)
        into blocks ``block_ids`` of layers ``first_layer`` on (all of them by default; a
        layer-by-layer load writes a band of layers at a time): one ``index_copy_`` per layer,
        on the current stream. On the CPU, where ``index_copy_`` runs at a sixth of ``copy_``'s
        speed (measured: 0.5 against 3-4.6 GB/s), runs of consecutive block ids are copied as
        slices instead (``_host_copy``)."""
        layers = range(first_layer, first_layer + int(src.shape[1]))
        if not 0 <= first_layer <= layers.stop <= len(self.names):
            raise IndexError(f"layers {layers} are not among the cache's {len(self.names)}")
        if self.on_cuda:
            src = src.view(self._moved_as)
            for i, layer in enumerate(layers):
                self._moved[layer].index_copy_(0, block_ids, src[:, i])
            return
        rows = _bits(src)
        runs = self._host_runs(block_ids)
        for i, layer in enumerate(layers):
            cache = self._host[layer]
            for first, at, n in runs:
                _host_copy(cache[first : first + n], rows[at : at + n, i])

    def _host_runs(self, block_ids: torch.Tensor) -> list[tuple[int, int, int]]:
        """``block_ids`` as runs of consecutive ids, every id checked against the cache: a
        numpy slice would clamp or wrap an id out of range where ``index_select`` raises."""
        ids = block_ids.tolist()
        if block_ids.dim() != 1 or (ids and not 0 <= min(ids) <= max(ids) < self.num_blocks):
            raise IndexError(
                f"block ids must be a list of ids in [0, {self.num_blocks}), got {ids[:8]}"
            )
        return consecutive_runs(ids)


# numpy's integer dtype of each element size: a tensor's bits, whatever its float type
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> Any:
    """A CPU tensor's elements as a numpy array of integers of the same size (a view, same
    strides): numpy has no bf16 or fp8."""
    return t.view(_BITS[t.element_size()]).numpy()


def _host_copy(dst: Any, src: Any) -> None:
    """Copy between numpy views of CPU tensors. Not ``torch.copy_``: that runs on the
    process's OpenMP pool, whose threads then spin for a while after each copy; on a loader
    or writer thread beside the engine's own OpenMP threads they took a core from the
    thread receiving the next chunk (``scripts/bench_datamover.py`` on 2 cores: loads 1.9 ->
    2.7 GB/s). numpy copies on the calling thread, without the GIL. Tensors whose elements
    differ in size are refused: numpy would convert one integer type into the other."""
    if dst.dtype != src.dtype:
        raise TypeError(
            f"cannot copy {src.dtype.itemsize}-byte elements into {dst.dtype.itemsize}-byte ones"
        )
    dst[...] = src


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``ids`` as (first id, index in ``ids``, length) runs of consecutive values."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == b:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((b, i, 1))
    return runs
