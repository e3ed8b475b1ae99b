"""Namespace resets (``kvstore.fleet.generations``): one increment invalidates every block, readers
see it with their next lookup, the counter never goes back, and the sweep unlinks only older blocks.
On fakeredis (fast) and on a real redis-server (the scripts and the ACL)."""

from __future__ import annotations

import fakeredis
import pytest
import redis
import torch

from kvstore import KVStoreError, LookupBuffer, StorePermissionError
from kvstore.fleet.access import acl_rule
from kvstore.values.keys import block_name, generation_of, parse_key
from testing.redis_server import RedisServer, add_acl_user


def value() -> dict[str, torch.Tensor]:
    return {"k": torch.arange(8, dtype=torch.float32)}


def test_block_names_carry_their_generation_and_generation_0_keeps_the_old_names() -> None:
    assert block_name("abc", 0) == "abc"
    assert block_name("abc", 3) == "abc@3"
    assert generation_of("abc") == 0 and generation_of("abc@3") == 3
    assert generation_of("abc@12.g1") == 12
    parsed = parse_key("kv:ns:fp:abc@2.g1")
    assert parsed is not None and (parsed.kind, parsed.generation) == ("block", 2)
    claim = parse_key("kv:ns:fp:abc@2:claim:xyz:{kv:ns:fp:abc@2}")
    assert claim is not None and (claim.kind, claim.generation) == ("claim", 2)
    counter = parse_key("kv:ns:generation")
    assert counter is not None and counter.kind == "generation"


def test_a_reset_renames_every_block_and_a_second_reader_sees_it_with_its_next_survey() -> None:
    server = fakeredis.FakeServer()
    a = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    b = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    a.insert("h1", value())
    assert b.survey([["h1"]]).presences == [[True]]
    assert a.reset() == 1 and a.generation == 1
    assert b.generation == 0  # nothing read yet ...
    seen = b.survey([[block_name("h1", b.generation)]])
    assert seen.generation == 1 and b.generation == 1  # ... the next lookup brings it
    # named in the new generation, the old block is not found
    assert b.survey([[block_name("h1", b.generation)]]).presences == [[False]]


def test_instances_that_knew_different_generations_converge_after_a_flush() -> None:
    """Two resets by two instances, then FLUSHALL (or a restart without persistence): one
    left at 1 and the other at 2 would never agree again (every handoff of a producer
    ignored). Whoever reads less than it knows moves the counter past what it knew."""
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    producer = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    consumer = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    assert producer.reset() == 1
    assert consumer.reset() == 2
    r.flushall()
    assert producer.read_generation() == 2  # it knew 1: the counter is now past it
    assert consumer.read_generation() == 2  # it knew 2: nothing to raise
    assert r.get("kv:ns:generation") == b"2"
    assert consumer.survey([["h"]]).generation == 2 and producer.generation == 2


def test_a_reset_made_after_the_counter_was_lost_still_invalidates_every_block() -> None:
    """The counter alone evicted, then ``kvstore reset`` from a fresh client (which bumps from
    0 to 1): an instance that knew 3 must not take the counter back to 3, under which the
    blocks saved before the reset would be found again."""
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    instance = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    for _ in range(3):
        instance.reset()
    instance.insert(block_name("h", 3), value())
    r.delete("kv:ns:generation")
    trainer = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    assert trainer.reset() == 1
    seen = instance.read_generation()
    assert seen > 3  # past every generation it could have named blocks in
    assert instance.survey([[block_name("h", seen)]]).presences == [[False]]
    fresh = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    assert fresh.read_generation() == seen  # every client on one generation


def test_a_counter_that_is_not_a_plain_number_reads_0_everywhere() -> None:
    """Lua's tonumber takes "1e1" and "0x10", Python's int does not: both read such a counter
    as 0, so a client that knows more moves it past what it knew and all agree."""
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server)
    knows = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
    knows.reset()
    knows.reset()
    for garbage in (b"1e1", b"0x10", b" 7", b"-3"):
        r.set("kv:ns:generation", garbage)
        seen = knows.read_generation()
        assert r.get("kv:ns:generation") == str(seen).encode()
        fresh = LookupBuffer(fakeredis.FakeRedis(server=server), namespace="ns", fingerprint="fp")
        assert fresh.read_generation() == seen


def test_the_counter_never_goes_back_when_it_vanishes() -> None:
    r = fakeredis.FakeRedis()
    buf = LookupBuffer(r, namespace="ns", fingerprint="fp")
    buf.reset()
    buf.reset()
    r.delete("kv:ns:generation")  # evicted or flushed
    assert buf.read_generation() == 3  # past what it knew: a reset may have come meanwhile
    assert r.get("kv:ns:generation") == b"3"  # put back for everyone else
    r.delete("kv:ns:generation")
    assert buf.reset() == 4  # bumped from what this client knew, not from 0


def test_the_sweep_unlinks_older_blocks_of_every_fingerprint_and_nothing_else() -> None:
    r = fakeredis.FakeRedis()
    buf = LookupBuffer(r, namespace="ns", fingerprint="fp")
    other = buf.for_fingerprint("fp2")
    buf.insert_many([("h1", value()), ("h2", value())])
    other.insert("h1", value())
    buf.open_handoff("hand")
    r.set("kv:other:fp:h1", b"x")  # another namespace
    gen = buf.reset()
    buf.insert(block_name("h1", gen), value())
    assert buf.sweep() == 3
    left = sorted(k.decode() for k in r.keys("*"))
    assert left == [
        "kv:ns:fp:h1@1",
        "kv:ns:fp:handoff:{hand}",  # records expire on their own, within minutes
        "kv:ns:generation",
        "kv:other:fp:h1",
    ]


def test_a_sweep_stops_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.fleet.generations as generations

    monkeypatch.setattr(generations, "SWEEP_BATCH", 10)
    r = fakeredis.FakeRedis()
    buf = LookupBuffer(r, namespace="ns", fingerprint="fp")
    buf.insert_many([(f"h{i}", value()) for i in range(35)])
    buf.reset()
    assert buf.sweep(stop=lambda: True) == 10  # one batch, then it stopped
    assert buf.sweep() == 25


@pytest.mark.redis
def test_resets_run_on_a_real_server_under_the_documented_acl(
    private_redis: RedisServer,
) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    rule = acl_rule(["ping", "generation", "lookup", "insert", "reset", "sweep"], "ns")
    add_acl_user(admin, "resetter", rule)
    url = f"redis://resetter:pw@127.0.0.1:{private_redis.port}/0"
    with LookupBuffer.from_url(url, namespace="ns", fingerprint="fp") as buf:
        buf.check_access(["generation", "reset", "sweep"])
        buf.insert("h1", value())
        assert buf.reset() == 1
        assert buf.sweep() == 1
        assert buf.read_generation() == 1
    # a user without the script commands is told which one is missing
    add_acl_user(admin, "plain", acl_rule(["ping", "insert"], "ns"))
    url = f"redis://plain:pw@127.0.0.1:{private_redis.port}/0"
    with LookupBuffer.from_url(url, namespace="ns", fingerprint="fp") as buf:
        with pytest.raises(StorePermissionError):
            buf.check_access(["reset"])
        with pytest.raises(StorePermissionError):
            buf.reset()


def test_a_reader_of_the_counter_never_writes_it_and_warns_once_of_a_lower_one(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The producer's and consumers' rules may only read the counter: a client under them
    keeps the generation it knew when the counter vanishes or reads lower, writes nothing
    (not even SET NX), says so once, and does not try again on every lookup."""
    admin = redis.Redis.from_url(private_redis.url)
    admin.set("kv:ns:generation", 3)
    rule = acl_rule(["ping", "generation", "lookup", "insert"], "ns")
    assert "%R~kv:ns:generation" in rule.split()
    add_acl_user(admin, "sharer", rule)
    url = f"redis://sharer:pw@127.0.0.1:{private_redis.port}/0"

    def calls(cmd: str) -> tuple[int, int]:
        stats = admin.info("commandstats").get(f"cmdstat_{cmd}", {})
        return stats.get("calls", 0), stats.get("rejected_calls", 0)

    with LookupBuffer.from_url(url, namespace="ns", fingerprint="fp") as buf:
        assert buf.read_generation() == 3
        admin.delete("kv:ns:generation")
        with caplog.at_level("WARNING", logger="kvstore"):
            assert buf.read_generation() == 3
            assert admin.get("kv:ns:generation") is None  # a missing counter stays missing
            admin.set("kv:ns:generation", 1)
            assert buf.read_generation() == 3
            before = calls("fcall"), calls("set")
            assert [buf.read_generation() for _ in range(5)] == [3] * 5
            assert (calls("fcall"), calls("set")) == before  # no retries per lookup
        assert admin.get("kv:ns:generation") == b"1"  # left as it was
        warnings = [r for r in caplog.records if "may not raise it" in r.getMessage()]
        assert len(warnings) == 2  # once for the missing counter, once for the lower one
        assert "kvstore reset" in warnings[0].getMessage()
    # the admin's rule heals it: past what it knew
    rule = acl_rule(["ping", "generation", "reset"], "ns")
    add_acl_user(admin, "healer", rule)
    url = f"redis://healer:pw@127.0.0.1:{private_redis.port}/0"
    with LookupBuffer.from_url(url, namespace="ns", fingerprint="fp") as buf:
        buf.check_access(["generation", "reset"])
        assert buf.read_generation() == 1
        assert buf.reset() == 2


@pytest.mark.redis
@pytest.mark.parametrize(
    ("stored", "reads"),
    [
        (b"7", 7),
        (b"0000000000000005", 5),
        (str(2**53 - 1).encode(), 2**53 - 1),
        (str(2**53).encode(), 2**53),
        (str(2**53 + 1).encode(), 0),  # a double would round it down into range
        (b"99999999999999999999", 0),
        (b"1e20", 0),
        (b"-3", 0),
        (b"\xd9\xa3", 0),  # a non-ASCII digit
    ],
)
def test_a_counter_reads_the_same_in_lua_and_python_and_stops_at_2_pow_53(
    private_redis: RedisServer, stored: bytes, reads: int
) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    admin.set("kv:ns:generation", stored)
    with LookupBuffer.from_url(private_redis.url, namespace="ns", fingerprint="fp") as buf:
        assert buf.read_generation() == reads  # Python's reading
    with LookupBuffer.from_url(private_redis.url, namespace="ns", fingerprint="fp") as buf:
        if reads == 2**53:
            with pytest.raises(KVStoreError, match="2\\*\\*53"):
                buf.reset()
            assert admin.get("kv:ns:generation") == stored
        else:
            assert buf.reset() == reads + 1  # the script's reading, plus one
            assert admin.get("kv:ns:generation") == str(reads + 1).encode()


@pytest.mark.parametrize(
    ("name", "generation", "named"),
    [("h1", 0, "h1"), ("h1", 2, "h1@2"), ("h1@3", 0, "h1"), ("h1@3", 5, "h1@5"),
     ("h1@3.g1", 7, "h1@7.g1"), ("h1@12.g0", 0, "h1.g0")],
)  # fmt: skip
def test_a_block_name_moves_to_another_generation_whole(
    name: str, generation: int, named: str
) -> None:
    from kvstore.values.keys import in_generation

    assert in_generation(name, generation) == named
    assert generation_of(named) == generation


SECRET = b"namespace sig's secret, 32 bytes"


def test_a_signed_namespace_never_reads_a_missing_counter_as_generation_0(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 52: delete a signed namespace's counter and an instance started afterwards read
    generation 0, so a value signed before the first reset (named without a generation) and
    put back loaded as a verified hit. Now a reader that may not write the counter loads
    nothing until the admin makes it again, and one that may makes it past every generation
    made before."""
    admin = redis.Redis(port=private_redis.port)
    with LookupBuffer.from_url(
        private_redis.url, namespace="sig", fingerprint="fp", secret=SECRET
    ) as old:
        old.insert("h1", value())  # signed in generation 0: its name is "h1"
    rule = acl_rule(["ping", "generation", "lookup", "select"], "sig")
    add_acl_user(admin, "reader", rule)
    url = f"redis://reader:pw@127.0.0.1:{private_redis.port}/0"
    with (
        LookupBuffer.from_url(url, namespace="sig", fingerprint="fp", secret=SECRET) as reader,
        caplog.at_level("WARNING", logger="kvstore"),
    ):
        assert reader.survey([["h1"]]).presences == [[False]]  # there, and not offered
        assert reader.survey([["h1"]]).presences == [[False]]
        warnings = [r for r in caplog.records if "loads nothing" in r.getMessage()]
        assert len(warnings) == 1 and "kvstore reset --namespace sig" in warnings[0].getMessage()
        with LookupBuffer.from_url(
            private_redis.url, namespace="sig", fingerprint="fp", secret=SECRET
        ) as writer:
            generation = writer.reset()  # the admin makes the counter again
            writer.insert(block_name("h2", generation), value())
        assert reader.survey([[block_name("h2", generation)]]).presences == [[True]]  # resumed
    # a user that may write the counter makes it again above every earlier generation
    admin.delete("kv:sig:generation")
    with LookupBuffer.from_url(
        private_redis.url, namespace="sig", fingerprint="fp", secret=SECRET
    ) as fresh:
        fresh.read_generation()
        assert fresh.generation > 10**12 and int(admin.get("kv:sig:generation")) == fresh.generation
        # what it now looks up for that chain is named in the new generation: not there
        assert fresh.survey([[block_name("h1", fresh.generation)]]).presences == [[False]]
    # an unsigned namespace trusts its writers anyway: a missing counter still reads 0
    with LookupBuffer.from_url(private_redis.url, namespace="open", fingerprint="fp") as plain:
        plain.insert("h1", value())
        assert plain.survey([["h1"]]).presences == [[True]] and plain.generation == 0


@pytest.mark.redis
def test_planted_key_names_neither_stop_a_sweep_nor_the_cli_and_one_too_long_is_typed(
    private_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer of the namespace chooses its key names (a review): 600 names of 8 KiB made
    every SCAN page of 1,000 a reply over the 4 MiB bound on control replies, and one name
    that is not UTF-8 stopped every sweep of its namespace -- the reset bumped the generation
    and left every old block behind. Pages shrink to fit; a name the bound cannot hold at all
    stops the walk with a typed error saying how to remove it."""
    import kvstore.cli
    from kvstore.errors import StoreReplyTooLargeError

    admin = redis.Redis.from_url(private_redis.url)
    with LookupBuffer.from_url(private_redis.url, namespace="ns", fingerprint="fp") as buf:
        buf.insert_many([(f"h{i}", value()) for i in range(5)])
        pipe = admin.pipeline(transaction=False)
        for i in range(600):
            pipe.set(f"kv:ns:fp:{i:04d}" + "x" * (8 << 10), b"planted")
        pipe.set(b"kv:ns:fp:\xff\xfe", b"planted")
        pipe.execute()
        assert kvstore.cli.main(["--url", private_redis.url, "ls"]) == 0
        assert "ns" in capsys.readouterr().out
        buf.reset()
        buf.sweep()  # (the long names look like old blocks of the namespace: swept too)
        left = admin.keys("kv:ns:fp:*")
        assert left == [b"kv:ns:fp:\xff\xfe"]  # every old block gone; that one is not ours
        admin.set(b"kv:ns:fp:" + b"y" * (5 << 20), b"planted")  # one name over the bound
        with pytest.raises(StoreReplyTooLargeError, match="UNLINK it"):
            buf.sweep()
    assert kvstore.cli.main(["--url", private_redis.url, "ls"]) == 2
    assert "UNLINK it" in capsys.readouterr().err
