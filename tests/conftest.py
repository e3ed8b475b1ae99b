from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from kvstore import LookupBuffer
from testing.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_client() -> Iterator[fakeredis.FakeRedis]:
    client = fakeredis.FakeRedis()
    yield client
    client.flushall()


@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeRedis:
    """Every store the code under test opens, whatever its URL, is one fakeredis server
    (``.server``: set ``connected = False`` to take it away)."""
    import kvstore.lookup_buffer

    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    monkeypatch.setattr(
        kvstore.lookup_buffer, "make_client", lambda *a, **k: fakeredis.FakeRedis(server=server)
    )
    client.server = server  # type: ignore[attr-defined]
    return client


@pytest.fixture
def fake_buffer(fake_client: fakeredis.FakeRedis) -> LookupBuffer:
    return LookupBuffer(fake_client, namespace="test", layout={"model": "unit"})


def _need_redis_binary() -> None:
    if not (shutil.which("redis-server") or shutil.which("valkey-server")):
        pytest.fail("redis-server is not installed; the README's test command installs it")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free port for the whole session (never the default port)."""
    _need_redis_binary()
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A server this test alone may stop, kill, restart or reconfigure."""
    _need_redis_binary()
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed CA and a server certificate for 127.0.0.1, made with openssl."""
    if not shutil.which("openssl"):
        pytest.fail("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kvstore-test-ca")  # fmt: skip
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
        "-out", "server.csr", "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return {k: str(d / f) for k, f in
            {"ca": "ca.crt", "cert": "server.crt", "key": "server.key"}.items()}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on GPU machines only)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("KVSTORE_SKIP_E2E") == "1":
        skip_e2e = pytest.mark.skip(reason="KVSTORE_SKIP_E2E=1")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip_e2e)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama model made locally by scripts/make_tiny_model.py (no downloads)."""
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(out)],
        check=True,
        capture_output=True,
    )
    return out
