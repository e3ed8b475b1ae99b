"""The one read path: ``select``, ``drop_select``, ``select_into`` and the data mover's loads
all claim (when consuming), receive, verify and count here."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from .claims import Claimer
from .codec import decode_value
from .counters import Counters
from .errors import CorruptValueError, StoreTimeoutError, StoreUnavailableError
from .guard import Guard
from .transport import Destination, Transport
from .wire import Oversize

logger = logging.getLogger("kvstore")

# Connections per server for a public select / drop_select (select_into takes its own).
# Chosen with transport.READ_DEPTH from scripts/bench_paths.py --sweep; see docs/benchmarks.md.
READ_CONNECTIONS = 1

# Keys already warned about as invalid: each is logged once (bounded memory).
_LOGGED_BAD_KEYS = 4096


class Reader:
    def __init__(
        self,
        transport: Transport,
        guard: Guard,
        claims: Claimer,
        counters: Counters,
        *,
        fingerprint: str,
        max_value_bytes: int,
        connections: int = READ_CONNECTIONS,
    ) -> None:
        self._transport = transport
        self._guard = guard
        self._claims = claims
        self._counters = counters
        self._fingerprint = fingerprint
        self._max_value_bytes = max_value_bytes
        self.connections = connections
        self._logged_bad: OrderedDict[str, None] = OrderedDict()
        self._logged_lock = threading.Lock()

    def read(
        self,
        hashes: Sequence[str],
        keys: list[str],
        views: list[memoryview] | None,
        *,
        consume: bool,
        timeout_s: float = 0.0,
        connections: int | None = None,
    ) -> list[dict[str, torch.Tensor] | None]:
        """Claim (when consuming), receive each value into its view -- or, when ``views`` is
        None, into a new buffer of its own size -- verify, and delete the claims. The returned
        tensors are views on those buffers: no second copy."""
        dests: list[Destination] = (
            list(views) if views is not None else [self._max_value_bytes] * len(keys)
        )
        conns = connections or self.connections
        if not consume:
            commands: list[tuple[Any, ...]] = [("GET", k) for k in keys]
            received = self._guard.call(
                "GET", lambda: self._transport.get_values(commands, dests, conns)
            )
            raw = [_as_raw(got, dests[i]) for i, got in enumerate(received)]
            return self._verify(hashes, keys, raw)
        batch = self._claims.claim(keys, timeout_s)
        targets = [i for i, st in enumerate(batch.statuses) if st == 1]
        claimed = [("GET", k) for k in batch.claim_keys]
        target_dests = [dests[i] for i in targets]

        def fetch() -> list[Any]:
            return self._transport.get_values(claimed, target_dests, conns) if claimed else []

        try:
            try:
                received = self._guard.call("GET", fetch)
            except (StoreUnavailableError, StoreTimeoutError):
                received = self._guard.call("GET", fetch)  # the claims are still there: once more
            fetched = [_as_raw(got, dests[i]) for i, got in zip(targets, received, strict=True)]
            out = self._verify(hashes, keys, batch.raw_values(fetched))
        except BaseException:  # nothing was delivered: give the values back
            self._claims.release(batch)
            raise
        self._claims.finish(batch)
        return out

    def _verify(
        self, hashes: Sequence[str], keys: list[str], raw: list[Any]
    ) -> list[dict[str, torch.Tensor] | None]:
        """Decode and check each value (``codec.decode_value``); an invalid one is a counted miss,
        logged once per key."""
        out: list[dict[str, torch.Tensor] | None] = []
        hits = misses = nbytes = 0
        bad: list[tuple[str, CorruptValueError]] = []
        for h, key, value in zip(hashes, keys, raw, strict=True):
            if value is None:
                misses += 1
                out.append(None)
                continue
            try:
                if isinstance(value, int):
                    if value < 0:
                        raise CorruptValueError("wrong-type", "the key does not hold a string")
                    raise CorruptValueError(
                        "oversize",
                        f"{value} bytes exceeds max_value_bytes={self._max_value_bytes} "
                        "or the buffer it was read into",
                    )
                _, tensors = decode_value(
                    value,
                    fingerprint=self._fingerprint,
                    block_hash=h,
                    max_value_bytes=self._max_value_bytes,
                    copy=False,
                )
            except CorruptValueError as exc:
                bad.append((key, exc))
                misses += 1
                out.append(None)
                continue
            hits += 1
            nbytes += len(value)
            out.append(tensors)
        self._counters.add_reads(hits, misses, nbytes, [err.reason for _, err in bad])
        if bad:
            self._log_bad(bad)
        return out

    def _log_bad(self, bad: list[tuple[str, CorruptValueError]]) -> None:
        for key, err in bad:
            with self._logged_lock:
                first_time = key not in self._logged_bad
                self._logged_bad[key] = None
                if len(self._logged_bad) > _LOGGED_BAD_KEYS:
                    self._logged_bad.popitem(last=False)
            if first_time:
                logger.warning(
                    "kvstore: ignoring invalid value at %s (%s); counted as a miss. "
                    "Delete it with `redis-cli UNLINK %s` if it keeps appearing.",
                    key,
                    err,
                    key,
                )


def _as_raw(got: Any, dest: Destination) -> Any:
    """A received reply as ``_verify`` takes it: the value's bytes, None (missing), a length
    (oversize) or -1 (wrong type)."""
    if isinstance(got, Oversize):
        return got.length
    if isinstance(got, int) and isinstance(dest, memoryview) and got >= 0:
        return dest[:got]
    return got  # bytes-like, None or -1
