"""A namespace's generation: what ``reset`` bumps to invalidate every block at once, in O(1).

A block's name holds the generation it was saved in (``keys.at_generation``): ``<hash>`` in
generation 0 (the names blocks always had), ``<hash>@<n>`` after the n-th reset. A reset is one
atomic increment of ``<prefix>:<namespace>:generation``; readers name the blocks they look up
with the generation they last read, and read the counter with every lookup (in the same round
trip), so an instance sees a reset within one lookup and never looks up an older block again.
Older blocks stay until their TTL, or until ``sweep`` unlinks them, in bounded SCAN batches off
the serving path.

The counter never goes back: a client remembers the highest generation it read, restores the
counter if it vanished (evicted, flushed) and bumps from the higher of the two, so blocks of an
older generation can never be named again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .guard import Guard
from .keys import KeySpace, parse_key
from .transport import Transport

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
        if reply is None and known > 0:
            self._restore(known)
        return known

    def _restore(self, known: int) -> None:
        """The counter vanished while this client knew a later generation: put it back (NX: a
        reset that raced us wins)."""

        def fill(pipe: Any) -> None:
            pipe.set(self.key, known, nx=True)

        self._guard.call("SET", lambda: self._transport.pipeline(fill))

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
