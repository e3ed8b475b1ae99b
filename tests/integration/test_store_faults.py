"""kvstore against real redis-servers that misbehave: ACL users missing a permission, a full
server, a read-only replica, a server that is killed, paused or stopped (SIGSTOP)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
import torch

from kvstore import (
    Claim,
    DeadlinePassedError,
    LookupBuffer,
    StoreBusyError,
    StoreCircuitOpenError,
    StoreCommandError,
    StoreOutOfMemoryError,
    StorePermissionError,
    StoreTimeoutError,
    StoreTopologyError,
    StoreUnavailableError,
    chain_hashes,
)
from kvstore.fleet.access import ACCESS, acl_rule
from kvstore.net.connection import make_client, parse_url
from kvstore.net.server_code import ScriptMode
from testing.blocks import filled_block
from testing.redis_server import RedisServer, add_acl_user
from testing.relay import DelayRelay

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * 8)), 16)
ALL_OPS = list(ACCESS)


def without(rule: str, command: str) -> str:
    drop = "+" + command.lower().replace(" ", "|")
    return " ".join(t for t in rule.split() if t != drop)


def acl_user(server: RedisServer, name: str, rule: str) -> str:
    admin = redis.Redis.from_url(server.url)
    add_acl_user(admin, name, rule)
    admin.close()
    return f"redis://{name}:pw@127.0.0.1:{server.port}/0"


def keys_without_ttl(server: RedisServer) -> list[bytes]:
    admin = redis.Redis.from_url(server.url)
    return [k for k in admin.scan_iter("kv:*") if admin.pttl(k) == -1]


def test_the_documented_rule_is_enough_for_every_operation(private_redis: RedisServer) -> None:
    url = acl_user(private_redis, "full", acl_rule(ALL_OPS, "acl"))
    with LookupBuffer.from_url(url, namespace="acl", ttl_s=60) as buf:
        buf.check_access(ALL_OPS)
        buf.insert_many([(h, filled_block(i)) for i, h in enumerate(HASHES[:3])])
        buf.publish_handoff("h1", 3)
        assert buf.read_handoff("h1", HASHES[:4]).committed == 3
        assert buf.claim_handoff("h1") == Claim.WON
        assert buf.longest_prefix(HASHES) == 3 and buf.select(HASHES[:1])[0] is not None
        assert buf.drop_select(HASHES[:2])[1] is not None
        assert buf.delete(HASHES[2:3]) == 1
    assert keys_without_ttl(private_redis) == []


@pytest.mark.parametrize("missing", sorted({c for cs in ACCESS.values() for c in cs}))
def test_a_missing_permission_is_named_at_startup(private_redis: RedisServer, missing: str) -> None:
    rule = without(acl_rule(ALL_OPS, "acl"), missing)
    url = acl_user(private_redis, "partial", rule)
    with (
        LookupBuffer.from_url(url, namespace="acl", check=False) as buf,
        pytest.raises(StorePermissionError) as info,
    ):
        buf.check_access(ALL_OPS)
    assert missing in str(info.value) and "ACL SETUSER" in str(info.value)
    assert keys_without_ttl(private_redis) == []  # the probe left nothing behind for good


def test_a_key_pattern_outside_the_acl_is_a_permission_error(private_redis: RedisServer) -> None:
    url = acl_user(private_redis, "other", acl_rule(ALL_OPS, "other"))
    with LookupBuffer.from_url(url, namespace="acl", check=False) as buf:
        with pytest.raises(StorePermissionError, match="SET"):
            buf.check_access(["insert"])
        with pytest.raises(StorePermissionError):
            buf.insert(HASHES[0], filled_block(0))


@pytest.mark.parametrize(
    ("missing", "error"), [("strlen", StoreCommandError), ("rename", StorePermissionError)]
)
def test_drop_select_without_a_script_permission_fails_loudly_and_strands_nothing(
    private_redis: RedisServer, missing: str, error: type[Exception]
) -> None:
    with LookupBuffer.from_url(private_redis.url, namespace="acl", ttl_s=60) as admin:
        admin.insert_many([(h, filled_block(i)) for i, h in enumerate(HASHES[:3])])
    rule = without(acl_rule(ALL_OPS, "acl"), missing)
    url = acl_user(private_redis, "nope", rule)
    # never silent misses: a refused command inside the claim script is an error, raised
    # before the script changed anything (a refused RENAME: by redis.acl_check_cmd)
    with LookupBuffer.from_url(url, namespace="acl") as buf, pytest.raises(error):
        buf.drop_select(HASHES[:3])
    assert keys_without_ttl(private_redis) == []
    with LookupBuffer.from_url(private_redis.url, namespace="acl") as admin:
        assert all(g is not None for g in admin.select(HASHES[:3]))  # all still in place


def test_a_full_server_is_an_out_of_memory_error(private_redis: RedisServer) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) + 100_000))
    with LookupBuffer.from_url(private_redis.url, namespace="oom") as buf:
        with pytest.raises(StoreOutOfMemoryError, match="maxmemory-policy"):
            for i in range(50):
                buf.insert(HASHES[i % 8], {"kv": torch.zeros(64 << 10)})
        assert buf.available  # a full server is not a down server: the breaker stays closed


def test_writing_to_a_replica_is_a_topology_error(redis_server: RedisServer) -> None:
    replica_of = ["--replicaof", "127.0.0.1", str(redis_server.port)]
    with (
        RedisServer(extra_args=replica_of) as replica,
        LookupBuffer.from_url(replica.url, namespace="ro") as buf,
        pytest.raises(StoreTopologyError, match="read-only replica"),
    ):
        buf.insert(HASHES[0], filled_block(0))


def _fails_fast(op: object, within_s: float = 0.05) -> float:
    t0 = time.perf_counter()
    with pytest.raises(StoreCircuitOpenError):
        op()  # type: ignore[operator]
    took = time.perf_counter() - t0
    assert took < within_s, took
    return took


def test_a_dead_server_opens_the_breaker_and_a_restart_closes_it(
    private_redis: RedisServer,
) -> None:
    buf = LookupBuffer.from_url(private_redis.url, namespace="brk", breaker_probe_s=0.1)
    buf.insert(HASHES[0], filled_block(0))
    private_redis.kill()
    for _ in range(3):
        with pytest.raises(StoreUnavailableError):
            buf.longest_prefix(HASHES)
    assert not buf.available and buf.stats().breaker_opens == 1
    _fails_fast(lambda: buf.select(HASHES[:1]))
    _fails_fast(lambda: buf.insert(HASHES[1], filled_block(1)))
    private_redis.start()
    assert buf.breaker.wait_closed(5)
    buf.insert(HASHES[0], filled_block(0))
    assert buf.longest_prefix(HASHES) == 1
    buf.close()


def test_a_client_short_of_connections_is_busy_not_the_server_down(
    private_redis: RedisServer,
) -> None:
    """Found by a review: redis-py's pool, its wait for a free connection run out, raises its
    ConnectionError, which was taken for the server down -- "check that the server runs" --
    and opened the circuit breaker in front of a healthy server. Every connection held here,
    as busy threads hold them: a typed StoreBusyError naming max_connections, breaker closed."""
    address = parse_url(private_redis.url)
    client = make_client(address, socket_timeout_s=0.2, max_connections=1)
    buf = LookupBuffer(client, namespace="busy", control_client=client, breaker_failures=2)
    buf.insert(HASHES[0], filled_block(0))
    held = client.connection_pool.get_connection()
    try:
        for _ in range(3):
            with pytest.raises(StoreBusyError, match="max_connections"):
                buf.longest_prefix(HASHES)
        assert buf.available and buf.stats().breaker_opens == 0
    finally:
        client.connection_pool.release(held)
    assert buf.longest_prefix(HASHES) == 1
    buf.close()


def test_a_load_past_its_own_deadline_is_typed_and_not_the_server_down(
    private_redis: RedisServer,
) -> None:
    """A batch read past the deadline its caller gave (a load's) ends typed, its connection
    dropped -- and the breaker does not count it: a load's deadline can be tens of
    milliseconds (the load policy's wait), so a busy but healthy server must not be taken
    for a dead one."""
    buf = LookupBuffer.from_url(private_redis.url, namespace="late", breaker_failures=2)
    block = filled_block(0)
    buf.insert(HASHES[0], block)
    rows = [torch.empty(1 << 20, dtype=torch.uint8)]  # (room for the value)
    for _ in range(3):
        with pytest.raises(DeadlinePassedError):
            buf.select_into(HASHES[:1], rows, deadline=time.monotonic() - 1.0)
    assert buf.available and buf.stats().breaker_opens == 0
    got = buf.select_into(HASHES[:1], rows)[0]
    assert got is not None and all(torch.equal(got[k], block[k]) for k in block)
    buf.close()


def all_stored(buf: LookupBuffer, blocks: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Whether every one of ``blocks`` is under its key, as it was stored."""
    got = buf.select(list(blocks))
    return all(
        g is not None and all(torch.equal(g[k], b[k]) for k in b)
        for g, b in zip(got, blocks.values(), strict=True)
    )


@pytest.mark.parametrize("connections", [1, 2])
def test_a_consuming_read_past_its_deadline_gives_back_what_it_claimed(
    private_redis: RedisServer, connections: int
) -> None:
    """Found by a review: on one connection the claim and its reads go in one round trip,
    which did not take the deadline. Past it mid-read, typed, and every claimed value is back
    under its key: nothing lost, nothing delivered."""
    blocks = {h: filled_block(i, shape=(2, 16, 8, 512)) for i, h in enumerate(HASHES[:8])}
    direct = LookupBuffer.from_url(private_redis.url, namespace="late")
    direct.insert_many(list(blocks.items()))
    # 0.6 MB/s: each 128 KiB value in 0.2 s, the eight in 1.7 s, where the read has 0.4 s
    with DelayRelay("127.0.0.1", private_redis.port, 0.0, rate_bytes_per_s=6e5) as relay:
        slow = LookupBuffer.from_url(relay.url, namespace="late")
        rows = [torch.empty(1 << 20, dtype=torch.uint8) for _ in blocks]
        with pytest.raises(DeadlinePassedError):
            slow.select_into(
                list(blocks),
                rows,
                consume=True,
                connections=connections,
                deadline=time.monotonic() + 0.4,
            )
        assert slow.wait_given_back(30)
        slow.close()
    assert all_stored(direct, blocks)
    direct.close()


def test_a_claim_that_reaches_the_server_after_the_deadline_strands_nothing(
    private_redis: RedisServer,
) -> None:
    """Found by a review: a consuming read on one connection sends its claim and its GETs at
    once; with the claim's own reply under the deadline, the caller gave back what the claim
    had taken -- nothing yet -- and a claim held on its way ran afterwards, its values left
    under claim keys. The claim's reply is waited for (it refuses to run late by itself); the
    values after it keep the deadline."""
    blocks = {h: filled_block(i) for i, h in enumerate(HASHES[:8])}
    direct = LookupBuffer.from_url(private_redis.url, namespace="held")
    direct.insert_many(list(blocks.items()))
    with DelayRelay("127.0.0.1", private_redis.port, 0.0) as relay:
        slow = LookupBuffer.from_url(relay.url, namespace="held")
        rows = [torch.empty(1 << 20, dtype=torch.uint8) for _ in blocks]
        absent = chain_hashes(list(range(1000, 1016)), 16)
        slow.select_into(absent, rows[:1], consume=True)  # (its code loaded first)
        relay.hold_requests(b"_claim", 0.6)  # the next claim, with its GETs
        with pytest.raises(DeadlinePassedError):
            slow.select_into(list(blocks), rows, consume=True, deadline=time.monotonic() + 0.2)
        assert relay.held_sent.wait(10)  # the claim reached the server
        assert slow.wait_given_back(30)
        slow.close()
    assert all_stored(direct, blocks)
    direct.close()


def test_a_load_that_waited_past_its_deadline_for_a_connection_is_late_not_busy(
    private_redis: RedisServer,
) -> None:
    """Found by a review: the pool's wait for a free connection ran out past the load's
    deadline as StoreBusyError, which a load logs as a Redis failure, not as its expiry."""
    address = parse_url(private_redis.url)
    client = make_client(address, socket_timeout_s=0.2, max_connections=1)
    buf = LookupBuffer(client, namespace="busy", control_client=client)
    block = filled_block(0)
    buf.insert(HASHES[0], block)
    rows = [torch.empty(1 << 20, dtype=torch.uint8)]
    held = client.connection_pool.get_connection()
    try:
        with pytest.raises(DeadlinePassedError, match="free connection"):
            buf.select_into(HASHES[:1], rows, deadline=time.monotonic() + 0.05)
    finally:
        client.connection_pool.release(held)
    assert buf.select_into(HASHES[:1], rows)[0] is not None
    buf.close()


@pytest.mark.parametrize("hang", ["sigstop", "client-pause"])
def test_a_hung_server_costs_one_control_timeout_then_nothing(
    private_redis: RedisServer, hang: str
) -> None:
    buf = LookupBuffer.from_url(
        private_redis.url,
        namespace="hung",
        socket_timeout_s=2,
        control_timeout_s=0.2,
        breaker_probe_s=0.1,
    )
    buf.insert(HASHES[0], filled_block(0))
    assert private_redis.proc is not None
    if hang == "sigstop":
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
    else:
        redis.Redis.from_url(private_redis.url).execute_command("CLIENT", "PAUSE", 3000, "ALL")
    try:
        t0 = time.perf_counter()
        for _ in range(3):
            with pytest.raises(StoreTimeoutError):
                buf.longest_prefix(HASHES)
        assert time.perf_counter() - t0 < 3 * 0.2 + 0.5  # the control timeout, not 2 s
        _fails_fast(lambda: buf.longest_prefix(HASHES))
    finally:
        if hang == "sigstop":
            os.kill(private_redis.proc.pid, signal.SIGCONT)
    assert buf.breaker.wait_closed(5)
    assert buf.longest_prefix(HASHES) == 1
    buf.close()


def test_a_new_connection_to_a_hung_server_costs_one_timeout_not_a_retry_storm(
    private_redis: RedisServer,
) -> None:
    """redis-py 8 retries a failed connect 10 times with backoff by default: a lookup on a
    fresh connection to a stopped server took seconds instead of one timeout."""
    assert private_redis.proc is not None
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        buf = LookupBuffer.from_url(
            private_redis.url,
            namespace="hung",
            connect_timeout_s=0.3,
            control_timeout_s=0.3,
            check=False,
        )
        t0 = time.perf_counter()
        with pytest.raises((StoreTimeoutError, StoreUnavailableError)):
            buf.longest_prefix(HASHES)
        assert time.perf_counter() - t0 < 1.0
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    buf.close()


def test_a_claim_refused_fcall_names_fcall_and_runs_once_it_is_granted(
    private_redis: RedisServer,
) -> None:
    """A role without +fcall fell back to EVALSHA, and the claim's refusal then told the
    operator to grant +evalsha +script|load, the grant that runs any Lua; granted +fcall, the
    running store stayed on EVALSHA (fresh-eyes review, 2026-11-29)."""
    ops = ["ping", "insert", "drop_select"]
    url = acl_user(private_redis, "nofcall", without(acl_rule(ops, "acl"), "FCALL"))
    with LookupBuffer.from_url(url, namespace="acl", fingerprint="fp", ttl_s=60) as buf:
        buf.insert(HASHES[0], {"kv": torch.ones(4)})
        with pytest.raises(StorePermissionError) as info:
            buf.drop_select(HASHES[:1])
        assert "+fcall" in str(info.value) and "evalsha" not in str(info.value).lower()
        # a call in flight (CI: the refused claim's give-back, in the background) settled
        # scripts again before the grant, and the next claim after it was refused as well
        role = redis.Redis.from_url(url)
        assert buf.server_code.mode(role) is ScriptMode.SCRIPTS
        role.close()
        acl_user(private_redis, "nofcall", acl_rule(ops, "acl"))  # the operator grants it
        (got,) = buf.drop_select(HASHES[:1])
        assert got is not None and got["kv"].tolist() == [1.0] * 4
        assert buf.server_code.settled is ScriptMode.FUNCTIONS


def test_a_handoff_claim_refused_fcall_runs_once_it_is_granted(
    private_redis: RedisServer,
) -> None:
    """The same for a script sent alone (a handoff's claim): scripts settled before the
    operator's grant, the first claim after it runs, as FCALL."""
    ops = ["ping", "insert", "handoff_read", "handoff_claim"]
    url = acl_user(private_redis, "nofcall2", without(acl_rule(ops, "acl"), "FCALL"))
    with LookupBuffer.from_url(url, namespace="acl", fingerprint="fp", ttl_s=60) as buf:
        buf.publish_handoff("h1", 3)
        with pytest.raises(StorePermissionError) as info:
            buf.claim_handoff("h1")
        assert "+fcall" in str(info.value)
        role = redis.Redis.from_url(url)
        assert buf.server_code.mode(role) is ScriptMode.SCRIPTS
        role.close()
        acl_user(private_redis, "nofcall2", acl_rule(ops, "acl"))
        assert buf.claim_handoff("h1") == Claim.WON
        assert buf.server_code.settled is ScriptMode.FUNCTIONS


@pytest.mark.redis
def test_a_closed_store_sends_nothing_and_says_so(private_redis: RedisServer) -> None:
    """After ``close`` a call quietly opened new connections through redis-py's pool, or
    failed untyped where the fan-out threads were gone. Every round trip now raises
    ``StoreClosedError`` (a ``StoreUnavailableError``: callers that recompute on one do so),
    and no connection is made."""
    from kvstore import StoreClosedError

    admin = redis.Redis.from_url(private_redis.url)
    buf = LookupBuffer.from_url(private_redis.url, namespace="ns", fingerprint="fp")
    view = buf.for_fingerprint("fp2")
    buf.insert("h1", {"k": torch.ones(4)})
    buf.close()
    clients = admin.client_list()
    calls = [
        lambda: buf.select(["h1"]),
        lambda: buf.insert("h2", {"k": torch.ones(4)}),
        lambda: buf.contains(["h1"]),
        lambda: buf.drop_select(["h1"]),
        lambda: view.select(["h1"]),
    ]
    for call in calls:
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    assert len(admin.client_list()) == len(clients)  # (the admin's own connection only)
    assert not buf.breaker.is_open  # not the server's fault
    admin.close()
