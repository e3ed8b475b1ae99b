"""Start and stop a throwaway ``redis-server`` (or ``valkey-server``) on a free port.

Used by the tests, the benchmarks and the demo, which must never touch a server they did not
start. Not meant for production: it runs without persistence.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from kvstore.errors import StoreUnavailableError
from kvstore.fleet.functions import LIBRARY
from kvstore.net.server_code import load_library


def add_acl_user(admin: redis.Redis, name: str, rule: str | list[str]) -> None:
    """``ACL SETUSER <name>`` with ``rule`` and the password "pw", the kvstore functions loaded
    first by ``admin``, as an operator does once (docs/operations.md): roles are granted
    ``+fcall`` and never load code themselves."""
    load_library(admin, LIBRARY)
    words = rule.split() if isinstance(rule, str) else list(rule)
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", *words)


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes the local ports of outgoing connections from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(below: int | None = None) -> int:
    """A loopback port free now (under ``below``, if given), below the ephemeral range: a port
    the kernel hands out for port 0 is one it also gives outgoing connections (Redis clients,
    HTTP calls), so one found free could be some connection's local port by the time a server
    binds it (CI's engines lane saw the proxy exit with "address already in use"). Tests'
    servers bind seconds later (vLLM tens of seconds), so a port outside that range is only
    ever taken by another test's pick."""
    low, _ = _ephemeral_ports()
    low = min(low, below) if below is not None else low
    first = 12000
    for _ in range(200):
        port = random.randrange(first, low) if low - first > 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free loopback port in [{first}, {low})")


def free_cluster_port() -> int:
    """A free port for a Cluster node: its bus port (port + 10000) must be free too, and below
    the ephemeral range as well (a review: 57 % of bus ports fell inside it)."""
    while True:
        port = free_port(below=_ephemeral_ports()[0] - 10000)
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


# The servers besides the system's redis-server that the integration tests run against:
# unpacked by scripts/setup.sh into <venv>/servers/<name>/ (KVSTORE_SERVERS overrides the dir).
EXTRA_SERVERS = {
    "redis-6.2": "redis-server",
    "valkey-8.1": "valkey-server",
    "valkey-9.1": "valkey-server",
}


def server_binary(name: str) -> str:
    """The path of a named server build: "redis" (the system's) or a key of EXTRA_SERVERS."""
    if name == "redis":
        return find_server_binary()
    root = Path(os.environ.get("KVSTORE_SERVERS", Path(sys.prefix) / "servers"))
    path = root / name / EXTRA_SERVERS[name]
    if not path.exists():
        raise StoreUnavailableError(
            f"{path} is missing: `bash scripts/setup.sh` unpacks the {name} server there"
        )
    return str(path)


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
        """Start the server; a no-op while it runs, so ``with RedisServer().start() as s``
        does not start a second process that cannot bind the port (and leak the first)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
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

    def __init__(
        self,
        service: str,
        master_port: int,
        *,
        down_after_ms: int = 1000,
        password: str | None = None,
    ) -> None:
        """``password``: the sentinel's own (``requirepass``), and the master's it uses."""
        self.port = free_port()
        self.service = service
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvstore-sentinel-{self.port}-"))
        self.conf = self.dir / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} 10000\n"
            f"sentinel parallel-syncs {service} 1\n"
            + (
                f"requirepass {password}\nsentinel auth-pass {service} {password}\n"
                if password
                else ""
            )
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
                redis.Redis(port=self.port, socket_timeout=1, password=self.password).ping()
                return self
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                time.sleep(0.05)
        self.cleanup()
        raise StoreUnavailableError(f"redis-sentinel did not answer on port {self.port} in time")

    def master_port(self) -> int:
        client = redis.Redis(port=self.port, socket_timeout=1, password=self.password)
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


class ClusterServers:
    """A Redis/Valkey Cluster on loopback: ``masters`` masters with ``replicas`` replicas each,
    created with ``redis-cli --cluster create`` (``valkey-cli`` for a valkey-server binary).
    Fast failover (``cluster-node-timeout``) so fault tests take seconds."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        *,
        binary: str | None = None,
        node_timeout_ms: int = 1000,
        extra_args: list[str] | None = None,
        tls: dict[str, str] | None = None,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.masters = masters
        self.replicas = replicas
        args = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms)]
        # a node keeps serving its slots when another shard is down (the client decides)
        args += ["--cluster-require-full-coverage", "no", *(extra_args or [])]
        self.nodes = [
            RedisServer(free_cluster_port(), binary=self.binary, extra_args=list(args))
            for _ in range(masters * (1 + replicas))
        ]
        for node in self.nodes:  # each node's cluster state file lives in its own directory
            node.extra_args += ["--cluster-config-file", str(node.dir / "nodes.conf")]
        # tls: {"ca", "cert", "key"} files; then clients, replication and the bus use TLS only
        self.tls = tls
        for node in self.nodes if tls else []:
            node.extra_args += [
                "--tls-port", str(node.port), "--port", "0", "--tls-cluster", "yes",
                "--tls-replication", "yes", "--tls-cert-file", tls["cert"],  # type: ignore[index]
                "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"],  # type: ignore[index]
                "--tls-auth-clients", "no",
            ]  # fmt: skip

    @property
    def url(self) -> str:
        return self.url_for("rediss-cluster" if self.tls else "redis-cluster")

    def url_for(self, scheme: str) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters])
        return f"{scheme}://{seeds}"

    def cli_binary(self) -> str:
        name = "valkey-cli" if "valkey" in Path(self.binary).name else "redis-cli"
        sibling = Path(self.binary).with_name(name)
        found = (
            str(sibling) if sibling.exists() else shutil.which(name) or shutil.which("redis-cli")
        )
        if not found:
            raise StoreUnavailableError(f"no {name} next to {self.binary} or on PATH")
        return found

    def start(self, timeout_s: float = 30.0) -> ClusterServers:
        try:
            for node in self.nodes:
                node.start()
            if self.replicas == 0:  # redis-cli wants 3+ masters; 1 or 2 are assigned by hand
                self._assign_slots_by_hand()
                self.wait_healthy(timeout_s)
                return self
            subprocess.run(
                [self.cli_binary(), "--cluster", "create"]
                + [f"127.0.0.1:{n.port}" for n in self.nodes]
                + ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
                + (["--tls", "--cacert", self.tls["ca"]] if self.tls else []),
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )
            self.wait_healthy(timeout_s)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _assign_slots_by_hand(self) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            first, last = 16384 * i // n, 16384 * (i + 1) // n - 1
            self.client(node).execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
            if i:
                self.client(node).execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[0].port)

    def client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(unix_socket_path=node.unix_socket, socket_timeout=2)

    def add_master_without_slots(self, timeout_s: float = 30.0) -> RedisServer:
        """A node started like the others and met by the Cluster, serving no slot yet: the
        first step of a scale-out (``CLUSTER SLOTS`` does not name it until it serves one).
        Cleaned up with the rest; not counted in ``masters``."""
        if self.tls:
            raise NotImplementedError("a TLS Cluster's new node is not set up here")
        first = self.nodes[0]
        # (the first's arguments, its own state file last)
        node = RedisServer(
            free_cluster_port(), binary=self.binary, extra_args=first.extra_args[:-1]
        )
        node.extra_args.append(str(node.dir / "nodes.conf"))
        self.nodes.append(node)
        node.start()
        self.client(node).execute_command("CLUSTER MEET", "127.0.0.1", first.port)
        known = str(len(self.nodes))
        deadline = time.monotonic() + timeout_s
        while any(
            (info := self.client(n).cluster("info")).get("cluster_known_nodes") != known
            or info.get("cluster_state") != "ok"
            for n in (node, *self.master_nodes())
        ):
            if time.monotonic() > deadline:
                raise StoreUnavailableError("the new node was not met by the Cluster in time")
            time.sleep(0.05)
        return node

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and ``masters`` masters serve all
        16384 slots; with every node alive, each master also has a replica attached (after a
        node was killed, its master has none to wait for)."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                live = [n for n in self.nodes if n.proc is not None]
                states = [self.client(n).cluster("info") for n in live]
                masters = self.master_nodes()
                ok = all(s.get("cluster_state") == "ok" for s in states)
                ok = ok and all(int(s["cluster_slots_ok"]) == 16384 for s in states)
                ok = ok and len(masters) == self.masters
                if ok and self.replicas and len(live) == len(self.nodes):
                    ok = all(
                        int(self.client(m).info("replication")["connected_slaves"]) >= 1
                        for m in masters
                    )
                if ok:
                    return
                last = str(states[0])
            except (redis.exceptions.RedisError, OSError, KeyError) as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise StoreUnavailableError(f"the cluster did not become healthy in time: {last}")

    def master_nodes(self) -> list[RedisServer]:
        """The live nodes that are masters now (a replica promoted by a failover counts)."""
        out = []
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                if self.client(node).info("replication")["role"] == "master":
                    out.append(node)
            except (redis.exceptions.RedisError, OSError):
                continue
        return out

    def node_of(self, key: str) -> RedisServer:
        """The live master serving ``key``'s slot."""
        slot = int(self.client(self.master_nodes()[0]).cluster("keyslot", key))
        for node in self.master_nodes():
            for rng in self.client(node).cluster("slots"):
                if rng[0] <= slot <= rng[1] and int(rng[2][1]) == node.port:
                    return node
        raise StoreUnavailableError(f"no live master serves slot {slot}")

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def __enter__(self) -> ClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
