"""A client holding one role's credentials, as the ACL table of docs/operations.md gives them to
tenant "a", tries what it must not do, against a real server (Redis 7 and Valkey): overwrite tenant
"b"'s block, reset either namespace, delete another namespace's keys, run admin commands, plant KV
its own readers would load, and exhaust a reader's memory. Every attempt is refused by the server,
or ends as a counted miss in the reader. docs/reliability.md ("Hostile writers") tabulates it."""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Iterator

import pytest
import redis
import torch

from kvstore import LookupBuffer
from kvstore.fleet.functions import LIBRARY
from kvstore.fleet.generations import BUMP, RAISE, RAISE_LUA
from kvstore.fleet.handoff import CLAIM_RECORDS
from kvstore.net.server_code import LIBRARY_NAME
from testing.redis_server import RedisServer, add_acl_user, server_binary
from tests.conftest import ROOT

pytestmark = pytest.mark.redis

SECRET = b"tenant a's secret, 32 bytes long"
H = "ab" * 16
ROLES = [
    "`kv_producer`",
    "`kv_consumer`, consume mode",
    "`kv_consumer`, share mode",
    "`kv_both`, share mode",
    "`kv_both`, consume mode",
    "`connector.warm`",
    "kvstore's `drop_select`",
]
ADMIN = (
    "admin: resets (vLLM's `reset_prefix_cache` with the connector, `kvstore reset`) and their "
    "sweep"
)


def rule_for(label: str, tenant: str) -> list[str]:
    """The documented rule for ``label``, given to ``tenant`` (its namespace for ``vllm``)."""
    readme = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(rf"^\| {re.escape(label)} \| `([^`]+)`", readme, re.MULTILINE)
    assert m, f"no ACL row for {label} in docs/operations.md"
    return m.group(1).replace("\\|", "|").replace("kv:vllm:", f"kv:{tenant}:").split()


@pytest.fixture(scope="module", params=["redis", "valkey-9.1"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    binary = server_binary(request.param)
    srv = RedisServer(binary=binary).start()
    try:
        yield srv
    finally:
        srv.cleanup()


def user(server: RedisServer, name: str, rule: list[str]) -> redis.Redis:
    admin = redis.Redis.from_url(server.url)
    add_acl_user(admin, name, rule)
    return redis.Redis(host="127.0.0.1", port=server.port, username=name, password="pw")


def refused(call: object) -> bool:
    try:
        call()  # type: ignore[operator]
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as exc:  # a refusal inside a script
        return (
            "NOPERM" in str(exc)
            or "no permission" in str(exc).lower()
            or "can't access" in str(exc)
        )
    return False


def tenants(server: RedisServer) -> redis.Redis:
    """Tenant "b"'s block and both namespaces' counters, written as their admins would."""
    admin = redis.Redis.from_url(server.url)
    admin.flushall()
    with LookupBuffer.from_url(server.url, namespace="b", fingerprint="fp") as b:
        b.insert(H, {"kv": torch.ones(8)})
    admin.set("kv:a:generation", 2)
    admin.set("kv:b:generation", 5)
    return admin


@pytest.mark.parametrize("label", ROLES)
def test_no_role_reaches_another_tenant_or_the_counters(server: RedisServer, label: str) -> None:
    admin = tenants(server)
    before = admin.get(f"kv:b:fp:{H}")
    c = user(server, f"hostile{ROLES.index(label)}", rule_for(label, "a"))
    attempts = {
        "overwrite b's block": lambda: c.set(f"kv:b:fp:{H}", b"forged"),
        "delete b's block": lambda: c.unlink(f"kv:b:fp:{H}"),
        "read b's block": lambda: c.get(f"kv:b:fp:{H}"),
        "reset a (SET)": lambda: c.set("kv:a:generation", 99),
        "reset a (delete)": lambda: c.unlink("kv:a:generation"),
        "reset a (script)": lambda: c.eval(RAISE_LUA, 1, "kv:a:generation", 99),
        "reset b (SET)": lambda: c.set("kv:b:generation", 99),
        "reset a (function)": lambda: c.fcall(RAISE.function, 1, "kv:a:generation", 99),
        "reset b (function)": lambda: c.fcall(BUMP.function, 1, "kv:b:generation", 0),
        # code of its own: a busy loop stalls every tenant, allow-oom writes pass maxmemory
        "run its own Lua": lambda: c.eval("return 1", 0),
        "load a script": lambda: c.script_load("#!lua flags=allow-oom\nreturn 1"),
        "load a function": lambda: c.function_load(
            "#!lua name=evil\nredis.register_function('evil', function() return 1 end)"
        ),
        "replace kvstore's functions": lambda: c.function_load(LIBRARY.text(), replace=True),
        "delete kvstore's functions": lambda: c.function_delete(LIBRARY_NAME),
        "flush functions": lambda: c.function_flush(),
        "write outside kv:": lambda: c.set("other", b"x"),
        "flushall": lambda: c.flushall(),
        "config": lambda: c.config_set("maxmemory", "1"),
        "keys": lambda: c.keys("*"),
    }
    allowed = [what for what, call in attempts.items() if not refused(call)]
    assert allowed == [], f"{label} may {allowed}"
    assert admin.get(f"kv:b:fp:{H}") == before
    assert (admin.get("kv:a:generation"), admin.get("kv:b:generation")) == (b"2", b"5")


def test_the_admin_resets_its_own_namespace_only(server: RedisServer) -> None:
    admin = tenants(server)
    c = user(server, "admin_a", rule_for(ADMIN, "a"))
    url = f"redis://admin_a:pw@127.0.0.1:{server.port}/0"
    with LookupBuffer.from_url(url, namespace="a", fingerprint="fp") as a:
        assert a.reset() == 3
    assert refused(lambda: c.set("kv:b:generation", 0))
    assert refused(lambda: c.unlink(f"kv:b:fp:{H}"))
    assert refused(lambda: c.eval(RAISE_LUA, 1, "kv:b:generation", 99))
    assert refused(lambda: c.fcall(BUMP.function, 1, "kv:b:generation", 0))
    assert refused(lambda: c.script_load("return 1"))
    assert admin.get("kv:b:generation") == b"5" and admin.exists(f"kv:b:fp:{H}")


def test_kv_planted_without_the_secret_is_never_loaded(server: RedisServer) -> None:
    """A producer's credentials (it may SET a's blocks) but not a's secret: whatever it plants
    -- its own KV, a replay of another block's signed value -- a's readers count as misses."""
    tenants(server)
    user(server, "producer_a", rule_for("`kv_producer`", "a"))
    url = f"redis://producer_a:pw@127.0.0.1:{server.port}/0"
    reader_url = f"redis://127.0.0.1:{server.port}/0"
    with (
        LookupBuffer.from_url(reader_url, namespace="a", fingerprint="fp", secret=SECRET) as a,
        LookupBuffer.from_url(url, namespace="a", fingerprint="fp") as hostile,
    ):
        a.insert("cd" * 16, {"kv": torch.full((8,), 7.0)})
        hostile.insert(H, {"kv": torch.full((8,), 666.0)})  # unsigned
        assert a.select([H]) == [None]
        hostile.client.set(f"kv:a:fp:{H}", hostile.client.get(f"kv:a:fp:{'cd' * 16}"))  # replay
        assert a.select([H]) == [None]
        row = [torch.zeros(4096, dtype=torch.uint8)]
        assert a.select_into([H], row) == [None]
        assert a.stats().corrupt_by_reason == {"unsigned": 1, "key": 2}
        got = a.select(["cd" * 16])[0]
        assert got is not None and torch.equal(got["kv"], torch.full((8,), 7.0))


def test_values_built_to_exhaust_a_reader_cost_it_bounded_memory(server: RedisServer) -> None:
    """What a writer in the namespace plants to exhaust its readers, read into the 1 MiB rows a
    reader sizes for its blocks: an lz4 bomb (64 MiB stored in ~256 KiB) and a 1.5 MiB value
    are counted misses (the second drained within its deadline); a 48 MiB value -- more than
    twice the row -- is a counted miss too, its connection dropped, not drained
    (wire.drain_limit), so a planted value does not make every read of its key pull it whole,
    and the batch's other values, before and after it, are delivered (issue 52: it failed the
    whole batch). The reader's peak memory stays far below any of them."""
    tenants(server)
    url = f"redis://127.0.0.1:{server.port}/0"
    with LookupBuffer.from_url(url, namespace="a", fingerprint="fp", compression="lz4") as w:
        w.insert("b0" * 16, {"kv": torch.zeros(64 << 20, dtype=torch.uint8)})
        w.client.set(f"kv:a:fp:{'b1' * 16}", bytes(3 << 19))
        w.client.set(f"kv:a:fp:{'b3' * 16}", bytes(48 << 20))
        w.insert("b2" * 16, {"kv": torch.ones(8)})
    with LookupBuffer.from_url(url, namespace="a", fingerprint="fp") as reader:
        rows = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(4)]
        tracemalloc.start()
        try:
            got = reader.select_into(["b0" * 16, "b1" * 16], rows[:2])
            around = reader.select_into(["b2" * 16, "b3" * 16, "b2" * 16, "b3" * 16], rows)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got == [None, None]
        assert around[1] is None and around[3] is None  # misses, counted
        for good in (around[0], around[2]):  # before and after it, on another connection
            assert good is not None and torch.equal(good["kv"], torch.ones(8))
        assert reader.stats().corrupt_by_reason == {"oversize": 4}
        assert peak < 16 << 20, f"peak {peak >> 20} MiB"
        # the connections it used are usable, or were replaced: a good value reads
        good = reader.select_into(["b2" * 16], rows[:1])[0]
        assert good is not None and torch.equal(good["kv"], torch.ones(8))


def test_kvstores_own_functions_cannot_grow_a_full_server(server: RedisServer) -> None:
    """The functions run with allow-oom (a claim or a reset must work on a full server), so
    what they write is bounded: a tenant with the consumer's rule took a 32 MiB server to
    454 MiB through a claim's 50 MB "taken" mark, and to 566 MiB creating keys without a TTL
    through the reset functions (fresh-eyes review, 2026-11-29)."""
    admin = tenants(server)
    c = user(server, "full_a", rule_for("`kv_consumer`, consume mode", "a"))
    record = "kv:a:fp:handoff:{h0}"
    admin.set(record, b"3", px=60_000)
    used = admin.info("memory")["used_memory"]
    admin.config_set("maxmemory", str(used + (1 << 20)))
    admin.config_set("maxmemory-policy", "noeviction")
    try:
        attempts = {
            "a 50 MB mark": lambda: c.fcall(
                CLAIM_RECORDS.function, 1, record, b"Z" * 50_000_000, 60_000, b"taken:"
            ),
            "a TTL past a minute": lambda: c.fcall(
                CLAIM_RECORDS.function, 1, record, b"taken:x", 10**12, b"taken:"
            ),
            "a new key without a TTL": lambda: c.fcall(BUMP.function, 1, "kv:a:fp:new", 0),
            "a 1 MB key name": lambda: c.fcall(BUMP.function, 1, "kv:a:fp:" + "N" * 2**20, 0),
        }
        keys = admin.dbsize()
        allowed = [what for what, call in attempts.items() if not refused_or_error(call)]
        assert allowed == []
        # nothing stored grew or appeared (a request's own argument buffer is not the data:
        # any command with a 50 MB argument costs that while it is read)
        assert admin.dbsize() == keys and admin.get(record) == b"3"
        assert (admin.memory_usage(record) or 0) < 1024
    finally:
        admin.config_set("maxmemory", "0")


def refused_or_error(call: object) -> bool:
    try:
        call()  # type: ignore[operator]
    except redis.exceptions.ResponseError:
        return True
    return False
