"""A value's tensors read a range at a time (``kvstore.values.tensor_reads``): the header with the
first tensors, then later tensors, each verified by its own checksum. On fakeredis and on a real
``redis-server``; hostile and stale values are counted misses, never data."""

from __future__ import annotations

import struct

import fakeredis
import pytest
import redis
import torch
import xxhash

from kvstore import LookupBuffer, ValueHeader, encode_value
from kvstore.values.codec import frame_parts, plan_entries, read_header, tensor_checksums_ok
from kvstore.values.tensor_reads import HeadMiss
from testing.blocks import without_tensor_checksums

LAYERS = 4
SHAPE = (2, 16, 8)  # float32: 1 KiB a layer


def store_on(client: redis.Redis) -> LookupBuffer:
    return LookupBuffer(client, namespace="ranges", fingerprint="fp")


def layer_values(block: int) -> list[torch.Tensor]:
    return [torch.full(SHAPE, float(10 * block + layer)) for layer in range(LAYERS)]


def write_blocks(store: LookupBuffer, hashes: list[str]) -> tuple[list, int, int]:
    """Values as the data mover frames them (one tensor per layer); (entries, header bytes,
    payload bytes)."""
    entries, raw = plan_entries([f"l{i}" for i in range(LAYERS)], torch.float32, SHAPE)
    values = []
    for b, h in enumerate(hashes):
        pieces = [t.numpy().view("uint8").reshape(-1) for t in layer_values(b)]
        values.append((h, frame_parts(entries, pieces, fingerprint="fp", block_hash=h)))
    store.insert_parts(values, positions=list(range(len(hashes))))
    return entries, memoryview(values[0][1][0]).nbytes, raw


def rows(n: int, nbytes: int) -> list[torch.Tensor]:
    return list(torch.zeros(n, nbytes, dtype=torch.uint8))


@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
def client(request: pytest.FixtureRequest) -> redis.Redis:
    if request.param == "fakeredis":
        return fakeredis.FakeRedis(server=fakeredis.FakeServer())
    url = request.getfixturevalue("redis_url")
    return redis.Redis.from_url(url)


def test_the_header_and_first_layers_then_the_rest_arrive_verified(client: redis.Redis) -> None:
    store = store_on(client)
    hashes = [f"{i:032x}" for i in range(3)]
    entries, header, raw = write_blocks(store, hashes)
    head = rows(3, header + raw)
    got = store.select_head_into(hashes, head, header_bytes=header, entries=entries, tensors=1)
    assert all(isinstance(h, ValueHeader) for h in got)
    for b, row in enumerate(head):
        first = row[header : header + raw // LAYERS].view(torch.float32).view(SHAPE)
        assert torch.equal(first, layer_values(b)[0])
    rest = rows(3, raw)
    ok = store.select_tensors_into(hashes, got, rest, 1, LAYERS)  # type: ignore[arg-type]
    assert ok == [True, True, True]
    for b, row in enumerate(rest):
        layers = row[: 3 * raw // LAYERS].view(torch.float32).view(3, *SHAPE)
        assert torch.equal(layers, torch.stack(layer_values(b)[1:]))
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (3, 0, 0)
    assert stats.bytes_in == 3 * (header + raw)


def test_a_missing_key_is_a_miss_and_a_value_not_in_ranges_is_read_whole(
    client: redis.Redis,
) -> None:
    store = store_on(client)
    entries, header, raw = write_blocks(store, ["a" * 32])
    # a value as an older writer framed it: no per-tensor checksums
    new = encode_value(
        {f"l{i}": t for i, t in enumerate(layer_values(0))}, fingerprint="fp", block_hash="b" * 32
    )
    client.set(store.redis_key("b" * 32), without_tensor_checksums(bytes(new)))
    got = store.select_head_into(
        ["a" * 32, "b" * 32, "c" * 32],
        rows(3, header + raw),
        header_bytes=header,
        entries=entries,
        tensors=2,
    )
    assert isinstance(got[0], ValueHeader)
    assert got[1] is HeadMiss.WHOLE
    assert got[2] is HeadMiss.MISSING
    whole = store.select_into(["b" * 32], rows(1, 2 * (header + raw)))
    assert whole[0] is not None and torch.equal(whole[0]["l3"], layer_values(0)[3])


@pytest.mark.parametrize("where", ["header", "first", "later"])
def test_a_flipped_byte_anywhere_is_a_counted_miss(client: redis.Redis, where: str) -> None:
    store = store_on(client)
    entries, header, raw = write_blocks(store, ["d" * 32])
    key = store.redis_key("d" * 32)
    value = bytearray(client.get(key))
    at = {"header": 40, "first": header + 5, "later": header + raw - 7}[where]
    value[at] ^= 0x40
    client.set(key, bytes(value))
    got = store.select_head_into(
        ["d" * 32], rows(1, header + raw), header_bytes=header, entries=entries, tensors=2
    )
    if where == "later":
        assert isinstance(got[0], ValueHeader)
        assert store.select_tensors_into(["d" * 32], got, rows(1, raw), 2, LAYERS) == [False]  # type: ignore[arg-type]
        assert store.stats().range_failures == 1
    else:
        assert got[0] in (HeadMiss.INVALID, HeadMiss.WHOLE)
    assert store.stats().corrupt + (got[0] is HeadMiss.WHOLE) >= 1


def test_a_value_replaced_or_gone_between_ranges_fails_its_next_range(
    client: redis.Redis,
) -> None:
    store = store_on(client)
    hashes = ["e" * 32, "f" * 32]
    entries, header, raw = write_blocks(store, hashes)
    got = store.select_head_into(
        hashes, rows(2, header + raw), header_bytes=header, entries=entries, tensors=1
    )
    # the first value is overwritten by another payload of the same layout, the second deleted
    pieces = [torch.full(SHAPE, -1.0).numpy().view("uint8").reshape(-1)] * LAYERS
    other = frame_parts(entries, pieces, fingerprint="fp", block_hash=hashes[0])
    store.insert_parts([(hashes[0], other)], positions=[0])
    client.delete(store.redis_key(hashes[1]))
    ok = store.select_tensors_into(hashes, got, rows(2, raw), 1, LAYERS)  # type: ignore[arg-type]
    assert ok == [False, False]


def test_a_hostile_value_costs_no_more_than_the_range_asked_for(client: redis.Redis) -> None:
    store = store_on(client)
    entries, header, raw = write_blocks(store, ["1" * 32])
    # claims a header of 2**40 bytes, then a huge payload
    hostile = struct.pack("<Q", 1 << 40) + b"{" * (4 << 20)
    client.set(store.redis_key("2" * 32), hostile)
    client.set(store.redis_key("3" * 32), b"x")  # shorter than a header length
    client.rpush(store.redis_key("4" * 32), b"a list, not a string")
    hashes = ["1" * 32, "2" * 32, "3" * 32, "4" * 32]
    buffers = rows(4, header + raw)
    got = store.select_head_into(hashes, buffers, header_bytes=header, entries=entries, tensors=1)
    assert isinstance(got[0], ValueHeader)
    assert got[1] in (HeadMiss.INVALID, HeadMiss.WHOLE)
    assert got[2] in (HeadMiss.INVALID, HeadMiss.WHOLE)
    assert got[3] is HeadMiss.INVALID
    # nothing was received past the range asked for
    assert all(not row[header + raw // LAYERS :].any() for row in buffers)


def test_per_tensor_checksums_are_each_tensors_own() -> None:
    tensors = {f"t{i}": torch.arange(i + 3, dtype=torch.int32) for i in range(3)}
    value = bytes(encode_value(tensors, fingerprint="fp", block_hash="h"))
    header = read_header(value)
    payload = value[header.header_bytes :]
    for i, e in enumerate(header.tensors):
        assert header.tensor_checksums[i] == xxhash.xxh3_64_hexdigest(payload[e.start : e.end])
    assert tensor_checksums_ok(header, 1, 3, payload[header.tensors[1].start :])
    assert not tensor_checksums_ok(header, 1, 3, payload[header.tensors[1].start : -1])
    compressed = {f"t{i}": torch.zeros(64, dtype=torch.int32) for i in range(2)}
    pytest.importorskip("lz4")
    packed = bytes(encode_value(compressed, fingerprint="f", block_hash="h", compression="lz4"))
    assert read_header(packed).tensor_checksums == ()  # only uncompressed values have them
