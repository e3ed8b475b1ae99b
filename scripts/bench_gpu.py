"""The data mover on a GPU: save and load GB/s, the forward-path cost of saving, host-to-
device from pinned staging against the machine's own pinned bandwidth, and the split path: a
layer-by-layer load (``datamover.LayeredLoad``) of the same blocks, when each band of layers
lands, and how long a stand-in forward pass waits before each layer (without compute, and
with each layer computing for as long as the whole load takes per layer: the break-even).

Needs only PyTorch (with CUDA for the GPU figures), redis-py and a ``redis-server`` binary -- no
vLLM. Synthetic paged KV caches of Llama-3-8B geometry (32 layers, 8 KV heads, head size 128,
16-token blocks, bf16: 2 MiB per block). ``--device cpu`` runs the same measurements on the
CPU (a smoke test; the stream figures then mean nothing).

    python -m scripts.bench_gpu --out gpu.json     # on a GPU machine, from the repo root
    python -m scripts.bench_gpu --device cpu --layers 4 --blocks 32   # anywhere

``--masters N`` runs the save and load against an N-master Cluster on loopback instead of one
standalone server; ``--server-io-threads N`` starts the server(s) with N I/O threads (reads too);
``--server`` picks the binary (e.g. a ``valkey-server``); ``--quick`` measures only save and load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from datamover import BlockMover, LayeredLoad, SaveItem
from kvstore import LookupBuffer, chain_hashes
from kvstore.net.wire import WireCore, native_available, wire_core
from testing.redis_server import ClusterServers, RedisServer


@contextlib.contextmanager
def store_servers(masters: int, io_threads: int, binary: str | None) -> Any:
    """The URL of one standalone server (``masters`` 0) or of an N-master Cluster."""
    extra = ["--maxmemory", "0", "--save", "", "--appendonly", "no"]
    if io_threads > 1:
        extra += ["--io-threads", str(io_threads), "--io-threads-do-reads", "yes"]
    if masters:
        with ClusterServers(masters, replicas=0, binary=binary, extra_args=extra) as cluster:
            yield cluster.url
    else:
        with RedisServer(extra_args=extra, binary=binary) as server:
            yield server.url


def make_caches(device: str, layers: int, blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(layers):
        t = torch.empty(blocks, 8, 16, 256, dtype=torch.bfloat16, device=device)
        if fill:
            t.normal_()
        else:
            t.zero_()
        out[f"model.layers.{i}.self_attn"] = t
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pinned_h2d_gbps(nbytes: int, rounds: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def busy_forward(device: str) -> Any:
    """Queue ~100+ ms of GPU work on the current stream, as a forward pass would."""
    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device)
    for _ in range(12):
        a = a @ a
        a /= a.norm()
    return a


def compute_held_ms(
    src: dict[str, torch.Tensor],
    store: LookupBuffer,
    kw: dict[str, Any],
    blocks: int,
    rounds: int,
) -> dict[str, dict[str, float]]:
    """How long the compute stream stays held after ``stage_saves`` of ``blocks`` blocks has
    returned (what a forward pass enqueued right then would wait, on an otherwise idle GPU), per
    number of device scratch chunks (``device_chunks``): a gather waits for the copy that frees
    its scratch, so beyond that many chunks the next forward pass waits for copies to the host
    too."""
    out: dict[str, dict[str, float]] = {}
    for device_chunks in (2, 8, 32):
        mover = BlockMover(src, store, device_chunks=device_chunks, **kw)
        per_n: dict[str, float] = {}
        for n in (16, 64, blocks):
            held = []
            for r in range(rounds):
                hashes = chain_hashes([2000 + r, *range(n * 16 - 1)], 16)
                items = [SaveItem(i, h, i, "bench") for i, h in enumerate(hashes)]
                torch.cuda.synchronize()
                chunks, shed = mover.stage_saves(items)
                returned = time.perf_counter()
                # the compute stream's next work: it runs once the gathers are done
                released = torch.cuda.current_stream().record_event()
                released.synchronize()
                held.append((time.perf_counter() - returned) * 1e3)
                assert not shed, "raise --max-inflight-mib: saves were shed"
                for c in chunks:
                    c.ready.synchronize()
                    mover._save_pool.release(c.host)  # not written: only the hold is measured
            per_n[str(n)] = statistics.median(held)
        out[str(device_chunks)] = per_n
    return out


def layered_load(
    loader: BlockMover,
    dst_ids: list[int],
    hashes: list[str],
    layer_compute_s: float,
    band_bytes: int,
) -> dict[str, Any]:
    """One split load of ``hashes`` into ``dst_ids`` while a stand-in forward pass runs each
    layer for ``layer_compute_s`` after waiting for it (CUDA: the wait, then a sleep standing
    for the layer's kernels); when each band landed, how long each wait held its layer."""
    bands = loader.layer_bands(band_bytes)
    load = LayeredLoad(
        [loader], dst_ids, hashes, bands, time.monotonic() + 120, after=loader.compute_fence()
    )
    runner = threading.Thread(target=load.run)
    t0 = time.perf_counter()
    runner.start()
    waits = []
    for layer in range(len(loader.kv.names)):
        w0 = time.perf_counter()
        assert load.wait(layer), load.error
        waits.append((time.perf_counter() - w0) * 1e3)
        if layer_compute_s:
            time.sleep(layer_compute_s)
    total = time.perf_counter() - t0
    runner.join()
    assert load.finish() == [], "a layered load failed"
    return {
        "bands": len(bands),
        "GBps": load.nbytes / (load.landed_s or total) / 1e9,
        "forward_s": total,
        "band_landed_ms": [round(t * 1e3, 2) for t in load.band_landed_s],
        "wait_ms_per_layer": [round(w, 2) for w in waits],
        "stall_ms": round(load.stall_s * 1e3, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per transfer (256 = 4k tokens)")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-inflight-mib", type=int, default=2048)
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--masters", type=int, default=0, help="N-master Cluster (0: standalone)")
    ap.add_argument("--server-io-threads", type=int, default=1, help="the server's io-threads")
    ap.add_argument("--server", help="server binary (default: redis-server on PATH)")
    ap.add_argument("--quick", action="store_true", help="save and load only")
    ap.add_argument(
        "--read-ahead", type=int, default=1, help="chunks a load receives ahead (read_ahead)"
    )
    ap.add_argument("--chunk-mib", type=int, default=32, help="the data mover's chunk size")
    ap.add_argument(
        "--writers", type=int, default=1, help="threads writing a save's chunks (io_threads)"
    )
    args = ap.parse_args()
    dev = args.device
    total_blocks = args.blocks * 2 + 8
    src = make_caches(dev, args.layers, total_blocks, fill=True)
    dst = make_caches(dev, args.layers, total_blocks, fill=False)
    results: dict[str, Any] = {
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            "torch": torch.__version__,
            # which receiving path read the replies (kvstore/net/wire.py: KVSTORE_WIRE_CORE)
            "wire_core": "native"
            if native_available() and wire_core() is not WireCore.PYTHON
            else "python",
        },
        "geometry": {"layers": args.layers, "kv_heads": 8, "head_size": 128, "block_size": 16},
        "server": {
            "binary": Path(args.server).name if args.server else "redis-server",
            "masters": args.masters,
            "io_threads": args.server_io_threads,
            "connections": args.connections,
        },
        "read_ahead": args.read_ahead,
        "chunk_mib": args.chunk_mib,
        "writers": args.writers,
    }
    with store_servers(args.masters, args.server_io_threads, args.server) as url:
        store = LookupBuffer.from_url(url, namespace="gpu", layout={"bench": "gpu"})
        client = store.client
        kw = {
            "max_inflight_bytes": args.max_inflight_mib << 20,
            "connections": args.connections,
            "chunk_bytes": args.chunk_mib << 20,
        }
        # the loader reads ahead on threads of its own, as the connector's worker does
        prefetch = ThreadPoolExecutor(max(2, args.read_ahead), thread_name_prefix="bench-prefetch")
        # a save's chunks are written on writer threads, as the worker's io_threads write them
        writers = ThreadPoolExecutor(args.writers, thread_name_prefix="bench-writer")
        saver, loader = (
            BlockMover(src, store, **kw),
            BlockMover(dst, store, prefetch=prefetch, read_ahead=args.read_ahead, **kw),
        )
        block_bytes = saver.raw_bytes
        results["block_bytes"] = block_bytes
        results["chunk_blocks"] = saver.chunk_blocks

        # -- save GB/s (stage + write, until Redis acknowledged) and load GB/s, bit-exact
        save_s, load_s, copy_in_s = [], [], []
        for r in range(args.rounds):
            client.flushall()
            hashes = chain_hashes([r, *range(args.blocks * 16 - 1)], 16)
            ids = list(range(args.blocks))
            items = [
                SaveItem(b, h, i, "bench") for i, (b, h) in enumerate(zip(ids, hashes, strict=True))
            ]
            sync(dev)
            t0 = time.perf_counter()
            chunks, shed = saver.stage_saves(items)
            assert not shed, "raise --max-inflight-mib: saves were shed"
            for written in [writers.submit(saver.write, c) for c in chunks]:
                written.result()
            save_s.append(time.perf_counter() - t0)
            dst_ids = [args.blocks + 8 + i for i in ids]
            t0 = time.perf_counter()
            spent_copying = 0.0
            for chunk in loader.receive(dst_ids, hashes, timeout_s=60):
                c0 = time.perf_counter()
                got, _ = chunk.copy_in()
                spent_copying += time.perf_counter() - c0
                assert len(got) == len(chunk.block_ids)
            load_s.append(time.perf_counter() - t0)
            copy_in_s.append(spent_copying)
        for name in src:
            assert torch.equal(dst[name][args.blocks + 8 :], src[name][: args.blocks])
        nbytes = args.blocks * block_bytes
        results["round_trip_bit_exact"] = True
        results["save_GBps"] = nbytes / statistics.median(save_s) / 1e9
        results["load_GBps"] = nbytes / statistics.median(load_s) / 1e9
        results["staging_to_cache_GBps"] = nbytes / statistics.median(copy_in_s) / 1e9
        if dev == "cuda":
            results["pinned_h2d_GBps"] = pinned_h2d_gbps(saver.chunk_blocks * saver.slot_bytes)
            results["staging_to_cache_vs_pinned_h2d"] = (
                results["staging_to_cache_GBps"] / results["pinned_h2d_GBps"]
            )
        if args.quick:
            store.close()
            return report(results, args.out)

        # -- the split path: the same blocks, band by band, a stand-in forward pass waiting
        split: dict[str, Any] = {}
        hashes = chain_hashes([args.rounds - 1, *range(args.blocks * 16 - 1)], 16)
        dst_ids = [args.blocks + 8 + i for i in range(args.blocks)]
        whole_s = statistics.median(load_s)
        for name, per_layer in (("no compute", 0.0), ("break-even", whole_s / args.layers)):
            runs = [
                layered_load(loader, dst_ids, hashes, per_layer, 32 << 10)
                for _ in range(args.rounds)
            ]
            split[name] = min(runs, key=lambda r: r["forward_s"])  # the median is below
            split[name]["forward_s_median"] = statistics.median(r["forward_s"] for r in runs)
        for name in src:
            assert torch.equal(dst[name][args.blocks + 8 :], src[name][: args.blocks])
        split["GBps_vs_whole_load"] = split["no compute"]["GBps"] / results["load_GBps"]
        results["split"] = split

        # -- the forward path: stage_saves while the GPU is busy with a stand-in forward pass
        per_step: dict[str, float] = {}
        for n in (1, 16, 64, args.blocks):
            times = []
            for r in range(args.rounds):
                hashes = chain_hashes([1000 + r, *range(n * 16 - 1)], 16)
                items = [SaveItem(i, h, i, "bench") for i, h in enumerate(hashes)]
                sync(dev)
                busy_forward(dev)
                t0 = time.perf_counter()
                chunks, shed = saver.stage_saves(items)
                times.append(time.perf_counter() - t0)
                for c in chunks:
                    saver.write(c)
            per_step[str(n)] = statistics.median(times) * 1e3
        results["stage_saves_ms_by_blocks"] = per_step
        if dev == "cuda":
            results["compute_held_ms"] = compute_held_ms(src, store, kw, args.blocks, args.rounds)
        store.close()
    return report(results, args.out)


def report(results: dict[str, Any], out: Path | None) -> int:
    print(json.dumps(results, indent=2))
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
