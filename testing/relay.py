"""A TCP relay that delays every reply: a Redis server far away (another zone, a busy network),
for the tests and scripts that need one. Requests go through at once; each chunk the server
sends back is held ``delay_s`` from when it arrived, order kept. ``rate_bytes_per_s`` caps the
replies of every connection together, as one link would (None: no cap); it may be changed while
the relay runs.

    with DelayRelay("127.0.0.1", redis_port, delay_s=0.02) as relay:
        url = relay.url  # redis://127.0.0.1:<relay port>/0
    with DelayRelay("127.0.0.1", redis_port, 0.0, rate_bytes_per_s=8e6) as relay:  # 8 MB/s

``lose_replies(b"FCALL", 1)`` makes a reply go missing after the server ran the command: the
connection that next sends an FCALL is muted (the server gets its requests, the client gets
no reply again and times out). ``hold_requests(b"GET", 0.6)`` holds the next request holding
that text 0.6 s on its way to the server (a slow path, a retransmission); ``held_sent`` is set
once it went on.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from typing import Any

from .redis_server import free_port

# a throttled reply leaves in pieces of at most this many bytes, each when the link is free
_PIECE = 16 << 10


class DelayRelay:
    def __init__(
        self,
        host: str,
        port: int,
        delay_s: float,
        listen_port: int | None = None,
        rate_bytes_per_s: float | None = None,
    ):
        self.target = (host, port)
        self.delay_s = delay_s
        self.rate_bytes_per_s = rate_bytes_per_s
        self._link_free_at = 0.0  # when the capped link has sent what it was given
        self.port = listen_port or free_port()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._lose: dict[bytes, int] = {}  # request text -> connections left to mute
        self._hold: tuple[bytes, float] | None = None  # request text, seconds: the next one
        self.held_sent = threading.Event()

    def lose_replies(self, request: bytes, connections: int = 1) -> None:
        """Mute the next ``connections`` connections whose request contains ``request``, from
        that request on (see the module docstring)."""
        with self._lock:
            self._lose[request] = self._lose.get(request, 0) + connections

    def hold_requests(self, request: bytes, seconds: float) -> None:
        """Hold the next request holding ``request`` ``seconds`` before the server gets it."""
        with self._lock:
            self._hold = (request, seconds)
            self.held_sent.clear()

    def _holds(self, data: bytes) -> float:
        with self._lock:
            if self._hold is None or self._hold[0] not in data:
                return 0.0
            seconds, self._hold = self._hold[1], None
            return seconds

    def keep_replies(self) -> None:
        """Mute no more connections (those muted stay muted)."""
        with self._lock:
            self._lose.clear()

    def _mutes(self, data: bytes) -> bool:
        with self._lock:
            for text, left in self._lose.items():
                if left and text in data:
                    self._lose[text] = left - 1
                    return True
        return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> DelayRelay:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(256)
        self._listener = s
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(None)
            with self._lock:
                self._socks += [client, server]
            muted = threading.Event()
            threading.Thread(target=self._pipe, args=(client, server, muted), daemon=True).start()
            threading.Thread(
                target=self._delayed_pipe, args=(server, client, muted), daemon=True
            ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, muted: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                if not muted.is_set() and self._mutes(data):
                    muted.set()
                held = self._holds(data)
                if held:
                    time.sleep(held)
                dst.sendall(data)
                if held:
                    self.held_sent.set()
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _delayed_pipe(self, src: socket.socket, dst: socket.socket, muted: threading.Event) -> None:
        """Replies: each chunk leaves ``delay_s`` after it arrived (a sender thread holds it);
        none leaves a muted connection."""
        queue: list[tuple[float, int, bytes]] = []
        order = itertools.count()
        ready = threading.Condition()
        done = threading.Event()

        def send() -> None:
            with contextlib.suppress(OSError):
                while True:
                    with ready:
                        while not queue and not done.is_set():
                            ready.wait()
                        if not queue:
                            return
                        due, _, data = queue[0]
                        wait = due - time.monotonic()
                        if wait > 0:
                            ready.wait(wait)
                            continue
                        heapq.heappop(queue)
                    self._send(dst, data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                if muted.is_set():
                    continue
                with ready:
                    heapq.heappush(queue, (time.monotonic() + self.delay_s, next(order), data))
                    ready.notify()
        done.set()
        with ready:
            ready.notify()

    def _send(self, dst: socket.socket, data: bytes) -> None:
        """Send ``data``; under a rate cap, a piece at a time, each once the link shared by
        every connection has sent what came before it."""
        if not self.rate_bytes_per_s:
            dst.sendall(data)
            return
        view = memoryview(data)
        for at in range(0, len(view), _PIECE):
            piece = view[at : at + _PIECE]
            rate = self.rate_bytes_per_s or float("inf")
            with self._lock:
                start = max(time.monotonic(), self._link_free_at)
                self._link_free_at = start + len(piece) / rate
                done = self._link_free_at
            wait = done - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            dst.sendall(piece)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            # likewise: a listener closed under a blocked accept() goes on accepting
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            # shut down before closing: closing a socket another thread is blocked on does not
            # end the connection until that thread runs again (late on a busy machine); a
            # shutdown sends the FIN now and wakes the pipes' threads
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> DelayRelay:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
