"""How much faster ``select`` became when it stopped zero-filling and copying (issue 20).

One process, one ``redis-server``, interleaved rounds: the public ``select`` as it is now
(each value received into an unfilled buffer that the returned tensors view) against the
reception it replaced (a zero-filled ``bytearray`` per value, then every tensor cloned),
which this script puts back for its "old" rounds. Prints the median GB/s of each and the ratio.

    python -m scripts.ab_select_buffers [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import kvstore.reads as reads
import kvstore.wire as wire
from kvstore import LookupBuffer
from testing.redis_server import RedisServer

_NEW_RECEIVE = wire.ReplyReader.read_bulk_new
_NEW_VERIFY = reads.Reader._verify


def _old_receive(self: wire.ReplyReader, limit: int) -> Any:
    length = self._bulk_header(limit)
    if not isinstance(length, int):
        return length
    dest = bytearray(length)
    self._take(memoryview(dest))
    self._crlf()
    return dest


def _old_verify(self: reads.Reader, hashes: Any, keys: Any, raw: Any) -> Any:
    got = _NEW_VERIFY(self, hashes, keys, raw)  # then each tensor cloned, as decoding did
    return [None if g is None else {n: t.clone() for n, t in g.items()} for g in got]


def _use(old: bool) -> None:
    wire.ReplyReader.read_bulk_new = _old_receive if old else _NEW_RECEIVE  # type: ignore[method-assign]
    reads.Reader._verify = _old_verify if old else _NEW_VERIFY  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with RedisServer() as server, LookupBuffer.from_url(server.url) as buf:
        for size in (64 << 10, 256 << 10, 2 << 20, 8 << 20):
            hashes = [f"ab{size}x{i}" for i in range(16)]
            value = {"kv": torch.ones(size // 2, dtype=torch.float16)}
            buf.insert_many([(h, value) for h in hashes])
            speed: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for old in (True, False):
                    _use(old)
                    start = time.perf_counter()
                    got = buf.select(hashes)
                    elapsed = time.perf_counter() - start
                    assert all(g is not None for g in got)
                    del got
                    speed[old].append(16 * size / elapsed / 1e9)
            _use(False)
            before, now = statistics.median(speed[True]), statistics.median(speed[False])
            print(
                f"{size >> 10:>5} KiB: zero-filled + copied {before:.2f} GB/s, "
                f"unfilled, no copy {now:.2f} GB/s: {now / before:.2f}x"
            )


if __name__ == "__main__":
    main()
