"""The value format: one block's named tensors as a self-describing safetensors payload.

A value is exactly the safetensors layout -- an 8-byte little-endian header length, a JSON
header, then the tensor bytes -- so ``redis-cli GETRANGE key 0 400`` prints readable dtype,
shape and metadata, and an uncompressed value saved to a file loads with ``safetensors``.
kvstore's own fields live in the header's ``__metadata__`` under ``kvstore.*``:

``format`` (version), ``fingerprint`` (layout), ``key`` (block hash), ``codec`` (``none`` or
``lz4``), ``raw_bytes`` (uncompressed payload size), ``payload_bytes`` (stored payload size),
``checksum`` (``xxh3_64`` of the stored payload, verified on every read), ``tensor_checksums``
(uncompressed values: the ``xxh3_64`` of each tensor's bytes, 16 hex digits each in the order of
their offsets, so a reader that takes some of a value's tensors by ``GETRANGE`` verifies what it
read: ``tensor_reads.py``; values written before it have none and are read whole), ``created``
(UTC).

A store given its namespace's secret (``value_auth.ValueKey``) signs its values: ``mac`` is a
keyed BLAKE3 tag (32 hex digits) of the whole header as stored, with the tag's own digits
zeroed; ``checksum`` and ``tensor_checksums`` are keyed tags of the stored payload and of each
tensor's bytes (32 hex digits each; each use has its own key). The header tag covers the
checksums, so header and payload are authenticated together, and a range read verifies what it
read on its own. Such a reader takes no unsigned value, and a reader without the secret no
signed one: each is a counted miss.

The framing is written here rather than with ``safetensors.torch.save`` because that copies each
tensor twice and cannot embed a checksum of its own payload; the tests load our values with the
safetensors library to keep the framing honest.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import re
import struct
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Union

import torch
import xxhash

from kvstore.errors import CorruptValueError, InvalidArgumentError, InvalidValueError
from kvstore.values.value_auth import HEADER, MAC_HEX, PAYLOAD, TENSOR, ValueKey

FORMAT_VERSION = "1"
# what a value's pieces may be: anything with the buffer protocol (bytes, memoryview, numpy)
Buffer = Union[bytes, bytearray, memoryview, Any]  # noqa: UP007 (a runtime alias)
CODECS = ("none", "lz4")


def lz4_block() -> Any:
    """The ``lz4.block`` module (the optional ``[lz4]`` extra), or a typed error saying how to
    install it."""
    try:
        import lz4.block
    except ImportError:
        raise InvalidArgumentError(
            "compression 'lz4' needs the lz4 package: pip install 'vllm-redis-kvstore[lz4]'"
        ) from None
    return lz4.block


# A header is a few hundred bytes per tensor; anything far larger is not ours.
MAX_HEADER_BYTES = 1 << 20
_META_PREFIX = "kvstore."
_CHECKSUM_WIDTH = 16  # hex digits of xxh3_64, fixed so the header length is known before hashing
_MAC_MARKER = b'"kvstore.mac":"'
_MAC_ZEROS = "0" * MAC_HEX

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPE_TO_ST[getattr(torch, _name)] = _st
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}

# torch warns once that a bytes object is not writable; values from Redis are only read or copied.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class ValueHeader:
    """The parsed, validated header of a stored value (no payload bytes were touched)."""

    format_version: str
    fingerprint: str
    block_name: str  # the block it was written for (its "kvstore.key")
    codec: str
    checksum: str
    created: str
    raw_bytes: int
    payload_bytes: int
    header_bytes: int  # 8 + JSON length: where the payload starts
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] = field(default_factory=dict)  # the caller's own metadata
    # each tensor's xxh3_64 (hex), aligned with ``tensors``; empty for a value written without
    # them (older writers) or compressed: such a value can only be read whole
    tensor_checksums: tuple[str, ...] = ()
    mac: str = ""  # the header's keyed tag: "" for a value written without a secret


_clock: tuple[int, str] = (-1, "")  # (a UTC second, its ISO text): formatted once a second


def _now_iso() -> str:
    global _clock
    ns = time.time_ns()  # integers: no float rounding moves a millisecond
    second, ms = ns // 1_000_000_000, ns // 1_000_000 % 1000
    cached = _clock
    if cached[0] != second:
        text = datetime.fromtimestamp(second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        cached = _clock = (second, text)
    return f"{cached[1]}.{ms:03d}Z"


def _value_header(
    entries: Sequence[TensorEntry],
    *,
    fingerprint: str,
    block_hash: str,
    codec: str,
    raw_bytes: int,
    payload_bytes: int,
    checksum: str,
    created: str,
    metadata: dict[str, str],
    tensor_checksums: str = "",
    pad_to: int | None = None,
    value_key: ValueKey | None = None,
) -> bytes:
    """A value's header: the same bytes as ``json.dumps`` (ensure_ascii, compact) of
    ``{"__metadata__": {kvstore's fields, then the caller's}, name: spec, ...}``, behind its
    8-byte length. The metadata comes first, so ``GETRANGE 0 400`` shows it first. The text
    around the per-value fields is rendered once per store (``_header_head``) and the tensor
    specs once per layout (``_entries_json``): rendering the whole header cost 7 us a value, a
    tenth of sending a 64 KiB one. The caller's metadata, which may change with every value,
    is rendered each time."""
    head, mid = _header_head(fingerprint, codec)
    caller = "".join([f",{_json_str(k)}:{_json_str(v)}" for k, v in metadata.items()])
    per_tensor = f',"kvstore.tensor_checksums":"{tensor_checksums}"' if tensor_checksums else ""
    mac = f',"kvstore.mac":"{_MAC_ZEROS}"' if value_key is not None else ""
    # the checksums (hex) and the time (ISO digits) are ours and need no escaping
    raw = (
        f'{head}{_json_str(block_hash)}{mid}{raw_bytes}","kvstore.payload_bytes":"'
        f'{payload_bytes}","kvstore.checksum":"{checksum}"{per_tensor}{mac},"kvstore.created":'
        f'"{created}"{caller}}}{_entries_json(tuple(entries))}}}'
    ).encode("ascii")
    # safetensors pads the header with spaces so the payload starts 8-byte aligned
    size = pad_to if pad_to is not None else len(raw) + (-(8 + len(raw)) % 8)
    header = struct.pack("<Q", size) + raw.ljust(size, b" ")
    if value_key is None:
        return header
    # the tag of the header as stored, its own digits zeroed; the marker is written once
    # above (the caller's metadata may not use kvstore.* names; a tensor's spec is an object)
    at = header.index(_MAC_MARKER) + len(_MAC_MARKER)
    return header[:at] + value_key.tag(HEADER, header).encode("ascii") + header[at + MAC_HEX :]


# what json.dumps (ensure_ascii) writes for a str; half the cost of dumping a dict of eight
_json_str = json.encoder.encode_basestring_ascii


@functools.lru_cache(maxsize=64)
def _header_head(fingerprint: str, codec: str) -> tuple[str, str]:
    """The constant text of a store's headers before the key, and between the key and the
    raw size (the fields' order is the format's; ``_parse_header`` reads any)."""
    head = (
        f'{{"__metadata__":{{"kvstore.format":{_json_str(FORMAT_VERSION)},'
        f'"kvstore.fingerprint":{_json_str(fingerprint)},"kvstore.key":'
    )
    return head, f',"kvstore.codec":{_json_str(codec)},"kvstore.raw_bytes":"'


@functools.lru_cache(maxsize=256)
def _entries_json(entries: tuple[TensorEntry, ...]) -> str:
    """The header's tensor specs as JSON members, each after a comma (render cost 1.3 us a
    tensor: 40 us for a 32-layer block, were it rendered for every value)."""
    specs = {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
        for e in entries
    }
    return "," + json.dumps(specs, separators=(",", ":"))[1:-1] if specs else ""


def _validate_tensors(tensors: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise InvalidValueError(
            "a value must be a non-empty dict of name -> torch.Tensor, "
            f"got {type(tensors).__name__}"
        )
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise InvalidValueError(f"value[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPE_TO_ST:
            raise InvalidValueError(f"value[{name!r}] has unsupported dtype {t.dtype}")
        if t.is_sparse or t.layout != torch.strided:
            raise InvalidValueError(f"value[{name!r}] must be a dense tensor, got {t.layout}")
        if t.dim() > MAX_TENSOR_DIMS:  # (readers refuse more: see _header_shape)
            raise InvalidValueError(
                f"value[{name!r}] has {t.dim()} dimensions, more than {MAX_TENSOR_DIMS}: reshape it"
            )
        items.append((name, t))
    return items


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    meta: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(f"metadata must map str to str, got {k!r}: {v!r}")
        if k.startswith(_META_PREFIX):
            raise InvalidArgumentError(f"metadata keys starting with {_META_PREFIX!r} are reserved")
        meta[k] = v
    return meta


@dataclass
class StagedValue:
    """A value whose tensor bytes are already in ``buffer`` (payload at ``header_bytes``) but
    whose header -- checksum, codec -- is not written yet: :func:`finish_value` does that.

    Staging only copies, so it can run on the forward path; hashing and compression run later
    on a writer thread. ``buffer`` always holds the *uncompressed* value, so a pool of staging
    buffers sized from one staged probe value bounds memory whatever the codec.
    """

    buffer: torch.Tensor  # CPU uint8, at least header_bytes + raw_bytes long
    entries: tuple[TensorEntry, ...]
    raw_bytes: int
    header_bytes: int  # 8 + the padded JSON header of the uncompressed value
    fingerprint: str
    block_name: str
    metadata: dict[str, str]
    created: str
    value_key: ValueKey | None = None  # signs the value when set

    @property
    def nbytes(self) -> int:
        return self.header_bytes + self.raw_bytes


def _staged_header(
    staged: StagedValue,
    codec: str,
    checksum: str,
    payload_bytes: int,
    tensor_checksums: str = "",
    pad_to: int | None = None,
) -> bytes:
    return _value_header(
        staged.entries,
        fingerprint=staged.fingerprint,
        block_hash=staged.block_name,
        codec=codec,
        raw_bytes=staged.raw_bytes,
        payload_bytes=payload_bytes,
        checksum=checksum,
        created=staged.created,
        metadata=staged.metadata,
        tensor_checksums=tensor_checksums,
        pad_to=pad_to,
        value_key=staged.value_key,
    )


@dataclass(frozen=True)
class _TensorPlan:
    """Where a value's tensors go: their order (widest elements first), entries and size."""

    order: tuple[str, ...]
    entries: tuple[TensorEntry, ...]
    raw_bytes: int


# Plans by the tensors' (name, dtype, shape, layout): a model's blocks share a few. Validating
# and laying out a value each time cost 1.5 us, a twentieth of sending a 64 KiB one.
_plans: dict[tuple[Any, ...], _TensorPlan] = {}
MAX_CACHED_PLANS = 256


def _signature(tensors: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a value's plan depends on; None when ``tensors`` is not a dict of named tensors
    (the full validation then says what is wrong)."""
    if not isinstance(tensors, Mapping):
        return None
    signature = []
    for name, t in tensors.items():
        if type(name) is not str or not isinstance(t, torch.Tensor):
            return None
        signature.append((name, t.dtype, t.shape, t.layout))
    return tuple(signature)


def _new_plan(tensors: Mapping[str, Any]) -> _TensorPlan:
    # widest elements first: every tensor then starts at a multiple of its element size (sizes
    # are powers of two, the payload starts 8-aligned), so it can be viewed in place; the
    # offsets stay back to back, as safetensors requires
    items = _validate_tensors(tensors)
    if len(items) > 1:
        items.sort(key=lambda item: -item[1].element_size())
    entries: list[TensorEntry] = []
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(name, _DTYPE_TO_ST[t.dtype], tuple(t.shape), offset, offset + nbytes)
        )
        offset += nbytes
    return _TensorPlan(tuple(name for name, _ in items), tuple(entries), offset)


def _plan(
    tensors: Mapping[str, torch.Tensor], max_value_bytes: int | None
) -> tuple[list[tuple[str, torch.Tensor]], tuple[TensorEntry, ...], int]:
    signature = _signature(tensors)
    plan = _plans.get(signature) if signature is not None else None
    if plan is None:
        plan = _new_plan(tensors)  # validates: raises on anything that is not a value
        if signature is not None:
            if len(_plans) >= MAX_CACHED_PLANS:
                _plans.clear()
            _plans[signature] = plan
    if max_value_bytes is not None and plan.raw_bytes > max_value_bytes:
        raise InvalidValueError(
            f"value of {plan.raw_bytes} bytes exceeds max_value_bytes={max_value_bytes}; "
            "raise the limit or store smaller blocks"
        )
    return [(name, tensors[name]) for name in plan.order], plan.entries, plan.raw_bytes


def stage_value(
    tensors: Mapping[str, torch.Tensor],
    *,
    fingerprint: str,
    block_hash: str,
    metadata: Mapping[str, str] | None = None,
    max_value_bytes: int | None = None,
    out: torch.Tensor | None = None,
    value_key: ValueKey | None = None,
) -> StagedValue:
    """Copy ``tensors`` (any device, any strides) once, straight into ``out`` (a CPU uint8
    tensor, e.g. pinned staging memory reused across calls) or a fresh buffer, behind room for
    the header. Nothing is hashed or compressed here."""
    items, entries, raw_bytes = _plan(tensors, max_value_bytes)
    staged = StagedValue(
        buffer=torch.empty(0, dtype=torch.uint8),
        entries=entries,
        raw_bytes=raw_bytes,
        header_bytes=0,
        fingerprint=fingerprint,
        block_name=block_hash,
        metadata=_check_metadata(metadata),
        created=_now_iso(),
        value_key=value_key,
    )
    placeholder = "0" * _digest_width(value_key)
    staged.header_bytes = len(
        _staged_header(staged, "none", placeholder, raw_bytes, placeholder * len(entries))
    )
    total = staged.nbytes
    if out is None:
        out = torch.empty(total, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.device.type != "cpu" or out.numel() < total:
        raise InvalidArgumentError(
            f"out must be a CPU uint8 tensor of at least {total} bytes, got "
            f"{out.dtype} {out.device} with {out.numel()} elements"
        )
    staged.buffer = out
    payload = out[staged.header_bytes : total]
    for (_, t), e in zip(items, entries, strict=True):
        if e.end > e.start:
            payload[e.start : e.end].view(t.dtype).view(t.shape).copy_(t)
    return staged


def finish_value(staged: StagedValue, compression: str = "none") -> memoryview:
    """Hash (and compress) a staged value and write its header; returns the bytes to store.

    Uncompressed, the result is a view on the staging buffer itself (no copy); with lz4 it is
    a new buffer of header + compressed payload.
    """
    if compression not in CODECS:
        raise InvalidArgumentError(f"compression must be one of {CODECS}, got {compression!r}")
    whole = memoryview(staged.buffer[: staged.nbytes].numpy()).cast("B")  # type: ignore[arg-type]
    payload = whole[staged.header_bytes :]
    if compression == "none":
        per_tensor = _tensor_digests(staged.entries, [payload], staged.value_key)
        header = _staged_header(
            staged,
            "none",
            _payload_digest([payload], staged.value_key),
            staged.raw_bytes,
            per_tensor,
            pad_to=staged.header_bytes - 8,
        )
        whole[: len(header)] = header
        return whole
    header, packed = _compressed(staged, compression, payload)
    return memoryview(header + packed)


def _digest_width(value_key: ValueKey | None) -> int:
    """Hex digits of one checksum: an xxh3_64, or a keyed tag."""
    return MAC_HEX if value_key is not None else _CHECKSUM_WIDTH


def _digest(data: Buffer, value_key: ValueKey | None, use: str) -> str:
    """A checksum: the ``xxh3_64`` of ``data``, or its keyed tag as a ``use``."""
    return value_key.tag(use, data) if value_key is not None else xxhash.xxh3_64_hexdigest(data)


def _payload_digest(pieces: Sequence[Buffer], value_key: ValueKey | None) -> str:
    """The ``checksum`` field of an uncompressed value: the ``xxh3_64`` of its payload, or its
    keyed tag. (Signed, the tensors' tags would cover the payload too, but a whole read then
    pays a call per tensor: 2 us each, as much as hashing 16 KiB.)"""
    if value_key is not None:
        if len(pieces) == 1:
            return value_key.tag(PAYLOAD, pieces[0])
        mac = value_key.hasher(PAYLOAD)
        for p in pieces:
            mac.update(p)
        return str(mac.hexdigest(MAC_HEX // 2))
    if len(pieces) == 1:  # half the cost of a streaming digest, for a 64 KiB value
        return xxhash.xxh3_64_hexdigest(pieces[0])
    digest = xxhash.xxh3_64()
    for p in pieces:
        digest.update(p)
    return digest.hexdigest()


def _tensor_digests(
    entries: Sequence[TensorEntry], pieces: Sequence[Buffer], value_key: ValueKey | None = None
) -> str:
    """The ``tensor_checksums`` field: each entry's ``xxh3_64`` (or keyed tag) in hex over its
    bytes of the payload that ``pieces`` hold back to back, in the entries' order. Pieces
    usually are the tensors one for one; any other cut is walked."""
    views = [memoryview(p).cast("B") for p in pieces]
    if len(views) == len(entries) and all(
        len(v) == e.end - e.start for v, e in zip(views, entries, strict=True)
    ):
        return "".join([_digest(v, value_key, TENSOR) for v in views])
    out: list[str] = []
    piece, at = 0, 0  # the piece the next byte is in, and where in it
    for e in entries:
        left = e.end - e.start
        digest: Any = value_key.hasher(TENSOR) if value_key is not None else xxhash.xxh3_64()
        while left:
            take = min(left, len(views[piece]) - at)
            digest.update(views[piece][at : at + take])
            left -= take
            at += take
            if at == len(views[piece]):
                piece, at = piece + 1, 0
        out.append(digest.hexdigest(MAC_HEX // 2) if value_key is not None else digest.hexdigest())
    return "".join(out)


def tensor_checksums_ok(
    header: ValueHeader,
    first: int,
    end: int,
    payload: Buffer,
    value_key: ValueKey | None = None,
) -> bool:
    """Whether ``payload`` -- the bytes of tensors ``[first, end)`` of a value with ``header``,
    back to back -- hashes to the header's checksums of those tensors (keyed tags, with
    ``value_key``: its header must have been read with the same key). False when the header
    has none (a value only a whole read can verify) or ``payload`` is not exactly their size."""
    if not header.tensor_checksums or not 0 <= first < end <= len(header.tensors):
        return False
    if (value_key is None) != (not header.mac):
        return False  # signed, but no key to verify it with; or the reverse
    view = memoryview(payload).cast("B")
    base = header.tensors[first].start
    if len(view) != header.tensors[end - 1].end - base:
        return False
    for i in range(first, end):
        e = header.tensors[i]
        digest = _digest(view[e.start - base : e.end - base], value_key, TENSOR)
        if not hmac.compare_digest(digest, header.tensor_checksums[i]):
            return False
    return True


def _compressed(staged: StagedValue, compression: str, payload: Buffer) -> tuple[bytes, bytes]:
    """A compressed value: its header and its compressed payload."""
    packed = lz4_block().compress(payload, store_size=False)
    checksum = _digest(packed, staged.value_key, PAYLOAD)
    return _staged_header(staged, compression, checksum, len(packed)), packed


def plan_entries(
    names: Sequence[str], dtype: torch.dtype, shape: Sequence[int]
) -> tuple[list[TensorEntry], int]:
    """The entries of a value made of one tensor per name, all of ``dtype`` and ``shape``, laid
    out back to back in ``names`` order; and its payload size. For callers that stage payloads
    themselves (the data mover) and frame them with :func:`frame_parts`."""
    if dtype not in _DTYPE_TO_ST:
        raise InvalidValueError(f"unsupported dtype {dtype}")
    if len(shape) > MAX_TENSOR_DIMS:
        raise InvalidValueError(f"a shape of {len(shape)} dimensions, more than {MAX_TENSOR_DIMS}")
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= int(s)
    entries = [
        TensorEntry(
            name, _DTYPE_TO_ST[dtype], tuple(int(s) for s in shape), i * nbytes, (i + 1) * nbytes
        )
        for i, name in enumerate(names)
    ]
    return entries, nbytes * len(entries)


def frame_parts(
    entries: Sequence[TensorEntry],
    pieces: Sequence[Buffer],
    *,
    fingerprint: str,
    block_hash: str,
    compression: str = "none",
    metadata: Mapping[str, str] | None = None,
    value_key: ValueKey | None = None,
) -> list[Buffer]:
    """A value as a list of buffers to send back to back: its header, then ``pieces`` (the
    payload, in ``entries`` order, each piece where it already is). Uncompressed, nothing is
    copied: the checksum streams over the pieces and they go to the socket as they are. With
    lz4 the payload is compressed into one new buffer. ``value_key`` signs it."""
    raw_bytes = sum(memoryview(p).nbytes for p in pieces)
    expected = entries[-1].end if entries else 0
    if raw_bytes != expected:
        raise InvalidArgumentError(f"pieces hold {raw_bytes} bytes, the entries {expected}")
    return _framed(
        entries, pieces, raw_bytes, fingerprint, block_hash, compression, metadata, value_key
    )


def _framed(
    entries: Sequence[TensorEntry],
    pieces: Sequence[Buffer],
    raw_bytes: int,
    fingerprint: str,
    block_hash: str,
    compression: str,
    metadata: Mapping[str, str] | None,
    value_key: ValueKey | None = None,
) -> list[Buffer]:
    """:func:`frame_parts` once ``pieces`` are known to hold ``raw_bytes``, as ``entries`` say."""
    if compression not in CODECS:
        raise InvalidArgumentError(f"compression must be one of {CODECS}, got {compression!r}")
    meta = _check_metadata(metadata)
    if compression == "none":
        # each piece is hashed twice (its tensors, then the value: the second pass finds them
        # in the CPU cache, ~10% of the hashing unsigned); reads verify the whole value once
        per_tensor = _tensor_digests(entries, pieces, value_key)
        checksum = _payload_digest(pieces, value_key)
        header = _value_header(
            entries,
            fingerprint=fingerprint,
            block_hash=block_hash,
            codec="none",
            raw_bytes=raw_bytes,
            payload_bytes=raw_bytes,
            checksum=checksum,
            created=_now_iso(),
            metadata=meta,
            tensor_checksums=per_tensor,
            value_key=value_key,
        )
        return [header, *pieces]
    staged = StagedValue(
        buffer=torch.empty(0, dtype=torch.uint8),
        entries=tuple(entries),
        raw_bytes=raw_bytes,
        header_bytes=0,
        fingerprint=fingerprint,
        block_name=block_hash,
        metadata=meta,
        created=_now_iso(),
        value_key=value_key,
    )
    return list(_compressed(staged, compression, b"".join(pieces)))


def frame_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    fingerprint: str,
    block_hash: str,
    metadata: Mapping[str, str] | None = None,
    compression: str = "none",
    max_value_bytes: int | None = None,
    value_key: ValueKey | None = None,
) -> list[Buffer] | None:
    """``tensors`` in CPU memory framed as :func:`frame_parts` does, around their own bytes:
    uncompressed, nothing is copied (a non-contiguous tensor is made contiguous first). The
    result refers to the tensors: send it before they change. None when a tensor lies on
    another device: stage it with :func:`encode_value`."""
    items, entries, raw_bytes = _plan(tensors, max_value_bytes)
    if not all(t.is_cpu for _, t in items):
        return None
    pieces = [_bytes_of(t) for _, t in items]  # exactly the entries' bytes, in their order
    return _framed(
        entries, pieces, raw_bytes, fingerprint, block_hash, compression, metadata, value_key
    )


def _bytes_of(t: torch.Tensor) -> Any:
    """A CPU tensor's logical bytes as a C-contiguous uint8 array: a view when it is contiguous."""
    if t.requires_grad:
        t = t.detach()
    if t.is_neg() or t.is_conj():  # lazy views: their bytes are not the values yet
        t = t.resolve_neg().resolve_conj()
    if not t.is_contiguous():
        t = t.contiguous()
    # an N-d C-contiguous array is one buffer to xxhash and sendmsg alike, so it is flattened
    # only where viewing its bytes needs it: 0-d, a last dimension of size 1 with another
    # stride (contiguous all the same; reshape keeps such a stride on a 1-element 1-d
    # tensor, as_strided does not), or empty (an N-d view with a zero cannot be cast)
    if t.dim() == 0 or t.stride(-1) != 1 or (t.numel() == 0 and t.dim() != 1):
        t = t.as_strided((t.numel(),), (1,))
    return t.view(torch.uint8).numpy()


def encode_value(
    tensors: Mapping[str, torch.Tensor],
    *,
    fingerprint: str,
    block_hash: str,
    metadata: Mapping[str, str] | None = None,
    compression: str = "none",
    max_value_bytes: int | None = None,
    out: torch.Tensor | None = None,
    value_key: ValueKey | None = None,
) -> memoryview:
    """Serialise ``tensors`` into one value: :func:`stage_value` then :func:`finish_value`.

    ``out`` receives the uncompressed value; the result is then a view on ``out`` unless it
    is compressed. ``value_key`` signs it.
    """
    if compression not in CODECS:
        raise InvalidArgumentError(f"compression must be one of {CODECS}, got {compression!r}")
    staged = stage_value(
        tensors,
        fingerprint=fingerprint,
        block_hash=block_hash,
        metadata=metadata,
        max_value_bytes=max_value_bytes,
        out=out,
        value_key=value_key,
    )
    return finish_value(staged, compression)


def _corrupt(reason: str, detail: str) -> CorruptValueError:
    return CorruptValueError(reason, detail)


def read_header(
    value: bytes | memoryview,
    max_value_bytes: int | None = None,
    value_key: ValueKey | None = None,
) -> ValueHeader:
    """Parse and validate a value's header; raises :class:`CorruptValueError`. With
    ``value_key`` its MAC is verified too; without, a signed header is parsed unverified
    (``header.mac`` says it is signed): for people looking, never for loading."""
    authenticate = value_key is not None
    return _read_header(value, max_value_bytes, value_key=value_key, authenticate=authenticate)[0]


# A header is JSON, and parsing and validating it cost 10 us (one tensor) to 50 us (sixteen) per
# value: as much as receiving 64 KiB. But one model's values differ only in a few fields (the
# block hash, the checksums, the creation time), so the rest -- the layout -- is parsed and
# validated once and kept: a later header of the same length, equal to it byte for byte outside
# those values, and with plain values (printable ASCII, no quote or backslash), parses exactly
# as the cached one with those values put in. A header whose fields are not plain, or appear
# more than once, or that holds a backslash anywhere (an escape can spell a field name the byte
# comparison does not see), is parsed in full every time. The per-tensor checksums are
# optional (values written before them have none).
_VARYING = (b'"kvstore.key":"', b'"kvstore.checksum":"', b'"kvstore.created":"')
_OPTIONAL_VARYING = (b'"kvstore.tensor_checksums":"', _MAC_MARKER)
_PLAIN = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')
_PLAIN_CLASS = b"[" + re.escape(_PLAIN) + b"]"  # _PLAIN as a regular expression's class
_HEX_BYTES = b"0123456789abcdef"
MAX_CACHED_LAYOUTS = 256  # layouts kept (a few per model); past that the cache starts again
MAX_LAYOUTS_PER_LENGTH = 8  # a lookup tries each layout of the header's length
# the longest header kept: ~110 bytes a tensor, so 256 tensors; a longer one is parsed each time
MAX_CACHED_HEADER_BYTES = 32 << 10


@dataclass(frozen=True)
class _Run:
    """Back-to-back tensors of one dtype and shape: viewed as one ``[len(names), *shape]``
    tensor and unbound, one torch call instead of three per tensor."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class _Layout:
    header: ValueHeader  # the header this layout was first parsed from
    runs: tuple[_Run, ...]
    # the header byte for byte, but for a group of plain characters (_PLAIN_CLASS) of the same
    # length for each varying value (``v<i>``, ``i`` its place in _VARYING + _OPTIONAL_VARYING):
    # one match tests the header and extracts them
    pattern: re.Pattern[bytes]


_layouts: dict[int, list[_Layout]] = {}  # by header length
_layouts_lock = threading.Lock()  # for writers: readers only look up


def _varying_spans(raw: bytes) -> tuple[tuple[int, int, int], ...] | None:
    """Where the values of the varying fields lie in ``raw``, as (start, end, field number);
    None when a required one is missing, or one is repeated or not plain."""
    spans = []
    for field_no, marker in enumerate(_VARYING + _OPTIONAL_VARYING):
        at = raw.find(marker)
        if at < 0:
            if field_no < len(_VARYING):
                return None
            continue
        if raw.find(marker, at + 1) >= 0:
            return None
        start = at + len(marker)
        end = raw.find(b'"', start)
        if end < 0 or raw[start:end].translate(None, _PLAIN):
            return None
        spans.append((start, end, field_no))
    return tuple(spans)


def _cached_layout(raw: bytes) -> tuple[_Layout, dict[str, bytes]] | None:
    """The cached layout ``raw`` is an instance of, and its varying values by group name."""
    for layout in _layouts.get(len(raw), ()):
        match = layout.pattern.fullmatch(raw)
        if match is not None:
            return layout, match.groupdict()
    return None


def _split_tensor_checksums(text: bytes | str, tensors: int, width: int) -> tuple[str, ...] | None:
    """``tensor_checksums`` as one hex digest of ``width`` digits per tensor; None when it is
    not that."""
    try:
        data = text.encode("ascii") if isinstance(text, str) else text
    except UnicodeEncodeError:  # (a server's text: anything)
        return None
    if len(data) != width * tensors or data.translate(None, _HEX_BYTES):
        return None
    decoded = data.decode("ascii")
    return tuple(decoded[i : i + width] for i in range(0, len(decoded), width))


def _remember(raw: bytes, header: ValueHeader, runs: tuple[_Run, ...]) -> None:
    with _layouts_lock:
        _remember_locked(raw, header, runs)


def _remember_locked(raw: bytes, header: ValueHeader, runs: tuple[_Run, ...]) -> None:
    if b"\\" in raw:  # an escape could spell a field again where the markers do not see it
        return
    if len(raw) > MAX_CACHED_HEADER_BYTES:
        return  # no model's layout is that long; compiling its pattern would cost more
    if len(_layouts.get(len(raw), ())) >= MAX_LAYOUTS_PER_LENGTH:
        return  # values whose own metadata varies: each would be a layout, none used again
    spans = _varying_spans(raw)
    if spans is None:
        return
    values = {field_no: raw[a:b].decode("ascii") for a, b, field_no in spans}
    expected = {0: header.block_name, 1: header.checksum, 2: header.created}
    if header.tensor_checksums:
        expected[3] = "".join(header.tensor_checksums)
    if header.mac:
        expected[4] = header.mac
    if values != expected:
        return
    pattern, at = b"", 0
    for start, end, field_no in sorted(spans):
        group = b"(?P<v%d>%s{%d})" % (field_no, _PLAIN_CLASS, end - start)
        pattern += re.escape(raw[at:start]) + group
        at = end
    pattern += re.escape(raw[at:])
    if sum(len(entries) for entries in _layouts.values()) >= MAX_CACHED_LAYOUTS:
        _layouts.clear()
    _layouts.setdefault(len(raw), []).append(_Layout(header, runs, re.compile(pattern, re.S)))


def _read_header(
    value: bytes | memoryview,
    max_value_bytes: int | None,
    *,
    whole: bool = True,
    value_key: ValueKey | None = None,
    authenticate: bool = True,
) -> tuple[ValueHeader, tuple[_Run, ...]]:
    """Parse and check the header at the start of ``value``: the whole value (``whole``: its
    payload must be the size the header says) or its first bytes. With ``authenticate`` a
    signed header must verify with ``value_key``, and with a key an unsigned one is refused
    (``CorruptValueError`` "no-secret", "unsigned", "forged")."""
    if len(value) < 8:
        raise _corrupt("truncated", f"{len(value)} bytes is shorter than a header length")
    (n,) = struct.unpack_from("<Q", value, 0)
    if n > MAX_HEADER_BYTES:
        raise _corrupt("not-kvstore", f"header length {n} is implausible")
    if 8 + n > len(value):
        raise _corrupt("truncated", f"header of {n} bytes but value has {len(value)}")
    raw = bytes(value[8 : 8 + n])
    cached = _cached_layout(raw)
    if cached is not None:
        layout, varying = cached
        # the first header with its varying fields changed, made without the frozen
        # dataclass's __init__ (its eleven object.__setattr__ calls were a tenth of reading
        # 64 KiB)
        header = object.__new__(ValueHeader)
        fields = header.__dict__
        fields.update(layout.header.__dict__)
        fields["block_name"] = varying["v0"].decode("ascii")
        fields["checksum"] = varying["v1"].decode("ascii")
        fields["created"] = varying["v2"].decode("ascii")
        if varying.get("v4") is not None:
            fields["mac"] = varying["v4"].decode("ascii")
        if varying.get("v3") is not None:
            width = MAC_HEX if header.mac else _CHECKSUM_WIDTH
            per_tensor = _split_tensor_checksums(varying["v3"], len(header.tensors), width)
            if per_tensor is None:
                raise _corrupt("not-kvstore", "malformed kvstore.tensor_checksums")
            fields["tensor_checksums"] = per_tensor
        fields["metadata"] = dict(fields["metadata"])
        runs = layout.runs
        _check_size(header, max_value_bytes)
        if authenticate:
            _authenticate(value, header, value_key)
    else:
        header = _parse_header(raw, max_value_bytes)
        runs = _runs(header.tensors)
        if authenticate:
            _authenticate(value, header, value_key)
        # remembered once it is known good: a header from a writer without the secret never
        # costs the cache (its regular expression: a second per MiB of header to compile).
        # The cache keeps its own metadata dict: the caller may change the one returned
        _remember(raw, dataclasses.replace(header, metadata=dict(header.metadata)), runs)
    if whole and len(value) - header.header_bytes != header.payload_bytes:
        raise _corrupt(
            "truncated",
            f"payload is {len(value) - header.header_bytes} bytes, header says "
            f"{header.payload_bytes}",
        )
    return header, runs


def _authenticate(
    value: bytes | memoryview, header: ValueHeader, value_key: ValueKey | None
) -> None:
    """Check a parsed header's MAC: the keyed tag of the header bytes as stored, its own
    digits zeroed. The tag's place is its marker's one occurrence in the bytes (JSON escapes
    every quote inside a string, so the marker cannot hide in a name or a value)."""
    if value_key is None:
        if header.mac:
            raise _corrupt(
                "no-secret",
                "the value is signed (kvstore.mac) and this reader has no secret for its "
                "namespace: configure the namespace's secret_file or secret_env",
            )
        return
    if not header.mac:
        raise _corrupt(
            "unsigned",
            "the value carries no MAC and this reader's namespace has a secret: it was "
            "written by a writer without the secret",
        )
    raw = bytes(memoryview(value)[: header.header_bytes])
    at = raw.find(_MAC_MARKER)
    start = at + len(_MAC_MARKER)
    if (
        at < 0
        or raw.find(_MAC_MARKER, start) >= 0
        or raw[start : start + MAC_HEX] != (header.mac.encode("ascii"))
    ):
        raise _corrupt("forged", "the header's kvstore.mac is not where it is written")
    zeroed = raw[:start] + _MAC_ZEROS.encode("ascii") + raw[start + MAC_HEX :]
    if not value_key.verify(HEADER, zeroed, header.mac):
        raise _corrupt(
            "forged",
            "the header's MAC does not verify: written without this namespace's secret, "
            "or with another one",
        )


def _check_size(header: ValueHeader, max_value_bytes: int | None) -> None:
    if (
        max_value_bytes is not None
        and max(header.raw_bytes, header.payload_bytes) > max_value_bytes
    ):
        raise _corrupt(
            "oversize", f"{header.raw_bytes} bytes exceeds max_value_bytes={max_value_bytes}"
        )


def _runs(entries: Sequence[TensorEntry]) -> tuple[_Run, ...]:
    runs: list[_Run] = []
    for e in entries:
        last = runs[-1] if runs else None
        if last is not None and last.dtype == _ST_TO_DTYPE[e.dtype] and last.shape == e.shape:
            runs[-1] = _Run((*last.names, e.name), last.dtype, last.shape, last.start, e.end)
        else:
            runs.append(_Run((e.name,), _ST_TO_DTYPE[e.dtype], e.shape, e.start, e.end))
    return tuple(runs)


# a tensor's dimensions at most (a KV block's have 2 to 6), and the largest dimension, offset or
# count of elements a header may give (torch's strides are 64-bit): a shape of 6,000 dimensions
# of 1e308 each, 36 KiB of header, took 19 s to multiply out before the MAC was checked, and a
# megabyte of it would take hours (a review's)
MAX_TENSOR_DIMS = 16
_MAX_HEADER_INT = 1 << 56


def _header_int(value: object) -> int:
    """A shape's dimension or a data offset as safetensors writes it: a JSON integer (not a
    float, bool or string), 0 to ``_MAX_HEADER_INT``."""
    if type(value) is not int or not 0 <= value <= _MAX_HEADER_INT:
        raise ValueError(f"{str(value)[:40]!r} is not a size")
    return value


def _header_shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_TENSOR_DIMS:
        raise ValueError(f"a shape is a list of at most {MAX_TENSOR_DIMS} sizes")
    shape = tuple(_header_int(s) for s in value)
    extent = 1  # (its elements but for a zero dimension: torch's strides must fit)
    for s in shape:
        extent *= max(s, 1)
        if extent > _MAX_HEADER_INT:
            raise ValueError("a shape larger than any value")
    return shape


def _parse_header(raw: bytes, max_value_bytes: int | None) -> ValueHeader:
    """Parse and validate a header's JSON (``raw``): everything that does not depend on the
    rest of the value."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _corrupt("not-kvstore", f"header is not JSON ({exc})") from None
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or "kvstore.format" not in meta:
        raise _corrupt("not-kvstore", "no kvstore.format in the header metadata")
    if meta["kvstore.format"] != FORMAT_VERSION:
        raise _corrupt(
            "format", f"format version {meta['kvstore.format']!r}, expected {FORMAT_VERSION!r}"
        )
    try:
        codec = str(meta["kvstore.codec"])
        raw_bytes = int(meta["kvstore.raw_bytes"])
        payload_bytes = int(meta["kvstore.payload_bytes"])
        entries = []
        for name, spec in doc.items():
            if name == "__metadata__":
                continue
            offsets = spec["data_offsets"]
            if not isinstance(offsets, list) or len(offsets) != 2:
                raise ValueError("data_offsets is not [start, end]")
            start, end = (_header_int(x) for x in offsets)
            shape = _header_shape(spec["shape"])
            entries.append(TensorEntry(name, str(spec["dtype"]), shape, start, end))
        header = ValueHeader(
            format_version=str(meta["kvstore.format"]),
            fingerprint=str(meta["kvstore.fingerprint"]),
            block_name=str(meta["kvstore.key"]),
            codec=codec,
            checksum=str(meta["kvstore.checksum"]),
            created=str(meta.get("kvstore.created", "")),
            raw_bytes=raw_bytes,
            payload_bytes=payload_bytes,
            header_bytes=8 + len(raw),
            tensors=tuple(sorted(entries, key=lambda e: e.start)),
            metadata={k: str(v) for k, v in meta.items() if not k.startswith(_META_PREFIX)},
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # Overflow: int(1e999)
        raise _corrupt("not-kvstore", f"malformed header field ({exc!r})") from None
    if "kvstore.mac" in meta:
        mac = meta["kvstore.mac"]
        if not isinstance(mac, str) or _split_tensor_checksums(mac, 1, MAC_HEX) is None:
            raise _corrupt("not-kvstore", "malformed kvstore.mac")
        header = dataclasses.replace(header, mac=mac)
    if "kvstore.tensor_checksums" in meta:
        text = meta["kvstore.tensor_checksums"]
        width = MAC_HEX if header.mac else _CHECKSUM_WIDTH
        per_tensor = (
            _split_tensor_checksums(text, len(header.tensors), width)
            if isinstance(text, str)
            else None
        )
        if per_tensor is None or codec != "none":
            raise _corrupt("not-kvstore", "malformed kvstore.tensor_checksums")
        header = dataclasses.replace(header, tensor_checksums=per_tensor)

    if codec not in CODECS:
        raise _corrupt("format", f"unknown codec {codec!r}")
    _check_size(header, max_value_bytes)
    expected = 0
    for e in header.tensors:
        if e.dtype not in _ST_TO_DTYPE or any(s < 0 for s in e.shape) or e.start != expected:
            raise _corrupt("not-kvstore", f"bad tensor entry {e.name!r}")
        numel = 1
        for s in e.shape:
            numel *= s
        itemsize = _ST_TO_DTYPE[e.dtype].itemsize
        if e.end - e.start != numel * itemsize:
            raise _corrupt("not-kvstore", f"tensor {e.name!r} size does not match its shape")
        if e.start % itemsize:  # kvstore lays tensors out widest first; it cannot be viewed
            raise _corrupt("not-kvstore", f"tensor {e.name!r} is not aligned to its dtype")
        expected = e.end
    if expected != raw_bytes:
        raise _corrupt("not-kvstore", "tensor offsets do not cover the payload")
    if codec == "none" and payload_bytes != raw_bytes:
        raise _corrupt("not-kvstore", "uncompressed payload size differs from raw size")
    return header


def checksum_ok(
    value: bytes | memoryview, header: ValueHeader, value_key: ValueKey | None = None
) -> bool:
    """Whether the stored payload hashes to the header's checksum. A signed value's checksum
    is keyed: without ``value_key`` it never verifies (its header must have been read with
    the key: ``read_header``)."""
    payload = memoryview(value)[header.header_bytes :]
    if not header.mac:
        return xxhash.xxh3_64_hexdigest(payload) == header.checksum
    return value_key is not None and value_key.verify(PAYLOAD, payload, header.checksum)


def decode_value(
    value: bytes | memoryview,
    *,
    fingerprint: str,
    block_hash: str | None,
    max_value_bytes: int | None = None,
    copy: bool = True,
    value_key: ValueKey | None = None,
    max_raw_bytes: int | None = None,
) -> tuple[ValueHeader, dict[str, torch.Tensor]]:
    """Validate and decode one value; raises :class:`CorruptValueError` on anything off.

    With ``copy=False`` uncompressed tensors are views on ``value`` (no copy at all; read-only
    when ``value`` is): for callers that own ``value`` or copy the tensors on straight away.
    ``value_key``: the namespace's key; the value must be signed with it. ``max_raw_bytes``:
    the most a compressed value may decompress to (the size the caller expects), checked
    before any memory is spent.
    """
    header, runs = _read_header(value, max_value_bytes, value_key=value_key)
    if header.fingerprint != fingerprint:
        raise _corrupt(
            "fingerprint",
            f"value has layout fingerprint {header.fingerprint}, this store expects {fingerprint}",
        )
    if block_hash is not None and header.block_name != block_hash:
        raise _corrupt("key", f"value was written for block {header.block_name}")
    if not checksum_ok(value, header, value_key):
        raise _corrupt("forged" if header.mac else "checksum", "payload checksum mismatch")
    payload = memoryview(value)[header.header_bytes :]
    if header.codec == "lz4":
        # lz4 expands at most 255-fold: a header that claims more lies, and what it claims
        # would be allocated before a byte is decompressed
        bound = len(payload) * 255 + 16
        if max_raw_bytes is not None:
            bound = min(bound, max_raw_bytes)
        if header.raw_bytes > bound:
            raise _corrupt(
                "oversize",
                f"a {len(payload)}-byte lz4 payload claims {header.raw_bytes} bytes; at most "
                f"{bound} are expected",
            )
        try:
            lz4 = lz4_block()
        except InvalidArgumentError as exc:  # another instance compresses; this one cannot read
            raise _corrupt("codec", str(exc)) from None
        try:
            raw: bytes | bytearray | memoryview = lz4.decompress(
                payload, uncompressed_size=header.raw_bytes, return_bytearray=True
            )
        except lz4.LZ4BlockError as exc:
            raise _corrupt("checksum", f"lz4 payload does not decompress ({exc})") from None
        if len(raw) != header.raw_bytes:
            raise _corrupt("truncated", "lz4 payload decompressed to the wrong size")
        copy = False  # the decompressed buffer is already ours, and writable
    else:
        raw = payload
    tensors: dict[str, torch.Tensor] = {}
    for run in runs:
        if run.end == run.start:
            for name in run.names:
                tensors[name] = torch.empty(run.shape, dtype=run.dtype)
            continue
        count = (run.end - run.start) // run.dtype.itemsize
        t = torch.frombuffer(raw, dtype=run.dtype, count=count, offset=run.start)
        views = (t.view(run.shape),) if len(run.names) == 1 else t.view(-1, *run.shape).unbind(0)
        # a copy is one storage per tensor, as before: keeping one layer keeps only its bytes
        tensors.update(zip(run.names, (v.clone() for v in views) if copy else views, strict=True))
    return header, tensors
