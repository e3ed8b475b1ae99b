"""The values the store tests write as blocks: tensors a test can tell apart by the number it
made them from. Each builder says what it builds; a test that needs another shape or dtype binds
them with ``functools.partial`` (the scheduler tests' per-layer blocks are
``scheduler_harness.zero_block``). ``without_tensor_checksums`` turns a stored value into the
one a writer from before per-tensor checksums would have stored."""

from __future__ import annotations

import struct

import torch

from kvstore.values.codec import read_header

Block = dict[str, torch.Tensor]


def filled_block(
    i: int, shape: tuple[int, ...] = (2, 16, 8), dtype: torch.dtype = torch.float32
) -> Block:
    """One tensor, ``kv``, every element ``i``."""
    return {"kv": torch.full(shape, float(i), dtype=dtype)}


def k_v_block(i: int) -> Block:
    """Two fp32 tensors of shape (2, 16, 8): ``k`` all ``i``, ``v`` all ``-i``."""
    return {"k": torch.full((2, 16, 8), float(i)), "v": torch.full((2, 16, 8), -float(i))}


def random_k_v_block(seed: int) -> Block:
    """Two tensors of shape (2, 16, 64), random values drawn from ``seed``: ``k`` bf16, ``v``
    fp32."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16),
        "v": torch.randn(2, 16, 64, generator=gen),
    }


def without_tensor_checksums(value: bytes) -> bytes:
    """``value`` as a writer before per-tensor checksums framed it (same payload)."""
    (n,) = struct.unpack_from("<Q", value)
    doc = value[8 : 8 + n].rstrip(b" ")
    start = doc.index(b',"kvstore.tensor_checksums":"')
    end = doc.index(b'"', start + len(b',"kvstore.tensor_checksums":"')) + 1
    doc = doc[:start] + doc[end:]
    doc += b" " * (-(8 + len(doc)) % 8)
    out = struct.pack("<Q", len(doc)) + doc + value[8 + n :]
    assert not read_header(out).tensor_checksums
    return out
