"""Start and stop a throwaway ``redis-server`` (or ``valkey-server``) on a free port.

Used by the tests, the benchmarks and the demo, which must never touch a server they did not
start. Not meant for production: it runs without persistence.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from kvstore.errors import StoreUnavailableError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A free port for a Cluster node: its bus port (port + 10000) must exist and be free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def find_server_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    raise StoreUnavailableError(
        "no redis-server or valkey-server on PATH: install one "
        "(Debian/Ubuntu: `sudo apt-get install redis-server`)"
    )


def terminate(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL after 10 s; nothing if it is not running."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """A redis-server child process listening on 127.0.0.1:<port> and a unix socket."""

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: list[str] | None = None,
        password: str | None = None,
        binary: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.binary = binary or find_server_binary()
        self.extra_args = list(extra_args or [])
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvstore-redis-{self.port}-"))
        self.unix_socket = str(self.dir / "redis.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_socket}?db=0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", self.unix_socket,
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise StoreUnavailableError(
                    f"redis-server exited with code {self.proc.returncode} "
                    f"(port {self.port}):\n{log}"
                )
            try:
                # the unix socket answers whatever the TCP/TLS setup is
                client = redis.Redis(
                    unix_socket_path=self.unix_socket, password=self.password, socket_timeout=1
                )
                client.ping()
                client.close()
                return self
            except redis.exceptions.AuthenticationError:
                return self
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                time.sleep(0.05)
            except redis.exceptions.ResponseError:  # e.g. still loading
                time.sleep(0.05)
        self.stop()
        raise StoreUnavailableError(f"redis-server did not answer on port {self.port} in time")

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class SentinelServer:
    """A Redis Sentinel on 127.0.0.1:<port> watching one master (quorum 1, fast failover)."""

    def __init__(self, service: str, master_port: int, *, down_after_ms: int = 1000) -> None:
        self.port = free_port()
        self.service = service
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvstore-sentinel-{self.port}-"))
        self.conf = self.dir / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} 10000\n"
            f"sentinel parallel-syncs {service} 1\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, scheme: str = "redis-sentinel") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/{self.service}"

    def start(self, timeout_s: float = 10.0) -> SentinelServer:
        self.proc = subprocess.Popen(
            [find_server_binary(), str(self.conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return self
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                time.sleep(0.05)
        self.cleanup()
        raise StoreUnavailableError(f"redis-sentinel did not answer on port {self.port} in time")

    def master_port(self) -> int:
        client = redis.Redis(port=self.port, socket_timeout=1)
        addr = client.sentinel_get_master_addr_by_name(self.service)
        if not isinstance(addr, tuple):
            raise StoreUnavailableError(f"the sentinel knows no master {self.service!r}")
        return int(addr[1])

    def cleanup(self) -> None:
        terminate(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
