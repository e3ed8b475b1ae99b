"""LookupBuffer semantics on fakeredis (fast; the same scripts run on real Redis elsewhere)."""

from __future__ import annotations

import logging
import time

import fakeredis
import pytest
import torch

from kvstore import (
    Claim,
    InvalidArgumentError,
    InvalidValueError,
    LookupBuffer,
    chain_hashes,
    layout_fingerprint,
)
from testing.blocks import k_v_block

HASHES = chain_hashes(list(range(16 * 6)), 16)


def fill(buf: LookupBuffer, n: int) -> None:
    buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(n)])


def test_insert_then_select_returns_the_tensors_and_keeps_them(fake_buffer: LookupBuffer) -> None:
    fill(fake_buffer, 3)
    got = fake_buffer.select(HASHES[:4])
    assert [g is None for g in got] == [False, False, False, True]
    want = k_v_block(2)
    assert torch.equal(got[2]["k"], want["k"]) and torch.equal(got[2]["v"], want["v"])
    assert fake_buffer.select(HASHES[:1])[0] is not None


def test_drop_select_takes_the_values_once(fake_buffer: LookupBuffer) -> None:
    fill(fake_buffer, 2)
    first = fake_buffer.drop_select(HASHES[:3])
    assert torch.equal(first[1]["k"], k_v_block(1)["k"]) and first[2] is None
    assert fake_buffer.drop_select(HASHES[:2]) == [None, None]
    assert fake_buffer.contains(HASHES[:2]) == [False, False]


def test_drop_select_leaves_no_claim_keys(fake_buffer: LookupBuffer, fake_client) -> None:
    fill(fake_buffer, 3)
    fake_buffer.drop_select(HASHES[:3])
    assert fake_client.keys("*") == []


def test_drop_select_waits_until_every_key_is_present(fake_buffer: LookupBuffer) -> None:
    fill(fake_buffer, 1)
    t0 = time.monotonic()
    got = fake_buffer.drop_select(HASHES[:2], timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.29
    assert got[0] is not None and got[1] is None  # on timeout it takes what is there


def test_drop_select_waiting_consumes_nothing_until_complete(fake_buffer: LookupBuffer) -> None:
    fill(fake_buffer, 1)
    # zero timeout: partial take allowed
    assert fake_buffer.drop_select(HASHES[1:3]) == [None, None]
    assert fake_buffer.contains(HASHES[:1]) == [True]


def test_longest_prefix_counts_leading_blocks(fake_buffer: LookupBuffer) -> None:
    assert fake_buffer.longest_prefix(HASHES) == 0
    fill(fake_buffer, 3)
    fake_buffer.insert(HASHES[4], k_v_block(4))  # a gap at 3
    assert fake_buffer.longest_prefix(HASHES) == 3
    assert fake_buffer.longest_prefix([]) == 0


def test_longest_prefix_across_fingerprints_needs_every_rank(fake_client) -> None:
    ranks = [
        LookupBuffer(fake_client, namespace="tp", layout={"tp_rank": r, "tp_size": 2})
        for r in range(2)
    ]
    fps = [b.fingerprint for b in ranks]
    for i in range(3):
        ranks[0].insert(HASHES[i], k_v_block(i))
    ranks[1].insert(HASHES[0], k_v_block(0))
    assert ranks[0].longest_prefix(HASHES, fingerprints=fps) == 1
    assert ranks[0].longest_prefix(HASHES) == 3


def test_delete_and_contains(fake_buffer: LookupBuffer) -> None:
    fill(fake_buffer, 2)
    assert fake_buffer.delete(HASHES[:3]) == 2
    assert fake_buffer.contains(HASHES[:2]) == [False, False]


def test_ttl_is_set_in_milliseconds(fake_client) -> None:
    buf = LookupBuffer(fake_client, namespace="ttl", ttl_s=2.5)
    buf.insert(HASHES[0], k_v_block(0))
    assert 2000 < fake_client.pttl(buf.redis_key(HASHES[0])) <= 2500


def test_no_ttl_by_default(fake_buffer: LookupBuffer, fake_client) -> None:
    fake_buffer.insert(HASHES[0], k_v_block(0))
    assert fake_client.pttl(fake_buffer.redis_key(HASHES[0])) == -1


def test_insert_async_returns_a_future(fake_buffer: LookupBuffer) -> None:
    fut = fake_buffer.insert_async(HASHES[0], k_v_block(0))
    assert fut.result(timeout=5) is None
    assert fake_buffer.contains(HASHES[:1]) == [True]


def test_insert_async_future_carries_the_error(fake_buffer: LookupBuffer) -> None:
    fut = fake_buffer.insert_async(HASHES[0], {"x": "not a tensor"})  # type: ignore[dict-item]
    with pytest.raises(InvalidValueError):
        fut.result(timeout=5)


def test_key_is_readable_and_scannable(fake_buffer: LookupBuffer, fake_client) -> None:
    fake_buffer.insert(HASHES[0], k_v_block(0))
    key = fake_buffer.redis_key(HASHES[0])
    assert key == f"kv:test:{fake_buffer.fingerprint}:{HASHES[0]}"
    assert [k.decode() for k in fake_client.scan_iter(match=fake_buffer.key_pattern())] == [key]


def test_counters(fake_buffer: LookupBuffer) -> None:
    fill(fake_buffer, 2)
    fake_buffer.select(HASHES[:3])
    s = fake_buffer.stats()
    assert (s.inserts, s.hits, s.misses, s.corrupt) == (2, 2, 1, 0)
    assert s.bytes_out > 2 * 2 * 2 * 16 * 8 * 4 and s.bytes_in > 0


@pytest.mark.parametrize(
    "garbage",
    [b"not a kvstore value", b"\x00" * 3],
    ids=["text", "short"],
)
def test_corrupt_value_is_a_counted_miss_logged_once(
    fake_buffer: LookupBuffer, fake_client, garbage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    key = fake_buffer.redis_key(HASHES[0])
    fake_client.set(key, garbage)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert fake_buffer.select(HASHES[:1]) == [None]
        assert fake_buffer.select(HASHES[:1]) == [None]
    s = fake_buffer.stats()
    assert s.corrupt == 2 and s.misses == 2 and s.hits == 0
    assert sum(key in r.getMessage() for r in caplog.records) == 1


def test_bit_flip_in_stored_value_is_a_checksum_miss(
    fake_buffer: LookupBuffer, fake_client
) -> None:
    fake_buffer.insert(HASHES[0], k_v_block(0))
    key = fake_buffer.redis_key(HASHES[0])
    value = bytearray(fake_client.get(key))
    value[-1] ^= 1
    fake_client.set(key, bytes(value))
    assert fake_buffer.drop_select(HASHES[:1]) == [None]
    assert fake_buffer.stats().corrupt_by_reason == {"checksum": 1}


def test_value_copied_to_another_block_key_is_rejected(
    fake_buffer: LookupBuffer, fake_client
) -> None:
    fake_buffer.insert(HASHES[0], k_v_block(0))
    fake_client.copy(fake_buffer.redis_key(HASHES[0]), fake_buffer.redis_key(HASHES[1]))
    assert fake_buffer.select(HASHES[1:2]) == [None]
    assert fake_buffer.stats().corrupt_by_reason == {"key": 1}


def test_other_model_in_the_same_namespace_never_reads_our_bytes(fake_client) -> None:
    a = LookupBuffer(fake_client, namespace="shared", layout={"model": "a", "dtype": "bf16"})
    b = LookupBuffer(fake_client, namespace="shared", layout={"model": "b", "dtype": "bf16"})
    a.insert(HASHES[0], k_v_block(0))
    assert b.select(HASHES[:1]) == [None] and b.longest_prefix(HASHES) == 0
    # even if a value is moved under b's key, its header's fingerprint gives it away
    fake_client.copy(a.redis_key(HASHES[0]), b.redis_key(HASHES[0]))
    assert b.select(HASHES[:1]) == [None]
    assert b.stats().corrupt_by_reason == {"fingerprint": 1}


def test_wrong_type_key_is_a_counted_miss(fake_buffer: LookupBuffer, fake_client) -> None:
    fake_client.rpush(fake_buffer.redis_key(HASHES[0]), b"x")
    assert fake_buffer.select(HASHES[:1]) == [None]
    assert fake_buffer.drop_select(HASHES[:1]) == [None]
    assert fake_buffer.stats().corrupt_by_reason == {"wrong-type": 2}
    assert fake_client.type(fake_buffer.redis_key(HASHES[0])) == b"list"  # not ours: left alone


def test_oversize_value_is_refused_without_reading_it(fake_client) -> None:
    big = LookupBuffer(fake_client, namespace="sz")
    small = LookupBuffer(fake_client, namespace="sz", max_value_bytes=4096)
    big.insert(HASHES[0], {"x": torch.zeros(8192)})
    assert small.select(HASHES[:1]) == [None]
    assert small.drop_select(HASHES[:1]) == [None]
    assert small.stats().corrupt_by_reason == {"oversize": 2}
    assert big.contains(HASHES[:1]) == [True]


@pytest.mark.parametrize("bad", [[], "abc", None])
def test_bad_key_lists_are_rejected(fake_buffer: LookupBuffer, bad: object) -> None:
    for op in (fake_buffer.select, fake_buffer.drop_select, fake_buffer.delete):
        with pytest.raises(InvalidArgumentError):
            op(bad)  # type: ignore[arg-type]


def test_bad_hash_and_namespace_are_rejected(fake_client) -> None:
    with pytest.raises(InvalidArgumentError):
        LookupBuffer(fake_client, namespace="has space")
    with pytest.raises(InvalidArgumentError):
        LookupBuffer(fake_client, namespace="a:b")
    with pytest.raises(InvalidArgumentError):
        LookupBuffer(fake_client, compression="zstd")
    buf = LookupBuffer(fake_client)
    with pytest.raises(InvalidArgumentError):
        buf.redis_key("a b")


def test_a_url_given_for_a_client_is_refused_with_the_constructor_to_use() -> None:
    with pytest.raises(InvalidArgumentError, match=r"LookupBuffer\.from_url"):
        LookupBuffer("redis://127.0.0.1:1/0", namespace="n")  # type: ignore[arg-type]


def test_layout_fingerprint_is_order_independent_and_sensitive() -> None:
    a = layout_fingerprint({"model": "m", "tp_rank": 0})
    assert a == layout_fingerprint({"tp_rank": 0, "model": "m"})
    assert a != layout_fingerprint({"model": "m", "tp_rank": 1})


def test_compressed_buffer_round_trips(fake_client: fakeredis.FakeRedis) -> None:
    buf = LookupBuffer(fake_client, namespace="z", compression="lz4")
    buf.insert(HASHES[0], k_v_block(3))
    assert torch.equal(buf.select(HASHES[:1])[0]["k"], k_v_block(3)["k"])  # type: ignore[index]


def test_reused_scratch_buffers_never_mix_values(fake_buffer: LookupBuffer) -> None:
    for i in range(3):  # one thread, consecutive batches: the same scratch buffers each time
        fake_buffer.insert_many(
            [(HASHES[2 * i], k_v_block(2 * i)), (HASHES[2 * i + 1], k_v_block(2 * i + 1))]
        )
    got = fake_buffer.select(HASHES[:6])
    for i in range(6):
        assert torch.equal(got[i]["k"], k_v_block(i)["k"])  # type: ignore[index]


def test_chain_tails_get_shorter_ttls_so_they_expire_and_evict_first(fake_client) -> None:
    buf = LookupBuffer(fake_client, namespace="ttl", ttl_s=100, ttl_step_ms=50)
    fill(buf, 4)
    ttls = [fake_client.pttl(buf.redis_key(h)) for h in HASHES[:4]]
    assert ttls == sorted(ttls, reverse=True) and ttls[0] - ttls[3] >= 140
    buf.insert_encoded([(HASHES[5], buf.encode(HASHES[5], k_v_block(5)))], positions=[40])
    assert fake_client.pttl(buf.redis_key(HASHES[5])) <= 100_000 - 40 * 50


def test_handoff_is_committed_then_taken_by_exactly_one_consumer(fake_client) -> None:
    producer = LookupBuffer(fake_client, namespace="h", fingerprint="f0", ttl_s=60)
    consumer = LookupBuffer(fake_client, namespace="h", fingerprint="f0")
    fill(producer, 3)
    before = consumer.read_handoff("req1", HASHES[:4])
    assert (before.committed, before.taken, before.present) == (None, False, 3)
    producer.publish_handoff("req1", 3)
    assert consumer.read_handoff("req1", HASHES[:4]).committed == 3
    claims = [consumer.claim_handoff("req1", owner=who) for who in ("a", "a", "b", "a")]
    # one owner; it may ask again, also after a loser asked (who must not take its mark)
    assert claims == [Claim.WON, Claim.WON, Claim.TAKEN, Claim.WON]
    after = consumer.read_handoff("req1", HASHES[:4])
    assert after.taken and after.committed is None
    assert 0 < fake_client.pttl(consumer.keys.handoff("req1")) <= 60_000  # and soon expires


@pytest.mark.parametrize("planted", [b" 3 ", b"1_0", b"-1", b"+3", b"3" * 17, "\u0663".encode()])
def test_a_commit_record_that_is_not_a_count_is_never_loaded_from(fake_client, planted) -> None:
    """``int()`` took " 3 ", "1_0" and a count of -1 blocks as commit records (a review's):
    a record that is not decimal digits is one nobody can read, never waited on or loaded."""
    consumer = LookupBuffer(fake_client, namespace="h", fingerprint="f0")
    fill(consumer, 3)
    fake_client.set(consumer.keys.handoff("req1"), planted)
    state = consumer.read_handoff("req1", HASHES[:4])
    assert state.committed is None and state.taken
    fake_client.set(consumer.keys.handoff("req1"), b"3")  # (the same record, as published)
    assert consumer.read_handoff("req1", HASHES[:4]).committed == 3


def test_handoff_over_ranks_waits_for_every_rank_and_takes_the_minimum(fake_client) -> None:
    ranks = [LookupBuffer(fake_client, namespace="h", fingerprint=f"f{r}") for r in range(2)]
    fps = [r.fingerprint for r in ranks]
    ranks[0].publish_handoff("req", 5)
    assert ranks[0].read_handoff("req", HASHES[:1], fps).committed is None  # rank 1 still writing
    # nothing to claim yet, and nothing created
    assert ranks[0].claim_handoff("req", ["f1"]) == Claim.UNCOMMITTED
    assert fake_client.exists(ranks[1].keys.handoff("req")) == 0
    assert ranks[0].read_handoff("req", HASHES[:1], fps).pending is False
    ranks[1].open_handoff("req")
    assert ranks[0].read_handoff("req", HASHES[:1], fps).pending  # rank 1 is writing
    ranks[1].publish_handoff("req", 2)  # rank 1 had to shed three blocks
    assert ranks[0].read_handoff("req", HASHES[:1], fps).committed == 2


def test_any_redis_py_error_becomes_a_typed_store_error(fake_buffer: LookupBuffer) -> None:
    import redis.exceptions as rex

    from kvstore import KVStoreError, StoreCommandError

    for exc in (rex.InvalidResponse("Protocol error"), rex.DataError("bad"), OSError("EPIPE")):

        def broken(*a, exc=exc, **k):  # type: ignore[no-untyped-def]
            raise exc

        fake_buffer.client.ping = broken  # type: ignore[method-assign]
        with pytest.raises(KVStoreError) as info:
            fake_buffer.ping()
        assert not isinstance(info.value, rex.RedisError)
        if not isinstance(exc, OSError):
            assert isinstance(info.value, StoreCommandError)


def test_a_consuming_read_refuses_repeated_hashes_and_takes_nothing(
    fake_buffer: LookupBuffer,
) -> None:
    fake_buffer.insert("a" * 32, {"model": torch.ones(2)})
    with pytest.raises(InvalidArgumentError, match="must not repeat"):
        fake_buffer.drop_select(["a" * 32, "a" * 32])
    got = fake_buffer.drop_select(["a" * 32])[0]  # still there: nothing was claimed
    assert got is not None and torch.equal(got["model"], torch.ones(2))


def test_a_give_back_that_fails_untyped_counts_its_blocks_stranded() -> None:
    """Found by a review: a release whose reply is not a number (``int()``'s ValueError) was
    logged and counted nowhere -- neither given back nor stranded."""
    from kvstore.values.drop_select import ClaimReleaser

    counted: list[tuple[int, int]] = []
    releaser = ClaimReleaser(lambda given, stranded: counted.append((given, stranded)))
    releaser.submit(lambda: int(b"not a number"), 5)
    assert releaser.wait(30)
    releaser.close(1)
    assert counted == [(0, 5)]
