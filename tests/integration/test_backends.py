"""Every kvstore operation against each server we claim: Redis 7.0 (the system's) and 6.2,
Valkey 8.1 and 9.1, standalone and as a 3-master Cluster with a replica per master. The
binaries besides the system's come from scripts/setup.sh (see testing.redis_server)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import torch

from kvstore import Claim, LookupBuffer, StoreCommandError, chain_hashes
from kvstore.net.connection import make_client, parse_url, translated_errors
from kvstore.values.codec import frame_parts, plan_entries
from kvstore.values.keys import parse_key
from testing.blocks import k_v_block
from testing.redis_server import ClusterServers, RedisServer, server_binary

pytestmark = pytest.mark.redis

HASHES = chain_hashes(list(range(16 * 80)), 16)
FPS = ["rank0fingerprint", "rank1fingerprint"]


def same(got: dict[str, torch.Tensor] | None, i: int) -> bool:
    want = k_v_block(i)
    return got is not None and all(torch.equal(got[n], want[n]) for n in want)


def parts(buf: LookupBuffer, i: int) -> list[object]:
    """Block ``i`` framed as insert_parts takes it: header and tensors as separate buffers."""
    tensors = k_v_block(i)
    entries, _ = plan_entries(list(tensors), torch.float32, (2, 16, 8))
    pieces = [t.numpy() for t in tensors.values()]
    return frame_parts(entries, pieces, fingerprint=buf.fingerprint, block_hash=HASHES[i])


@dataclass
class Backend:
    name: str
    url: str
    servers: RedisServer | ClusterServers

    @property
    def cluster(self) -> bool:
        return isinstance(self.servers, ClusterServers)

    def node_clients(self) -> list[redis.Redis]:
        if isinstance(self.servers, ClusterServers):
            return [self.servers.client(n) for n in self.servers.master_nodes()]
        return [redis.Redis(unix_socket_path=self.servers.unix_socket)]

    def keys(self, pattern: str = "kv:*") -> list[str]:
        return sorted(k.decode() for c in self.node_clients() for k in c.keys(pattern))

    def flush(self) -> None:
        for c in self.node_clients():
            c.flushall()


# name -> (server build, cluster?)
BACKENDS = {
    "redis-7.0": ("redis", False),
    "redis-6.2": ("redis-6.2", False),
    "valkey-8.1": ("valkey-8.1", False),
    "valkey-9.1": ("valkey-9.1", False),
    "redis-7.0-cluster": ("redis", True),
    "valkey-8.1-cluster": ("valkey-8.1", True),
}


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    build, cluster = BACKENDS[request.param]
    binary = server_binary(build)
    servers: RedisServer | ClusterServers
    if cluster:
        servers = ClusterServers(binary=binary).start()
        url = servers.url
    else:
        servers = RedisServer(binary=binary).start()
        url = servers.url
    try:
        yield Backend(request.param, url, servers)
    finally:
        servers.cleanup()


@pytest.fixture
def store(backend: Backend) -> Iterator[Backend]:
    backend.flush()
    yield backend


def test_the_server_is_the_build_we_meant(store: Backend) -> None:
    info = store.node_clients()[0].info("server")
    version = str(info["valkey_version"] if "valkey" in store.name else info["redis_version"])
    assert version.startswith(store.name.split("-")[1]), (store.name, version)
    with LookupBuffer.from_url(store.url, namespace="t") as buf:
        assert buf.cluster is store.cluster


def test_insert_select_and_lookup(store: Backend) -> None:
    with LookupBuffer.from_url(store.url, namespace="ops", ttl_s=60) as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(40)])
        got = buf.select(HASHES[:42])
        assert all(same(got[i], i) for i in range(40)) and got[40:] == [None, None]
        assert buf.longest_prefix(HASHES[:60]) == 40
        assert buf.contains(HASHES[39:41]) == [True, False]
        bufs = [torch.empty(8192, dtype=torch.uint8) for _ in range(42)]
        into = buf.select_into(HASHES[:42], bufs, connections=3)
        assert all(same(into[i], i) for i in range(40)) and into[40:] == [None, None]
        assert buf.delete(HASHES[:10]) == 10
        assert buf.longest_prefix(HASHES[:60]) == 0
        assert buf.stats().corrupt == 0


def test_longest_prefix_needs_every_fingerprint(store: Backend) -> None:
    with (
        LookupBuffer.from_url(store.url, namespace="tp", fingerprint=FPS[0]) as r0,
        LookupBuffer.from_url(store.url, namespace="tp", fingerprint=FPS[1]) as r1,
    ):
        r0.insert_many([(HASHES[i], k_v_block(i)) for i in range(10)])
        r1.insert_many([(HASHES[i], k_v_block(i)) for i in range(6)])
        assert r0.longest_prefix(HASHES[:10], FPS) == 6
        assert r0.delete(HASHES[:10], FPS) == 16


def test_insert_parts_then_consume_into_buffers(store: Backend) -> None:
    with LookupBuffer.from_url(store.url, namespace="parts") as buf:
        items = []
        for i in range(24):
            items.append((HASHES[i], parts(buf, i)))
        buf.insert_parts(items, connections=3)
        bufs = [torch.empty(8192, dtype=torch.uint8) for _ in range(25)]
        got = buf.select_into(HASHES[:25], bufs, consume=True, connections=2)
        assert all(same(got[i], i) for i in range(24)) and got[24] is None
        assert store.keys("kv:parts:*") == []  # taken, and the claims deleted


def test_drop_select_takes_values_and_leaves_nothing(store: Backend) -> None:
    with LookupBuffer.from_url(store.url, namespace="drop") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(30)])
        got = buf.drop_select(HASHES[:32])
        assert all(same(got[i], i) for i in range(30)) and got[30:] == [None, None]
        assert buf.drop_select(HASHES[:30]) == [None] * 30
        assert store.keys("kv:drop:*") == []


def test_blocking_drop_select_gets_values_inserted_later(store: Backend) -> None:
    with LookupBuffer.from_url(store.url, namespace="wait") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(4)])

        def produce() -> None:
            time.sleep(0.2)
            buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(4, 8)])

        threading.Thread(target=produce).start()
        got = buf.drop_select(HASHES[:8], timeout_s=5)
        assert all(same(got[i], i) for i in range(8))


def _racer(url: str, keys: list[str], out: mp.Queue) -> None:
    buf = LookupBuffer.from_url(url, namespace="race")
    got = []
    for start in range(0, len(keys), 3):
        for value in buf.drop_select(keys[start : start + 5]):
            if value is not None:
                got.append(int(value["k"][0, 0, 0].item()))
    out.put(got)


def test_drop_select_delivers_each_value_exactly_once_across_processes(store: Backend) -> None:
    n = 60
    with LookupBuffer.from_url(store.url, namespace="race") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(n)])
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    # every process walks all keys in overlapping windows, some in reverse order; on a Cluster
    # a window's keys live on different masters
    orders = [HASHES[:n], HASHES[:n][::-1], HASHES[:n], HASHES[:n][::-1]]
    procs = [ctx.Process(target=_racer, args=(store.url, keys, out)) for keys in orders]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    delivered = [v for r in results for v in r]
    assert sorted(delivered) == list(range(n)), "a value was lost or delivered twice"
    assert store.keys("kv:race:*") == []


def test_handoff_records_and_one_owner(store: Backend) -> None:
    with LookupBuffer.from_url(store.url, namespace="hand", fingerprint=FPS[0]) as buf:
        buf.open_handoff("req-1", FPS)
        state = buf.read_handoff("req-1", HASHES[:4], FPS)
        assert state.pending and state.committed is None
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(4)])
        with LookupBuffer.from_url(store.url, namespace="hand", fingerprint=FPS[1]) as r1:
            r1.insert_many([(HASHES[i], k_v_block(i)) for i in range(4)])
            r1.publish_handoff("req-1", 4)
        buf.publish_handoff("req-1", 4)
        state = buf.read_handoff("req-1", HASHES[:4], FPS)
        assert (state.committed, state.present) == (4, 4)
        owners = [buf.claim_handoff("req-1", FPS, owner=o) for o in ("a", "a", "b", "a")]
        # "a" again: sent twice; "b" loses and leaves a's mark, so a's later claim still wins
        assert owners == [Claim.WON, Claim.WON, Claim.TAKEN, Claim.WON]
        assert buf.delete_handoff("req-1", FPS) == 2


def test_every_permission_probe_passes(store: Backend) -> None:
    from kvstore.fleet.access import ACCESS

    with LookupBuffer.from_url(store.url, namespace="acl") as buf:
        buf.check_access(list(ACCESS))
    assert store.keys("kv:acl:*") == []


def test_foreign_and_corrupt_values_are_counted_misses(store: Backend) -> None:
    with LookupBuffer.from_url(store.url, namespace="bad") as buf:
        buf.insert(HASHES[0], k_v_block(0))
        buf.client.rpush(buf.redis_key(HASHES[1]), b"x")  # another type under a block key
        buf.client.set(buf.redis_key(HASHES[2]), b"not a kvstore value")
        got = buf.select(HASHES[:3])
        assert same(got[0], 0) and got[1:] == [None, None]
        bufs = [torch.empty(8192, dtype=torch.uint8) for _ in range(3)]
        assert buf.select_into(HASHES[:3], bufs)[1:] == [None, None]
        taken = buf.drop_select(HASHES[:3])
        assert same(taken[0], 0) and taken[1:] == [None, None]
        assert buf.stats().corrupt >= 4


def test_the_cli_sees_every_shard(store: Backend) -> None:
    from kvstore.cli import flush_namespace, list_prefixes, server_stats

    with LookupBuffer.from_url(store.url, namespace="cli") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(20)])
        rows = list_prefixes(buf.client, "kv", "cli")
        assert [(r["namespace"], r["blocks"]) for r in rows] == [("cli", 20)]
        stats = server_stats(buf.client, "kv")
        assert (stats["blocks"], stats["masters"]) == (20, 3 if store.cluster else 1)
        per_node = [int(c.info("memory")["used_memory"]) for c in store.node_clients()]
        assert stats["used_memory"] >= sum(per_node) * 0.9  # the whole cluster's, not one node's
        assert flush_namespace(buf.client, "kv", "cli") == 20
    assert store.keys("kv:cli:*") == []


# a server with CLIENT NO-TOUCH, one without, and a Cluster (each master's idle times)
READERSHIP_BACKENDS = ("valkey-9.1", "redis-7.0", "valkey-8.1-cluster")


def test_ls_counts_the_blocks_read_since_written_without_reading_them(store: Backend) -> None:
    """Saved blocks later loaded, by any instance, and the bytes of those nobody read: the
    server's idle times against the values' ages. Lookups (EXISTS) are not reads; looking
    (ls itself) is not a read where the server has CLIENT NO-TOUCH, and says so where not."""
    from kvstore.cli import list_blocks

    if store.name not in READERSHIP_BACKENDS:
        pytest.skip("the read figures on three kinds of server suffice")
    with LookupBuffer.from_url(store.url, namespace="reads") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(4)])
        clock = store.node_clients()[0]
        written = clock.time()[0]
        # the LRU clock counts whole seconds: the blocks must be older than its slack before a
        # read tells them apart (a wait for the server's clock, not a deadline)
        while clock.time()[0] < written + 4:
            time.sleep(0.2)
        assert buf.longest_prefix(HASHES[:4]) == 4  # a lookup reads nothing
        assert all(same(g, i) for i, g in enumerate(buf.select(HASHES[:2])))
        listing = list_blocks(buf.client, "kv", "reads")
        [row] = listing.rows
        assert (row["blocks"], row["read_blocks"], row["unread_blocks"]) == (4, 2, 2)
        no_touch = store.name != "redis-7.0"  # Redis 7.2 brought CLIENT NO-TOUCH
        assert listing.touched is not no_touch and bool(listing.notes) is not no_touch
        if no_touch:  # looking again finds the same: the listing read nothing
            [again] = list_blocks(buf.client, "kv", "reads").rows
            assert (again["read_blocks"], again["unread_blocks"]) == (2, 2)
        unread = [buf.redis_key(h) for h in HASHES[2:4]]  # (STRLEN is a read: asked last)
        assert row["unread_bytes"] == sum(int(buf.client.strlen(k)) for k in unread)
    if store.name == "valkey-9.1":  # a user who may not ask: not counted, and told what to grant
        admin = store.node_clients()[0]
        allowed = ["+scan", "+strlen", "+pttl", "+getrange", "+time", "+info"]
        admin.acl_setuser("looker", enabled=True, passwords=["+pw"], keys=["*"], commands=allowed)
        assert isinstance(store.servers, RedisServer)
        looker = redis.Redis(unix_socket_path=store.servers.unix_socket, username="looker",
                             password="pw")  # fmt: skip
        listing = list_blocks(looker, "kv", "reads")
        [row] = listing.rows
        assert (row["read_blocks"], row["unread_blocks"], row["unknown_blocks"]) == (0, 0, 4)
        assert any("+object|idletime" in n for n in listing.notes)
        assert any("+client|no-touch" in n and "Redis before" not in n for n in listing.notes)


def test_ls_counts_every_block_of_a_cluster_whose_slot_map_is_stale(store: Backend) -> None:
    """Found in review: ls sent each master its keys by the client's slot map, and a slot that
    had moved (a resharding, a failover) raised MOVED; the map is refreshed and asked again."""
    from kvstore.cli import list_blocks

    cluster_only(store)
    with LookupBuffer.from_url(store.url, namespace="moving") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(24)])
        nodes = buf.client.nodes_manager  # type: ignore[attr-defined]
        wrong = nodes.get_node_from_slot(0)
        for slot in range(16384):  # every slot at one master, as before a resharding is seen
            nodes.slots_cache[slot] = [wrong]
        listing = list_blocks(buf.client, "kv", "moving")
        assert [(r["namespace"], r["blocks"]) for r in listing.rows] == [("moving", 24)]


# ---------------------------------------------------------------- Cluster only


def cluster_only(store: Backend) -> ClusterServers:
    if not isinstance(store.servers, ClusterServers):
        pytest.skip("a Cluster behaviour")
    return store.servers


def test_a_prompts_blocks_spread_over_every_master(store: Backend) -> None:
    cluster_only(store)
    with LookupBuffer.from_url(store.url, namespace="spread") as buf:
        buf.insert_many([(HASHES[i], k_v_block(i)) for i in range(64)])
    per_master = [len(c.keys("kv:spread:*")) for c in store.node_clients()]
    assert len(per_master) == 3 and all(n >= 8 for n in per_master), per_master


def test_a_stale_slot_map_is_corrected_by_moved_replies(store: Backend) -> None:
    """The client's slot map points every slot at one master (as after a resharding it has not
    seen): the other masters answer MOVED, and every operation still gets the right bytes."""
    cluster_only(store)
    with LookupBuffer.from_url(store.url, namespace="moved") as buf:

        def stale_map() -> None:
            nodes = buf.client.nodes_manager  # type: ignore[attr-defined]
            wrong = nodes.get_node_from_slot(0)
            for slot in range(16384):
                nodes.slots_cache[slot] = [wrong]

        stale_map()
        items = []
        for i in range(24):
            items.append((HASHES[i], parts(buf, i)))
        buf.insert_parts(items, connections=2)
        stale_map()
        bufs = [torch.empty(8192, dtype=torch.uint8) for _ in range(24)]
        assert all(same(g, i) for i, g in enumerate(buf.select_into(HASHES[:24], bufs)))
        stale_map()
        assert buf.longest_prefix(HASHES[:30]) == 24
        stale_map()
        got = buf.drop_select(HASHES[:12])
        assert all(same(g, i) for i, g in enumerate(got))
        stale_map()
        got = buf.select_into(HASHES[12:24], bufs[:12], consume=True)
        assert all(same(g, 12 + i) for i, g in enumerate(got))
        assert buf.stats().redirects > 0  # the raw-socket paths saw MOVED and sent again
    assert store.keys("kv:moved:*") == []


def test_a_cluster_over_tls(tls_files: dict[str, str]) -> None:
    with ClusterServers(tls=tls_files) as cluster:
        assert cluster.url.startswith("rediss-cluster://")
        with LookupBuffer.from_url(
            cluster.url, namespace="tls", tls_ca_file=tls_files["ca"]
        ) as buf:
            buf.insert_parts([(HASHES[i], parts(buf, i)) for i in range(12)], connections=2)
            bufs = [torch.empty(8192, dtype=torch.uint8) for _ in range(12)]
            assert all(same(g, i) for i, g in enumerate(buf.select_into(HASHES[:12], bufs)))
            assert all(same(g, i) for i, g in enumerate(buf.drop_select(HASHES[:12])))
            assert buf.longest_prefix(HASHES[:12]) == 0
        # its nodes' control replies are bounded as a plain Cluster's are (test_cluster_errors)
        address = parse_url(cluster.url)
        client = make_client(address, socket_timeout_s=5.0, tls_ca_file=tls_files["ca"])
        try:
            client.set("big", b"B" * (5 << 20))
            with (
                pytest.raises(StoreCommandError, match="control replies"),
                translated_errors(address.safe_url, "GET"),
            ):
                client.get("big")
        finally:
            client.close()


def test_claim_keys_live_in_their_blocks_slot(store: Backend) -> None:
    cluster = cluster_only(store)
    with LookupBuffer.from_url(store.url, namespace="slot") as buf:
        buf.insert(HASHES[0], k_v_block(0))
        batch = buf._claims.claim([buf.redis_key(HASHES[0])])
        statuses, claims = batch.statuses, batch.claim_keys
        assert statuses == [1] and len(claims) == 1
        slot = buf.client.keyslot  # type: ignore[attr-defined]
        assert slot(claims[0]) == slot(buf.redis_key(HASHES[0]))
        parsed = parse_key(claims[0])
        assert parsed is not None and parsed.kind == "claim" and parsed.name == HASHES[0]
        assert cluster.node_of(claims[0]).port == cluster.node_of(buf.redis_key(HASHES[0])).port
