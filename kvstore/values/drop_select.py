"""Exactly-once claims: how ``drop_select`` and ``select_into(consume=True)`` take blocks so that
each stored value reaches one caller, and is never stranded.

A claim renames each present block key to a key private to the claiming call (``keys.claim_key``:
the block's key, the call's random suffix, and the block's key as a hash tag, so on a Cluster it
lives in the block's slot). The caller then reads the private keys and deletes them. On one
server, over one connection, the reads go in the claim's own request
(:meth:`Claimer.claim_reading`): two round trips in all instead of three.

- **Atomic and all-or-nothing per script**: the Lua script checks every key first and changes
  nothing unless it can finish. Every key it touches, block and private, is declared in KEYS, so
  a Cluster routes it correctly and, while a slot migrates, answers ASK / TRYAGAIN *before* the
  script runs: the whole claim is then retried until the migration ends, bounded by the call's
  deadline (at least :data:`MIGRATION_WAIT_S`).
- **TTLs are kept**: ``RENAME`` keeps a key's TTL, and the script sets none, so a block released
  back is exactly as it was stored.
- **Bounded, and nothing stranded**: a claim is over within the caller's wait for keys plus one
  reply timeout (the client's socket timeout). A claim whose reply was lost (a dropped
  connection) is sent again with the same suffix -- the script counts keys that suffix already
  holds as claimed -- only while that bound allows; a claim that timed out is not. The server
  refuses a claim it runs after its caller stopped waiting (ARGV[3], in the server's clock, as
  measured with ``TIME`` in the background: :class:`ServerClock`), so one queued behind
  ``CLIENT PAUSE``, ``DEBUG SLEEP`` or a long script takes nothing. What a failed call may hold
  is given back (:data:`RELEASE_LUA`) on a background thread (:class:`ClaimReleaser`), retried
  for :data:`RELEASE_RETRY_S`, never while the caller waits.
  Private keys are left only by a caller that dies between claiming and deleting, or by a
  server that does not answer for that long (counted and logged); they keep the blocks' TTLs
  and expire with them, and ``kvstore ls`` counts them.

Values never pass through Lua: returning a multi-MiB string from a script costs ~4x a plain GET.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rex

from kvstore.errors import (
    InvalidArgumentError,
    KVStoreError,
    StoreCircuitOpenError,
    StoreCodeError,
    StoreCommandError,
    StorePermissionError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvstore.net.guard import Guard
from kvstore.net.server_code import ScriptMode, ServerCode, ServerScript
from kvstore.net.transport import Transport
from kvstore.values.keys import claim_key

logger = logging.getLogger("kvstore")

# KEYS[1..n]: block keys, KEYS[n+1..2n]: this call's private keys for them. ARGV[1]: max bytes;
# ARGV[2]: "all" (claim nothing unless every key is present; reply nil) or "any"; ARGV[3]: the
# server time (ms) after which the caller no longer waits for the reply: a script run later
# (queued behind CLIENT PAUSE, DEBUG SLEEP or a long script) takes nothing and replies -1.
# Reply: a [status, length] pair per key; status 1 claimed, 0 missing, 2 over the size limit
# (left in place), 3 not a string. A key this call's suffix already holds counts as claimed.
# redis.acl_check_cmd (Redis/Valkey 7+) refuses a forbidden RENAME before anything changed.
# Key names are bounded (allow-oom: a rename to a 40 MB name would grow a full server).
CLAIM_LUA = """
for i = 1, #KEYS do
  if #KEYS[i] > 1024 then return redis.error_reply('ERR KVSTORE a key over 1024 bytes') end
end
local n = #KEYS / 2
local maxlen = tonumber(ARGV[1])
local late = tonumber(ARGV[3])
if late then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > late then return -1 end
end
local out, mine, missing = {}, {}, false
for i = 1, n do
  local len = redis.pcall('STRLEN', KEYS[n + i])
  mine[i] = type(len) == 'number' and len > 0
  if not mine[i] then len = redis.pcall('STRLEN', KEYS[i]) end
  if type(len) == 'table' and len.err then
    if not string.find(tostring(len.err), 'WRONGTYPE', 1, true) then return len end
    out[2 * i - 1] = 3; out[2 * i] = 0
  elseif len == 0 then
    out[2 * i - 1] = 0; out[2 * i] = 0; missing = true
  elseif len > maxlen then
    out[2 * i - 1] = 2; out[2 * i] = len
  else
    out[2 * i - 1] = 1; out[2 * i] = len
  end
end
if missing and ARGV[2] == 'all' then return false end
if redis.acl_check_cmd then
  for i = 1, n do
    if out[2 * i - 1] == 1 and not mine[i]
        and not redis.acl_check_cmd('RENAME', KEYS[i], KEYS[n + i]) then
      return redis.error_reply('NOPERM this user has no permissions to run the RENAME command')
    end
  end
end
for i = 1, n do
  if out[2 * i - 1] == 1 and not mine[i] then redis.call('RENAME', KEYS[i], KEYS[n + i]) end
end
return out
"""
# (allow-oom: a claim only renames, and a full server must still let consumers take -- and so
# free -- what was handed to them)
CLAIM = ServerScript("claim", CLAIM_LUA, ("allow-oom",))

# Gives claimed values back (same KEYS layout): a private key goes back to its block's key,
# unless a new value was stored there meanwhile (then the newer one stays). Reply: how many.
RELEASE_LUA = """
for i = 1, #KEYS do
  if #KEYS[i] > 1024 then return redis.error_reply('ERR KVSTORE a key over 1024 bytes') end
end
local n = #KEYS / 2
local released = 0
for i = 1, n do
  if redis.call('EXISTS', KEYS[n + i]) == 1 then
    if redis.call('EXISTS', KEYS[i]) == 1 then
      redis.call('UNLINK', KEYS[n + i])
    else
      redis.call('RENAME', KEYS[n + i], KEYS[i]); released = released + 1
    end
  end
end
return released
"""
RELEASE = ServerScript("release", RELEASE_LUA, ("allow-oom",))

# How long a claim keeps retrying a slot that is migrating, when the caller gave no longer
# deadline: a migration of a slot of KV blocks takes about a second per GB moved.
MIGRATION_WAIT_S = 2.0

# A claim the server may run this long before its caller stops waiting is still sent: the reply
# must travel back (and the clock offset is measured to within a round trip)
_LATE_MARGIN_S = 0.05
# the server's clock is read again this often (the offset drifts)
_CLOCK_EVERY_S = 60.0
# claims given back in the background are retried this long (then they expire with their TTL)
RELEASE_RETRY_S = 60.0

# A waiting claim polls after 0.5 ms, doubling up to 20 ms.
_FIRST_POLL_S = 0.0005
_MAX_POLL_S = 0.02

# What redis-py's cluster client raises when a slot stays mid-migration for its whole
# redirect budget ("TTL exhausted") or the slot is not served at the moment.
_MIGRATING = (rex.TryAgainError, rex.AskError, rex.ClusterError, rex.SlotNotCoveredError)


class _TooLate(StoreTimeoutError):
    """The server ran the claim after its caller had stopped waiting for it: nothing taken."""


class _StillMigrating(StoreUnavailableError):
    """A slot stayed mid-migration past the claim's bound: sending the claim again now would
    only wait again."""


def _deadline(timeout_s: float) -> float:
    if timeout_s < 0:
        raise InvalidArgumentError(f"timeout_s must be >= 0, got {timeout_s}")
    return time.monotonic() + timeout_s


def _everything(keys: list[str], suffix: str) -> ClaimedBatch:
    """A batch naming every key as claimed by ``suffix``: what to give back when it is not
    known which of them the claim took."""
    return ClaimedBatch(keys, suffix, [1] * len(keys), [0] * len(keys))


def _pause(delay: float, deadline: float) -> float:
    """Sleep ``delay`` (never past ``deadline``); the next poll's delay."""
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 2, _MAX_POLL_S)


# a claim's status of a key: 1 claimed, 0 missing, 2 oversize, 3 wrong type (CLAIM_LUA)
_STATUSES = frozenset({0, 1, 2, 3})


def claim_statuses(reply: object, keys: int, safe_url: str) -> tuple[list[int], list[int]]:
    """A claim's table as (statuses, lengths): two integers per key, a known status and a
    length that is not negative. Any other reply -- a server that is not Redis, or a script not
    ours under its name -- fails the call typed (it was an ``AssertionError``, or ``zip``'s
    ``ValueError``: a review's)."""
    if (
        not isinstance(reply, list)
        or len(reply) != 2 * keys
        or not all(type(v) is int for v in reply)
        or not all(st in _STATUSES for st in reply[0::2])
        or any(n < 0 for n in reply[1::2])
    ):
        shown = repr(reply)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise StoreCommandError(
            f"{safe_url} answered a claim with {shown}, not a status and a length for each of "
            f"its {keys} key(s): check that the URL names a Redis/Valkey server and that no "
            "other script was loaded under kvstore's names"
        )
    return reply[0::2], reply[1::2]


@dataclass(frozen=True)
class ClaimedBatch:
    """What one claim took: per block key a status (1 claimed, 0 missing, 2 oversize, 3 wrong
    type) and length, and the private keys now holding the claimed values, in key order."""

    keys: list[str]
    suffix: str
    statuses: list[int]
    lengths: list[int]

    @property
    def claim_keys(self) -> list[str]:
        return [
            claim_key(k, self.suffix)
            for k, st in zip(self.keys, self.statuses, strict=True)
            if st == 1
        ]

    def only(self, kept: Sequence[bool]) -> ClaimedBatch:
        """The same claim holding only the claimed keys ``kept`` names (one flag per claimed
        key, in order): what to finish, or to give back, of it."""
        flags = iter(kept)
        chosen = [
            (k, n)
            for k, st, n in zip(self.keys, self.statuses, self.lengths, strict=True)
            if st == 1 and next(flags)
        ]
        return ClaimedBatch(
            [k for k, _ in chosen], self.suffix, [1] * len(chosen), [n for _, n in chosen]
        )

    def raw_values(self, fetched: Sequence[Any]) -> list[Any]:
        """Per key, what the decoder takes: a claimed key's fetched value, a length (oversize),
        -1 (wrong type) or None (missing)."""
        values = iter(fetched)
        raw: list[Any] = []
        for status, length in zip(self.statuses, self.lengths, strict=True):
            if status == 1:
                raw.append(next(values))
            elif status == 2:
                raw.append(int(length))
            elif status == 3:
                raw.append(-1)
            else:
                raw.append(None)
        return raw


class ServerClock:
    """The server's clock as claims need it: the offset from this host's ``time.time()``,
    measured with ``TIME`` (shared by a buffer and its views). Read in the background, never
    on a claim's path: until the first reading claims go without a limit."""

    def __init__(self, read: Callable[[], float]) -> None:
        self._read = read  # the offset now (raises KVStoreError)
        self.offset_s: float | None = None
        self._read_at = float("-inf")
        self._reading = threading.Lock()
        self._closed = False
        self.disagrees = 0  # calls whose "too late" came back in time, in a row

    def read_now(self) -> None:
        """Measure the offset now (a failure keeps the last one, or none; none once closed)."""
        with self._reading:
            if self._closed:
                return
            self._read_at = time.time()
            with contextlib.suppress(KVStoreError):
                self.offset_s = self._read()

    def _read_in_background(self) -> None:
        try:
            self.read_now()
        except Exception:  # not the store's error: reported here, not lost with the thread
            logger.warning(
                "kvstore: reading the server's clock failed unexpectedly; the last offset "
                "stays (claims go without a time limit until one is known)",
                exc_info=True,
            )

    def close(self, wait_s: float) -> None:
        """No readings from now on, and none still running when this returns: one under way
        is waited for, up to ``wait_s`` (a client without a socket timeout, on a hung server,
        could hold it for ever: it is then logged and left). Called before the connections
        close: a reading on a closing client would break inside redis-py, or open a
        connection again after the close."""
        self._closed = True  # (a reading not yet started sees it under the lock and returns)
        if not self._reading.acquire(timeout=wait_s):
            logger.warning(
                "kvstore: a reading of the server's clock still runs after %.1fs; closing "
                "without waiting for it",
                wait_s,
            )
            return
        self._reading.release()

    def late_ms(self, reply_timeout_s: float) -> str:
        """ARGV[3] of a claim sent now: the server time (ms) past which it must take nothing
        -- when its caller stops waiting for the reply, less a margin -- or "" (no limit) while
        the clock is unknown or does not agree with replies."""
        now = time.time()
        if now - self._read_at > _CLOCK_EVERY_S and not self._reading.locked() and not self._closed:
            self._read_at = now
            threading.Thread(
                target=self._read_in_background, name="kvstore-clock", daemon=True
            ).start()
        offset = self.offset_s
        if offset is None or self.disagrees >= 2:
            return ""
        return str(int((now + offset + reply_timeout_s - _LATE_MARGIN_S) * 1000))

    def accepted(self) -> None:
        """A claim sent with a limit was run in time: the clocks agree."""
        self.disagrees = 0

    def late_in_time(self, safe_url: str) -> None:
        """One call's claim answered "too late" before its caller stopped waiting: the
        server's clock runs ahead of the offset measured. Measured again; two calls in a row,
        and claims go without the limit (one run after its caller gave up is then given
        back, not refused)."""
        self.read_now()
        self.disagrees += 1
        if self.disagrees == 2:
            logger.warning(
                "kvstore: %s's clock does not agree with its replies; claims are sent without "
                "a time limit (one run after its caller gave up is given back)",
                safe_url,
            )


class ClaimReleaser:
    """Gives claimed blocks back on a thread of its own (shared by a buffer and its views),
    retried with backoff for up to :data:`RELEASE_RETRY_S`: a hung or paused server holds that
    thread, not the caller. Each outcome is logged and counted (``on_given_back(given back,
    stranded)``)."""

    def __init__(self, on_given_back: Callable[[int, int], None]) -> None:
        self._on_given_back = on_given_back
        self._queue: queue.SimpleQueue[tuple[Callable[[], int], int, float] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = threading.Event()

    def submit(self, release: Callable[[], int], keys: int) -> None:
        """``release()`` gives ``keys`` block keys back (how many it did; raises on failure)."""
        with self._idle:
            if self._closed.is_set():
                self._on_given_back(0, keys)
                logger.warning("kvstore: %d claimed block(s) not given back: closed", keys)
                return
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvstore-claim-release", daemon=True
                )
                self._thread.start()
        self._queue.put((release, keys, time.monotonic() + RELEASE_RETRY_S))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            release, keys, until = item
            try:
                self._give_back(release, keys, until)
            except Exception:  # never lose the thread: the next batches still go back
                # (and what this batch held is counted: a reply that is not a number raised
                # ValueError here, and the blocks were neither given back nor stranded)
                self._on_given_back(0, keys)
                logger.exception(
                    "kvstore: giving %d claimed block(s) back failed; any there stay under "
                    "claim keys and expire with their TTLs",
                    keys,
                )
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _give_back(self, release: Callable[[], int], keys: int, until: float) -> None:
        delay = 0.05
        while True:
            try:
                released = release()
            except KVStoreError as exc:
                if time.monotonic() + delay >= until or self._closed.is_set():
                    self._on_given_back(0, keys)
                    logger.warning(
                        "kvstore: could not give up to %d claimed block(s) back (%s); any "
                        "there stay under claim keys (kvstore ls counts them) and expire with "
                        "their TTLs",
                        keys,
                        exc,
                    )
                    return
                self._closed.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            self._on_given_back(released, 0)
            if released:
                logger.info("kvstore: gave %d claimed block(s) back", released)
            return

    def wait(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for what is pending, then stop: a give-back still failing is given
        up on (counted as stranded) instead of retried against a closed buffer."""
        self.wait(timeout_s)
        self._closed.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)


class Claimer:
    """Claims, releases and finishes batches of block keys (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        guard: Guard,
        *,
        exists: Callable[[Sequence[str]], list[int]],
        max_value_bytes: int,
        on_retry: Callable[[], None],
        releaser: ClaimReleaser,
        clock: ServerClock,
        code: ServerCode,
    ) -> None:
        self._transport = transport
        self._client = client = transport.client
        self._shards = transport.shards
        self._guard = guard
        self._exists = exists
        self._max_value_bytes = max_value_bytes
        self._on_retry = on_retry
        self._code = code
        self._claim_script = code.bind(CLAIM, client)
        self._release_script = code.bind(RELEASE, client)
        # how long a caller waits for a claim's reply (the client's socket timeout): a call
        # claims within it (plus its own wait for keys), and a claim the server runs later
        # takes nothing (CLAIM_LUA's ARGV[3], in the server's clock)
        kwargs: dict[str, Any] = getattr(client, "get_connection_kwargs", dict)() or {}
        self.reply_timeout_s = float(kwargs.get("socket_timeout") or 10.0)
        # shared by a buffer and its views: the server's clock, and the thread giving claims
        # back after their call failed (the caller is not held another timeout)
        self.clock = clock
        self.releaser = releaser

    # ------------------------------------------------------------------ claim
    @property
    def reads_in_claim(self) -> bool:
        """Whether :meth:`claim_reading` can serve (one server: a Cluster claims per slot)."""
        return not self._shards.cluster

    def claim(self, keys: list[str], timeout_s: float = 0.0) -> ClaimedBatch:
        """Claim the present ``keys`` for one caller. With ``timeout_s > 0`` wait (polling with
        backoff) until every key is present; when the time runs out take what is there. A lost
        reply is recovered by sending the claim again while the call's bound allows
        (``timeout_s`` plus one reply timeout); if that fails, whatever the claim took is given
        back in the background (:meth:`release_later`) and the error is raised at once."""
        return self._claim(keys, _deadline(timeout_s), uuid.uuid4().hex)

    def _claim(self, keys: list[str], deadline: float, suffix: str) -> ClaimedBatch:
        try:
            statuses, lengths = self._claim_all(keys, deadline, suffix)
        except (StoreTimeoutError, StoreUnavailableError) as first:
            if isinstance(first, StoreCircuitOpenError):
                raise  # nothing was sent
            if isinstance(first, _StillMigrating):
                raise  # what the other slots took is given back (``_claim_per_slot``)
            return self._claim_again(keys, deadline, suffix, first)
        except BaseException as exc:  # any other error: other slots' claims may have run
            if not self._took_nothing(exc):
                self.release_later(_everything(keys, suffix))
            raise
        return ClaimedBatch(keys, suffix, statuses, lengths)

    def _took_nothing(self, exc: BaseException) -> bool:
        """A claim sent alone that one server refused took nothing: the function never ran
        (NOPERM on FCALL, a library not this release's) or refused before its first rename (a
        NOPERM inside). On a Cluster other slots' claims may have run; in
        :meth:`claim_reading` the refusal may be a read's, after the claim ran."""
        return not self._shards.cluster and isinstance(exc, (StorePermissionError, StoreCodeError))

    def claim_reading(
        self,
        keys: list[str],
        timeout_s: float,
        read: Callable[[tuple[Any, ...], list[str]], tuple[list[int] | None, list[Any]]],
    ) -> tuple[ClaimedBatch, list[Any] | None]:
        """Claim as :meth:`claim` does, and read the claimed values in the same round trip (one
        server only: :attr:`reads_in_claim`). ``read(script, private_keys)`` sends the claim
        script, then a ``GET`` of every key's private key -- the server runs them after the
        script; a key not claimed answers nil -- and returns the script's reply and the GETs'.

        Returns the batch and the claimed keys' replies, in key order. When the round trip
        fails (the script may have run and its reply been lost), the claim is sent again alone
        with the same suffix, which counts what the first took as claimed, and the replies are
        None: the caller reads the private keys as after :meth:`claim`. If that fails too,
        whatever was taken is given back before the error is raised. A claim that must wait
        for keys not stored yet (``timeout_s``) polls with the script alone, and its replies
        are None too."""
        deadline = _deadline(timeout_s)
        suffix = uuid.uuid4().hex
        private = [claim_key(k, suffix) for k in keys]
        scripted = [*keys, *private]

        def round_trip(mode: str) -> tuple[list[int] | int | None, list[Any]]:
            lua = self._code.mode(self._client)
            args = (self._max_value_bytes, mode, self._late_ms())
            try:
                return read(self._claim_script.command_args(scripted, args, lua), private)
            except rex.NoPermissionError as exc:
                error = self._code.refused(exc, self._client)
                if error is not None:
                    raise error from None
                # an EVALSHA refused took nothing: granted +fcall since, the same as FCALL
                functions = ScriptMode.FUNCTIONS
                return read(self._claim_script.command_args(scripted, args, functions), private)
            except rex.ResponseError as exc:
                # the server lost its code (a restart, SCRIPT FLUSH): nothing ran, so the same
                # again once it is back
                if not self._claim_script.recover(exc):
                    raise
                return read(self._claim_script.command_args(scripted, args), private)

        try:
            mode = "all" if time.monotonic() < deadline else "any"
            sent = time.monotonic()
            reply, got = self._guard.call(
                self._claim_script.command, functools.partial(round_trip, mode)
            )
        except (StoreTimeoutError, StoreUnavailableError) as first:
            if isinstance(first, StoreCircuitOpenError):
                raise  # nothing was sent
            return self._claim_again(keys, deadline, suffix, first), None
        except BaseException:  # (the claim may have run: a read after it may be what failed)
            self.release_later(_everything(keys, suffix))
            raise
        if reply == -1:  # "too late" came back in time: the clocks disagree (nothing taken)
            self._late_reply_in_time(sent)
            return self._claim(keys, deadline, suffix), None
        if reply is None:  # waiting for keys not there yet (nothing was claimed): the polls
            # that follow carry the script alone, and what it takes is read as after claim()
            return self._claim(keys, deadline, suffix), None
        try:
            statuses, lengths = claim_statuses(reply, len(keys), self._guard.safe_url)
        except StoreCommandError:  # (whatever it may have taken goes back)
            self.release_later(_everything(keys, suffix))
            raise
        self.clock.accepted()
        claimed = [r for r, st in zip(got, statuses, strict=True) if st == 1]
        return ClaimedBatch(keys, suffix, statuses, lengths), claimed

    def _claim_again(
        self, keys: list[str], deadline: float, suffix: str, first: KVStoreError
    ) -> ClaimedBatch:
        """After a claim whose reply was lost: the same suffix again recovers what it took (and
        claims the rest), if the call's bound -- its wait for keys plus one reply timeout --
        leaves room; if not, or that fails too, everything the suffix holds is given back in
        the background and the error raised."""
        if time.monotonic() >= deadline + self.reply_timeout_s:
            self.release_later(_everything(keys, suffix))
            raise first
        logger.info("kvstore: claim sent again after %s", first)
        self._on_retry()
        try:
            statuses, lengths = self._claim_all(keys, deadline, suffix)
        except BaseException:
            self.release_later(_everything(keys, suffix))
            raise
        return ClaimedBatch(keys, suffix, statuses, lengths)

    # ------------------------------------------------------------------ the server's clock
    def _late_ms(self) -> str:
        return self.clock.late_ms(self.reply_timeout_s)

    def server_offset(self) -> float:
        """This host's ``time.time()`` to the server's, now (one ``TIME`` round trip)."""
        return float(self._guard.call("TIME", self._server_offset))

    def _server_offset(self) -> float:
        t0 = time.time()
        try:
            # (redis-py converts the reply to two ints: a malformed one raises there)
            reply = self._client.time()
            t1 = time.time()
            if isinstance(reply, dict):  # a Cluster answers per node: any master's clock
                reply = next(iter(reply.values()))
            seconds, micros = reply
            offset = float(seconds) + float(micros) / 1e6 - (t0 + t1) / 2
        except (TypeError, ValueError, IndexError, OverflowError, StopIteration):
            offset = math.nan
        if not math.isfinite(offset):
            # (a KVStoreError: the clock keeps its last reading; it was a ValueError, which
            # went up through a claim whose "too late" made it read the clock: a review's)
            raise StoreCommandError(
                f"{self._guard.safe_url} answered TIME with something other than two numbers: "
                "check that the URL names a Redis/Valkey server"
            )
        return offset

    def _late_reply_in_time(self, sent: float) -> None:
        """A claim answered "too late": if it came back before its caller stopped waiting,
        the clocks disagree (``ServerClock.late_in_time``); otherwise it really ran late."""
        self._on_retry()
        if time.monotonic() - sent < self.reply_timeout_s - _LATE_MARGIN_S:
            self.clock.late_in_time(self._guard.safe_url)

    def _claim_all(
        self, keys: list[str], deadline: float, suffix: str
    ) -> tuple[list[int], list[int]]:
        if self._shards.cluster:
            return self._claim_per_slot(keys, deadline, suffix)
        delay = _FIRST_POLL_S
        scripted = [*keys, *(claim_key(k, suffix) for k in keys)]
        while True:
            waiting = time.monotonic() < deadline
            args = [self._max_value_bytes, "all" if waiting else "any", self._late_ms()]
            sent = time.monotonic()
            reply = self._guard.call(
                self._claim_script.command,
                functools.partial(self._claim_script, keys=scripted, args=args),
            )
            if reply == -1:
                self._late_reply_in_time(sent)
                if time.monotonic() >= deadline + self.reply_timeout_s:
                    raise _TooLate(f"{self._guard.safe_url}: the claim ran too late")
                continue
            if reply is not None:
                statuses = claim_statuses(reply, len(keys), self._guard.safe_url)
                self.clock.accepted()
                return statuses
            delay = _pause(delay, deadline)

    def _claim_per_slot(
        self, keys: list[str], deadline: float, suffix: str
    ) -> tuple[list[int], list[int]]:
        """On a Cluster: one script per slot (a script may touch one slot), pipelined per master
        with the masters in parallel. Each key is still claimed exactly once, but a batch is not
        claimed all-or-nothing across slots: waiting for every key polls ``EXISTS`` first."""
        delay = _FIRST_POLL_S
        while time.monotonic() < deadline and not all(self._exists(keys)):
            delay = _pause(delay, deadline)
        by_slot: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            by_slot.setdefault(self._shards.slot(k), []).append(i)
        groups = [[keys[i] for i in idx] for idx in by_slot.values()]

        def args() -> list[int | str]:
            return [self._max_value_bytes, "any", self._late_ms()]

        def scripted(group: list[str]) -> list[str]:
            return [*group, *(claim_key(k, suffix) for k in group)]

        def on_one_master(server: redis.Redis, part: list[list[str]]) -> list[Any]:
            pipe = server.pipeline(transaction=False)
            for group in part:
                self._claim_script(keys=scripted(group), args=args(), client=pipe)
            return list(pipe.execute(raise_on_error=False))

        def claim_group(n: int, reply: Any, sent: float) -> Any:
            if isinstance(reply, Exception) and self._claim_script.recover(reply):
                # that master lost the code (nothing ran there): the group again, directly
                reply = self._claim_script(
                    keys=scripted(groups[n]), args=args(), client=self._client
                )
            if reply == -1:  # "too late" in time: this master's clock runs ahead
                if not late_seen:  # (counted once per call, however many slots)
                    late_seen.append(True)
                    self._late_reply_in_time(sent)
                reply = self._claim_script(
                    keys=scripted(groups[n]), args=args(), client=self._client
                )
                if reply == -1:
                    raise _TooLate(f"{self._guard.safe_url}: the claim ran too late")
            if isinstance(reply, Exception) and isinstance(reply, _MIGRATING):
                # the slot moved or is moving: the whole group again, through redis-py's
                # cluster client (it follows MOVED / ASK), until the migration ends -- one
                # bound for the call, however many of its slots move (a review's four
                # migrating slots waited four bounds: 6.8 s for 3)
                if not migrating_until:
                    migrating_until.append(max(deadline, time.monotonic() + MIGRATION_WAIT_S))
                reply = self._claim_migrating(scripted(groups[n]), args, migrating_until[0])
            if isinstance(reply, Exception):
                raise reply
            return claim_statuses(reply, len(groups[n]), self._guard.safe_url)

        late_seen: list[bool] = []
        migrating_until: list[float] = []  # (set by the first slot found moving)

        def claim_groups() -> list[Any]:
            sent = time.monotonic()
            replies = self._shards.fan_out(on_one_master, groups, key=lambda g: g[0])
            try:
                for n, reply in enumerate(replies):
                    replies[n] = claim_group(n, reply, sent)
            except _StillMigrating:
                # the migrating slot's script never ran (a Cluster answers ASK / TRYAGAIN
                # first): only the slots that answered took anything, and go back (a table
                # not read yet, or read: its statuses and lengths)
                took = [k for g, r in zip(groups, replies, strict=True)
                        if isinstance(r, list | tuple) for k in g]  # fmt: skip
                if took:
                    self.release_later(_everything(took, suffix))
                raise
            if not late_seen:
                self.clock.accepted()
            return replies

        replies = self._guard.call(self._claim_script.command, claim_groups)
        statuses, lengths = [0] * len(keys), [0] * len(keys)
        for idx, (group_statuses, group_lengths) in zip(by_slot.values(), replies, strict=True):
            for j, i in enumerate(idx):
                statuses[i], lengths[i] = group_statuses[j], group_lengths[j]
        return statuses, lengths

    def _claim_migrating(
        self, scripted: list[str], args: Callable[[], list[Any]], until: float
    ) -> Any:
        delay = _FIRST_POLL_S
        while True:
            self._on_retry()
            try:
                reply = self._claim_script(keys=scripted, args=args(), client=self._client)
                if reply == -1:
                    raise _TooLate(f"{self._guard.safe_url}: the claim ran too late")
                return reply
            except _MIGRATING as exc:
                if time.monotonic() >= until:
                    raise _StillMigrating(
                        f"{self._guard.safe_url}: slot {self._shards.slot(scripted[0])} is "
                        f"still migrating ({exc}); its blocks are left in place, untouched"
                    ) from None
            delay = _pause(delay, until)

    def check_scripts(self, key: str) -> None:
        """Claim ``key`` and give it back, raising what the server refuses (for
        ``LookupBuffer.check_access``)."""
        scripted = [key, claim_key(key, uuid.uuid4().hex)]
        late = self.server_offset() + time.time() + 60  # (TIME, here and in the script)
        self._claim_script(keys=scripted, args=[self._max_value_bytes, "any", int(late * 1000)])
        self._release_script(keys=scripted)

    # ------------------------------------------------------------------ after the read
    def finish(self, batch: ClaimedBatch) -> None:
        """Delete the private keys once their values were delivered (best effort: if this
        fails, they expire with the blocks' TTLs)."""
        claimed = batch.claim_keys
        if not claimed:
            return
        try:
            self._guard.call("UNLINK", lambda: self._transport.unlink(claimed))
        except KVStoreError as exc:
            logger.warning("kvstore: could not delete claimed keys (they expire): %s", exc)

    def release(self, batch: ClaimedBatch) -> int:
        """Give what ``batch`` holds back to the blocks' keys (their TTLs as stored), now;
        returns how many, or raises the first failure (slots that answered are given back)."""
        groups: dict[int, list[str]] = {}
        for k in batch.keys:
            groups.setdefault(self._shards.slot(k), []).append(k)
        released, failed = 0, list[KVStoreError]()
        for group in groups.values():  # each slot on its own: one that is moving fails alone
            scripted = [*group, *(claim_key(k, batch.suffix) for k in group)]
            try:  # sent even while the breaker is open: the failure may be what opened it
                released += int(
                    self._guard.call_anyway(
                        self._release_script.command,
                        functools.partial(self._release_script, keys=scripted),
                    )
                )
            except StoreTimeoutError as exc:
                failed.append(exc)
                break  # a hung server: not one timeout per slot
            except KVStoreError as exc:
                failed.append(exc)
        if failed:
            raise failed[0]
        return released

    def release_later(self, batch: ClaimedBatch) -> None:
        """Give ``batch`` back on the releaser's thread (:class:`ClaimReleaser`)."""
        self.releaser.submit(functools.partial(self.release, batch), len(batch.claim_keys))

    def wait_given_back(self, timeout_s: float) -> bool:
        """Wait until every claim handed to :meth:`release_later` was given back (or given
        up on); True if none is pending."""
        return self.releaser.wait(timeout_s)
