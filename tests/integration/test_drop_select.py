"""Exactly-once claims that hold (``drop_select`` / ``select_into(consume=True)``): a reply
lost after the server ran the claim or the read is recovered by the same call or the values are
given back, never stranded; on a Cluster, a claim during a live slot migration is retried until
the migration ends, and one that cannot finish changes nothing. Real servers, faults injected
with a relay that mutes a connection after a chosen request (the server runs it, the client
never hears back and times out)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
import torch

from kvstore import LookupBuffer, StoreTimeoutError, StoreUnavailableError, chain_hashes
from kvstore.errors import StoreCommandError
from kvstore.fleet.functions import LIBRARY
from kvstore.values.drop_select import CLAIM
from testing.blocks import filled_block
from testing.redis_server import ClusterServers, RedisServer
from testing.relay import DelayRelay

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * 9)), 16)
TTL_S = 3600


def fill(buf: LookupBuffer, n: int) -> None:
    buf.insert_many([(HASHES[i], filled_block(i)) for i in range(n)])


def assert_blocks(got: list[dict[str, torch.Tensor] | None], n: int) -> None:
    assert len(got) == n
    for i, value in enumerate(got):
        assert value is not None, f"block {i} missing"
        assert torch.equal(value["kv"], filled_block(i)["kv"])


@pytest.fixture
def relayed(private_redis: RedisServer) -> Iterator[tuple[DelayRelay, LookupBuffer, redis.Redis]]:
    """A buffer whose every reply passes through a relay; a direct client to check the server."""
    with DelayRelay("127.0.0.1", private_redis.port, delay_s=0.0) as relay:
        buf = LookupBuffer.from_url(
            # 2 failures open the breaker: a claim whose replies are lost opens it, and giving
            # the values back must still happen
            relay.url,
            namespace="claims",
            ttl_s=TTL_S,
            socket_timeout_s=0.5,
            breaker_failures=2,
        )
        direct = redis.Redis(port=private_redis.port)
        try:
            buf.drop_select([HASHES[-1]])  # settles the functions: later claims are one FCALL each
            yield relay, buf, direct
        finally:
            buf.close()
            direct.close()


def next_caller(direct: redis.Redis) -> LookupBuffer:
    """Another caller, straight to the server."""
    port = direct.connection_pool.connection_kwargs["port"]
    return LookupBuffer.from_url(f"redis://127.0.0.1:{port}/0", namespace="claims", ttl_s=TTL_S)


def block_keys(direct: redis.Redis) -> list[bytes]:
    return sorted(k for k in direct.keys("kv:*") if b":claim:" not in k)


def test_a_claim_whose_reply_is_lost_fails_at_once_and_gives_the_blocks_back_with_their_ttl(
    relayed,
) -> None:  # type: ignore[no-untyped-def]
    """The claim and the reads of what it claimed go in one request: the server runs them all
    and every reply is lost. The call fails within its one socket timeout (sending the claim
    again would wait another: issue 38, item 8), and what the claim took goes back under the
    blocks' keys in the background, TTLs as stored."""
    relay, buf, direct = relayed
    fill(buf, 5)
    before = sorted(block_keys(direct))
    relay.lose_replies(b"FCALL")
    with pytest.raises(StoreTimeoutError):
        buf.drop_select(HASHES[:5])
    assert buf.wait_given_back(30)
    assert sorted(block_keys(direct)) == before  # every block back under its own key
    assert not [k for k in direct.keys("kv:*") if b":claim:" in k]
    assert min(direct.pttl(k) for k in before) > (TTL_S - 60) * 1000  # TTLs as stored
    assert buf.stats().claims_given_back == 5 and buf.stats().claims_stranded == 0
    assert_blocks(next_caller(direct).drop_select(HASHES[:5]), 5)  # who gets them all


def test_a_claim_the_server_runs_after_its_caller_gave_up_takes_nothing(
    private_redis: RedisServer,
) -> None:
    """Issue 38, item 8: with writes paused, drop_select sent its claim twice and its give-back
    once, each waiting out the socket timeout (3 s at 1 s); the queued claims then ran when the
    pause ended. Now the call fails after one timeout, and the claim, run late, takes nothing:
    the blocks stay under their keys for the next caller."""
    buf = LookupBuffer.from_url(
        private_redis.url, namespace="claims", ttl_s=TTL_S, socket_timeout_s=2.0
    )
    direct = redis.Redis(port=private_redis.port)
    fill(buf, 5)
    buf.drop_select([HASHES[-1]])  # the script loaded, the server's clock read (behind)
    until_clock_known(buf)
    before = block_keys(direct)
    direct.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            buf.drop_select(HASHES[:5])
        took = time.monotonic() - t0
    finally:
        direct.execute_command("CLIENT", "UNPAUSE")
    assert took < 4.0, took  # one 2 s timeout, not three (6 s and more)
    # the queued claim runs now, past its time: nothing taken, nothing to give back
    assert buf.wait_given_back(30)
    assert block_keys(direct) == before
    assert not [k for k in direct.keys("kv:*") if b":claim:" in k]
    assert buf.stats().claims_stranded == 0
    assert_blocks(next_caller(direct).drop_select(HASHES[:5]), 5)
    buf.close()
    direct.close()


def until_clock_known(buf: LookupBuffer) -> None:
    """Wait for the event: the server's clock read in the background (claims.ServerClock)."""
    deadline = time.monotonic() + 30
    while buf._claims.clock.offset_s is None:
        assert time.monotonic() < deadline, "the server's clock was never read"
        time.sleep(0.01)


@pytest.mark.parametrize("connections", [1, 2])
def test_a_clock_read_wrong_costs_one_claim_not_the_call(
    private_redis: RedisServer, connections: int
) -> None:
    """Found by a fresh-eyes review: the server's "too late" reply to a claim sent with its
    reads (one connection) could not be parsed, so after a bad clock reading every drop_select
    failed until the next one. Now such a reply, come back in time, means the clocks disagree:
    read again, and the claim is sent again."""
    buf = LookupBuffer.from_url(
        private_redis.url, namespace="claims", ttl_s=TTL_S, read_connections=connections
    )
    fill(buf, 5)
    buf.drop_select([HASHES[-1]])
    until_clock_known(buf)
    assert buf._claims.clock.offset_s is not None
    buf._claims.clock.offset_s -= 30  # the server looks 30 s behind: every limit already past
    assert_blocks(buf.drop_select(HASHES[:5]), 5)
    assert abs(buf._claims.clock.offset_s) < 5  # read again
    buf.close()


@pytest.mark.parametrize("connections", [1, 2])
def test_a_claim_answered_in_another_shape_fails_typed_and_gives_back(
    private_redis: RedisServer, connections: int
) -> None:
    """Found by a fresh-eyes review: kvstore's library replaced under its name (its version
    function kept) by one whose claim answers something else -- a number, too few entries, an
    unknown status, a negative length, strings -- failed drop_select with an AssertionError or
    zip's ValueError. Each is now a StoreCommandError, and nothing stays claimed."""
    direct = redis.Redis(port=private_redis.port)
    buf = LookupBuffer.from_url(
        private_redis.url, namespace="claims", ttl_s=TTL_S, read_connections=connections
    )
    ours = LIBRARY.text()
    claim_body = f"local function {CLAIM.name}(KEYS, ARGV)\n{CLAIM.lua}\nend"
    assert claim_body in ours
    try:
        for answer in ("5", "{}", "{1}", "{7, 0, 7, 0}", "{1, -5, 1, -5}", "{'1', '9', '1', '9'}"):
            fill(buf, 2)
            hostile = f"local function {CLAIM.name}(KEYS, ARGV)\nreturn {answer}\nend"
            direct.function_load(ours.replace(claim_body, hostile), replace=True)
            with pytest.raises(StoreCommandError):
                buf.drop_select(HASHES[:2])
            direct.function_load(ours, replace=True)
            assert buf.wait_given_back(30)
            assert_blocks(buf.drop_select(HASHES[:2]), 2)  # nothing was kept claimed
    finally:
        buf.close()
        direct.close()


@pytest.mark.parametrize("lost", [1, 1000])
def test_a_read_whose_reply_is_lost_gives_the_blocks_back(relayed, lost: int) -> None:  # type: ignore[no-untyped-def]
    """The reads go in the claim's request: a lost reply fails the call within its timeout
    (once or for good, alike), and the claimed blocks go back for the next caller."""
    relay, buf, direct = relayed
    fill(buf, 4)
    relay.lose_replies(b"\r\nGET\r\n", lost)
    with pytest.raises(StoreTimeoutError):
        buf.drop_select(HASHES[:4])
    relay.keep_replies()
    assert buf.wait_given_back(30)
    assert len(block_keys(direct)) == 4
    assert_blocks(next_caller(direct).drop_select(HASHES[:4]), 4)


@pytest.mark.parametrize("connections", [1, 2])
def test_consuming_reads_survive_the_server_losing_its_scripts(
    private_redis: RedisServer, connections: int
) -> None:
    buf = LookupBuffer.from_url(private_redis.url, namespace="claims", ttl_s=TTL_S)
    direct = redis.Redis(port=private_redis.port)
    try:
        fill(buf, 3)
        assert_blocks(buf.drop_select(HASHES[:3]), 3)  # the claim script is loaded now
        fill(buf, 3)
        direct.script_flush()  # as a restart or a SCRIPT FLUSH does
        buffers = [torch.empty(1 << 16, dtype=torch.uint8) for _ in range(3)]
        got = buf.select_into(HASHES[:3], buffers, consume=True, connections=connections)
        assert_blocks(got, 3)
        assert direct.keys("kv:*") == []  # taken once, the private keys deleted
    finally:
        buf.close()
        direct.close()


def test_a_waiting_consuming_read_takes_the_blocks_once_they_are_all_there(
    redis_url: str,
) -> None:
    buf = LookupBuffer.from_url(redis_url, namespace="claims", ttl_s=TTL_S)
    try:
        fill(buf, 2)  # 2 of the 3 keys: the read waits for the third
        writer = threading.Timer(0.2, lambda: buf.insert(HASHES[2], filled_block(2)))
        writer.start()
        got = buf.drop_select(HASHES[:3], timeout_s=60)  # returns once the third arrived
        writer.join()
        assert_blocks(got, 3)
        assert buf.drop_select(HASHES[:3]) == [None] * 3
    finally:
        buf.close()


def test_select_into_consume_gives_back_what_it_could_not_read(relayed) -> None:  # type: ignore[no-untyped-def]
    relay, buf, direct = relayed
    fill(buf, 4)
    buffers = [torch.empty(1 << 16, dtype=torch.uint8) for _ in range(4)]
    relay.lose_replies(b"\r\nGET\r\n", 1000)
    with pytest.raises(StoreTimeoutError):
        buf.select_into(HASHES[:4], buffers, consume=True, connections=2)
    relay.keep_replies()
    assert buf.wait_given_back(30)
    assert len(block_keys(direct)) == 4
    assert_blocks(next_caller(direct).select_into(HASHES[:4], buffers, consume=True), 4)


# ---------------------------------------------------------------------------- Cluster
@pytest.fixture
def cluster() -> Iterator[ClusterServers]:
    with ClusterServers(masters=3, replicas=0) as servers:
        yield servers


class SlotMove:
    """A live migration of one slot, driven by hand as ``redis-cli --cluster reshard`` does."""

    def __init__(
        self, cluster: ClusterServers, key: str, target: RedisServer | None = None
    ) -> None:
        self.cluster = cluster
        self.slot = _slot(key)
        self.source = cluster.node_of(key)
        self.target = target or next(
            n for n in cluster.master_nodes() if n.port != self.source.port
        )
        self.src, self.dst = cluster.client(self.source), cluster.client(self.target)

    def start(self) -> None:
        src_id, dst_id = self._id(self.src), self._id(self.dst)
        self.dst.execute_command("CLUSTER SETSLOT", self.slot, "IMPORTING", src_id)
        self.src.execute_command("CLUSTER SETSLOT", self.slot, "MIGRATING", dst_id)

    def finish(self) -> None:
        keys = self.src.execute_command("CLUSTER GETKEYSINSLOT", self.slot, 1000)
        for key in keys:
            self.src.execute_command("MIGRATE", "127.0.0.1", self.target.port, key, 0, 5000)
        dst_id = self._id(self.dst)
        for client in (self.dst, self.src):
            client.execute_command("CLUSTER SETSLOT", self.slot, "NODE", dst_id)

    @staticmethod
    def _id(client: redis.Redis) -> str:
        node_id = client.execute_command("CLUSTER MYID")
        return node_id.decode() if isinstance(node_id, bytes) else str(node_id)


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def test_a_claim_during_a_live_slot_migration_waits_for_it_and_takes_each_block_once(
    cluster: ClusterServers,
) -> None:
    buf = LookupBuffer.from_url(cluster.url, namespace="move", ttl_s=TTL_S)
    fill(buf, 8)
    move = SlotMove(cluster, buf.redis_key(HASHES[0]))
    move.start()
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(buf.drop_select(HASHES[:8], 60.0)))
    worker.start()
    # the event that matters: the claim met the migrating slot and is retrying it
    while buf.stats().redirects == 0 and worker.is_alive():
        threading.Event().wait(0.01)
    move.finish()
    worker.join()
    assert got, "drop_select raised (see the thread's traceback above)"
    assert_blocks(got[0], 8)  # type: ignore[arg-type]
    assert buf.drop_select(HASHES[:8]) == [None] * 8
    for node in cluster.master_nodes():
        assert cluster.client(node).keys("kv:*") == []  # no private key left anywhere
    buf.close()


def test_a_claim_the_migration_outlasts_changes_nothing(cluster: ClusterServers) -> None:
    buf = LookupBuffer.from_url(cluster.url, namespace="stuck", ttl_s=TTL_S, breaker_failures=10)
    fill(buf, 8)
    move = SlotMove(cluster, buf.redis_key(HASHES[0]))
    move.start()
    with pytest.raises(StoreUnavailableError, match="migrating"):
        buf.drop_select(HASHES[:8])
    assert buf.wait_given_back(30)  # what the other slots' claims took
    keys = {k for node in cluster.master_nodes() for k in cluster.client(node).keys("kv:*")}
    assert len(keys) == 8 and not [k for k in keys if b":claim:" in k]
    for node in cluster.master_nodes():
        client = cluster.client(node)
        for key in client.keys("kv:*"):  # TTLs as stored: nothing ran before the script could
            assert client.pttl(key) > (TTL_S - 60) * 1000
    move.finish()
    assert_blocks(buf.drop_select(HASHES[:8]), 8)
    buf.close()


def test_a_claim_asked_to_a_master_just_added_fails_typed_and_gives_every_block_back(
    cluster: ClusterServers,
) -> None:
    """Found in review, on a real Cluster: the first slot moving to a master just added (which
    ``CLUSTER SLOTS`` does not name until it serves one) answers ASK naming that master.
    redis-py looked it up, got None and raised ``AttributeError``: untyped, and the give-back of
    the other slots' claims stopped at it -- 5 of 6 values stayed under claim keys, reaching
    nobody. Now each call fails as a Cluster that cannot serve the key now, and every claim
    goes back."""
    buf = LookupBuffer.from_url(cluster.url, namespace="grow", ttl_s=TTL_S, breaker_failures=20)
    fill(buf, 6)
    newcomer = cluster.add_master_without_slots()
    key = buf.redis_key(HASHES[0])
    move = SlotMove(cluster, key, target=newcomer)
    move.start()  # (its one key moved: the source answers ASK for it from now on)
    move.src.execute_command("MIGRATE", "127.0.0.1", newcomer.port, key, 0, 5000)
    with pytest.raises(StoreUnavailableError):
        buf.drop_select(HASHES[:6])
    with pytest.raises(StoreUnavailableError):  # a write through redis-py's client
        fill(buf, 1)
    with pytest.raises(StoreUnavailableError):  # and a lookup through its pipeline
        buf.longest_prefix(HASHES[:6])
    assert buf.wait_given_back(30)
    keys = [k for node in cluster.master_nodes() for k in cluster.client(node).keys("kv:*")]
    assert len(keys) == 6 and not [k for k in keys if b":claim:" in k], keys
    assert buf.stats().claims_stranded == 0
    buf.close()


def test_a_claimed_value_whose_slot_migrates_before_its_read_goes_back_not_away(
    cluster: ClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reshard reaches a block's slot between its claim and the read of its private key
    (which is MIGRATEd): the read is redirected twice, a miss this time, and the value must be
    given back for the next caller -- it reached nobody. (It was deleted through the ASK.)"""
    from kvstore.values import drop_select

    buf = LookupBuffer.from_url(cluster.url, namespace="lost", ttl_s=TTL_S)
    fill(buf, 4)
    move = SlotMove(cluster, buf.redis_key(HASHES[0]))
    claim = drop_select.Claimer.claim

    def claim_then_the_reshard_arrives(self, keys, timeout_s=0.0):  # type: ignore[no-untyped-def]
        batch = claim(self, keys, timeout_s)
        move.start()
        for key in move.src.execute_command("CLUSTER GETKEYSINSLOT", move.slot, 1000):
            move.src.execute_command("MIGRATE", "127.0.0.1", move.target.port, key, 0, 5000)
        return batch

    monkeypatch.setattr(drop_select.Claimer, "claim", claim_then_the_reshard_arrives)
    got = buf.drop_select(HASHES[:4])
    monkeypatch.undo()
    assert got[0] is None and all(g is not None for g in got[1:])
    move.finish()
    assert buf.wait_given_back(30)
    assert buf.stats().claims_stranded == 0
    assert_blocks(buf.drop_select(HASHES[:1]), 1)  # the next caller gets it, once
    for node in cluster.master_nodes():
        assert cluster.client(node).keys("kv:*") == []
    buf.close()


def test_slots_migrating_one_after_another_share_one_bound(
    cluster: ClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: each migrating slot of a claim got a bound of its own, so k slots
    whose migrations end one after another held a call k times MIGRATION_WAIT_S (four: 6.8 s
    for a documented 3). Two slots migrate; the first ends while the claim retries it; every
    wait for the second must end by the bound the call began with."""
    from kvstore.values import drop_select

    buf = LookupBuffer.from_url(cluster.url, namespace="both", ttl_s=TTL_S, breaker_failures=10)
    fill(buf, 8)
    slots: dict[int, int] = {}
    for i in range(8):
        slots.setdefault(_slot(buf.redis_key(HASHES[i])), i)
    first, second = (SlotMove(cluster, buf.redis_key(HASHES[i])) for i in list(slots.values())[:2])
    first.start()
    second.start()
    untils: list[float] = []
    pause = drop_select._pause

    def spied(delay: float, until: float) -> float:
        if not untils:
            first.finish()  # the first slot's migration ends while the claim retries it
        untils.append(until)
        return pause(delay, until)

    monkeypatch.setattr(drop_select, "_pause", spied)
    with pytest.raises(StoreUnavailableError, match="migrating"):
        buf.drop_select(HASHES[:8])
    monkeypatch.undo()
    assert len(untils) > 1 and set(untils) == {untils[0]}
    second.finish()
    assert buf.wait_given_back(30)
    assert_blocks(buf.drop_select(HASHES[:8]), 8)  # nothing was lost on the way
    buf.close()


def test_control_calls_follow_a_slot_that_moved(cluster: ClusterServers) -> None:
    """Lookups, handoff records, TTL reads and deletes go to each master's own connection (not
    redis-py's cluster pipeline): a slot that moved since the map was learned answers MOVED,
    and the command is sent again to the new owner."""
    buf = LookupBuffer.from_url(cluster.url, namespace="moved", ttl_s=TTL_S)
    fill(buf, 8)
    buf.open_handoff("h-moved")
    buf.publish_handoff("h-moved", 8)
    move = SlotMove(cluster, buf.redis_key(HASHES[0]))
    move.start()
    move.finish()  # the buffer's clients still map the slot to its old master
    assert buf.longest_prefix(HASHES[:8]) == 8
    assert [info.present for info in buf.block_info(HASHES[:8])] == [True] * 8
    assert buf.renew(HASHES[:8]) == 8
    assert buf.read_handoff("h-moved", HASHES[:8]).committed == 8
    assert buf.stats().redirects >= 1
    assert buf.delete(HASHES[:8]) == 8
    assert buf.longest_prefix(HASHES[:8]) == 0
    buf.close()


def test_close_closes_every_connection_it_opened(private_redis: RedisServer) -> None:
    direct = redis.Redis(port=private_redis.port)
    before = len(direct.client_list())
    for _ in range(20):
        buf = LookupBuffer.from_url(private_redis.url, namespace="close")
        fill(buf, 2)
        buf.drop_select(HASHES[:2])
        buf.close()
    assert len(direct.client_list()) == before  # this client's own connection only
    direct.close()


@pytest.mark.parametrize("cut_at", [0, 1, 4, 7])
def test_a_claim_whose_reads_time_out_midway_is_recovered_by_the_same_call(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, cut_at: int
) -> None:
    # the claim's reply arrived, then the reads' replies stop after ``cut_at`` values (a socket
    # timeout): the same call claims again with its suffix, reads, and delivers every value once
    from kvstore.net import wire

    buf = LookupBuffer.from_url(private_redis.url, namespace="claims", ttl_s=TTL_S)
    direct = redis.Redis(port=private_redis.port)
    real = wire.ReplyReader.read_bulk_new
    calls = {"n": 0}

    def cut(self: wire.ReplyReader, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == cut_at + 1:
            raise redis.exceptions.TimeoutError("injected: timed out reading a reply")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    try:
        buf.drop_select([HASHES[-1]])  # loads the script: the cut request runs the claim
        fill(buf, 8)
        monkeypatch.setattr(wire.ReplyReader, "read_bulk_new", cut)
        assert_blocks(buf.drop_select(HASHES[:8]), 8)
        assert calls["n"] > 8  # the cut happened, and the values were read again
        assert direct.keys("kv:*") == []  # taken once, the private keys deleted
        monkeypatch.undo()
        assert buf.drop_select(HASHES[:8]) == [None] * 8
    finally:
        buf.close()
        direct.close()
