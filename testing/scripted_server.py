"""A loopback RESP server scripted per command, for tests of what a hostile, broken or slow
server does to kvstore's readers (tests/integration/test_bounded_replies.py, test_wire.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class ScriptedServer:
    """A loopback server: to each command, ``answer(name)`` -- bytes sent at once, or a
    callable that sends its reply on the socket itself (a drip). One connection at a time."""

    def __init__(self, answer: Callable[[bytes], bytes | Callable[[socket.socket], None]]) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.05)  # (accept and recv wake to see ``stopped``)
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(0.05)
            with conn, contextlib.suppress(OSError):  # (the client hung up)
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        buf = b""
        while not self.stopped.is_set():
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return
            buf += data
            while True:
                command, buf = one_command(buf)
                if command is None:
                    break
                reply = self.answer(command.upper())
                if callable(reply):
                    conn.settimeout(5.0)
                    reply(conn)
                    return
                conn.sendall(reply)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.listener.close()
        assert not self.thread.is_alive()


def one_command(buf: bytes) -> tuple[bytes | None, bytes]:
    """The first command's name in ``buf`` (RESP array of bulk strings) and the rest."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None, buf
    head, rest = buf.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buf
        length_line, rest = rest.split(b"\r\n", 1)
        n = int(length_line[1:])
        if len(rest) < n + 2:
            return None, buf
        args.append(rest[:n])
        rest = rest[n + 2 :]
    return args[0], rest
