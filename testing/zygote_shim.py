"""The executable ``multiprocessing``'s spawn runs in a zygote's children: it has the zygote fork
the new process instead of starting an interpreter that imports torch and vLLM from scratch.

vLLM starts a server's engine core, and every engine core's worker, with the ``spawn`` start
method (forced on CPU): ``python -c 'from multiprocessing.spawn import spawn_main; ...'``,
handing the child the pipes it reads its task from and writes its death on (``pass_fds``).
A zygote child (``testing/zygote.py``) sets this file as spawn's executable, so such a start
runs this instead, as the spawning process's child. It sends the zygote its command line,
environment, directory and every open file descriptor (``SCM_RIGHTS``); the zygote forks a
child that takes those descriptors at the same numbers and runs the command. This process then
stands in for that child: the spawning process waits on it, and a signal sent to it goes to
the child's process group (the child's own spawns included). It exits with the child's status
(or dies by the same signal). Should its parent die, it kills that group; should it die first,
the child kills itself: nothing outlives the process that started it.

Standard library only, and started with ``python -S``: it runs once per spawned process. The
zygote writes it out with a first line naming the interpreter and the zygote's socket
(``ZYGOTE_SOCKET``); tests only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys

ZYGOTE_SOCKET = ""  # (the zygote's copy sets it)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip


def open_fds() -> list[int]:
    """The descriptors this process inherited (``pass_fds`` and its standard streams)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed by now)
            os.fstat(int(name))
            fds.append(int(name))
    return sorted(fds)


def exit_like(status: int) -> None:
    """Exit as the child did: with its code, or killed by the same signal."""
    if status < 0:
        if -status in FORWARDED:  # (its handler here would only pass it on)
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 1)


def main(socket_path: str, argv: list[str]) -> None:
    """Have the zygote at ``socket_path`` run ``argv`` (``-c PROGRAM args``), then stand in
    for that child until it exits."""
    if "--multiprocessing-fork" not in argv:  # not a Process (the resource tracker): as asked
        os.execv(sys.executable, [sys.executable, *argv])
    parent = os.getppid()
    parent_fd = os.pidfd_open(parent)
    fds = open_fds()
    child: int | None = None
    pending: list[int] = []

    def signal_child(signum: int) -> None:
        assert child is not None
        with contextlib.suppress(ProcessLookupError):  # (its group: what it spawned too)
            os.killpg(child, signum)

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)
        else:
            signal_child(signum)

    for forwarded in FORWARDED:
        signal.signal(forwarded, forward)
    start = argv.index("-c")  # (interpreter options before it were the zygote's to choose)
    request = {"argv": argv[start:], "env": dict(os.environ), "cwd": os.getcwd(),
               "fds": fds, "asker": os.getpid()}  # fmt: skip
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
    # (its copies stay open until it exits: the spawner's sentinel, a pipe's end, must not
    # close before the exit status it then reads is here)
    buffer = b""
    while True:
        ready, _, _ = select.select([conn.fileno(), parent_fd], [], [])
        if parent_fd in ready:  # whoever spawned it is gone: so goes the child, group and all
            if child is not None:
                signal_child(signal.SIGKILL)
            os._exit(1)
        chunk = conn.recv(4096)
        if not chunk:
            print("zygote_shim: the zygote closed the connection", file=sys.stderr)
            os._exit(1)
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            if "pid" in message:
                child = int(message["pid"])
                for signum in pending:
                    signal_child(signum)
            elif "status" in message:
                exit_like(int(message["status"]))


if __name__ == "__main__":
    main(ZYGOTE_SOCKET, sys.argv[1:])
