"""Headers read through a cached layout (``codec._read_header``) read exactly as a full parse of
the same bytes: the same header, or the same refusal. Fuzzed: values of the same length with
their varying fields (block hash, checksum, creation time) replaced by any bytes, and headers
with any byte changed, read right after the layout they resemble was cached."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvstore import CorruptValueError
from kvstore.values import codec
from kvstore.values.codec import ValueHeader, decode_value, encode_value, read_header

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def outcome(value: bytes) -> ValueHeader | str:
    try:
        return read_header(value, max_value_bytes=1 << 20)
    except CorruptValueError as exc:
        return exc.reason


def uncached_outcome(value: bytes) -> ValueHeader | str:
    codec._layouts.clear()
    return outcome(value)


@pytest.fixture(autouse=True)
def fresh_layouts() -> Iterator[None]:
    codec._layouts.clear()
    yield
    codec._layouts.clear()


def value_of(block_hash: str = "a" * 32, **meta: str) -> bytes:
    tensors = {
        "model.layers.0.self_attn": torch.arange(64, dtype=torch.bfloat16).view(2, 32),
        "model.layers.1.self_attn": torch.arange(64, dtype=torch.bfloat16).view(2, 32),
        "scale": torch.ones(3, dtype=torch.float32),
    }
    return bytes(
        encode_value(tensors, fingerprint="fp", block_hash=block_hash, metadata=meta or None)
    )


def n_header(value: bytes) -> int:
    return int(struct.unpack_from("<Q", value)[0])


def header_span(value: bytes) -> tuple[int, int]:
    (n,) = struct.unpack_from("<Q", value)
    return 8, 8 + n


def field_span(value: bytes, field: str) -> tuple[int, int]:
    marker = f'"kvstore.{field}":"'.encode()
    start = value.index(marker) + len(marker)
    return start, value.index(b'"', start)


@settings(max_examples=400, deadline=None)
@given(
    field=st.sampled_from(["key", "checksum", "created"]),
    replacement=st.binary(min_size=0, max_size=40),
)
def test_a_field_replaced_by_any_bytes_reads_as_a_full_parse_would(
    field: str, replacement: bytes
) -> None:
    base = value_of()
    assert isinstance(outcome(base), ValueHeader)  # its layout is cached now
    start, end = field_span(base, field)
    # keep the header's length, so the cached layout is a candidate
    replacement = (replacement + b"0" * (end - start))[: end - start]
    other = base[:start] + replacement + base[end:]
    assert outcome(other) == uncached_outcome(other)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_header_with_any_byte_changed_reads_as_a_full_parse_would(data: st.DataObject) -> None:
    base = value_of(note='say "hi"')  # a quote in the metadata: parsed in full, never cached
    plain = value_of()
    for value in (base, plain):
        first, last = header_span(value)
        outcome(value)
        at = data.draw(st.integers(first, last - 1))
        byte = data.draw(st.integers(0, 255))
        other = value[:at] + bytes([byte]) + value[at + 1 :]
        assert outcome(other) == uncached_outcome(other)


def test_values_of_one_layout_read_their_own_fields() -> None:
    a, b = value_of("a" * 32), value_of("b" * 32)
    ha, hb = read_header(a), read_header(b)
    assert (ha.block_name, hb.block_name) == ("a" * 32, "b" * 32)
    assert ha.tensors == hb.tensors
    assert hb == uncached_outcome(b)
    _, tensors = decode_value(b, fingerprint="fp", block_hash="b" * 32)
    assert torch.equal(tensors["model.layers.1.self_attn"], torch.arange(64).view(2, 32).bfloat16())
    with pytest.raises(CorruptValueError) as err:
        decode_value(b, fingerprint="fp", block_hash="a" * 32)
    assert err.value.reason == "key"


def reordered(block_hash: str, checksum: str, created: str) -> bytes:
    """A value whose header another writer rendered: the same fields, the varying ones in
    another order (created, key, checksum) and not where kvstore puts them."""
    value = value_of()
    (n,) = struct.unpack_from("<Q", value)
    doc = json.loads(value[8 : 8 + n])
    meta = doc.pop("__metadata__")
    varying = {"kvstore.created": created, "kvstore.key": block_hash, "kvstore.checksum": checksum}
    for name in varying:
        del meta[name]
    raw = json.dumps({**doc, "__metadata__": {**varying, **meta}}, separators=(",", ":")).encode()
    raw = raw.ljust(n)
    assert len(raw) == n
    return struct.pack("<Q", n) + raw + value[8 + n :]


def test_a_header_with_its_fields_in_another_order_reads_each_values_own_fields() -> None:
    payload_checksum = read_header(value_of()).checksum
    first = reordered("a" * 32, payload_checksum, "2026-11-26T10:00:00.000Z")
    second = reordered("b" * 32, "0" * 16, "2026-11-26T11:00:00.000Z")
    assert outcome(first) == uncached_outcome(first)
    outcome(first)
    assert len(codec._layouts[n_header(first)]) == 1  # the second is read through this layout
    got = outcome(second)
    assert isinstance(got, ValueHeader)
    assert (got.block_name, got.checksum, got.created) == (
        "b" * 32,
        "0" * 16,
        "2026-11-26T11:00:00.000Z",
    )
    assert got == uncached_outcome(second)
    _, tensors = decode_value(first, fingerprint="fp", block_hash="a" * 32)
    assert torch.equal(tensors["scale"], torch.ones(3))


def with_key_twice(first: str, last: str) -> bytes:
    value = value_of(first)
    _, end = field_span(value, "key")
    (n,) = struct.unpack_from("<Q", value)
    header = value[8 : end + 1] + f',"kvstore.key":"{last}"'.encode() + value[end + 1 : 8 + n]
    raw = header.rstrip(b" ")
    raw = raw.ljust(len(raw) + (-(8 + len(raw)) % 8))
    return struct.pack("<Q", len(raw)) + raw + value[8 + n :]


def test_a_repeated_varying_field_is_parsed_in_full_and_the_last_one_counts() -> None:
    # JSON keeps the last of two equal keys: a layout cached from a header whose two keys agree
    # must not answer for one whose first key differs
    same, differ = with_key_twice("a" * 32, "a" * 32), with_key_twice("b" * 32, "a" * 32)
    assert outcome(same) == uncached_outcome(same)
    outcome(same)
    got = outcome(differ)
    assert isinstance(got, ValueHeader) and got.block_name == "a" * 32
    assert got == uncached_outcome(differ)


def test_more_layouts_than_the_cache_holds_still_read_correctly() -> None:
    values = [
        bytes(encode_value({"x": torch.zeros(i + 1)}, fingerprint="fp", block_hash="h"))
        for i in range(codec.MAX_CACHED_LAYOUTS + 20)
    ]
    for _ in range(2):
        for i, value in enumerate(values):
            assert read_header(value).tensors[0].shape == (i + 1,)


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(
        st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__"),
        min_size=1,
        max_size=4,
        unique=True,
    ),
    metadata=st.dictionaries(
        st.text(max_size=8).filter(lambda k: not k.startswith("kvstore.")),
        st.text(max_size=12),
        max_size=3,
    ),
    fingerprint=st.text(min_size=1, max_size=10),
    block_hash=st.text(min_size=1, max_size=10),
    compression=st.sampled_from(["none", "lz4"]),
)
def test_a_header_is_the_json_of_its_document_with_the_metadata_first(
    names: list[str],
    metadata: dict[str, str],
    fingerprint: str,
    block_hash: str,
    compression: str,
) -> None:
    # headers are rendered from cached text around the per-value fields: byte for byte what
    # json.dumps of the whole document gives, each field where it belongs
    tensors = {name: torch.arange(i + 1, dtype=torch.float16) for i, name in enumerate(names)}
    value = bytes(
        encode_value(
            tensors,
            fingerprint=fingerprint,
            block_hash=block_hash,
            metadata=metadata or None,
            compression=compression,
        )
    )
    (n,) = struct.unpack_from("<Q", value)
    doc = json.loads(value[8 : 8 + n])
    assert next(iter(doc)) == "__metadata__"
    assert value[8 : 8 + n].rstrip(b" ") == json.dumps(doc, separators=(",", ":")).encode()
    meta = doc["__metadata__"]
    raw = sum(2 * (i + 1) for i in range(len(names)))
    payload = len(value) - 8 - n
    assert meta == {
        "kvstore.format": codec.FORMAT_VERSION,
        "kvstore.fingerprint": fingerprint,
        "kvstore.key": block_hash,
        "kvstore.codec": compression,
        "kvstore.raw_bytes": str(raw),
        "kvstore.payload_bytes": str(payload),
        "kvstore.checksum": xxhash.xxh3_64_hexdigest(value[8 + n :]),
        **(
            {  # each tensor's own, in payload order: what a read of some tensors verifies
                "kvstore.tensor_checksums": "".join(
                    xxhash.xxh3_64_hexdigest(t.numpy().tobytes()) for t in tensors.values()
                )
            }
            if compression == "none"
            else {}
        ),
        "kvstore.created": meta["kvstore.created"],
        **metadata,
    }
    ours = [k for k in meta if k.startswith("kvstore.")]
    assert list(meta)[: len(ours)] == ours  # ours first
    assert outcome(value) == uncached_outcome(value)


def decoy_value(decoy: str, real: str) -> bytes:
    """A value whose block hash is spelled with a JSON escape (``kvstore\\u002ekey``) while a
    user-metadata key ending in ``"kvstore.key`` holds the marker the byte comparison sees
    (found by a review: the cache followed the decoy)."""
    payload = b"xy" * 4
    checksum = xxhash.xxh3_64_hexdigest(payload)
    meta = (
        '{"kvstore.format":"1","kvstore.fingerprint":"fp",'
        f'"kvstore\\u002ekey":"{real}","u\\"kvstore.key":"{decoy}",'
        '"kvstore.codec":"none","kvstore.raw_bytes":"8","kvstore.payload_bytes":"8",'
        f'"kvstore.checksum":"{checksum}","kvstore.created":"2024-01-01T00:00:00.000Z"}}'
    )
    spec = '"t":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}'
    raw = ('{"__metadata__":' + meta + "," + spec + "}").encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def test_a_field_spelled_with_an_escape_is_never_read_through_a_cached_layout() -> None:
    outcome(decoy_value("z" * 16, "z" * 16))  # a header that would prime a layout
    tricked = decoy_value("k" * 16, "z" * 16)
    got = outcome(tricked)
    assert got == uncached_outcome(tricked)
    assert isinstance(got, ValueHeader) and got.block_name == "z" * 16


def test_values_whose_own_metadata_varies_keep_the_cache_small_and_read_right() -> None:
    values = [value_of(request=f"{i:06d}") for i in range(3 * codec.MAX_LAYOUTS_PER_LENGTH)]
    for i, value in enumerate(values):
        header = read_header(value)
        assert header.metadata == {"request": f"{i:06d}"}
    assert all(len(v) <= codec.MAX_LAYOUTS_PER_LENGTH for v in codec._layouts.values())


def test_a_decoded_copy_gives_each_tensor_its_own_storage() -> None:
    # tensors of one shape are viewed together; a copy must still be one storage per tensor,
    # so that keeping one layer does not keep the whole block
    value = value_of()
    _, tensors = decode_value(value, fingerprint="fp", block_hash="a" * 32, copy=True)
    for t in tensors.values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert t.storage_offset() == 0
    _, views = decode_value(value, fingerprint="fp", block_hash="a" * 32, copy=False)
    first, second = views["model.layers.0.self_attn"], views["model.layers.1.self_attn"]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (1_700_000_000_123_000_000, "2023-11-14T22:13:20.123Z"),
        (1_700_000_000_999_999_999, "2023-11-14T22:13:20.999Z"),
        (1_700_000_001_000_000_000, "2023-11-14T22:13:21.000Z"),
        (1_700_000_000_000_999_999, "2023-11-14T22:13:20.000Z"),
    ],
)
def test_creation_times_are_the_millisecond_the_clock_says(
    monkeypatch: pytest.MonkeyPatch, ns: int, text: str
) -> None:
    monkeypatch.setattr(codec.time, "time_ns", lambda: ns)
    assert codec._now_iso() == text


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_values_written_by_format_1_writers_still_decode(compression: str) -> None:
    """Values stored before a release must load after it: bytes written by the format-1 code of
    2026-11-27 (commit 8e092d6), kept as files so that no rename in the source can change them
    too. (A tree move once rewrote the header's "kvstore.codec" key with the module path.)"""
    data = (Path(__file__).parent / "data" / f"value-format1-{compression}.bin").read_bytes()
    header, got = decode_value(data, fingerprint="fp-golden", block_hash="0123456789abcdef" * 2)
    assert header.codec == compression
    want = torch.arange(2 * 16 * 8, dtype=torch.float32).reshape(2, 16, 8)
    assert list(got) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert torch.equal(got["model.layers.0.self_attn"], want)
    assert torch.equal(got["model.layers.1.self_attn"], -want)
