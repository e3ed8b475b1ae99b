#!/usr/bin/env python3
"""Reads that land in a destination buffer, and writes, per value size, in one run against one
redis-server: plain redis-py, kvstore, and LMCache 0.5.6's ``resp://`` C++ client when it is
importable (``../shared/anchors/lmcache.md``: run this with ``/tmp/lmc/bin/python``).

Paths (batches of ``--batch`` values, each sample repeated up to 32 MiB, the median of ``--rounds``
interleaved rounds):
- ``redis-py``: pipelined ``SET`` of bytes; pipelined ``GET``, then each reply copied into its
  destination tensor (what a caller has to do with redis-py's ``bytes``);
- ``kvstore``: ``insert_many`` (framing, checksum, pipelined ``SET``); ``insert_parts`` with 1,
  2 and 4 connections (what the data mover does: header and checksum around the staged bytes,
  sent from where they lie with ``sendmsg``); ``select_into`` with 1, 2 and 4 connections
  (received straight into the destination, header and checksum verified);
- ``kvstore select`` / ``drop_select``: the public API (values received into buffers the
  library allocates; ``drop_select`` claims, reads and deletes -- its keys are written again,
  untimed, before each round);
- ``bare recv_into depth 1 xN``: ``GET`` received with kvstore's reply reader into the
  destination, one in flight per connection, on N connections, no verification -- the ceiling
  of this way of reading; ``bare sendmsg``: the payloads' ``SET`` sent with ``sendmsg``,
  nothing framed or hashed -- the ceiling of writing; ``insert_parts x1`` split in two: its
  ``checksums alone`` (framing, nothing sent) and its send of values ``framed before`` (the
  two add up to it: where a write's CPU goes);
- ``LMCache resp://``: ``batched_put`` / ``batched_get`` into its preallocated buffers;
- ``[python]``: a kvstore read with its replies received by the Python path instead of the
  compiled core (``kvstore/net/_wire_core.c``, where it was built).

GB/s counts value bytes. Prints a table with ratios against LMCache and redis-py and writes
``--json`` and PNG plots (GB/s against value size, one line per path) to ``--plot-dir``.

    python -m scripts.bench_paths [--sizes 256K,1M,2M,8M] [--batch 16] [--rounds 7]

``--sweep`` instead measures ``select_into`` for each read depth (replies in flight per
connection) and number of connections, per size: how kvstore's read defaults were chosen.

``--mac`` instead measures what a namespace secret costs (``kvstore/values/value_auth.py``): the MAC
constructions one core can run (xxh3_64, today's unkeyed checksum; keyed BLAKE3, the one
chosen; HMAC-SHA256 and keyed BLAKE2b from hashlib), then the data mover's write
(``insert_parts``) and read (``select_into``) paths with and without a secret, on values of
``--layers`` tensors as the mover frames them, interleaved in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from kvstore import LookupBuffer, chain_hashes
from kvstore.net.wire import ReplyReader, native_available, pack_set, send_buffers
from kvstore.values.codec import frame_parts, plan_entries
from testing.redis_server import RedisServer

Path_ = Callable[[], None]


# The least bytes one timed sample of a path moves (batches of small values are repeated).
SAMPLE_BYTES = 32 << 20


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def last_level_cache_bytes() -> int:
    """The CPU's largest cache, from sysfs (0 when it does not say)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        with contextlib.suppress(ValueError):
            sizes.append(parse_size(text[:-1] if text.endswith("B") else text))
    return max(sizes, default=0)


class CacheEvictor:
    """Writes a buffer twice the last-level cache's size, so that the next timed sample finds
    its data (and the server's) in memory, not in the cache. Without it the first path of a
    round to touch a batch pays its cache misses and the paths after it do not: on a host with
    a 300 MiB L3 that made ``insert_many`` look 25% slower than ``insert_parts`` on the same
    bytes. Cold is also what the GPU path sees: staged values arrive by DMA.

    The write is numpy's, on this thread: a torch op would leave its OpenMP threads spinning
    into the timed sample (``select_into`` of 256 KiB values ran 23% slower right after one
    than after a sleep, on 2 cores)."""

    def __init__(self, cache_bytes: int | None = None) -> None:
        size = 2 * (last_level_cache_bytes() if cache_bytes is None else cache_bytes)
        self.nbytes = min(max(size, 64 << 20), 1 << 30)
        self._junk = np.zeros(self.nbytes, dtype=np.uint8)
        self()  # its pages faulted in now, not in the first sample's turn

    def __call__(self) -> None:
        np.add(self._junk, 1, out=self._junk)


def server_cpu_seconds(pid: int) -> float:
    """CPU time a process (all its threads, exited ones included) has run, in seconds: its
    process CPU clock (Linux: ``clock_gettime`` of ``((~pid) << 3) | 2``, the scheduler's
    nanoseconds, ~1 us to read). Where that is refused, the sum of its live threads'
    ``/proc/<pid>/task/*/schedstat`` (``/proc/<pid>/stat`` counts 10 ms ticks, as long as a
    whole 2 MiB sample)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        pass
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


class CpuSpent:
    """CPU seconds the benchmark's process (every thread: LMCache's workers, kvstore's fan-out)
    and the redis-server spent per path, summed over every timed call, beside the wall time.
    They say which side bounds a path: a server busy for most of the wall time cannot serve a
    faster client."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.client: dict[str, float] = {}
        self.client_sys: dict[str, float] = {}  # the kernel's share of ``client``
        self.server: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def sample(self) -> tuple[float, float, float]:
        """(this process's CPU seconds, its system share, the server's) before a timed call: the
        client's read last here and first in :meth:`add`, so reading the server's is not charged
        to it."""
        server = server_cpu_seconds(self.server_pid) if self.server_pid else 0.0
        spent = resource.getrusage(resource.RUSAGE_SELF)
        return spent.ru_utime + spent.ru_stime, spent.ru_stime, server

    def add(self, name: str, before: tuple[float, float, float], wall: float) -> None:
        spent = resource.getrusage(resource.RUSAGE_SELF)
        server = server_cpu_seconds(self.server_pid) if self.server_pid else 0.0
        client = spent.ru_utime + spent.ru_stime
        self.client[name] = self.client.get(name, 0.0) + client - before[0]
        self.client_sys[name] = self.client_sys.get(name, 0.0) + spent.ru_stime - before[1]
        self.server[name] = self.server.get(name, 0.0) + server - before[2]
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.calls[name] = self.calls.get(name, 0) + 1

    def figures(self, name: str, call_bytes: int) -> dict[str, float]:
        """Client and server CPU ms per GB moved by ``name``, the client's kernel share of it
        (``client_sys``: sends, receives and the loopback's delivery; the rest is this process's
        own code), and the server's busy share."""
        gb = self.calls[name] * call_bytes / 1e9
        return {
            "client_ms_per_gb": self.client[name] / gb * 1e3,
            "client_sys_ms_per_gb": self.client_sys[name] / gb * 1e3,
            "server_ms_per_gb": self.server[name] / gb * 1e3,
            "server_busy": self.server[name] / self.wall[name],
        }

    def row(self, name: str, call_bytes: int) -> str:
        """``client (sys) / server`` ms per GB moved, and the server's busy share of the wall
        time."""
        f = self.figures(name, call_bytes)
        return (
            f"{f['client_ms_per_gb']:.0f} (sys {f['client_sys_ms_per_gb']:.0f}) / "
            f"{f['server_ms_per_gb']:.0f} ({f['server_busy']:.0%})"
        )

    def as_json(self, call_bytes: int) -> dict[str, dict[str, float]]:
        digits = {
            "client_ms_per_gb": 1,
            "client_sys_ms_per_gb": 1,
            "server_ms_per_gb": 1,
            "server_busy": 3,
        }
        return {
            name: {k: round(v, digits[k]) for k, v in self.figures(name, call_bytes).items()}
            for name in self.calls
        }


def median_seconds(
    paths: dict[str, Path_],
    rounds: int,
    after: Callable[[str], None] | None = None,
    repeat: int = 1,
    before: Callable[[], None] | None = None,
    cpu: CpuSpent | None = None,
) -> dict[str, float]:
    """Each path's median wall time over ``rounds`` interleaved rounds (every path in turn per
    round, so a busy moment of the machine hits all of them), a round's sample being ``repeat``
    calls (small batches take a millisecond: one call is mostly scheduling noise);
    ``before()`` runs untimed before each sample (a :class:`CacheEvictor`), ``after(name)``
    untimed after each call; ``cpu`` adds up the CPU time of the timed calls."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            if before is not None:
                before()
            spent = 0.0
            for _ in range(repeat):
                used = cpu.sample() if cpu is not None else (0.0, 0.0, 0.0)
                t0 = time.perf_counter()
                fn()
                wall = time.perf_counter() - t0
                spent += wall
                if cpu is not None:
                    cpu.add(name, used, wall)
                if after is not None:
                    after(name)
            times[name].append(spent / repeat)
    return {name: statistics.median(t) for name, t in times.items()}


class LMCacheResp:
    """LMCache 0.5.6's RESPConnector driven without an engine (see lmcache.md)."""

    def __init__(self, host: str, port: int, size: int, batch: int) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.redis_connector import RESPConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        layers, heads, head_size = 4, 4, 128
        tokens = max(1, size // (layers * 2 * heads * head_size * 2))
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=tokens,
            local_cpu=False,
            max_local_cpu_size=max(1.0, 3 * batch * size / 2**30),
            remote_url=f"redis://{host}:{port}",
            remote_serde="naive",
        )
        md = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(layers, 2, tokens, heads, head_size),
            chunk_size=tokens,
        )
        self.backend = LocalCPUBackend(cfg, md)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.conn = RESPConnector(host, port, self.loop, self.backend, num_threads=2)
        self.objs = [self.backend.allocate(md.get_shapes(), md.get_dtypes()) for _ in range(batch)]
        for obj in self.objs:
            obj.tensor.view(torch.uint8).view(-1).copy_(
                torch.frombuffer(bytearray(os.urandom(obj.tensor.nbytes)), dtype=torch.uint8)
            )
        self.nbytes = self.objs[0].tensor.nbytes
        self.keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(batch)]

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def put(self, before: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """``batched_put`` of every value; ``before`` first fills their buffers (flat uint8)."""
        if before is not None:
            before([obj.tensor.view(torch.uint8).view(-1) for obj in self.objs])
        self._run(self.conn.batched_put(self.keys, self.objs))

    def get(self, then: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """``batched_get`` of every value; ``then`` reads them (flat uint8) before they go
        back to LMCache's allocator."""
        got = self._run(self.conn.batched_get(self.keys))
        assert all(g is not None for g in got), "LMCache missed a value"
        if then is not None:
            then([g.tensor.view(torch.uint8).view(-1) for g in got])
        for g in got:
            g.ref_count_down()


def pipelined_set(client: redis.Redis, keys: list[str], values: list[bytes]) -> None:
    """The plain redis-py baseline for writes: one pipeline of ``SET``s of ready-made bytes."""
    pipe = client.pipeline(transaction=False)
    for k, v in zip(keys, values, strict=True):
        pipe.set(k, v)
    pipe.execute()


def pipelined_get_into(client: redis.Redis, keys: list[str], dests: list[torch.Tensor]) -> None:
    """The plain redis-py baseline for reads: one pipeline of ``GET``s, each reply copied into
    its buffer (where kvstore's ``select_into`` lands values)."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    for reply, dest in zip(pipe.execute(), dests, strict=True):
        dest[: len(reply)].copy_(torch.frombuffer(reply, dtype=torch.uint8))


def python_core(path: Path_) -> Path_:
    """``path`` with replies read by the Python path (``KVSTORE_WIRE_CORE=python``) instead of
    the compiled core (``kvstore/net/wire.py``): readers pick their core when made."""

    def run() -> None:
        before = os.environ.get("KVSTORE_WIRE_CORE")
        os.environ["KVSTORE_WIRE_CORE"] = "python"
        try:
            path()
        finally:
            if before is None:
                del os.environ["KVSTORE_WIRE_CORE"]
            else:
                os.environ["KVSTORE_WIRE_CORE"] = before

    return run


def bench_size(
    url: str,
    size: int,
    batch: int,
    rounds: int,
    lmc: bool,
    warm: bool = False,
    cpu: CpuSpent | None = None,
) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    payloads = [os.urandom(size) for _ in range(batch)]
    dests = [torch.empty(size + 4096, dtype=torch.uint8) for _ in range(batch)]
    plain_keys = [f"plain:{i}" for i in range(batch)]
    store = LookupBuffer.from_url(url, namespace="bench", layout={"bench": size})
    hashes = chain_hashes(list(range(batch * 16)), 16)
    tensors = [{"kv": torch.frombuffer(bytearray(p), dtype=torch.bfloat16)} for p in payloads]
    value_bytes = batch * size

    def plain_set() -> None:
        pipelined_set(client, plain_keys, payloads)

    def plain_get_landed() -> None:
        pipelined_get_into(client, plain_keys, dests)

    def bare_depth1(connections: int) -> Path_:
        """One GET in flight per connection, each reply received into its buffer."""

        def part(idx: list[int]) -> None:
            conn = client.connection_pool.get_connection()
            try:
                conn.connect()
                assert conn._sock is not None
                reader = ReplyReader(conn._sock)
                for i in idx:
                    conn.send_packed_command(conn.pack_command("GET", plain_keys[i]))
                    reader.read_bulk_into(memoryview(dests[i].numpy()))
            finally:
                client.connection_pool.release(conn)

        def run() -> None:
            idx = list(range(batch))
            threads = [
                threading.Thread(target=part, args=(idx[c::connections],))
                for c in range(1, connections)
            ]
            for t in threads:
                t.start()
            part(idx[0::connections])
            for t in threads:
                t.join()

        return run

    def bare_sendmsg() -> None:
        """SETs of the raw payloads sent with sendmsg and acknowledged, nothing framed or
        hashed: the ceiling of this way of writing."""
        conn = client.connection_pool.get_connection()
        try:
            conn.connect()
            assert conn._sock is not None
            send_buffers(
                conn._sock,
                [
                    b
                    for k, p in zip(plain_keys, payloads, strict=True)
                    for b in pack_set(k.encode(), [p], None)
                ],
            )
            reader = ReplyReader(conn._sock)
            for _ in plain_keys:
                reader.read_status()
        finally:
            client.connection_pool.release(conn)

    def kv_insert() -> None:
        store.insert_many(list(zip(hashes[:batch], tensors, strict=True)))

    entries, _ = plan_entries(["kv"], torch.bfloat16, [size // 2])
    pieces = [memoryview(t["kv"].view(torch.uint8).numpy()) for t in tensors]  # type: ignore[arg-type]

    def framed() -> list[tuple[str, list[Any]]]:
        """Each value framed (checksummed) around its staged bytes, as the data mover does."""
        return [
            (h, frame_parts(entries, [p], fingerprint=store.fingerprint, block_hash=h))
            for h, p in zip(hashes[:batch], pieces, strict=True)
        ]

    def kv_insert_parts(connections: int) -> Path_:
        """What the data mover does: frame each value and send it from where it lies, over
        ``connections`` connections."""

        def run() -> None:
            store.insert_parts(framed(), connections=connections)

        return run

    def kv_select() -> None:
        got = store.select(hashes[:batch], copy=False)
        assert all(g is not None for g in got), "kvstore missed a value"

    def kv_drop_select() -> None:
        got = store.drop_select(hashes[:batch], copy=False)
        assert all(g is not None for g in got), "kvstore missed a value"

    def kv_select_into(connections: int) -> Path_:
        def run() -> None:
            got = store.select_into(hashes[:batch], dests, connections=connections)
            assert all(g is not None for g in got), "kvstore missed a value"

        return run

    def kv_checksums_alone() -> None:
        """The framing of ``insert_parts x1`` without the send: the checksum of each value,
        read from memory (cold, as staged values are)."""
        framed()

    framed_before = framed()

    def kv_send_framed() -> None:
        """The send of ``insert_parts x1`` without its framing: values framed beforehand."""
        store.insert_parts(framed_before)

    writes: dict[str, Path_] = {
        "redis-py SET": plain_set,
        "bare sendmsg (ceiling)": bare_sendmsg,
        "kvstore insert_many": kv_insert,
        "kvstore insert_parts x1": kv_insert_parts(1),
        "kvstore insert_parts x1, checksums alone": kv_checksums_alone,
        "kvstore insert_parts x1, framed before": kv_send_framed,
        "kvstore insert_parts x2": kv_insert_parts(2),
        "kvstore insert_parts x4": kv_insert_parts(4),
    }
    reads: dict[str, Path_] = {
        "redis-py GET + copy": plain_get_landed,
        "bare recv_into depth 1 x1": bare_depth1(1),
        "bare recv_into depth 1 x2": bare_depth1(2),
        "kvstore select": kv_select,
        "kvstore select_into x1": kv_select_into(1),
        "kvstore select_into x2": kv_select_into(2),
        "kvstore select_into x4": kv_select_into(4),
    }
    if native_available():  # the same reads through the Python path: the core's gain
        for name in ("kvstore select", "kvstore select_into x1", "kvstore select_into x2"):
            reads[f"{name} [python]"] = python_core(reads[name])
    reads["kvstore drop_select"] = kv_drop_select  # last: it takes the values
    if lmc:
        host, port = url.removeprefix("redis://").split("/")[0].split(":")
        resp = LMCacheResp(host, int(port), size, batch)
        assert abs(resp.nbytes - size) <= size // 64, (resp.nbytes, size)
        writes["LMCache resp:// put"] = resp.put
        reads["LMCache resp:// get"] = resp.get
    for fn in writes.values():  # everything readable before the first timed read
        fn()

    def put_back(name: str) -> None:
        if name == "kvstore drop_select":
            kv_insert()  # what it took, for the paths after it

    # a sample moves at least SAMPLE_BYTES, so 64 KiB batches are timed over tens of ms too
    repeat = max(1, -(-SAMPLE_BYTES // value_bytes))
    seconds = median_seconds(
        {**writes, **reads},
        rounds,
        after=put_back,
        repeat=repeat,
        before=None if warm else CacheEvictor(),
        cpu=cpu,
    )
    store.close()
    return {name: value_bytes / t / 1e9 for name, t in seconds.items()}


def sweep_size(
    url: str, size: int, batch: int, rounds: int, warm: bool, cpu: CpuSpent
) -> dict[str, float]:
    """``select_into`` GB/s per (read depth, connections) at one value size, timed as
    :func:`bench_size` times its paths."""
    payloads = [{"kv": torch.frombuffer(bytearray(os.urandom(size)), dtype=torch.uint8)}]
    hashes = chain_hashes(list(range(batch * 16)), 16)
    dests = [torch.empty(size + 4096, dtype=torch.uint8) for _ in range(batch)]
    stores = {
        depth: LookupBuffer.from_url(url, namespace="sweep", read_depth=depth)
        for depth in (1, 2, 3, 4, 16)
    }
    stores[1].insert_many([(h, payloads[0]) for h in hashes[:batch]])

    def read(store: LookupBuffer, conns: int) -> Path_:
        def run() -> None:
            got = store.select_into(hashes[:batch], dests, connections=conns)
            assert all(g is not None for g in got), "kvstore missed a value"

        return run

    paths = {
        f"depth {depth} x{conns}": read(store, conns)
        for depth, store in stores.items()
        for conns in (1, 2, 4)
    }
    repeat = max(1, -(-SAMPLE_BYTES // (batch * size)))
    seconds = median_seconds(
        paths, rounds, repeat=repeat, before=None if warm else CacheEvictor(), cpu=cpu
    )
    for store in stores.values():
        store.close()
    return {name: batch * size / t / 1e9 for name, t in seconds.items()}


def mac_size(url: str, size: int, batch: int, rounds: int, warm: bool, layers: int) -> dict:
    """GB/s of each MAC construction over one value, and of the mover's paths with and
    without a secret, timed as :func:`bench_size` times its paths."""
    import hashlib
    import hmac

    import xxhash

    from kvstore.values.value_auth import ValueKey

    secret = os.urandom(32)
    key = ValueKey(secret, "mac")
    raw_key = os.urandom(32)
    payloads = [os.urandom(size) for _ in range(batch)]
    views = [memoryview(p) for p in payloads]

    def over_all(fn: Callable[[memoryview], object]) -> Path_:
        def run() -> None:
            for v in views:
                fn(v)

        return run

    constructions: dict[str, Path_] = {
        "xxh3_64 (unkeyed, today)": over_all(xxhash.xxh3_64_hexdigest),
        "keyed BLAKE3 (chosen)": over_all(lambda v: key.tag("payload", v)),
        "HMAC-SHA256": over_all(lambda v: hmac.digest(raw_key, v, "sha256")),
        "keyed BLAKE2b": over_all(lambda v: hashlib.blake2b(v, key=raw_key).digest()),
    }
    layer = size // layers
    entries, _ = plan_entries([f"l{i}" for i in range(layers)], torch.uint8, [layer])
    pieces = [[v[i * layer : (i + 1) * layer] for i in range(layers)] for v in views]
    hashes = chain_hashes(list(range(batch * 16)), 16)[:batch]
    dests = [torch.empty(size + 16384, dtype=torch.uint8) for _ in range(batch)]
    stores = {
        "no secret": LookupBuffer.from_url(url, namespace="mac", fingerprint="plain"),
        "secret": LookupBuffer.from_url(url, namespace="mac", fingerprint="signed", secret=secret),
    }

    def write(store: LookupBuffer) -> Path_:
        def run() -> None:
            items = [
                (h, store.frame_parts(entries, p, h)) for h, p in zip(hashes, pieces, strict=True)
            ]
            store.insert_parts(items)

        return run

    def read(store: LookupBuffer) -> Path_:
        def run() -> None:
            got = store.select_into(hashes, dests)
            assert all(g is not None for g in got), "kvstore missed a value"

        return run

    paths = {**constructions}
    for name, store in stores.items():
        paths[f"insert_parts x1, {name}"] = write(store)
    for name, store in stores.items():
        paths[f"select_into x1, {name}"] = read(store)
    for name in stores:
        paths[f"insert_parts x1, {name}"]()  # readable before the first timed read
    repeat = max(1, -(-SAMPLE_BYTES // (batch * size)))
    seconds = median_seconds(paths, rounds, repeat=repeat, before=None if warm else CacheEvictor())
    for store in stores.values():
        store.close()
    return {name: batch * size / t / 1e9 for name, t in seconds.items()}


def machine_name() -> str:
    return f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or 'cpu'})"


def print_table(
    sizes: list[int], names: list[str], cell: Callable[[int, str], str], label: str = "path"
) -> None:
    """A markdown table: a row per name, a column per value size."""
    print(f"| {label} | " + " | ".join(f"{s >> 10} KiB" for s in sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(cell(s, name) for s in sizes) + " |")


def write_results(
    args: argparse.Namespace, machine: str, gbps: dict[int, dict[str, float]], **extra: Any
) -> None:
    """``--json``: the run's settings, GB/s per size and path, and what else the mode adds."""
    doc = {"machine": machine, "batch": args.batch, "rounds": args.rounds, **extra}
    doc["gbps"] = {str(s): r for s, r in gbps.items()}
    args.json.write_text(json.dumps(doc, indent=2))


def print_cpu(cpu: dict[int, CpuSpent], sizes: list[int], names: list[str], batch: int) -> None:
    print(
        "\nCPU ms per GB moved (this process's threads, its time in the kernel in brackets / "
        "redis-server), and the share of the wall time the server was busy: near 100%, the "
        "server bounds the path"
    )
    print_table(sizes, names, lambda s, name: cpu[s].row(name, batch * s))


def plot(results: dict[int, dict[str, float]], names: list[str], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ax.plot([s >> 10 for s in sizes], [results[s][name] for s in sizes], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("value size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256K,1M,2M,8M")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot-dir", type=Path)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="select_into per read depth x connections per size (timed as the main table: "
        "interleaved, caches evicted unless --warm, samples of at least 32 MiB)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="do not evict the CPU caches before each sample (see CacheEvictor)",
    )
    ap.add_argument(
        "--mac",
        action="store_true",
        help="what a namespace secret costs: MAC constructions, and the mover's paths with and "
        "without a secret",
    )
    ap.add_argument("--layers", type=int, default=32, help="tensors per value for --mac")
    args = ap.parse_args(argv)
    if args.mac:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        with RedisServer() as server:
            got = {
                s: mac_size(server.url, s, args.batch, args.rounds, args.warm, args.layers)
                for s in sizes
            }
        machine = machine_name()
        caches = "warm caches" if args.warm else "caches evicted before each sample"
        print(
            f"GB/s (one core for the constructions), median of {args.rounds} interleaved rounds, "
            f"batches of {args.batch}, values of {args.layers} tensors, {caches}; {machine}"
        )
        print_table(sizes, list(got[sizes[0]]), lambda s, name: f"{got[s][name]:.2f}")
        for s in sizes:
            g = got[s]
            print(
                f"{s >> 10} KiB, secret / no secret: insert_parts "
                f"{g['insert_parts x1, secret'] / g['insert_parts x1, no secret']:.2f}x, "
                f"select_into {g['select_into x1, secret'] / g['select_into x1, no secret']:.2f}x"
            )
        if args.json:
            write_results(args, machine, got, layers=args.layers)
        return 0
    if args.sweep:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        cpu: dict[int, CpuSpent] = {}
        rows: dict[int, dict[str, float]] = {}
        with RedisServer() as server:
            for s in sizes:
                cpu[s] = CpuSpent(server.proc.pid if server.proc is not None else None)
                rows[s] = sweep_size(server.url, s, args.batch, args.rounds, args.warm, cpu[s])
        print(f"select_into GB/s, median of {args.rounds} rounds, batches of {args.batch}")
        print_table(
            sizes,
            list(rows[sizes[0]]),
            lambda s, name: f"{rows[s][name]:.2f}",
            "depth x connections",
        )
        print_cpu(cpu, sizes, list(rows[sizes[0]]), args.batch)
        if args.json:
            sweep = {
                str(s): {"gbps": r, "cpu": cpu[s].as_json(args.batch * s)} for s, r in rows.items()
            }
            args.json.write_text(json.dumps(sweep, indent=2))
        return 0
    try:
        import lmcache.v1.storage_backend.connector.redis_connector  # noqa: F401

        lmc = True
    except ImportError:
        lmc = False
        print("LMCache is not importable here: its columns are left out (see lmcache.md)")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results: dict[int, dict[str, float]] = {}
    cpu = {}
    with RedisServer() as server:
        for size in sizes:
            cpu[size] = CpuSpent(server.proc.pid if server.proc is not None else None)
            results[size] = bench_size(
                server.url, size, args.batch, args.rounds, lmc, args.warm, cpu[size]
            )
    machine = machine_name()
    names = list(next(iter(results.values())))
    caches = "warm caches" if args.warm else "caches evicted before each sample"
    print(
        f"GB/s, median of {args.rounds} interleaved rounds, batches of {args.batch}, {caches}; "
        f"{machine}"
    )
    print_table(sizes, names, lambda s, name: f"{results[s][name]:.2f}")
    print_cpu(cpu, sizes, names, args.batch)
    base = {"read": "LMCache resp:// get", "write": "LMCache resp:// put"} if lmc else {}
    best_read = {s: max(v for k, v in results[s].items() if "select_into" in k) for s in sizes}
    bare = {s: max(v for k, v in results[s].items() if "bare recv_into" in k) for s in sizes}
    for s in sizes:
        r = results[s]
        line = (
            f"{s >> 10} KiB reads / bare depth-1 ceiling: select_into {best_read[s] / bare[s]:.2f}"
        )
        line += f", select {r['kvstore select'] / bare[s]:.2f}"
        line += f", drop_select {r['kvstore drop_select'] / bare[s]:.2f}"
        if lmc:
            get = r["LMCache resp:// get"]
            line += f"; / LMCache get: select {r['kvstore select'] / get:.2f}x"
            line += f", drop_select {r['kvstore drop_select'] / get:.2f}x"
        print(line)
    # (the whole write: not its parts measured apart)
    best_write = {
        s: max(v for k, v in results[s].items() if "insert_parts" in k and "," not in k)
        for s in sizes
    }
    for s in sizes:
        line = f"{s >> 10} KiB: select_into (best) / redis-py GET+copy = "
        line += f"{best_read[s] / results[s]['redis-py GET + copy']:.2f}x"
        line += "; insert_parts (best) / redis-py SET = "
        line += f"{best_write[s] / results[s]['redis-py SET']:.2f}x"
        if lmc:
            line += f"; select_into / LMCache get = {best_read[s] / results[s][base['read']]:.2f}x"
            put = results[s][base["write"]]
            line += f"; insert_parts / LMCache put = {best_write[s] / put:.2f}x"
        print(line)
    if args.json:
        cpu_json = {str(s): cpu[s].as_json(args.batch * s) for s in sizes}
        write_results(args, machine, results, caches_evicted=not args.warm, cpu=cpu_json)
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        reads = [n for n in names if "GET" in n or "get" in n or "recv" in n or "select" in n]
        writes = [n for n in names if n not in reads]
        plot(results, reads, f"reads landed in a buffer; {machine}", args.plot_dir / "reads.png")
        plot(results, writes, f"writes; {machine}", args.plot_dir / "writes.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
