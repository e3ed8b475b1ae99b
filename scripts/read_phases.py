"""Where the time of one read goes: receiving, checking, and both as ``select_into`` does them.

One process, one ``redis-server``, 16 stored values per call, interleaved rounds, median GB/s:

- ``receive``: the values' GETs pipelined (``READ_DEPTH`` in flight) on one connection and each
  reply received into its buffer, nothing checked (``wire.ReplyReader``);
- ``check afterwards``: ``codec.decode_value`` over the received batch, as reads did before
  issue 20's third session (by then the first values have left the CPU cache);
- ``select_into``: both, each value checked on the receiving thread as it arrives;
- ``select``: the same into recycled buffers the result owns (``kvstore.net.buffer_pool``).

    python -m scripts.read_phases [--sizes 64K,2M] [--rounds 15]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvstore import LookupBuffer, chain_hashes
from kvstore.net.transport import READ_DEPTH
from kvstore.net.wire import ReplyReader, raw_socket
from kvstore.values.codec import decode_value
from testing.redis_server import RedisServer

from .bench_paths import median_seconds, parse_size

BATCH = 16


def phases(url: str, size: int, rounds: int) -> dict[str, float]:
    store = LookupBuffer.from_url(url, namespace=f"phases{size}")
    hashes = chain_hashes(list(range(BATCH * 16)), 16)[:BATCH]
    blocks = [{"kv": torch.randint(0, 255, (size,), dtype=torch.uint8)} for _ in hashes]
    store.insert_many(list(zip(hashes, blocks, strict=True)))
    dests = [torch.empty(size + 4096, dtype=torch.uint8) for _ in hashes]
    views = [memoryview(d.numpy()).cast("B") for d in dests]  # type: ignore[arg-type]
    keys = store.keys.blocks(hashes)
    client = store.client
    lengths: list[int] = []

    def receive() -> None:
        conn = client.connection_pool.get_connection()
        try:
            conn.connect()
            sock = raw_socket(conn)
            assert sock is not None, "needs a real socket"
            reader = ReplyReader(sock)
            lengths.clear()
            for start in range(0, BATCH, READ_DEPTH):
                window = keys[start : start + READ_DEPTH]
                conn.send_packed_command(conn.pack_commands([("GET", k) for k in window]))
                for i in range(start, start + len(window)):
                    lengths.append(int(reader.read_bulk_into(views[i])))  # type: ignore[arg-type]
        finally:
            client.connection_pool.release(conn)

    def check_afterwards() -> None:
        for h, view, n in zip(hashes, views, lengths, strict=True):
            decode_value(view[:n], fingerprint=store.fingerprint, block_hash=h, copy=False)

    def select_into() -> None:
        assert all(g is not None for g in store.select_into(hashes, dests))

    def select() -> None:
        assert all(g is not None for g in store.select(hashes, copy=False))

    paths: dict[str, Callable[[], None]] = {
        "receive": receive,
        "check afterwards": check_afterwards,
        "select_into": select_into,
        "select": select,
    }
    receive()  # check_afterwards checks what the last receive left
    seconds = median_seconds(paths, rounds)
    store.close()
    return {name: BATCH * size / t / 1e9 for name, t in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64K,256K,2M,8M")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    with RedisServer() as server:
        results = {size: phases(server.url, size, args.rounds) for size in sizes}
    names = list(next(iter(results.values())))
    print(f"GB/s, median of {args.rounds} interleaved rounds, {BATCH} values per call")
    print("| value | " + " | ".join(names) + " | receive then check | select_into / that |")
    print("| --- " * (len(names) + 3) + "|")
    for size, r in results.items():
        serial = 1 / (1 / r["receive"] + 1 / r["check afterwards"])
        cells = " | ".join(f"{r[n]:.2f}" for n in names)
        print(f"| {size >> 10} KiB | {cells} | {serial:.2f} | {r['select_into'] / serial:.2f}x |")


if __name__ == "__main__":
    main()
