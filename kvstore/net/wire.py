"""Receiving bulk-string replies straight into the caller's buffers, and sending values from
where they lie.

redis-py (with or without hiredis) turns every reply into a new ``bytes``: the socket's bytes
are copied into the parser's buffer, then into the ``bytes`` object, and the caller copies them
once more to where they belong. For multi-MiB values that is most of the cost of a read. This
module reads the replies of pipelined ``GET`` / ``GETRANGE`` / ``GETDEL`` commands itself, with
``recv_into`` into the destination: the bytes are copied once, by the kernel. redis-py keeps
everything else -- connecting, TLS, AUTH/ACL, sending the commands, the pool.

Writes go the other way: a ``SET`` is sent as a list of buffers -- the command's framing, then
the value's pieces where they already are (pinned staging memory), with ``sendmsg`` -- so a
value is never joined into one ``bytes`` first.

Only the reply types those commands produce are understood: a bulk string, a nil (RESP2 ``$-1``
or RESP3 ``_``) and an error -- and, for the claim script sent ahead of a consuming read
(``values/drop_select.py``), an array of integers. Anything else raises ``InvalidResponse``;
the caller then drops the connection, since its position in the stream is lost. Fuzzed against
hiredis in ``tests/integration/test_wire.py``.

**Two implementations of the receiving path, one behaviour.** Where the compiled core
(``_wire_core.c``) was built and the socket is plain TCP or Unix (not TLS), a bulk reply is
read in C with the GIL released for the whole reply: the other threads' reads, checksums and the
engine's own Python run meanwhile. Everywhere else the Python path reads it. Both follow the
rules below to the byte and raise the same exceptions; ``KVSTORE_WIRE_CORE`` (``auto``, the
default; ``native``; ``python``) forces either (:class:`WireCore`). The tests run both.

A socket timeout bounds each ``recv``, not a reply: a server (or a path) that sends a byte
just before each timeout would hold a read for ever. So every reply has a deadline -- the
socket timeout plus its size at :data:`MIN_BYTES_PER_S` -- and so has every send; past it
``redis.exceptions.TimeoutError`` is raised (kvstore's ``StoreTimeoutError`` once translated)
and the caller drops the connection, mid-reply as it is. A batch may have a deadline of its own
(a load's: ``ReplyReader``'s ``deadline``), which no reply's extends: past it,
``DeadlinePassedError`` (a server that answers each reply just within its own deadline held a
batch of 16 values for 16 times that).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.exceptions as rex

from kvstore.errors import DeadlinePassedError
from kvstore.net.slot_map import redirect_problem
from kvstore.text import printable, without_echoed_args

try:  # redis-py's own mapping of error codes to exception classes (OOM, NOPERM, ...)
    from redis._parsers.base import BaseParser

    _parse_error = BaseParser.parse_error
except ImportError:  # pragma: no cover - an older redis-py: the generic class
    _parse_error = rex.ResponseError


def error_reply(message: str) -> rex.RedisError:
    """The exception for an error reply's text: redis-py's class for its code (OOM, NOPERM,
    MOVED, ...), or a plain ``ResponseError`` where the text does not parse as that class's
    (redis-py splits a MOVED / ASK into slot and address, and a ``MOVED garbage`` raised its
    ``ValueError``, past every typed handler: found by a review). A server's text makes no
    other exception, and a redirect to a slot or an address no Cluster has is a plain one too.
    Its text is made printable and cut (``kvstore.text``): a server's error line with a newline
    and an ANSI escape forged a log line, and one of 3 MB went whole into an exception (a
    review); the arguments a server repeats of a refused command are left out (a password, in
    the handshake's)."""
    message = without_echoed_args(printable(message))
    try:
        exc = _parse_error(message)
    except (ValueError, IndexError, TypeError):
        return rex.ResponseError(message)
    if isinstance(exc, rex.AskError) and redirect_problem(exc):
        # (a slot past 16383 raised redis-py's KeyError where it moves the slot; a host the
        # resolver refuses was cached, and every later call failed: ``slot_map``)
        return rex.ResponseError(message)
    return exc


# the compiled core's interface this module calls (its VERSION): a build from before a change
# of its arguments -- an editable install not rebuilt after a pull -- is not used (every read
# failed with a TypeError on a core one argument short)
WIRE_CORE_VERSION = 2

try:  # the compiled receiving core, where pip could build it (a C compiler was there)
    from kvstore.net import _wire_core as _core  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the install
    _core = None
_STALE_CORE = _core is not None and getattr(_core, "VERSION", 1) != WIRE_CORE_VERSION
if _STALE_CORE:  # pragma: no cover - depends on the install
    _core = None
    logging.getLogger(__name__).warning(
        "kvstore's compiled core was built from an older source and is not used (reads take "
        "the slower Python path): rebuild it (pip install -e .)"
    )


class WireCore(enum.Enum):
    """Which implementation reads bulk replies (``KVSTORE_WIRE_CORE``)."""

    AUTO = "auto"  # the compiled core where built and the socket is not TLS, else Python
    NATIVE = "native"  # the compiled core, or an error where it was not built
    PYTHON = "python"  # the reference path, always


class WireCoreMissing(ImportError):
    """``KVSTORE_WIRE_CORE=native`` where the compiled core was not built."""


def wire_core() -> WireCore:
    """The implementation asked for in the environment (``KVSTORE_WIRE_CORE``)."""
    raw = os.environ.get("KVSTORE_WIRE_CORE", "auto").strip().lower() or "auto"
    try:
        chosen = WireCore(raw)
    except ValueError:
        raise ValueError(f"KVSTORE_WIRE_CORE={raw!r}: use auto, native or python") from None
    if chosen is WireCore.NATIVE and _core is None:
        why = "was built from an older source" if _STALE_CORE else "was not built"
        raise WireCoreMissing(
            f"KVSTORE_WIRE_CORE=native, but kvstore's compiled core (kvstore/net/_wire_core.c) "
            f"{why}: install a C compiler and the Python headers, then reinstall "
            "(pip install -e .), or unset KVSTORE_WIRE_CORE"
        )
    return chosen


def native_available() -> bool:
    """Whether the compiled core was built (importable)."""
    return _core is not None


_SCRATCH_BYTES = 1 << 16
_OK = b"+OK\r\n"
_MAX_LINE = 1 << 12  # a reply's first line: "$<length>" or an error message
_MAX_IOV = 512  # buffers per sendmsg: well under every platform's IOV_MAX (1024 on Linux)
# The slowest transfer taken for a live server: a reply (or a send) must be done within the
# socket timeout plus its size at this rate. Far below any network a KV cache pays off on,
# so only a stalled or dripping peer reaches it.
MIN_BYTES_PER_S = 1 << 20
# A bulk string longer than its destination is drained, so the batch's other replies can be
# read, only up to this size (within its deadline); a larger one -- no kvstore value is that
# large -- fails the read at once, and the connection is dropped rather than drained.
MAX_DRAIN_BYTES = 64 << 20
# ... and only up to this many times what was asked for (at least MIN_DRAIN_BYTES): a value
# planted under a popular block's key must not make every read of it pull 64 MiB from Redis
DRAIN_FACTOR = 2
MIN_DRAIN_BYTES = 1 << 20


def drain_limit(asked: int) -> int:
    """The longest reply that is drained when at most ``asked`` bytes were expected."""
    return min(MAX_DRAIN_BYTES, max(DRAIN_FACTOR * asked, MIN_DRAIN_BYTES))


_NO_TIMEOUT_S = 60.0  # a deadline's base on a socket without a timeout


class ReplyTooLarge(rex.InvalidResponse):
    """A bulk reply too large to drain (over ``drain_limit``): its bytes were not read, so the
    connection's place in the reply stream is lost and it must be dropped. The value itself is
    only a miss: a caller reads the batch's other replies again on another connection."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(_too_large(length, limit))
        self.length = length


@dataclass(frozen=True)
class Oversize:
    """A bulk string longer than its destination; its bytes were read and dropped."""

    length: int


class ReplyReader:
    """Reads replies from one connected socket, in order. Not thread-safe: one per connection
    and thread."""

    def __init__(
        self, sock: socket.socket, core: WireCore | None = None, *, deadline: float = math.inf
    ) -> None:
        """``deadline``: ``time.monotonic()`` past which no reply is waited for, whatever
        its own deadline (:class:`DeadlinePassedError`)."""
        self._sock = sock
        self._buf = bytearray(_SCRATCH_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes are self._buf[self._start : self._end]
        self._end = 0
        self._clock = _Deadline(sock, cap=deadline)
        core = core if core is not None else wire_core()
        plain = type(sock) is socket.socket  # (not TLS: its fd carries records, not replies)
        if core is WireCore.NATIVE and _core is None:
            raise WireCoreMissing("the compiled core was not built (see wire_core())")
        self.native = core is not WireCore.PYTHON and _core is not None and plain
        # the deadline and budget of the reply whose header the core just read
        self._native_at, self._native_budget = 0.0, 0.0

    def limit_to(self, deadline: float) -> None:
        """From now on no reply is waited for past ``deadline`` either."""
        self._clock.cap = min(self._clock.cap, deadline)

    def read_bulk_into(self, dest: memoryview) -> int | Oversize | None:
        """Read one reply. A bulk string's bytes land in ``dest[:length]`` and its length is
        returned; a nil returns None; one longer than ``dest`` is drained (never allocated) and
        returns :class:`Oversize`. An error reply raises redis-py's ``ResponseError`` (the
        stream stays usable)."""
        if self.native:
            return self._native_bulk(dest, len(dest))
        self._clock.start(0)
        try:
            length = self._bulk_header(len(dest))
            if isinstance(length, int):
                self._take(dest[:length])
                self._crlf()
            return length
        finally:
            self._clock.stop()

    def read_bulk_new(
        self, limit: int, allocate: Callable[[int], memoryview] | None = None
    ) -> memoryview | Oversize | None:
        """Read one reply into a new, writable buffer of exactly its size from ``allocate``
        (the kernel's copy is the only one). One longer than ``limit`` is drained, never
        allocated, and returns :class:`Oversize`; otherwise as :meth:`read_bulk_into`."""
        if self.native:
            length = self._native_bulk(None, limit)
            if not isinstance(length, int):
                return length
            dest = allocate(length) if allocate is not None else _new_buffer(length)
            self._native_body(dest)
            return dest
        self._clock.start(0)
        try:
            length = self._bulk_header(limit)
            if not isinstance(length, int):
                return length
            # not zero-filled, unlike bytearray(n): filling 2 MiB first made select 2x slower
            dest = allocate(length) if allocate is not None else _new_buffer(length)
            self._take(dest)
            self._crlf()
            return dest
        finally:
            self._clock.stop()

    # ------------------------------------------------------- the compiled core
    def _native_bulk(self, dest: memoryview | None, limit: int) -> int | Oversize | None:
        """One bulk reply read by the compiled core, as :meth:`read_bulk_into` returns it;
        without ``dest``, a fitting bulk string's length, its bytes next in the stream."""
        assert _core is not None
        started = time.monotonic()
        budget, cap = self._clock._base_s, self._clock.cap
        if started >= cap:  # (as the Python path: none begins past it)
            raise deadline_passed("before a reply")
        kind, value, self._start, self._end, at = _core.read_bulk(
            self._fileno(), self._buf, self._start, self._end, dest, limit, drain_limit(limit),
            self._recv_timeout(), started + budget, float(MIN_BYTES_PER_S), _MAX_LINE, cap,
        )  # fmt: skip
        if kind == _core.BULK:
            return int(value)
        if kind == _core.NIL:
            return None
        if kind == _core.OVERSIZE:
            return Oversize(value)
        if kind == _core.HEADER:
            self._native_at, self._native_budget = at, at - started
            return int(value)
        if kind == _core.ERROR_REPLY:
            raise error_reply(value.decode(errors="replace"))
        if kind == _core.INVALID and value[:1] == b"$":
            raise rex.InvalidResponse(f"bad bulk length {value!r}")
        if kind == _core.INVALID:
            raise rex.InvalidResponse(f"expected a bulk string reply, got {value!r}")
        if kind == _core.TOO_LARGE:
            raise ReplyTooLarge(int(value), limit)
        raise self._native_failure(kind, value, at - started)

    def _native_body(self, dest: memoryview) -> None:
        """The bytes (and CRLF) of the bulk string whose header ``_native_bulk`` just read."""
        assert _core is not None
        kind, value, self._start, self._end, _ = _core.read_body(
            self._fileno(), self._buf, self._start, self._end, dest, self._recv_timeout(),
            self._native_at,
        )  # fmt: skip
        if kind != _core.BULK:
            raise self._native_failure(kind, value, self._native_budget)

    def _fileno(self) -> int:
        """The socket's descriptor now (never one kept from before: a socket closed by
        another thread frees its number for the next connection, whose replies a kept number
        would read)."""
        fd = self._sock.fileno()
        if fd < 0:
            raise rex.ConnectionError("error reading a reply: the connection was closed")
        return fd

    def _recv_timeout(self) -> float:
        timeout = self._sock.gettimeout()
        return -1.0 if timeout is None else float(timeout)

    def _native_failure(self, kind: int, value: Any, budget_s: float) -> Exception:
        assert _core is not None
        if kind in (_core.TIMEOUT_RECV, _core.TIMEOUT_DEADLINE) and self._clock.cap_passed():
            return deadline_passed("reading a reply")
        if kind == _core.TIMEOUT_RECV:
            return rex.TimeoutError("timed out reading a reply")
        if kind == _core.TIMEOUT_DEADLINE:
            return rex.TimeoutError(_stalled("reading a reply", budget_s))
        if kind == _core.CLOSED:
            return rex.ConnectionError("the server closed the connection")
        if kind == _core.OS_ERROR:
            return rex.ConnectionError(f"error reading a reply: {os.strerror(value)}")
        if kind == _core.TOO_LONG_LINE:
            return rex.InvalidResponse("a reply line is too long")
        if kind == _core.NO_CRLF:
            return rex.InvalidResponse("a bulk string is not followed by CRLF")
        return rex.InvalidResponse(f"the compiled core failed reading a reply ({kind})")

    # ------------------------------------------------------- the Python path
    def _bulk_header(self, limit: int) -> int | Oversize | None:
        """Read a reply's first line: a bulk string's length when it fits in ``limit`` (its
        bytes are next in the stream), :class:`Oversize` (drained) when it does not, None for a
        nil; an error reply raises. The reply's deadline grows by its length."""
        line = self._line()
        if line[:1] != b"$":
            if line[:1] == b"_" and len(line) == 1:
                return None
            if line[:1] == b"-":
                raise error_reply(line[1:].decode(errors="replace"))
            raise rex.InvalidResponse(f"expected a bulk string reply, got {line[:40]!r}")
        length = _decimal(line[1:], 18)  # (as the compiled core)
        if length is None:
            raise rex.InvalidResponse(f"bad bulk length {line[:40]!r}")
        if length < 0:
            return None
        self._clock.extend(length + 2)
        if length > limit:
            drainable = drain_limit(limit)
            if length > drainable:
                raise ReplyTooLarge(length, limit)
            self._skip(length + 2)
            return Oversize(length)
        return length

    def read_status(self) -> bytes:
        """Read one simple-string reply (``+OK``) and return its text; an error reply raises
        redis-py's ``ResponseError`` (the stream stays usable)."""
        self._clock.start(0)
        try:
            line = self._line()
        finally:
            self._clock.stop()
        if line[:1] == b"+":
            return line[1:]
        if line[:1] == b"-":
            raise error_reply(line[1:].decode(errors="replace"))
        raise rex.InvalidResponse(f"expected a status reply, got {line[:40]!r}")

    def read_int_array(self, max_items: int) -> list[int] | int | None:
        """Read one reply that is an array of at most ``max_items`` integers (a script's table
        of numbers), an integer (a script's number) or a nil (its ``false``: RESP2 ``$-1`` /
        ``*-1``, RESP3 ``_``); an error reply raises redis-py's ``ResponseError`` (the stream
        stays usable). A longer array is refused before its elements are read: the count is
        the server's, and an unbounded one grew a reader by 540 MiB within its deadline (a
        review's)."""
        self._clock.start(0)
        try:
            line = self._line()
            if line in (b"$-1", b"*-1", b"_"):
                return None
            if line[:1] == b"-":
                raise error_reply(line[1:].decode(errors="replace"))
            if line[:1] == b":":
                return _integer(line)
            if line[:1] != b"*":
                raise rex.InvalidResponse(f"expected an array reply, got {line[:40]!r}")
            count = _decimal(line[1:], 18, signed=False)
            if count is None:
                raise rex.InvalidResponse(f"bad array length {line[:40]!r}")
            if count > max_items:
                raise rex.InvalidResponse(
                    f"an array of {count} elements where at most {max_items} were expected"
                )
            return [_integer(self._line()) for _ in range(count)]
        finally:
            self._clock.stop()

    def skip_ok(self, n: int) -> int:
        """Consume up to ``n`` consecutive ``+OK`` replies (the answers to SETs) and return
        how many; the first other reply is left unread, for :meth:`read_status`. Receives only
        while the replies it has are all ``+OK``: one comparison per buffer instead of
        parsing each reply (7 us each in Python, as much as framing a 64 KiB value)."""
        self._clock.start(n * len(_OK))
        try:
            return self._skip_ok(n)
        finally:
            self._clock.stop()

    def _skip_ok(self, n: int) -> int:
        done = 0
        while done < n:
            if self._end - self._start < len(_OK):
                if self._buf.startswith(_OK[: self._end - self._start], self._start, self._end):
                    self._fill()  # a partial +OK, or nothing yet
                    continue
                return done
            k = min(n - done, (self._end - self._start) // len(_OK))
            if self._buf.startswith(_OK * k, self._start, self._end):
                self._start += k * len(_OK)
                done += k
                continue
            while self._buf.startswith(_OK, self._start, self._end):  # +OKs, then another reply
                self._start += len(_OK)
                done += 1
            return done
        return done

    # -------------------------------------------------------------- the socket
    def _recv_into(self, view: memoryview) -> int:
        try:
            self._clock.before_io("reading a reply")  # (its settimeout fails on a closed socket)
            n = self._sock.recv_into(view)
        except TimeoutError:  # socket.timeout
            raise self._clock.timed_out("reading a reply") from None
        except OSError as exc:
            raise rex.ConnectionError(f"error reading a reply: {exc}") from None
        if n == 0:
            raise rex.ConnectionError("the server closed the connection")
        return n

    def _fill(self) -> None:
        """Receive more into the scratch buffer, moving unread bytes to its front first."""
        unread = self._end - self._start
        if self._start:
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        self._end += self._recv_into(self._view[self._end :])

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise rex.InvalidResponse("a reply line is too long")
            self._fill()

    def _take(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: what is buffered first, the rest straight from the socket."""
        have = min(self._end - self._start, len(dest))
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < len(dest):
            pos += self._recv_into(dest[pos:])

    def _skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                self._start = self._end = 0
                self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise rex.InvalidResponse("a bulk string is not followed by CRLF")
        self._start += 2


class _Deadline:
    """The deadline of one reply (or send) on ``sock``: the socket's timeout plus its bytes at
    :data:`MIN_BYTES_PER_S`, and never past ``cap`` (the batch's). The socket's timeout is
    shortened to what is left only once that is less than the timeout (near the end), and put
    back by :meth:`stop`: no extra system call per ``recv`` in the common case."""

    def __init__(self, sock: Any, cap: float = math.inf) -> None:
        self._sock = sock
        self.cap = cap
        # duck-typed sockets (tests' fakes) may have no timeout to get or set
        timeout = sock.gettimeout() if hasattr(sock, "gettimeout") else None
        self._timeout: float | None = timeout
        self._base_s = timeout if timeout else _NO_TIMEOUT_S
        self._can_shorten = hasattr(sock, "settimeout")
        self._shortened = False
        self._budget_s = 0.0
        self._at = math.inf

    def start(self, nbytes: int) -> None:
        """A reply (or send) begins: none does past ``cap``, even with its bytes at hand."""
        if self.cap_passed():
            raise deadline_passed("before a reply")
        self._budget_s = self._base_s + nbytes / MIN_BYTES_PER_S
        self._at = min(self.cap, time.monotonic() + self._budget_s)

    def extend(self, nbytes: int) -> None:
        """The reply turned out to hold ``nbytes`` more (a bulk string's length, once read)."""
        self._budget_s += nbytes / MIN_BYTES_PER_S
        self._at = min(self.cap, self._at + nbytes / MIN_BYTES_PER_S)

    def cap_passed(self) -> bool:
        return time.monotonic() >= self.cap

    def before_io(self, doing: str) -> None:
        """Raise if the deadline has passed; else bound the next socket call by it."""
        left = self._at - time.monotonic()
        if left <= 0:
            raise self.timed_out(doing)
        if self._can_shorten and (self._timeout is None or left < self._timeout):
            self._sock.settimeout(left)
            self._shortened = True

    def timed_out(self, doing: str) -> rex.TimeoutError | DeadlinePassedError:
        if self.cap_passed():
            return deadline_passed(doing)
        if not self._shortened and time.monotonic() < self._at:  # the socket's own timeout
            return rex.TimeoutError(f"timed out {doing}")
        return rex.TimeoutError(_stalled(doing, self._budget_s))

    def stop(self) -> None:
        """Put the socket's own timeout back, if it was shortened."""
        if self._shortened:
            self._shortened = False
            with contextlib.suppress(OSError):  # a socket closed meanwhile
                self._sock.settimeout(self._timeout)


def _stalled(doing: str, budget_s: float) -> str:
    return (
        f"timed out {doing}: not done within {budget_s:.1f} s (the socket timeout "
        f"plus {MIN_BYTES_PER_S >> 20} s per MiB); the server stalls or sends a few bytes "
        "at a time, and the connection is dropped"
    )


def _too_large(length: int, limit: int) -> str:
    return (
        f"a bulk reply of {length} bytes where at most {limit} were asked for: too "
        f"large to drain (over {drain_limit(limit)}), so the connection is dropped (the "
        "value is a miss); delete the key if it is not kvstore's (`kvstore inspect KEY` "
        "shows it)"
    )


def _integer(line: bytes) -> int:
    if line[:1] != b":":
        raise rex.InvalidResponse(f"expected an integer reply, got {line[:40]!r}")
    value = _decimal(line[1:], 19)  # (a 64-bit integer)
    if value is None:
        raise rex.InvalidResponse(f"bad integer {line[:40]!r}")
    return value


def _decimal(text: bytes, max_digits: int, *, signed: bool = True) -> int | None:
    """``text`` as a decimal integer written as Redis writes one -- an optional '-' (where
    ``signed``), then 1 to ``max_digits`` digits; not the spaces, '+' or '_' Python's int()
    also takes -- or None."""
    digits = text[1:] if signed and text[:1] == b"-" else text
    if not 0 < len(digits) <= max_digits or not digits.isdigit():
        return None
    return int(text)


def pack_set(key: bytes, parts: Sequence[Any], px_ms: int | None) -> list[Any]:
    """``SET key <parts joined> [PX px_ms]`` in RESP, as buffers to send back to back; the
    value's parts are referenced, not copied."""
    size = sum(memoryview(p).nbytes for p in parts)
    tail = b"\r\n"
    if px_ms is not None:
        px = str(int(px_ms)).encode()
        tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(px), px)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        3 if px_ms is None else 5,
        len(key),
        key,
        size,
    )
    return [head, *parts, tail]


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send ``buffers`` back to back: ``sendmsg`` in batches, resuming after partial sends. TLS
    sockets have no ``sendmsg``; there each buffer goes through ``send`` (TLS copies it into
    its records anyway). The whole send has a deadline, as a reply has: the socket timeout
    bounds each call, and a peer reading a few bytes at a time would hold it for ever."""
    clock = _Deadline(sock)
    try:
        views: list[memoryview] = []
        for b in buffers:  # flat byte views, so a partial send can be resumed mid-buffer
            v = memoryview(b)
            if v.nbytes:
                views.append(v if v.ndim == 1 and v.format == "B" else v.cast("B"))
        clock.start(sum(v.nbytes for v in views))
        if isinstance(sock, ssl.SSLSocket):
            for v in views:
                while v.nbytes:
                    clock.before_io("sending a command")
                    v = v[sock.send(v) :]
            return
        i = 0
        while i < len(views):
            batch = views[i : i + _MAX_IOV]
            clock.before_io("sending a command")
            sent = sock.sendmsg(batch)
            for v in batch:  # drop what went out; a partial buffer stays, shortened
                if sent >= v.nbytes:
                    sent -= v.nbytes
                    i += 1
                else:
                    views[i] = v[sent:]
                    break
    except TimeoutError:
        raise clock.timed_out("sending a command") from None
    except OSError as exc:
        raise rex.ConnectionError(f"error sending a command: {exc}") from None
    finally:
        clock.stop()


def deadline_passed(doing: str) -> DeadlinePassedError:
    """The error of a batch whose caller's deadline passed ``doing`` something."""
    return DeadlinePassedError(
        f"the batch's deadline passed {doing}: the rest of it is not read and the connection "
        "is dropped (a load past its deadline: the server answers slower than the load was "
        "given time for)"
    )


def raw_socket(conn: Any) -> socket.socket | None:
    """A connected redis-py connection's socket; None for clients that have none (fakeredis)."""
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def parsed_reply_into(reply: Any, dest: memoryview | int) -> int | bytearray | Oversize | None:
    """What ``ReplyReader.read_bulk_into`` (``dest`` a view) or ``read_bulk_new`` (``dest`` a
    size limit) returns, for a reply redis-py already parsed."""
    if reply is None:
        return None
    if isinstance(reply, Exception):
        raise reply
    limit = len(dest) if isinstance(dest, memoryview) else dest
    if len(reply) > limit:
        return Oversize(len(reply))
    if isinstance(dest, int):
        return bytearray(reply)  # writable, as read_bulk_new's: tensors may be views on it
    dest[: len(reply)] = reply
    return len(reply)


def _new_buffer(nbytes: int) -> memoryview:
    """A writable buffer that is not zero-filled."""
    return memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]
