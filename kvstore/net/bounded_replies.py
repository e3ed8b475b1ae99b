"""Bounds on the replies redis-py parses for kvstore: every reply kvstore does not read itself
(``wire.py`` reads values) -- control replies (the generation, handoff records, lookups,
scripts' answers) and the connection's handshake (HELLO, AUTH, the health-check PING).

redis-py's parsers take a reply whole however large, and a socket timeout bounds one
``recv``, not a reply: a hostile or broken server answering the generation GET with 128 MiB,
or a byte every second, held a reader's memory or its call without limit. Here each reply is
at most ``MAX_CONTROL_REPLY_BYTES`` and is done within the socket timeout plus its size at
``wire.MIN_BYTES_PER_S``, as values are; past either, the connection is dropped and the call
fails typed. A pipeline's replies are bounded together too (``reply_batch``): each within its
own bound, 512 replies of 4 MiB held 2 GiB for one lookup, and 50 replies each sent just
within the socket timeout held it for 20 s (a review's hostile server). A handshake reply of
the wrong shape (a HELLO answered with a string) is a protocol error, not redis-py's
``AttributeError``; an integer reply that is not an integer is a typed error
(``integer_reply``), not ``int()``'s ``ValueError``.

It keeps hiredis (redis-py's fast parser) and only watches what it is fed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rex
from redis._parsers.hiredis import _HiredisParser
from redis.utils import SENTINEL

from kvstore.errors import StoreCommandError
from kvstore.net.slot_map import check_slot_map
from kvstore.net.wire import MIN_BYTES_PER_S, error_reply
from kvstore.text import printable

# The largest control reply taken: far above any record, lookup answer or slot map kvstore
# reads (kilobytes), far below what a planted reply could cost a process
MAX_CONTROL_REPLY_BYTES = 4 << 20
_NO_TIMEOUT_S = 60.0  # a reply's base budget on a socket without a timeout
# RESP3 push messages taken ahead of one reply: kvstore subscribes to nothing and turns
# redis-py's maintenance notifications off, so a server of kvstore's sends none; redis-py
# reads each by recursing, and 500 of them (7 KB) raised an untyped RecursionError (a review's)
MAX_PUSHES_AHEAD = 64


@dataclass
class _Batch:
    """The replies of one pipeline read so far on this thread (``reply_batch``): since its
    first reply began (None: none yet), and their bytes."""

    started: float | None = None
    received: int = 0


_batches = threading.local()


@contextlib.contextmanager
def reply_batch() -> Iterator[None]:
    """Bound the replies read on this thread meanwhile as one: at most
    ``MAX_CONTROL_REPLY_BYTES`` in all, and done within the socket timeout plus their size at
    ``MIN_BYTES_PER_S`` from when the first of them began -- the bounds of one reply, for a
    pipeline's. Past either the connection is dropped and the call fails typed, as for one
    reply. The wait for a pooled connection and a new connection's handshake are not the
    replies' (each has its own bound): counted, a lookup after a reconnect on a slow link
    failed (a review's). (A lookup's replies are a few bytes each: 8,192 EXISTS answer in 32
    KiB and milliseconds.)"""
    before = getattr(_batches, "batch", None)
    _batches.batch = _Batch()
    try:
        yield
    finally:
        _batches.batch = before


def integer_reply(reply: object, command: str) -> int:
    """``reply`` where ``command`` answers an integer; anything else a server of kvstore's
    never sends (a string of digits included: ``int()`` also takes " -5 " and "1_0", and
    raised an untyped ``ValueError`` on "abc"), and the call fails typed."""
    if isinstance(reply, int) and not isinstance(reply, bool):
        return reply
    raise StoreCommandError(
        f"the server answered {command} with {printable(type(reply).__name__)} "
        f"{printable(reply, 40)} where an integer is due: not what a Redis or Valkey server "
        "sends; check that the URL names the right server"
    )


class ReplyTooLarge(rex.InvalidResponse):
    """A control reply over ``MAX_CONTROL_REPLY_BYTES``: its connection was dropped. (An
    ``InvalidResponse``, so redis-py and ``translated_errors`` take it as they did.)"""


class BoundedHiredisParser(_HiredisParser):
    """redis-py's hiredis parser, with a reply's size and time bounded (module docstring).

    The size is every byte received since the reply began, not what hiredis still buffers:
    hiredis builds an array's elements as they come and trims its buffer, so a 1 GiB array
    never looked larger than 64 KiB (found by a review). Past a bound the socket is shut down
    before the error is raised: some of redis-py's connections (Sentinel's) go back to the
    pool on an error that is not a ``ConnectionError``, and the rest of the reply would have
    answered the next command (also a review's)."""

    max_reply_bytes = MAX_CONTROL_REPLY_BYTES

    def __init__(self, socket_read_size: int) -> None:
        super().__init__(socket_read_size)
        self._reply_started: float | None = None
        self._received = 0  # bytes received since the reply began
        self._pushes = 0  # push messages read ahead of it (redis-py recurses once for each)

    def read_response(
        self,
        disable_decoding: bool = False,
        push_request: bool = False,
        timeout: float | object = SENTINEL,
    ) -> Any:
        outer = self._reply_started is None  # (a push notification recurses)
        if outer:
            self._reply_started = time.monotonic()
            self._received = 0
            self._pushes = 0
        else:
            self._pushes += 1
            if self._pushes > MAX_PUSHES_AHEAD:
                raise self._broken(
                    rex.InvalidResponse(
                        f"over {MAX_PUSHES_AHEAD} push messages ahead of a reply, where kvstore "
                        "subscribes to nothing: not what a Redis server of kvstore's sends, so "
                        "the connection is dropped"
                    )
                )
        try:
            return super().read_response(
                disable_decoding=disable_decoding, push_request=push_request, timeout=timeout
            )
        except MemoryError:  # hiredis sizes an array by its header ("*4000000000"): refused
            raise self._broken(
                rex.InvalidResponse(
                    "a reply declares more elements than memory holds: not what a Redis "
                    "server of kvstore's sends, so the connection is dropped"
                )
            ) from None
        finally:
            if outer:
                self._reply_started = None

    @classmethod
    def parse_error(cls, response: str) -> Exception:
        """An error reply's exception (hiredis calls this): a malformed MOVED / ASK is a plain
        ``ResponseError``, not redis-py's ``ValueError`` (``wire.error_reply``)."""
        return error_reply(response)

    def read_from_socket(
        self, timeout: float | object = SENTINEL, raise_on_timeout: bool = True
    ) -> bool:
        reader = self._reader
        before = int(reader.len()) if reader is not None else 0
        got = super().read_from_socket(timeout=timeout, raise_on_timeout=raise_on_timeout)
        reader = self._reader
        if reader is None or self._reply_started is None:
            return bool(got)
        # (nothing took a reply from the buffer in between: the growth is what came)
        came = max(0, int(reader.len()) - before)
        self._received += came
        batch: _Batch | None = getattr(_batches, "batch", None)
        if batch is not None:
            if batch.started is None:
                batch.started = self._reply_started
            batch.received += came
            self._check(batch.received, batch.started, "a pipeline's replies")
        self._check(self._received, self._reply_started, "a reply")
        return bool(got)

    def _check(self, received: int, started: float, what: str) -> None:
        """Past the size or the time ``received`` bytes since ``started`` may take: the
        connection dropped, and the error raised."""
        if received > self.max_reply_bytes:
            raise self._broken(
                ReplyTooLarge(
                    f"{what} of over {self.max_reply_bytes} bytes where kvstore reads small "
                    "control replies: not what a Redis server of kvstore's sends, so the "
                    "connection is dropped; check that the URL names the right server"
                )
            )
        base = self._socket_timeout if self._socket_timeout else _NO_TIMEOUT_S
        budget = base + received / MIN_BYTES_PER_S
        if time.monotonic() - started > budget:
            raise self._broken(
                rex.TimeoutError(
                    f"timed out reading {what}: not done within {budget:.1f} s (the socket "
                    f"timeout plus {MIN_BYTES_PER_S >> 20} s per MiB); the server stalls or "
                    "sends a few bytes at a time, and the connection is dropped"
                )
            )

    def _broken(self, error: Exception) -> Exception:
        """``error``, after the connection's socket is shut down: whatever redis-py does with
        the connection next, nobody reads the rest of this reply as another's."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.on_disconnect()
        return error


class _CheckedHandshake:
    """A connection whose handshake replies of the wrong shape are a typed protocol error."""

    def on_connect_check_health(self, check_health: bool = True) -> None:
        batch = getattr(_batches, "batch", None)
        _batches.batch = None  # (the handshake's replies are no pipeline's: bounded each)
        try:
            super().on_connect_check_health(check_health)  # type: ignore[misc]
        except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
            self.disconnect()  # type: ignore[attr-defined]
            raise rex.InvalidResponse(
                f"the server's reply to the connection handshake (HELLO / AUTH) is malformed "
                f"({type(exc).__name__}): is the URL a Redis or Valkey server's?"
            ) from None
        finally:
            _batches.batch = batch


def _names_cluster_slots(args: tuple[Any, ...]) -> bool:
    """Whether a command's arguments are ``CLUSTER SLOTS`` (redis-py sends it as one string)."""
    head = [a for a in args[:2] if isinstance(a, (str, bytes)) and len(a) < 16]
    words = b" ".join(a if isinstance(a, bytes) else a.encode() for a in head).upper().split()
    return words[:2] == [b"CLUSTER", b"SLOTS"]


class _SlotMapChecked:
    """A connection whose ``CLUSTER SLOTS`` reply is checked (``slot_map``) before redis-py
    builds its slot cache from it: every learning of the map -- at start-up, after a redirect
    or a failure, by kvstore's sweeps -- goes through a node's connection."""

    _slot_map_due = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._slot_map_due = False  # (a pipeline's, or what ``send_command`` sends)
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        super().send_command(*args, **kwargs)  # type: ignore[misc]
        self._slot_map_due = _names_cluster_slots(args)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        due, self._slot_map_due = self._slot_map_due, False  # (one reply, even an error)
        reply = super().read_response(*args, **kwargs)  # type: ignore[misc]
        if due:
            check_slot_map(reply)
        return reply


def _bounded(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("parser_class", BoundedHiredisParser)
    return kwargs


class BoundedConnection(_SlotMapChecked, _CheckedHandshake, redis.Connection):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_bounded(kwargs))


class BoundedSSLConnection(_SlotMapChecked, _CheckedHandshake, redis.SSLConnection):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_bounded(kwargs))


class BoundedUnixConnection(_SlotMapChecked, _CheckedHandshake, redis.UnixDomainSocketConnection):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**_bounded(kwargs))
