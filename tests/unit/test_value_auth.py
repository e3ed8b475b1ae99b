"""Authenticated values (``kvstore.values.value_auth``): with a namespace secret every value is
signed, and a reader loads only values signed with it. Everything a writer without the secret can do
to a value -- write its own, replay another block's or namespace's, change a byte of the payload or
a field of the header -- is a counted miss, on every read path: whole reads, reads into buffers,
range reads. Plus where secrets come from, and that they never show."""

from __future__ import annotations

import json
import logging
import os
import struct
import tracemalloc

import fakeredis
import pytest
import torch

from connector.config import RedisConnectorConfig
from kvstore import InvalidArgumentError, LookupBuffer
from kvstore.values.codec import plan_entries, read_header
from kvstore.values.tensor_reads import HeadMiss
from kvstore.values.value_auth import ValueKey, load_secret

SECRET = b"correct horse battery staple"
OTHER = b"another secret, just as long"
H = "ab" * 16


def store(server: fakeredis.FakeServer, secret: bytes | None, **kw: object) -> LookupBuffer:
    kw.setdefault("namespace", "ns")
    return LookupBuffer(fakeredis.FakeRedis(server=server), fingerprint="fp", secret=secret, **kw)  # type: ignore[arg-type]


def value(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(4, 16, generator=g, dtype=torch.float32),
        "v": torch.randn(4, 16, generator=g, dtype=torch.float32),
    }


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


def raw_client(server: fakeredis.FakeServer) -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=server)


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("path", ["insert", "insert_many", "insert_iter"])
def test_a_signed_value_reads_back_on_every_path(
    server: fakeredis.FakeServer, compression: str, path: str
) -> None:
    writer = store(server, SECRET, compression=compression)
    reader = store(server, SECRET)
    t = value()
    if path == "insert":
        writer.insert(H, t)
    elif path == "insert_many":
        writer.insert_many([(H, t)])  # framed around the tensors' own bytes
    else:
        writer.insert_many(iter([(H, t)]))  # staged into scratch buffers
    assert read_header(raw_client(server).get(f"kv:ns:fp:{H}")).mac  # signed
    got = reader.select([H])[0]
    assert got is not None and all(torch.equal(got[n], t[n]) for n in t)
    row = torch.zeros(4096, dtype=torch.uint8)
    got = reader.select_into([H], [row])[0]
    assert got is not None and torch.equal(got["v"], t["v"])


def forgeries(server: fakeredis.FakeServer) -> dict[str, bytes]:
    """What a writer without the secret can put under block ``H``."""
    signed = store(server, SECRET)
    signed.insert(H, value(1))
    signed.insert("cd" * 16, value(2))
    c = raw_client(server)
    genuine = c.get(f"kv:ns:fp:{H}")
    out = {}
    store(server, None).insert(H, value(3))
    out["unsigned"] = c.get(f"kv:ns:fp:{H}")
    store(server, OTHER).insert(H, value(3))
    out["another secret"] = c.get(f"kv:ns:fp:{H}")
    out["another block's value"] = c.get(f"kv:ns:fp:{'cd' * 16}")
    store(server, SECRET, namespace="other").insert(H, value(3))
    out["another namespace's value, same secret"] = c.get(f"kv:other:fp:{H}")
    flipped = bytearray(genuine)
    flipped[-1] ^= 0x01
    out["a payload bit flipped"] = bytes(flipped)
    # the header's tensors swapped (k's bytes read as v's), the tag kept
    n = struct.unpack_from("<Q", genuine)[0]
    header = json.loads(genuine[8 : 8 + n])
    header["k"]["data_offsets"], header["v"]["data_offsets"] = (
        header["v"]["data_offsets"],
        header["k"]["data_offsets"],
    )
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    out["the header's tensors swapped"] = genuine[:8] + text + genuine[8 + n :]
    # the tag of a genuine header with the tag field removed: an unsigned lookalike
    meta = header["__metadata__"]
    del meta["kvstore.mac"]
    out["the tag stripped"] = genuine[:8] + json.dumps(header).encode().ljust(n) + genuine[8 + n :]
    return out


def test_what_a_writer_without_the_secret_plants_is_a_counted_miss_everywhere(
    server: fakeredis.FakeServer,
) -> None:
    reader = store(server, SECRET)
    c = raw_client(server)
    for what, forged in forgeries(server).items():
        c.set(f"kv:ns:fp:{H}", forged)
        before = reader.stats().misses
        assert reader.select([H]) == [None], what
        row = torch.zeros(4096, dtype=torch.uint8)
        assert reader.select_into([H], [row]) == [None], what
        assert reader.stats().misses == before + 2, what
    reasons = reader.stats().corrupt_by_reason
    assert set(reasons) <= {"unsigned", "forged", "key", "not-kvstore"}, reasons
    assert reasons["forged"] >= 6 and reasons["unsigned"] >= 2


def test_a_reader_without_the_secret_loads_no_signed_value(server: fakeredis.FakeServer) -> None:
    store(server, SECRET).insert(H, value())
    plain = store(server, None)
    assert plain.select([H]) == [None]
    assert plain.stats().corrupt_by_reason == {"no-secret": 1}


def layered(server: fakeredis.FakeServer, secret: bytes | None) -> tuple[LookupBuffer, list, int]:
    s = store(server, secret)
    entries, raw = plan_entries([f"l{i}" for i in range(4)], torch.float32, (2, 8))
    pieces = [torch.full((2, 8), float(i)).numpy().view("uint8").reshape(-1) for i in range(4)]
    s.insert_parts([(H, s.frame_parts(entries, pieces, H))])
    return s, entries, raw


def test_range_reads_verify_each_tensor_with_the_key(server: fakeredis.FakeServer) -> None:
    writer, entries, raw = layered(server, SECRET)
    header_bytes = read_header(raw_client(server).get(f"kv:ns:fp:{H}")).header_bytes
    buf = [torch.zeros(header_bytes + raw, dtype=torch.uint8)]
    kw = {"header_bytes": header_bytes, "entries": entries, "tensors": 1}
    head = writer.select_head_into([H], buf, **kw)[0]
    assert not isinstance(head, str) and head.mac
    assert writer.select_tensors_into([H], [head], buf, 1, 4) == [True]
    # the same bytes, read by a store without the secret: a miss, never data
    assert store(server, None).select_head_into([H], buf, **kw)[0] == HeadMiss.INVALID
    # a later layer changed after its head was read: that band fails
    c = raw_client(server)
    v = bytearray(c.get(f"kv:ns:fp:{H}"))
    v[-1] ^= 0x01
    c.set(f"kv:ns:fp:{H}", bytes(v))
    assert writer.select_tensors_into([H], [head], buf, 1, 4) == [False]


def test_a_compressed_value_that_claims_more_than_its_buffer_costs_no_memory(
    server: fakeredis.FakeServer,
) -> None:
    """A 64 MiB lz4 bomb (~256 KiB stored) read into 1 MiB rows: a counted miss before any
    memory is spent. It used to be decompressed to the size its own header claimed."""
    store(server, None, compression="lz4").insert(
        H, {"kv": torch.zeros(64 << 20, dtype=torch.uint8)}
    )
    stored = raw_client(server).strlen(f"kv:ns:fp:{H}")
    assert stored < 1 << 20
    reader = store(server, None)
    rows = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(4)]
    tracemalloc.start()
    try:
        got = reader.select_into([H] * 4, rows)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [None] * 4
    assert reader.stats().corrupt_by_reason == {"oversize": 4}
    assert peak < 16 << 20, f"reading four bombs peaked at {peak >> 20} MiB"


def test_an_lz4_header_claiming_more_than_255_fold_is_refused_unread(
    server: fakeredis.FakeServer,
) -> None:
    store(server, None, compression="lz4").insert(H, {"kv": torch.zeros(4096, dtype=torch.uint8)})
    c = raw_client(server)
    v = c.get(f"kv:ns:fp:{H}")
    n = struct.unpack_from("<Q", v)[0]
    header = json.loads(v[8 : 8 + n])
    claim = 1 << 30
    header["__metadata__"]["kvstore.raw_bytes"] = str(claim)
    header["kv"]["shape"] = [claim]
    header["kv"]["data_offsets"] = [0, claim]
    text = json.dumps(header, separators=(",", ":")).encode()
    c.set(f"kv:ns:fp:{H}", struct.pack("<Q", len(text)) + text + v[8 + n :])
    reader = store(server, None)
    assert reader.select([H]) == [None]  # select has no buffer: the 255-fold bound holds
    assert reader.stats().corrupt_by_reason == {"oversize": 1}


def test_secrets_come_from_a_file_or_the_environment_and_never_show(
    tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = os.path.join(tmp_path, "secret")
    with open(path, "wb") as f:
        f.write(SECRET + b"\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert load_secret(secret_file=path) == SECRET  # the newline is not part of it
    assert "chmod 600" in caplog.text
    monkeypatch.setenv("KV_SECRET", SECRET.decode())
    assert load_secret(secret_env="KV_SECRET") == SECRET
    assert load_secret() is None
    for bad in (
        {"secret_file": path + ".missing"},
        {"secret_env": "KV_SECRET_UNSET"},
        {"secret_file": path, "secret_env": "KV_SECRET"},
    ):
        with pytest.raises(InvalidArgumentError) as info:
            load_secret(**bad)  # type: ignore[arg-type]
        assert SECRET.decode() not in str(info.value)
    monkeypatch.setenv("KV_SHORT", "short")
    with pytest.raises(InvalidArgumentError, match="16 to") as info:
        load_secret(secret_env="KV_SHORT")
    assert "short'" not in str(info.value) and ": short" not in str(info.value)
    # the connector reads it at startup, and keeps only where it came from
    cfg = RedisConnectorConfig.from_extra(
        {"url": "redis://127.0.0.1:1/0", "secret_env": "KV_SECRET"}, "kv_both"
    )
    assert SECRET.decode() not in repr(cfg)
    with pytest.raises(InvalidArgumentError, match="KV_SECRET_UNSET"):
        RedisConnectorConfig.from_extra(
            {"url": "redis://127.0.0.1:1/0", "secret_env": "KV_SECRET_UNSET"}, "kv_both"
        )
    key = ValueKey(SECRET, "ns")
    buf = LookupBuffer(fakeredis.FakeRedis(), namespace="ns", fingerprint="fp", secret=SECRET)
    for shown in (repr(key), str(key), repr(buf), repr(buf.value_key)):
        assert SECRET.decode() not in shown and "horse" not in shown


def test_the_data_mover_signs_what_it_saves_and_loads_only_signed_blocks() -> None:
    from datamover import BlockMover
    from kvstore import chain_hashes
    from testing.kv_caches import caches, load_all, save_all

    server = fakeredis.FakeServer()

    def mover(kv: dict[str, torch.Tensor], secret: bytes | None) -> BlockMover:
        s = LookupBuffer(
            fakeredis.FakeRedis(server=server), namespace="mover", fingerprint="fp", secret=secret
        )
        return BlockMover(kv, s, max_inflight_bytes=8 << 20, chunk_bytes=1 << 20)

    src, dst = caches("cpu"), caches("cpu", seed=None)
    hashes = chain_hashes(list(range(4 * 16)), 16)
    save_all(mover(src, SECRET), [1, 2, 3, 4], hashes)
    assert load_all(mover(dst, None), [10, 11, 12, 13], hashes) == []  # no secret: nothing
    assert not any(t.any() for t in dst.values())
    assert sorted(load_all(mover(dst, SECRET), [10, 11, 12, 13], hashes)) == [10, 11, 12, 13]
    for name in src:
        assert torch.equal(dst[name][[10, 11, 12, 13]], src[name][[1, 2, 3, 4]])


def test_tags_a_signing_writer_publishes_for_chosen_bytes_never_sign_a_header(
    server: fakeredis.FakeServer,
) -> None:
    """An application that stores caller-chosen tensors is an oracle: each value's checksum
    (in the clear) is the tag of bytes the caller chose. Tags of payloads, tensors and headers
    are made with separate keys, so such a tag never signs a forged header."""
    from kvstore.values.codec import _MAC_MARKER, _value_header

    signer, reader = store(server, SECRET), store(server, SECRET)
    c = raw_client(server)

    def oracle(data: bytes) -> str:
        name = f"{len(data):032x}"
        signer.insert(name, {"x": torch.frombuffer(bytearray(data), dtype=torch.uint8)})
        return read_header(c.get(f"kv:ns:fp:{name}")).checksum

    evil = {"k": torch.full((4, 16), 6.66), "v": torch.full((4, 16), -6.66)}
    pieces = [t.view(torch.uint8).numpy().tobytes() for t in evil.values()]
    entries, raw = plan_entries(list(evil), torch.float32, (4, 16))
    header = _value_header(
        entries,
        fingerprint="fp",
        block_hash=H,
        codec="none",
        raw_bytes=raw,
        payload_bytes=raw,
        checksum=oracle(b"".join(pieces)),
        created="2026-11-27T00:00:00.000Z",
        metadata={},
        tensor_checksums="".join(oracle(p) for p in pieces),
        value_key=ValueKey(b"not the secret, 24 bytes", "ns"),  # lays the mac field out
    )
    at = header.index(_MAC_MARKER) + len(_MAC_MARKER)
    zeroed = header[:at] + b"0" * 32 + header[at + 32 :]
    forged = zeroed[:at] + oracle(zeroed).encode() + zeroed[at + 32 :] + b"".join(pieces)
    c.set(f"kv:ns:fp:{H}", forged)
    assert reader.select([H]) == [None]
    assert reader.select_into([H], [torch.zeros(4096, dtype=torch.uint8)]) == [None]
    assert reader.stats().corrupt_by_reason == {"forged": 2}


def test_headers_from_a_writer_without_the_secret_are_never_cached(
    server: fakeredis.FakeServer,
) -> None:
    """Each new header layout costs a regular expression's compilation and stays in a process-
    wide cache: only a header that verified may. A big one (a few hundred KiB) never does."""
    from kvstore.values import codec

    codec._layouts.clear()
    reader = store(server, SECRET)
    hostile = store(server, None)
    for i in range(4):  # unsigned: refused, and not remembered
        hostile.insert(H, {f"t{j}": torch.ones(1) for j in range(8 + i)})
        assert reader.select([H]) == [None]
    assert not codec._layouts
    wide = {f"tensor-with-a-long-name-{j:05d}": torch.ones(1) for j in range(3000)}
    store(server, SECRET).insert(H, wide)
    assert reader.select([H])[0] is not None  # valid, parsed in full, not kept
    assert not codec._layouts
    store(server, SECRET).insert(H, value())
    assert reader.select([H])[0] is not None
    assert sum(len(v) for v in codec._layouts.values()) == 1


def test_a_reset_cannot_be_rolled_back_across_epochs(server: fakeredis.FakeServer) -> None:
    """Issue 52: the MAC binds a value to its name, not to the namespace's current generation.
    Record a signed value, reset (the weights changed), then delete the counter and put the
    value back: an instance started afterwards reads generation 0 and names the old block.
    Given the new weights' epoch, it never verifies it: a counted miss, not stale KV."""
    before = store(server, SECRET, epoch="step-100")
    before.insert(H, value(1))
    c = raw_client(server)
    key = f"kv:ns:fp:{H}"  # (generation 0: the name it always had)
    recorded = c.get(key)
    before.reset()  # the weights changed: generation 1 names every block anew
    c.delete(before.keys.generation())  # rolled back: a fresh instance reads generation 0
    c.set(key, recorded)
    same_epoch = store(server, SECRET, epoch="step-100")
    assert same_epoch.select([H])[0] is not None  # the attack, where epochs do not differ
    after = store(server, SECRET, epoch="step-200")
    assert after.select([H]) == [None]
    row = torch.zeros(4096, dtype=torch.uint8)
    assert after.select_into([H], [row]) == [None]
    assert after.stats().corrupt_by_reason == {"forged": 2}
    # and its own values read back
    after.insert("cd" * 16, value(2))
    got = after.select(["cd" * 16])[0]
    assert got is not None and torch.equal(got["k"], value(2)["k"])


@pytest.mark.parametrize("epoch", ["has space", "é", "x" * 129, "tab\t"])
def test_an_epoch_is_short_printable_ascii(server: fakeredis.FakeServer, epoch: str) -> None:
    with pytest.raises(InvalidArgumentError, match="epoch"):
        store(server, SECRET, epoch=epoch)


def test_an_epoch_without_a_secret_is_refused_where_it_is_configured(
    server: fakeredis.FakeServer,
) -> None:
    with pytest.raises(InvalidArgumentError, match="needs the namespace's secret"):
        store(server, None, epoch="step-1")
    with pytest.raises(InvalidArgumentError, match="needs the namespace's secret"):
        RedisConnectorConfig.from_extra(
            {"url": "redis://localhost:6379/0", "epoch": "step-1"}, "kv_both"
        )
