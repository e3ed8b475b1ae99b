"""The one write path: ``insert``, ``insert_many``, ``insert_encoded`` and the data mover's saves
all frame values (``codec``) and send them as SETs with their chain's TTLs here."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from kvstore.counters import Counters
from kvstore.errors import InvalidArgumentError
from kvstore.net.guard import Guard
from kvstore.net.transport import Transport
from kvstore.values.codec import encode_value, frame_tensors
from kvstore.values.keys import KeySpace
from kvstore.values.ttl import ChainTtl
from kvstore.values.value_auth import ValueKey

# Scratch memory kept per thread for framing values in insert_many (see there).
_SCRATCH_LIMIT = 64 << 20


class Writer:
    def __init__(
        self,
        transport: Transport,
        guard: Guard,
        keys: KeySpace,
        ttl: ChainTtl,
        counters: Counters,
        *,
        compression: str,
        max_value_bytes: int,
        value_key: ValueKey | None = None,
    ) -> None:
        self._value_key = value_key
        self._transport = transport
        self._guard = guard
        self._keys = keys
        self._ttl = ttl
        self._counters = counters
        self._compression = compression
        self._max_value_bytes = max_value_bytes
        self._local = threading.local()

    def encode(
        self,
        block_hash: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> memoryview:
        self._keys.block(block_hash)  # validates the hash
        return encode_value(
            tensors,
            fingerprint=self._keys.fingerprint,
            block_hash=block_hash,
            metadata=metadata,
            compression=self._compression,
            max_value_bytes=self._max_value_bytes,
            out=out,
            value_key=self._value_key,
        )

    def insert_many(
        self,
        items: Iterable[tuple[str, Mapping[str, torch.Tensor]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """When ``items`` is a sequence (a list, a tuple), tensors in CPU memory are sent from
        where they lie, framed around their bytes (``codec.frame_tensors``: copying a 64 KiB
        value first cost more than sending it); they must not change until this returns. From
        an iterator -- which may refill one tensor for every item -- and for tensors on a
        device, each value is copied as it comes into per-thread scratch buffers that are
        reused by the next call (fresh multi-MiB buffers cost a page fault per 4 KiB and made
        insert ~30% slower than plain ``SET``); buffers beyond ``_SCRATCH_LIMIT`` bytes per
        thread are not kept."""
        in_place = isinstance(items, Sequence)
        encoded: list[tuple[bytes, Sequence[Any]]] = []
        for i, (h, t) in enumerate(items):
            key = self._keys.block(h).encode()  # (validates the hash)
            parts = (
                frame_tensors(
                    t,
                    fingerprint=self._keys.fingerprint,
                    block_hash=h,
                    metadata=metadata,
                    compression=self._compression,
                    max_value_bytes=self._max_value_bytes,
                    value_key=self._value_key,
                )
                if in_place
                else None
            )
            encoded.append((key, parts or [self.encode(h, t, metadata, out=self._scratch(i, t))]))
        self._send(encoded)

    def _scratch(self, slot: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """This thread's reusable buffer number ``slot``, big enough for ``tensors``; None when
        compressing, when the value is not valid (encode then says why) or too big to keep."""
        if self._compression != "none":
            return None
        try:
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            need += 4096 + 256 * len(tensors)  # room for the JSON header
        except (AttributeError, TypeError):
            return None
        bufs: list[torch.Tensor] = self._local.__dict__.setdefault("scratch", [])
        if slot < len(bufs) and bufs[slot].numel() >= need:
            return bufs[slot]
        kept = sum(b.numel() for j, b in enumerate(bufs) if j != slot)
        if kept + need > _SCRATCH_LIMIT:
            return None
        buf = torch.empty(need, dtype=torch.uint8)
        if slot < len(bufs):
            bufs[slot] = buf
        else:
            bufs.append(buf)
        return buf

    def insert_parts(
        self,
        items: Sequence[tuple[str, Sequence[Any]]],
        *,
        positions: Sequence[int] | None = None,
        connections: int = 1,
    ) -> None:
        """SET each value, given as a list of buffers sent from where they lie, with the TTL of
        its chain position (``positions``, default the order of ``items``)."""
        self._send(
            [(self._keys.block(h).encode(), parts) for h, parts in items],
            positions=positions,
            connections=connections,
        )

    def _send(
        self,
        encoded: Sequence[tuple[bytes, Sequence[Any]]],
        *,
        positions: Sequence[int] | None = None,
        connections: int = 1,
    ) -> None:
        """SET each (key, parts) with its position's TTL, counting what was sent or failed."""
        if not encoded:
            return
        where = list(positions) if positions is not None else list(range(len(encoded)))
        if len(where) != len(encoded):
            raise InvalidArgumentError("positions must have one entry per item")
        if connections < 1:
            raise InvalidArgumentError(f"connections must be >= 1, got {connections}")
        commands = [
            (key, parts, self._ttl.at(pos))
            for (key, parts), pos in zip(encoded, where, strict=True)
        ]
        nbytes = sum(memoryview(p).nbytes for _, parts in encoded for p in parts)
        try:
            self._guard.call("SET", lambda: self._transport.set_values(commands, connections))
        except Exception:
            self._counters.add(insert_errors=len(encoded))
            raise
        self._counters.add(inserts=len(encoded), bytes_out=nbytes)
