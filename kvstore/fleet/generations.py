"""A namespace's generation: what ``reset`` bumps to invalidate every block at once, in O(1).

A block's name holds the generation it was saved in (``keys.block_name``): ``<hash>`` in
generation 0 (the names blocks always had), ``<hash>@<n>`` after the n-th reset. A reset is one
atomic increment of ``<prefix>:<namespace>:generation``; readers name the blocks they look up
with the generation they last read, and read the counter with every lookup (in the same round
trip), so an instance sees a reset within one lookup and never looks up an older block again.
Older blocks stay until their TTL, or until ``sweep`` unlinks them, in bounded SCAN batches off
the serving path.

The counter never goes back for a client: it remembers the highest generation it read, and
when it reads less (the counter evicted, flushed, restored from an older snapshot -- or lost,
then bumped by a reset made since, which looks the same) it keeps naming blocks by what it
knew. Only a user allowed to write the counter (the admin's ACL rule: resets) changes it:
such a client raises a lower counter to known + 1, never known, so a reset made after the loss
still invalidates every block this client could name, and clients converge on one generation;
the price of a lost counter is one invalidation of the pool. A user that may only read it (a
producer, a consumer) writes nothing: a missing counter reads 0, and it warns once when the
counter reads less than it knows. ``kvstore reset`` heals such a pool.

A counter is a decimal of at most 2**53 (a double holds every integer up to it exactly), read
the same way by the scripts (Lua's numbers are doubles) and by Python; anything else -- text,
"1e1", a number past the bound -- reads 0, and a reset past the bound is refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.errors import KVStoreError, StorePermissionError
from kvstore.net.guard import Guard
from kvstore.net.key_scan import scan_keys
from kvstore.net.server_code import ServerCode, ServerScript
from kvstore.net.transport import Transport
from kvstore.values.keys import KeySpace, parse_key

logger = logging.getLogger("kvstore")

SWEEP_BATCH = 1000  # keys per UNLINK

MAX_GENERATION = 2**53
_MAX_DIGITS = str(MAX_GENERATION).encode()  # 16 digits

# A counter that is not a plain decimal of at most 2**53 reads 0, in Lua as in Python: clients
# must agree on what a counter says. Digits are compared as text (equal lengths compare as
# numbers), never as a double, which would round 2**53 + 1 down into range.
_READ_LUA = f"""
local raw = redis.call('GET', KEYS[1])
local current = 0
if raw and string.match(raw, '^%d+$') and (#raw < {len(_MAX_DIGITS)} or
    (#raw == {len(_MAX_DIGITS)} and raw <= '{_MAX_DIGITS.decode()}')) then
  current = tonumber(raw)
end
"""

_EXHAUSTED = f"""
if current >= {MAX_GENERATION} then
  return redis.error_reply('KVSTORE generation counter at its bound of 2**53: flush the namespace')
end
"""

# The functions run with allow-oom (a reset must work on a full server), so they write nothing
# but a namespace's counter (a tenant's rule reaches no key of that shape: namespaces hold no
# ':'), and only a decimal: a tenant can neither create keys nor grow one through them.
_ONLY_A_COUNTER = """
if #KEYS ~= 1 or #KEYS[1] > 512 or not string.match(KEYS[1], '^[^:]+:[^:]+:generation$') then
  return redis.error_reply('ERR KVSTORE writes only a namespace generation counter')
end
if not ARGV[1] or #ARGV[1] > 16 or not string.match(ARGV[1], '^%d+$') then
  return redis.error_reply('ERR KVSTORE a generation is a decimal of at most 16 digits')
end
"""

# max(counter, the caller's floor) + 1, written back: a vanished counter never restarts at 1
BUMP_LUA = (
    _ONLY_A_COUNTER
    + _READ_LUA
    + """
local floor = tonumber(ARGV[1])
if floor > current then current = floor end
"""
    + _EXHAUSTED
    + """
current = current + 1
redis.call('SET', KEYS[1], current, 'KEEPTTL')
return current
"""
)

# a counter below what the caller knew (ARGV[1]) becomes known + 1; one at or above it stays
RAISE_LUA = (
    _ONLY_A_COUNTER
    + _READ_LUA
    + """
local known = tonumber(ARGV[1])
if current < known then
  current = known
"""
    + _EXHAUSTED
    + """
  current = known + 1
  redis.call('SET', KEYS[1], current, 'KEEPTTL')
end
return current
"""
)

# (allow-oom: a reset writes a few bytes, and is how a full pool is emptied)
BUMP = ServerScript("bump_generation", BUMP_LUA, ("allow-oom",))
RAISE = ServerScript("raise_generation", RAISE_LUA, ("allow-oom",))


def parse_generation(reply: Any) -> int:
    """A counter's GET reply as a generation: a plain decimal of at most 2**53; a missing or
    unreadable counter reads 0 (as the scripts read it)."""
    raw = reply.encode() if isinstance(reply, str) else reply
    if isinstance(raw, (bytes, bytearray)) and raw.isdigit() and raw.isascii():
        width = len(_MAX_DIGITS)
        if len(raw) < width or (len(raw) == width and bytes(raw) <= _MAX_DIGITS):
            return int(raw)
        return 0
    if isinstance(raw, int) and 0 <= raw <= MAX_GENERATION:
        return raw
    return 0


class Generations:
    """The generation of one namespace, as this client knows it (thread-safe)."""

    def __init__(
        self,
        transport: Transport,
        guard: Guard,
        keys: KeySpace,
        code: ServerCode,
        *,
        signed: bool = False,
    ) -> None:
        # a signed namespace (a secret) trusts no missing counter: see observe()
        self._signed = signed
        self._missing_refused: StorePermissionError | None = None  # may not create it
        self._missing = False
        self._transport = transport
        self._guard = guard
        self._keys = keys
        self.key = keys.generation()
        self._known = 0
        self._lock = threading.Lock()
        self._bump_script = code.bind(BUMP, transport.control)
        self._raise_script = code.bind(RAISE, transport.control)
        self._scripts_refused: StorePermissionError | None = None  # may not run the raise
        self._left_below: Any = object()  # a lower counter this client could not raise

    @property
    def known(self) -> int:
        """The highest generation this client has read or made (0 before any)."""
        return self._known

    @property
    def unknown(self) -> bool:
        """A signed namespace's counter was missing at the last reading, and this client could
        not put it back: the generation is not known, so nothing may be loaded (lookups answer
        misses) until the counter is there again (``kvstore reset``)."""
        return self._missing

    def observe(self, reply: Any) -> int:
        """Take a GET reply of the counter; returns the generation now known (never lower)."""
        if reply is None and self._signed:
            return self._counter_missing()
        self._missing = False
        value = parse_generation(reply)
        with self._lock:
            if value > self._known:
                self._known = value
            known = self._known
        if value < known:
            return self._raise(known, reply)
        return known

    def _raise(self, known: int, reply: Any) -> int:
        """The counter reads less than this client knows (or is missing): make it known + 1
        (atomic; a reset made meanwhile wins). A user that may not write the counter (every
        rule but the admin's) keeps its own generation and says so once: it loads nothing
        named before it, but may disagree with other instances until the next reset. Neither
        is tried again for the same reading: a lookup pays no extra round trips for it."""
        if reply == self._left_below:
            return known
        if self._scripts_refused is None:
            try:
                value = self._guard.call(
                    self._raise_script.command,
                    lambda: self._raise_script(keys=[self.key], args=[known]),
                )
            except StorePermissionError as exc:
                self._scripts_refused = exc
            except KVStoreError:
                return known  # Redis failing or slow: counted by the guard; the next read retries
            else:
                return self._adopt(parse_generation(value))
        self._left_below = reply
        logger.warning(
            "kvstore: the namespace's generation counter %s, less than this client knows "
            "(%d), and this user may not raise it (%s): this instance keeps generation %d; "
            "instances may name blocks in different generations until `kvstore reset` (the "
            "admin's ACL rule) makes them agree",
            "is missing" if reply is None else f"reads {reply!r}"[:80],
            known,
            self._scripts_refused,
            known,
        )
        return known

    def _counter_missing(self) -> int:
        """A signed namespace's counter is missing: deleted, flushed or evicted -- or never
        made. Read as 0 it would let a value saved before a reset, put back by whoever deleted
        the counter, load as a verified hit on every instance started since. A user that may
        write the counter makes it again above every generation made before: the time in ms
        (bumps add 1 each, so no earlier generation reached it), never less than known + 1.
        A user that may not loads nothing until the admin does (``kvstore reset``)."""
        if self._missing_refused is None:
            new = max(self._known + 1, int(time.time() * 1000))
            try:
                made = self._guard.call(
                    "SET", lambda: self._transport.control.set(self.key, new, nx=True)
                )
            except StorePermissionError as exc:
                self._missing_refused = exc
                logger.warning(
                    "kvstore: namespace %r is signed and its generation counter %s is missing, "
                    "and this user may not make it again (%s): this instance loads nothing "
                    "until the admin runs `python -m kvstore reset --namespace %s` (a missing "
                    "counter read as 0 would let values from before a reset load again)",
                    self._keys.namespace,
                    self.key,
                    exc,
                    self._keys.namespace,
                )
            except KVStoreError:
                pass  # counted by the guard; the next reading tries again
            else:
                if made:
                    logger.warning(
                        "kvstore: namespace %r's generation counter was missing: made again "
                        "at %d, past every generation before it (blocks named earlier are "
                        "not loaded)",
                        self._keys.namespace,
                        new,
                    )
                    self._missing = False
                    return self._adopt(new)
        self._missing = True  # (made meanwhile by another client: the next reading sees it)
        return self._known

    def _adopt(self, value: int) -> int:
        with self._lock:
            self._known = max(self._known, value)
            return self._known

    def read(self) -> int:
        """Read the counter (one round trip); the generation now known."""

        def fill(pipe: Any) -> None:
            pipe.get(self.key)

        return self.observe(self._guard.call("GET", lambda: self._transport.pipeline(fill))[0])

    def bump(self) -> int:
        """Start a new generation (atomic, one round trip); returns it."""
        floor = self._known
        new = self._guard.call(
            self._bump_script.command, lambda: self._bump_script(keys=[self.key], args=[floor])
        )
        return self.observe(new)

    def check_script(self) -> None:
        """Run the raise script on the counter with nothing known (``check_access``): it
        writes nothing, but the server checks the user may write the key the script declares.
        Raises what the server refuses."""
        self._raise_script(keys=[self.key], args=[0])

    def sweep(self, below: int, stop: Callable[[], bool] = lambda: False) -> int:
        """UNLINK this namespace's blocks (and claimed blocks) of generations before ``below``,
        every fingerprint's, a SCAN page at a time (``key_scan``); stops early when ``stop()``
        says so. Returns how many keys it unlinked."""
        pattern = self._keys.namespace_pattern()
        prefix = self._keys.prefix
        unlinked = 0
        batch: list[str] = []
        # each page through the guard (typed errors, the breaker); a key that is not UTF-8 is
        # none of kvstore's (a planted one stopped every sweep of its namespace: a review)
        for raw in scan_keys(self._transport.control, pattern, call=self._guard.call):
            key = raw.decode(errors="backslashreplace")
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
