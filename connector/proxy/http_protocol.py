"""The HTTP protocol the proxy's uvicorn runs: uvicorn's own, with a deadline on each request's
head (its request line and headers).

uvicorn bounds the body (the proxy's ``--body-read-timeout-s``) and the idle time between
requests (keep-alive), not the head: a client that opens connections and sends a header line
every 20 s held each for ever, and 1,100 of them ran a proxy out of file descriptors (a review's
slowloris). Here a head must be complete within ``--header-read-timeout-s`` of the connection,
or of its first byte on a kept-alive connection; else the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11  # (uvicorn's own dependency: its h11 protocol's state machine)

DEFAULT_HEADER_READ_TIMEOUT_S = 10.0


class _HeadInTime:
    """Mixed into a uvicorn HTTP protocol (httptools' or h11's): both keep the request being
    served as ``cycle``, a new one per request, made as its head completes."""

    header_read_timeout_s = DEFAULT_HEADER_READ_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None
    _in_message = False  # (httptools: between a request's first byte and its body's last)
    # (the base protocol's)
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self._head_timer is None and self._between_requests():
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before:  # its head is complete
            self._disarm()

    def _between_requests(self) -> bool:
        """The last request was answered and all of its body came: what comes now is a head.
        (Not the rest of a body the app answered early, a 503 say: timed as a head, the
        client was cut off mid-upload, before it could read the answer -- a review's.)"""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return False
        conn = getattr(self, "conn", None)  # h11's state machine
        if conn is not None:
            return bool(conn.their_state in (h11.IDLE, h11.DONE))
        return not self._in_message

    # httptools' parser callbacks (h11's protocol has none: its state machine says)
    def on_message_begin(self) -> None:
        self._in_message = True
        super().on_message_begin()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_read_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def http_protocol(header_read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools' where installed, as uvicorn picks, else h11's)
    with heads bounded by ``header_read_timeout_s``."""
    base: type[asyncio.Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:  # (httptools is uvicorn's optional speed-up)
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    return type(
        f"HeadInTime{base.__name__}",
        (_HeadInTime, base),
        {"header_read_timeout_s": header_read_timeout_s},
    )
