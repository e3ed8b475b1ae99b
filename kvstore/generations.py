"""A namespace's generation: what ``reset`` bumps to invalidate every block at once, in O(1).

A block's name holds the generation it was saved in (``keys.at_generation``): ``<hash>`` in
generation 0 (the names blocks always had), ``<hash>@<n>`` after the n-th reset. A reset is one
atomic increment of ``<prefix>:<namespace>:generation``; readers name the blocks they look up
with the generation they last read, and read the counter with every lookup (in the same round
trip), so an instance sees a reset within one lookup and never looks up an older block again.
Older blocks stay until their TTL, or until ``sweep`` unlinks them, in bounded SCAN batches off
the serving path.

The counter never goes back: a client remembers the highest generation it read, raises the
counter back to it if it reads less (the counter evicted, flushed, or restored from an older
snapshot, maybe by another client that knew less), and bumps from the higher of the two. So
blocks of an older generation can never be named again, and every client converges on the
highest generation any of them knew (with one remembering less, they would otherwise disagree
for good: a consumer ignores every handoff named in a generation other than its own).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from .errors import KVStoreError
from .guard import Guard
from .keys import KeySpace, parse_key
from .transport import Transport

logger = logging.getLogger("kvstore")

SWEEP_BATCH = 1000  # keys per SCAN page and per UNLINK

# max(counter, the caller's floor) + 1, written back: a vanished counter never restarts at 1
BUMP_LUA = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local floor = tonumber(ARGV[1])
if floor > current then current = floor end
current = current + 1
redis.call('SET', KEYS[1], current, 'KEEPTTL')
return current
"""

# max(counter, the caller's floor), written back when the floor is higher: never lowers it
RAISE_LUA = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local floor = tonumber(ARGV[1])
if floor > current then
  redis.call('SET', KEYS[1], floor, 'KEEPTTL')
  return floor
end
return current
"""


def parse_generation(reply: Any) -> int:
    """A counter's GET reply as a generation (a missing or unreadable counter reads 0)."""
    try:
        return max(0, int(reply)) if reply is not None else 0
    except (TypeError, ValueError):
        return 0


class Generations:
    """The generation of one namespace, as this client knows it (thread-safe)."""

    def __init__(self, transport: Transport, guard: Guard, keys: KeySpace) -> None:
        self._transport = transport
        self._guard = guard
        self._keys = keys
        self.key = keys.generation()
        self._known = 0
        self._lock = threading.Lock()
        self._bump_script = transport.control.register_script(BUMP_LUA)
        self._raise_script = transport.control.register_script(RAISE_LUA)
        self._raise_failed = False

    @property
    def known(self) -> int:
        """The highest generation this client has read or made (0 before any)."""
        return self._known

    def observe(self, reply: Any) -> int:
        """Take a GET reply of the counter; returns the generation now known (never lower)."""
        value = parse_generation(reply)
        with self._lock:
            if value > self._known:
                self._known = value
            known = self._known
        if value < known:
            return self._raise(known)
        return known

    def _raise(self, known: int) -> int:
        """The counter reads less than this client knows (vanished, flushed, or put back by a
        client that knew less): raise it (atomically; a later reset wins). A user without
        EVALSHA (the producer's and share mode's ACL rules) can still put back a vanished
        counter (SET NX); a lower one it leaves, keeping its own generation, and says so once:
        it loads nothing named before it, but may disagree with other instances."""
        try:
            value = self._guard.call(
                "EVALSHA", lambda: self._raise_script(keys=[self.key], args=[known])
            )
        except KVStoreError as exc:

            def fill(pipe: Any) -> None:
                pipe.set(self.key, known, nx=True)

            with contextlib.suppress(KVStoreError):
                if self._guard.call("SET", lambda: self._transport.pipeline(fill))[0]:
                    return known
            if not self._raise_failed:
                self._raise_failed = True
                logger.warning(
                    "kvstore: the namespace's generation counter reads less than this client "
                    "knows (%d) and could not be raised (%s): instances may name blocks in "
                    "different generations until the next reset; allow +evalsha "
                    "+script|load for this user",
                    known,
                    exc,
                )
            return known
        with self._lock:
            self._known = max(self._known, parse_generation(value))
            return self._known

    def read(self) -> int:
        """Read the counter (one round trip); the generation now known."""

        def fill(pipe: Any) -> None:
            pipe.get(self.key)

        return self.observe(self._guard.call("GET", lambda: self._transport.pipeline(fill))[0])

    def bump(self) -> int:
        """Start a new generation (atomic, one round trip); returns it."""
        floor = self._known
        new = self._guard.call("EVALSHA", lambda: self._bump_script(keys=[self.key], args=[floor]))
        return self.observe(new)

    def check_script(self, key: str) -> None:
        """Run the bump script on ``key`` (``LookupBuffer.check_access``): it keeps the key's
        TTL, so a probe key still expires. Raises what the server refuses."""
        self._bump_script(keys=[key], args=[0])

    def sweep(self, below: int, stop: Callable[[], bool] = lambda: False) -> int:
        """UNLINK this namespace's blocks (and claimed blocks) of generations before ``below``,
        every fingerprint's, a SCAN page at a time; stops early when ``stop()`` says so.
        Returns how many keys it unlinked."""
        pattern = self._keys.namespace_pattern()
        prefix = self._keys.prefix
        unlinked = 0
        batch: list[str] = []
        scan = self._transport.control.scan_iter(match=pattern, count=SWEEP_BATCH)
        for raw in scan:
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            parsed = parse_key(key, prefix)
            if parsed and parsed.kind in ("block", "claim") and parsed.generation < below:
                batch.append(key)
            if len(batch) >= SWEEP_BATCH:
                unlinked += self._unlink(batch)
                batch = []
                if stop():
                    return unlinked
        return unlinked + self._unlink(batch)

    def _unlink(self, keys: list[str]) -> int:
        return self._guard.call("UNLINK", lambda: self._transport.unlink(keys)) if keys else 0
