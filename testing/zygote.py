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
single-threaded OpenBLAS.

vLLM starts a server's engine core and every engine core's worker with ``spawn`` (forced on
CPU). In a zygote child, spawn's executable is ``testing/zygote_shim.py``: the zygote forks
those too, handing each the descriptors the spawning process passed, while the shim stands in
for it as the spawner's child (see there). ``KVSTORE_TEST_ZYGOTE_SPAWN=0`` in the zygote's
environment leaves them to start from scratch.

Start it through ``Zygote`` (``python -m testing.zygote SOCKET READY_FD [MODULE ...]``: what
to import, by default ``PRELOAD``). It exits when its parent does, or on SIGTERM. Tests only:
nothing shipped uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import importlib.util
import json
import multiprocessing.spawn
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
import types
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


def place_fds(targets: list[int], received: list[int]) -> None:
    """Put each received descriptor at the number it had in the asker (``targets``), as
    ``pass_fds`` would have: via free numbers above both lists, so none is overwritten early."""
    base = max([*targets, *received, 2]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)
        os.close(fd)


def die_with(asker: int) -> None:
    """Kill this process when ``asker`` (the shim standing in for it) ends first."""
    try:
        pidfd = os.pidfd_open(asker)
    except OSError:  # gone already
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-asker-watch", daemon=True).start()


def cpu_list(spec: str) -> set[int]:
    """The CPUs of a ``GOMP_CPU_AFFINITY`` list: ``"0 1"``, ``"0,2"``, ``"0-7"``, ``"0-7:2"``."""
    cpus: set[int] = set()
    for item in spec.replace(",", " ").split():
        span, _, stride = item.partition(":")
        first, _, last = span.partition("-")
        cpus.update(range(int(first), int(last or first) + 1, int(stride or 1)))
    return cpus


def apply_openmp_env() -> None:
    """Do what libgomp does with ``OMP_NUM_THREADS`` and ``GOMP_CPU_AFFINITY`` when a process
    loads it. A forked child loaded it in the zygote, before its environment was set; vLLM sets
    both for each worker it spawns (one thread per core it binds the worker to), and a worker
    forked without them computed 1.6x slower, its threads on every core."""
    affinity = os.environ.get("GOMP_CPU_AFFINITY", "")
    if affinity.strip():
        os.sched_setaffinity(0, cpu_list(affinity))  # (the threads it starts inherit it)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def run_child(
    request: dict[str, Any], inherited: list[socket.socket], received: list[int], shim: str
) -> None:
    """In the forked child: become the process the request describes; never returns.
    ``inherited``: the zygote's sockets (its listener, every asker's connection), closed here
    so that a zygote's death still ends its askers' connections. ``received``: the asker's
    descriptors (a spawn through ``shim``), or none (a test's request, with a log file).
    ``shim``: multiprocessing's spawn executable here, so the child's own spawns fork too."""
    code = 1
    try:
        for sock in inherited:
            sock.close()
        os.setsid()  # its own process group, as ``start_new_session=True`` gives
        if "fds" in request:  # a spawn: its standard streams and pipes are the asker's
            place_fds(request["fds"], received)
            die_with(request["asker"])
        else:
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            stdout = request.get("stdout")
            out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stdout else log
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out, 1)
            os.dup2(log, 2)
            for fd in {log, out, devnull}:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        apply_openmp_env()
        if shim:
            multiprocessing.spawn.set_executable(shim)
        argv = list(request["argv"])
        if argv[0] == "-m":  # python -m MODULE args...
            spec = importlib.util.find_spec(argv[1])
            sys.argv = [spec.origin if spec and spec.origin else argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":  # python -c PROGRAM args... (multiprocessing's spawn)
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
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


def write_shim(path: str) -> str:
    """``testing/zygote_shim.py`` as an executable beside the socket, naming this interpreter
    and the socket; "" when ``KVSTORE_TEST_ZYGOTE_SPAWN=0``."""
    if os.environ.get("KVSTORE_TEST_ZYGOTE_SPAWN", "1") == "0":
        return ""
    source = (Path(__file__).parent / "zygote_shim.py").read_text()
    source = source.replace('ZYGOTE_SOCKET = ""', f"ZYGOTE_SOCKET = {path!r}", 1)
    shim = str(Path(path).with_suffix(".shim"))
    with open(shim, "w") as f:
        f.write(f"#!{sys.executable} -S\n{source}")
    os.chmod(shim, 0o755)
    return shim


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON line from an asker, and the descriptors sent with it (a shim's)."""
    buffer, fds = b"", list[int]()
    deadline = time.monotonic() + 10  # (one slow asker holds up every fork: not for long)
    try:
        while b"\n" not in buffer:
            conn.settimeout(max(0.0, deadline - time.monotonic()))
            chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 256)
            fds += more
            if not chunk:
                raise ValueError("the asker closed its connection before a whole request")
            buffer += chunk
        return json.loads(buffer.split(b"\n", 1)[0]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def serve(path: str, ready_fd: int, modules: Sequence[str] = PRELOAD) -> None:
    """Import ``modules``, say so on ``ready_fd`` (one JSON line: a pipe of its own, since
    vLLM's logging writes to stdout), then fork for every request on ``path``."""
    missing = preload(modules)
    if os_threads() != 1:  # a fork would copy locks that other threads hold
        raise SystemExit(f"zygote: {os_threads()} threads after the imports; cannot fork safely")
    parent = os.getppid()
    # the orphans of its children (a shim whose spawner was killed) become its to reap
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    shim = write_shim(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with os.fdopen(ready_fd, "w") as ready_pipe:  # (closed: no child inherits it)
        ready_pipe.write(json.dumps({"ready": True, "missing": missing}) + "\n")
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # (its parent gone, nobody would ask again)
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            received: list[int] = []
            try:
                request, received = read_request(conn)
                conn.settimeout(10)  # (its replies: a pid, then a status)
                # (a SIGTERM the asker passes on at once must not meet this process's handler)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                pid = os.fork()
            except (OSError, ValueError) as e:  # the asker sees its connection closed
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                print(f"zygote: a request failed: {e!r}", file=sys.stderr, flush=True)
                for fd in received:
                    os.close(fd)
                conn.close()
                continue
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                run_child(request, [listener, conn, *children.values()], received, shim)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            for fd in received:  # (the child's now)
                os.close(fd)
            children[pid] = conn
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # none at all
                break
            if pid == 0:
                break
            asker = children.pop(pid, None)  # (None: an orphan of a child, or an import's)
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


def vllm_ld_preload(current: str = "") -> str:
    """``LD_PRELOAD`` as vLLM's CPU platform sets it for the processes it spawns: PyTorch's own
    libgomp (thread binding uses one core otherwise, vLLM issue 27369) and vLLM's tcmalloc.
    A library is loaded when a process starts, so the zygote needs them from its start for the
    engine cores and workers it forks to run with what vLLM would have given them. (Found
    without importing torch or vLLM here: their packages' paths.)"""
    found = []
    searched = {
        "vllm": ("libs/libtcmalloc_minimal*.so*", "libs/libtcmalloc.so*"),
        "torch": ("../torch.libs/libgomp*.so*", "lib/libgomp*.so*"),
    }
    for package, patterns in searched.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for pattern in patterns:
            matches = sorted(root.glob(pattern))
            if matches:
                found.append(str(matches[0].resolve()))
                break
    kept = [lib for lib in current.split(":") if lib]
    libs = [lib for lib in found if Path(lib).name.split(".")[0] not in " ".join(kept)]
    return ":".join([*kept, *libs])


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
                # OpenBLAS (numpy's) would start a thread pool at import: one thread, no pool;
                # the libraries vLLM preloads in the processes it spawns, loaded from the start
                env={
                    **os.environ,
                    "PYTHONPATH": root,
                    "OPENBLAS_NUM_THREADS": "1",
                    "LD_PRELOAD": vllm_ld_preload(os.environ.get("LD_PRELOAD", "")),
                },
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

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: Path, log: Path, stdout: Path | None = None
    ) -> ZygoteChild:
        """Fork a child that runs ``argv`` (``[script, args...]``) as ``python script args``
        would, with exactly ``env``, in ``cwd``, its output in ``log`` (its standard output in
        ``stdout`` where given)."""
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
        if stdout is not None:
            request["stdout"] = str(stdout)
        with self._lock:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                raise RuntimeError(f"the zygote exited ({rc}):\n{self.log_tail()}")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            return ZygoteChild(conn)

    def stop(self) -> None:
        """Stop the zygote. The children it forked for tests run on (they are their tests' to
        stop); the processes it forked for their spawns end with their shims, which end with it."""
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
