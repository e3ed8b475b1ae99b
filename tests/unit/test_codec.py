from __future__ import annotations

import json
import struct
import sys

import pytest
import safetensors.torch
import torch

from kvstore import CorruptValueError, InvalidArgumentError, InvalidValueError
from kvstore.values import codec
from kvstore.values.codec import decode_value, encode_value, frame_tensors, read_header

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(1,), (2, 16, 4, 8), (3, 0, 5), (128, 129)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(shape) * 4
    if dtype in (torch.int8, torch.uint8):
        return t.to(torch.int16).clamp(0 if dtype == torch.uint8 else -128, 127).to(dtype)
    return t.to(dtype)


def encode(tensors: dict[str, torch.Tensor], **kw: object) -> bytes:
    kw.setdefault("fingerprint", "fp")
    kw.setdefault("block_hash", "h0")
    return bytes(encode_value(tensors, **kw))  # type: ignore[arg-type]


def decode(value: bytes, **kw: object) -> dict[str, torch.Tensor]:
    kw.setdefault("fingerprint", "fp")
    kw.setdefault("block_hash", "h0")
    return decode_value(value, **kw)[1]  # type: ignore[arg-type]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(torch.uint8) if a.numel() else a.float(),
            b.contiguous().view(torch.uint8) if b.numel() else b.float(),
        )
    )


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_bit_exact(
    dtype: torch.dtype, shape: tuple[int, ...], compression: str
) -> None:
    tensors = {"k": random_tensor(shape, dtype), "v": random_tensor(shape, dtype)}
    out = decode(encode(tensors, compression=compression))
    assert list(out) == ["k", "v"]
    for name in tensors:
        assert same_bits(out[name], tensors[name])


@pytest.mark.parametrize("copy", [True, False])
def test_tensors_of_mixed_element_sizes_round_trip(copy: bool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # an int8 tensor before a float32 one used to leave the float32 misaligned: encode raised
    # a raw RuntimeError ("storage_offset() must be divisible by 4")
    tensors = {
        "codes": torch.arange(3, dtype=torch.int8),
        "scale": torch.tensor([0.5, 2.0]),
        "half": torch.ones(5, dtype=torch.float16),
        "index": torch.tensor([7, 9], dtype=torch.int64),
    }
    value = encode(tensors)
    out = decode(bytearray(value), copy=copy)  # type: ignore[arg-type]
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert same_bits(out[name], t)
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(value)
    loaded = safetensors.torch.load_file(str(path))  # still a valid safetensors file
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_uncompressed_value_is_a_safetensors_file_with_readable_header(tmp_path) -> None:
    tensors = {"kv": torch.arange(64, dtype=torch.bfloat16).view(2, 4, 8)}
    value = encode(tensors, metadata={"tokens": "16"})
    path = tmp_path / "block.safetensors"
    path.write_bytes(value)
    loaded = safetensors.torch.load_file(str(path))
    assert torch.equal(loaded["kv"], tensors["kv"])
    head = value[:400].decode("latin-1")
    for text in ('"BF16"', "[2,4,8]", "kvstore.checksum", "kvstore.format", '"tokens":"16"'):
        assert text in head


def test_compressed_value_is_flagged_and_smaller_for_redundant_data() -> None:
    tensors = {"kv": torch.zeros(4096, dtype=torch.float16)}
    value = encode(tensors, compression="lz4")
    header = read_header(value)
    assert header.codec == "lz4" and header.payload_bytes < header.raw_bytes
    assert torch.equal(decode(value)["kv"], tensors["kv"])


def test_non_contiguous_tensors_are_stored_as_their_logical_values() -> None:
    base = torch.randn(8, 6)
    t = base.t()[:, ::2]
    assert not t.is_contiguous()
    assert torch.equal(decode(encode({"x": t}))["x"], t)


ODD_STRIDES = {
    "one element, stride 5": torch.arange(10.0)[::5][:1],
    "one element at an offset": torch.arange(10.0)[::5][1:2],
    "1x1, strides (5, 5)": torch.arange(25.0).view(5, 5)[:1, :1].as_strided((1, 1), (5, 5)),
    "0-d": torch.tensor(3.0),
    "empty 2-d": torch.empty(0, 3),
    "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
    "transposed": torch.arange(12.0).view(3, 4).t(),
}


@pytest.mark.parametrize("tensor", ODD_STRIDES.values(), ids=ODD_STRIDES.keys())
def test_tensors_framed_where_they_lie_read_back_as_their_values(tensor: torch.Tensor) -> None:
    for _ in range(2):  # the second time through the cached plan
        parts = frame_tensors({"x": tensor}, fingerprint="fp", block_hash="h0")
        assert parts is not None
        value = b"".join(bytes(memoryview(p)) for p in parts)
        assert torch.equal(decode(value)["x"], tensor)
        assert torch.equal(safetensors.torch.load(value)["x"], tensor)


def test_a_returned_headers_metadata_changed_by_its_caller_changes_no_later_read() -> None:
    codec._layouts.clear()
    first = read_header(encode({"x": torch.ones(4)}, metadata={"m": "1"}))
    first.metadata["injected"] = "x"
    later = encode({"x": torch.ones(4)}, block_hash="h1", metadata={"m": "1"})
    assert read_header(later).metadata == {"m": "1"}
    assert decode_value(later, fingerprint="fp", block_hash="h1")[0].metadata == {"m": "1"}


def test_zero_copy_decode_shares_the_value_buffer() -> None:
    value = encode({"x": torch.arange(10, dtype=torch.float32)})
    out = decode(value, copy=False)["x"]
    assert torch.equal(out, torch.arange(10, dtype=torch.float32))


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"x": [1, 2]},
        {"x": 3},
        {"": torch.zeros(1)},
        {"x": torch.zeros(2, dtype=torch.complex64)},
        {"x": torch.zeros([1] * 17)},  # (readers refuse more than 16 dimensions)
    ],
    ids=["empty", "list", "int", "empty-name", "complex", "17-dims"],
)
def test_bad_values_are_rejected_with_a_clear_error(bad: dict) -> None:
    with pytest.raises(InvalidValueError):
        encode(bad)


def test_not_a_dict_is_rejected() -> None:
    with pytest.raises(InvalidValueError, match="dict"):
        encode(torch.zeros(3))  # type: ignore[arg-type]


def test_reserved_and_non_string_metadata_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        encode({"x": torch.zeros(1)}, metadata={"kvstore.format": "2"})
    with pytest.raises(InvalidArgumentError):
        encode({"x": torch.zeros(1)}, metadata={"n": 3})


def test_value_over_the_limit_is_refused_on_write() -> None:
    with pytest.raises(InvalidValueError, match="max_value_bytes"):
        encode({"x": torch.zeros(1000)}, max_value_bytes=100)


def _reason(value: bytes, **kw: object) -> str:
    with pytest.raises(CorruptValueError) as info:
        decode(value, **kw)
    return info.value.reason


def test_flipped_payload_byte_fails_the_checksum() -> None:
    value = bytearray(encode({"x": torch.randn(64)}))
    value[-5] ^= 0x40
    assert _reason(bytes(value)) == "checksum"


def test_flipped_byte_in_compressed_payload_is_detected() -> None:
    value = bytearray(encode({"x": torch.randn(64)}, compression="lz4"))
    value[-3] ^= 0x01
    assert _reason(bytes(value)) == "checksum"


def test_truncated_values_are_detected() -> None:
    value = encode({"x": torch.randn(64)})
    assert _reason(value[:-1]) == "truncated"
    assert _reason(value[:20]) == "truncated"
    assert _reason(value[:3]) == "truncated"


@pytest.mark.parametrize(
    "foreign",
    [b"hello world, not ours", b"\xff" * 64, struct.pack("<Q", 2) + b"{}"],
    ids=["text", "binary", "empty-json"],
)
def test_values_not_written_by_kvstore_are_rejected(foreign: bytes) -> None:
    assert _reason(foreign) in ("not-kvstore", "truncated")


def test_plain_safetensors_file_without_our_metadata_is_rejected() -> None:
    assert _reason(safetensors.torch.save({"x": torch.zeros(4)})) == "not-kvstore"


def _rewrite_meta(value: bytes, **changes: str) -> bytes:
    (n,) = struct.unpack_from("<Q", value)
    doc = json.loads(value[8 : 8 + n])
    doc["__metadata__"].update(changes)
    raw = json.dumps(doc).encode()
    return struct.pack("<Q", len(raw)) + raw + value[8 + n :]


def test_other_format_version_is_rejected() -> None:
    value = _rewrite_meta(encode({"x": torch.zeros(4)}), **{"kvstore.format": "999"})
    assert _reason(value) == "format"


def test_fingerprint_mismatch_is_rejected() -> None:
    assert _reason(encode({"x": torch.zeros(4)}), fingerprint="other-model") == "fingerprint"


def test_value_stored_under_another_block_is_rejected() -> None:
    assert _reason(encode({"x": torch.zeros(4)}), block_hash="h1") == "key"


def test_oversize_header_claim_is_refused_before_allocating() -> None:
    value = _rewrite_meta(encode({"x": torch.zeros(4)}), **{"kvstore.raw_bytes": str(1 << 40)})
    assert _reason(value, max_value_bytes=1 << 20) == "oversize"


def test_shape_that_does_not_match_offsets_is_rejected() -> None:
    value = encode({"x": torch.zeros(4)})
    (n,) = struct.unpack_from("<Q", value)
    doc = json.loads(value[8 : 8 + n])
    doc["x"]["shape"] = [1 << 30]
    raw = json.dumps(doc).encode()
    assert _reason(struct.pack("<Q", len(raw)) + raw + value[8 + n :]) == "not-kvstore"


def _rewrite_tensor(value: bytes, name: str, **changes: object) -> bytes:
    (n,) = struct.unpack_from("<Q", value)
    doc = json.loads(value[8 : 8 + n])
    doc[name].update(changes)
    raw = json.dumps(doc).encode()
    return struct.pack("<Q", len(raw)) + raw + value[8 + n :]


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        # 6,000 dimensions of 1e308 (36 KiB of header) took 19 s to multiply out, before the
        # MAC was checked; a megabyte of them, hours (a review's)
        ([1e308] * 6000, "at most 16 sizes"),
        ([1e308, 1e308], "not a size"),
        ([4.0], "not a size"),
        (["4"], "not a size"),
        ([True, 4], "not a size"),
        ([2] * 17, "at most 16 sizes"),
        ([-1, -4], "not a size"),
        ([1 << 60], "not a size"),
        # zero elements, but strides past 64 bits: torch.empty raised a RuntimeError
        ([0, 1 << 40, 1 << 40], "larger than any value"),
        ("16", "at most 16 sizes"),
    ],
)
def test_a_shape_kvstore_never_writes_is_refused_on_its_form(shape: object, why: str) -> None:
    assert decode(encode({"x": torch.zeros([1] * 15 + [4])}))["x"].shape == (1,) * 15 + (4,)
    value = _rewrite_tensor(encode({"x": torch.zeros(4)}), "x", shape=shape)
    with pytest.raises(CorruptValueError, match=why) as info:
        decode(value)
    assert info.value.reason == "not-kvstore"
    with pytest.raises(CorruptValueError, match=why):
        read_header(value)


@pytest.mark.parametrize("offsets", [[0.0, 16.0], [0, 16, 32], [0, 1e308], "0,16", [0, -16]])
def test_data_offsets_kvstore_never_writes_are_refused(offsets: object) -> None:
    value = _rewrite_tensor(encode({"x": torch.zeros(4)}), "x", data_offsets=offsets)
    assert _reason(value) == "not-kvstore"


@pytest.mark.parametrize("field", ["kvstore.mac", "kvstore.tensor_checksums"])
def test_a_checksum_field_that_is_not_ascii_is_a_corrupt_value(field: str) -> None:
    # ``str.encode("ascii")`` raised its UnicodeEncodeError out of decode_value (a review's)
    value = _rewrite_meta(encode({"x": torch.zeros(4)}), **{field: "\u00e9" * 16})
    assert _reason(value) == "not-kvstore"
    with pytest.raises(CorruptValueError):
        read_header(value)


def test_without_the_lz4_extra_lz4_is_refused_up_front_and_lz4_values_are_counted_misses(
    monkeypatch: pytest.MonkeyPatch, fake_client: object
) -> None:
    from kvstore import LookupBuffer, chain_hashes

    reader = LookupBuffer(fake_client, namespace="n", layout={"m": 1})  # type: ignore[arg-type]
    key = chain_hashes(list(range(16)), 16)[0]
    value = encode_value(  # written by an instance that has lz4
        {"x": torch.ones(64)}, fingerprint=reader.fingerprint, block_hash=key, compression="lz4"
    )
    fake_client.set(reader.redis_key(key), bytes(value))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lz4", None)  # this one lacks the [lz4] extra
    monkeypatch.setitem(sys.modules, "lz4.block", None)
    with pytest.raises(InvalidArgumentError, match=r"vllm-redis-kvstore\[lz4\]"):
        LookupBuffer(fake_client, compression="lz4")  # type: ignore[arg-type]
    assert reader.select([key]) == [None]  # a counted miss, not an exception
    assert reader.stats().corrupt_by_reason == {"codec": 1}


def _misaligned_value() -> bytes:
    """A value kvstore could not have written: an int8 tensor first, so the float32 after it
    starts at byte 1 (the payload and its checksum are still valid)."""
    value = encode({"a": torch.zeros(1, dtype=torch.int8), "b": torch.ones(1)})
    (n,) = struct.unpack_from("<Q", value)
    doc = json.loads(value[8 : 8 + n])
    doc["a"]["data_offsets"], doc["b"]["data_offsets"] = [0, 1], [1, 5]
    raw = json.dumps(doc).encode()
    return struct.pack("<Q", len(raw)) + raw + value[8 + n :]


def test_a_tensor_not_aligned_to_its_dtype_is_rejected() -> None:
    assert _reason(_misaligned_value()) == "not-kvstore"


def test_a_header_nested_too_deep_for_the_json_parser_is_rejected() -> None:
    raw = b"[" * 200_000 + b"]" * 200_000
    assert _reason(struct.pack("<Q", len(raw)) + raw) == "not-kvstore"


def test_bad_headers_are_counted_misses_not_errors(fake_client: object) -> None:
    """Reads check each value on the thread that received it: whatever is wrong with a value
    must come back as a counted miss, never as an exception out of the read."""
    from kvstore import LookupBuffer, chain_hashes

    buf = LookupBuffer(fake_client, namespace="n")  # type: ignore[arg-type]
    hashes = chain_hashes(list(range(48)), 16)
    buf.insert_many([(h, {"x": torch.ones(8)}) for h in hashes])
    nested = b"[" * 200_000 + b"]" * 200_000
    fake_client.set(buf.redis_key(hashes[0]), _misaligned_value())  # type: ignore[attr-defined]
    fake_client.set(buf.redis_key(hashes[1]), struct.pack("<Q", len(nested)) + nested)  # type: ignore[attr-defined]
    got = buf.select(hashes)
    assert got[0] is None and got[1] is None and got[2] is not None
    stats = buf.stats()
    assert (stats.hits, stats.misses, stats.corrupt_by_reason) == (1, 2, {"not-kvstore": 2})


def test_a_header_number_past_a_float_is_a_corrupt_value_not_an_overflow() -> None:
    good = bytes(encode_value({"k": torch.ones(4)}, fingerprint="fp", block_hash="h"))
    n = struct.unpack_from("<Q", good)[0]
    header = json.loads(good[8 : 8 + n])
    header["k"]["data_offsets"] = [0, 1e999]  # json writes Infinity; a hostile writer 1e999
    text = json.dumps(header).replace("Infinity", "1e999").encode()
    with pytest.raises(CorruptValueError, match="not-kvstore"):
        read_header(struct.pack("<Q", len(text)) + text + good[8 + n :])
