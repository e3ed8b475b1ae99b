"""The one read path: ``select``, ``drop_select``, ``select_into`` and the data mover's loads
all claim (when consuming), receive, verify and count here."""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from kvstore.counters import Counters
from kvstore.errors import (
    CorruptValueError,
    InvalidArgumentError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvstore.net.guard import Guard
from kvstore.net.transport import Destination, Transport
from kvstore.net.wire import Oversize
from kvstore.text import printable
from kvstore.values.codec import decode_value
from kvstore.values.drop_select import Claimer
from kvstore.values.value_auth import ValueKey

logger = logging.getLogger("kvstore")

# Connections per server for a public select / drop_select (select_into takes its own).
# Chosen with transport.READ_DEPTH from scripts/bench_paths.py --sweep; see docs/benchmarks.md.
READ_CONNECTIONS = 1


class Checked(NamedTuple):
    """One received value after ``Reader._check``: its tensors (None for a miss or an invalid
    value), its stored bytes, and why it is invalid."""

    tensors: dict[str, torch.Tensor] | None
    nbytes: int
    error: CorruptValueError | None


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
        value_key: ValueKey | None = None,
    ) -> None:
        self._value_key = value_key
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
        deadline: float = math.inf,
    ) -> list[dict[str, torch.Tensor] | None]:
        """Claim (when consuming), receive each value into its view -- or, when ``views`` is
        None, into a new buffer of its own size -- verify, and delete the claims. The returned
        tensors are views on those buffers: no second copy. Each value is verified on the
        thread that received it, as soon as it arrived (``Transport.get_values``' ``each``).
        No value is waited for past ``deadline`` (``time.monotonic()``; a consuming read's
        claim runs as ever, and what it took is given back): ``DeadlinePassedError``."""
        dests: list[Destination] = (
            list(views) if views is not None else [self._max_value_bytes] * len(keys)
        )
        conns = connections or self.connections
        if not consume:
            commands: list[tuple[Any, ...]] = [("GET", k) for k in keys]
            check = self._checker(hashes, dests)
            checked = self._guard.call(
                "GET",
                lambda: self._transport.get_values(
                    commands, dests, conns, check, deadline=deadline
                ),
            )
            return self._tally(keys, checked)
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError(
                "a consuming read takes each block once: its hashes must not repeat"
            )
        fetched: list[Any] | None = None
        if self._claims.reads_in_claim and conns == 1:
            # one round trip: the claim script, then the GETs of the keys it claims
            check_all = self._checker(hashes, dests)

            def claim_and_get(script: tuple[Any, ...], private: list[str]) -> Any:
                gets = [("GET", k) for k in private]
                # (the claim answers a status and a length per key)
                return self._transport.script_then_values(
                    script, gets, dests, check_all, script_items=2 * len(gets), deadline=deadline
                )

            batch, fetched = self._claims.claim_reading(keys, timeout_s, claim_and_get)
        else:
            batch = self._claims.claim(keys, timeout_s)
        targets = [i for i, st in enumerate(batch.statuses) if st == 1]
        claimed = [("GET", k) for k in batch.claim_keys]
        target_dests = [dests[i] for i in targets]
        check_claimed = self._checker([hashes[i] for i in targets], target_dests)

        def fetch() -> list[Any]:
            if not claimed:
                return []
            return self._transport.get_values(
                claimed, target_dests, conns, check_claimed, deadline=deadline
            )

        try:
            if fetched is None:  # claimed alone (a Cluster, several connections, a lost reply)
                try:
                    fetched = self._guard.call("GET", fetch)
                except (StoreUnavailableError, StoreTimeoutError):
                    fetched = self._guard.call("GET", fetch)  # the claims are still there
            raw = batch.raw_values(fetched)  # the claimed keys' entries are checked already
            checked = [
                r if st == 1 else self._check(h, r)
                for h, st, r in zip(hashes, batch.statuses, raw, strict=True)
            ]
            out = self._tally(keys, checked)
        except BaseException:  # nothing was delivered: give the values back (in the
            # background: a hung server must not hold the caller another timeout)
            self._claims.release_later(batch)
            raise
        # a claimed value not received -- its private key moved with a slot being migrated
        # (redirected twice: a miss this time) -- goes back, not deleted: it reached nobody
        # (a review's reshard race lost 47 of 8,788 that way, counted nowhere)
        received = [not (c.tensors is None and c.error is None) for c in fetched]
        if all(received):
            self._claims.finish(batch)
        else:
            self._claims.release_later(batch.only([not r for r in received]))
            self._claims.finish(batch.only(received))
        return out

    def _checker(
        self, hashes: Sequence[str], dests: Sequence[Destination]
    ) -> Callable[[int, Any], Checked]:
        """``Transport.get_values``' ``each`` for replies ``i`` of ``hashes`` landing in
        ``dests``: the reply as ``_check`` takes it, checked."""
        return lambda i, got: self._check(hashes[i], _as_raw(got, dests[i]), _room(dests[i]))

    def _check(self, block_hash: str, value: Any, room: int | None = None) -> Checked:
        """Decode and check one value (``codec.decode_value``): never raises, so it can run on
        a receiving thread; an invalid value comes back as its error. ``room``: the size of the
        buffer the caller gave for it, which bounds what a compressed value may expand to (a
        caller sizes it for the values it expects)."""
        if value is None:
            return Checked(None, 0, None)
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
                block_hash=block_hash,
                max_value_bytes=self._max_value_bytes,
                copy=False,
                value_key=self._value_key,
                max_raw_bytes=room,
            )
        except CorruptValueError as exc:
            return Checked(None, 0, exc)
        except Exception as exc:  # a header decode_value's checks let through: still a bad value
            reason = f"header decodes with {type(exc).__name__}: {exc}"
            return Checked(None, 0, CorruptValueError("not-kvstore", reason))
        return Checked(tensors, len(value), None)

    def _tally(
        self, keys: list[str], checked: list[Checked]
    ) -> list[dict[str, torch.Tensor] | None]:
        """Count the hits, misses and bytes of one read together; an invalid value is a counted
        miss, logged once per key."""
        bad = [(key, c.error) for key, c in zip(keys, checked, strict=True) if c.error is not None]
        hits = sum(1 for c in checked if c.tensors is not None)
        nbytes = sum(c.nbytes for c in checked)
        self._counters.add_reads(hits, len(checked) - hits, nbytes, [e.reason for _, e in bad])
        if bad:
            self.log_bad(bad)
        return [c.tensors for c in checked]

    def log_bad(self, bad: list[tuple[str, CorruptValueError]]) -> None:
        """Warn about each bad value once per key (bounded memory)."""
        for key, err in bad:
            with self._logged_lock:
                first_time = key not in self._logged_bad
                self._logged_bad[key] = None
                if len(self._logged_bad) > _LOGGED_BAD_KEYS:
                    self._logged_bad.popitem(last=False)
            if first_time:
                # the error quotes the value's header (its fingerprint, its block hash): in a
                # namespace without a secret anyone could have written it, newlines included
                logger.warning(
                    "kvstore: ignoring invalid value at %s (%s); counted as a miss. "
                    "Delete it with `redis-cli UNLINK %s` if it keeps appearing.",
                    printable(key),
                    printable(err),
                    printable(key),
                )


def _room(dest: Destination) -> int | None:
    """The size of a caller's buffer; None for a value received into a buffer of its own."""
    return len(dest) if isinstance(dest, memoryview) else None


def _as_raw(got: Any, dest: Destination) -> Any:
    """A received reply as ``Reader._check`` takes it: the value's bytes, None (missing), a length
    (oversize) or -1 (wrong type)."""
    if isinstance(got, Oversize):
        return got.length
    if isinstance(got, int) and isinstance(dest, memoryview) and got >= 0:
        return dest[:got]
    return got  # bytes-like, None or -1
