"""A parent that has imported vLLM once and forks the tests' vLLM processes from there.

An in-process test engine (``testing/engine_runner.py`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
spends most of its start-up importing torch and vLLM, and so does an OpenAI server's first
process; the end-to-end tests start dozens. This process imports them once, then for each
request forks a child that runs ``python SCRIPT args`` or ``python -m MODULE args`` as a fresh
interpreter would: in a session (process group) of its own, with exactly the environment,
working directory and log file asked for. The parent reports each child's pid, then its exit
status, on the request's connection (one JSON line each). Android's zygote is the model.

Only imports happen before a fork: no engine, no thread pool and no thread other than the main
one (``serve`` refuses to start otherwise), so a child starts as clean as a fresh interpreter
that ran the same imports. What an import reads once comes from the first test's environment
(vLLM's logging settings, for one), and every child shares the zygote's hash seed and its
single-threaded OpenBLAS. (A server's engine core and workers are spawned by vLLM, which forces
``spawn`` on CPU: they start from scratch.)

Start it through ``Zygote`` (``python -m testing.zygote SOCKET READY_FD [MODULE ...]``: what
to import, by default ``PRELOAD``). It exits when its parent does, or on SIGTERM. Tests only:
nothing shipped uses it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What an in-process engine of the tests imports before its first step, heaviest first (the
# runner's ``-X importtime``: vLLM, its config and offline entry point, the CPU model runner),
# and an OpenAI server's API process. Anything left out is imported by the child as usual.
PRELOAD = (
    "torch",
    "vllm",
    "vllm.config",
    "vllm.inputs",
    "vllm.entrypoints.llm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.models.llama",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "connector.redis_connector",
    "vllm.entrypoints.openai.api_server",  # (an OpenAI server's first process)
)


def preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules``; the names that failed to import (a release without them, or one
    whose import raised): a child imports those itself, as a fresh interpreter would."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            missing.append(name)
    return missing


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run_child(request: dict[str, Any], inherited: list[socket.socket]) -> None:
    """In the forked child: become the process the request describes; never returns.
    ``inherited``: the zygote's sockets (its listener, every asker's connection), closed here
    so that a zygote's death still ends its askers' connections."""
    code = 1
    try:
        for sock in inherited:
            sock.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()  # its own process group, as ``start_new_session=True`` gives
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = list(request["argv"])
        if argv[0] == "-m":  # python -m MODULE args...
            spec = importlib.util.find_spec(argv[1])
            sys.argv = [spec.origin if spec and spec.origin else argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT args...
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str, ready_fd: int, modules: Sequence[str] = PRELOAD) -> None:
    """Import ``modules``, say so on ``ready_fd`` (one JSON line: a pipe of its own, since
    vLLM's logging writes to stdout), then fork for every request on ``path``."""
    missing = preload(modules)
    if os_threads() != 1:  # a fork would copy locks that other threads hold
        raise SystemExit(f"zygote: {os_threads()} threads after the imports; cannot fork safely")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with os.fdopen(ready_fd, "w") as ready_pipe:  # (closed: no child inherits it)
        ready_pipe.write(json.dumps({"ready": True, "missing": missing}) + "\n")
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # (its parent gone, nobody would ask again)
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            conn.settimeout(10)
            try:
                with conn.makefile("rb") as f:
                    request = json.loads(f.readline())
                pid = os.fork()
            except (OSError, ValueError) as e:  # the asker sees its connection closed
                print(f"zygote: a request failed: {e!r}", file=sys.stderr, flush=True)
                conn.close()
                continue
            if pid == 0:
                run_child(request, [listener, conn, *children.values()])
            children[pid] = conn
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            asker = children.pop(pid, None)  # (None: something an import left behind)
            if asker is None:
                continue
            with contextlib.suppress(OSError):
                exitcode = os.waitstatus_to_exitcode(status)
                asker.sendall(json.dumps({"status": exitcode}).encode() + b"\n")
            asker.close()


class ZygoteChild:
    """A forked child, seen as much like a ``subprocess.Popen`` as the tests use: ``pid``
    (its process group too), ``poll``, ``wait`` and ``returncode``. Its exit status comes from
    the zygote; should the zygote die first, a pidfd tells when the child ends (its status is
    then unknown: reported as killed). Unlike a Popen's, its pid is freed when it exits."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = b""
        pid_line = self._line(timeout_s=60)
        if not pid_line:
            raise RuntimeError("the zygote did not answer with a pid within 60 s (see its log)")
        self.pid: int = json.loads(pid_line)["pid"]
        self.returncode: int | None = None
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):  # (gone already: its status is on its way)
            self._pidfd = os.pidfd_open(self.pid)

    def _line(self, timeout_s: float | None) -> bytes | None:
        """The next line from the zygote; ``None`` if none came within ``timeout_s``; ``b""``
        if the zygote closed the connection without one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                return b""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _read_status(self, timeout_s: float | None) -> None:
        if self._conn.fileno() == -1:  # the zygote died: wait on the child itself
            self._wait_orphan(timeout_s)
            return
        line = self._line(timeout_s)
        if line is None:
            return
        self._conn.close()
        if line:
            self._set(json.loads(line)["status"])
        else:  # the zygote died: nobody reaps the child for us now
            self._wait_orphan(timeout_s)

    def _wait_orphan(self, timeout_s: float | None) -> None:
        if self._pidfd is not None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout_s)
            if not ready:
                return
        self._set(-signal.SIGKILL)

    def _set(self, returncode: int) -> None:
        self.returncode = returncode
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
        return self.returncode


class Zygote:
    """``python -m testing.zygote`` started from this process (its parent), and the way to
    fork runners from it."""

    def __init__(self, workdir: Path, preload: Sequence[str] | None = None) -> None:
        """Start one in this process's environment, importing ``preload`` (default:
        ``PRELOAD``), its socket and log in ``workdir``."""
        self.path = str(workdir / "zygote.sock")
        self.log = workdir / "zygote.log"
        self._lock = threading.Lock()
        root = str(Path(__file__).resolve().parents[1])
        ready_r, ready_w = os.pipe()
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "testing.zygote", self.path, str(ready_w), *(preload or ())],
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(ready_w,),
                # OpenBLAS (numpy's) would start a thread pool at import: one thread, no pool
                env={**os.environ, "PYTHONPATH": root, "OPENBLAS_NUM_THREADS": "1"},
                cwd=root,
                # (a Ctrl-C to the tests' group would kill it before the tests stop its children)
                start_new_session=True,
            )
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready_pipe:
            ready, _, _ = select.select([ready_pipe], [], [], 600)
            line = ready_pipe.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"the zygote exited or hung while importing:\n{self.log_tail()}")
        self.missing: list[str] = json.loads(line)["missing"]

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ZygoteChild:
        """Fork a child that runs ``argv`` (``[script, args...]``) as ``python script args``
        would, with exactly ``env``, in ``cwd``, its output in ``log``."""
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
        with self._lock:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                raise RuntimeError(f"the zygote exited ({rc}):\n{self.log_tail()}")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            return ZygoteChild(conn)

    def stop(self) -> None:
        """Stop the zygote (children it forked run on: they are their tests' to stop)."""
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3:] or PRELOAD)
