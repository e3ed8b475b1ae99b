"""The one-command demo's failure messages (its happy path is the README's first command, and
the same stack runs in test_e2e_serving.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from testing.redis_server import free_port
from tests.conftest import ROOT


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.serve_demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},  # a narrow console: long lines must not wrap
    )


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_a_taken_port_fails_with_a_clear_message(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_demo("--proxy-port", str(port), "--workdir", str(tmp_path))
    assert out.returncode == 1
    assert f"proxy port {port} already in use" in one_line(out.stdout)


def test_a_model_directory_without_config_fails_clearly(tmp_path) -> None:
    ports = [str(free_port()) for _ in range(4)]
    out = run_demo(
        "--model", str(tmp_path),
        "--proxy-port", ports[0], "--prefill-port", ports[1],
        "--decode-port", ports[2], "--redis-port", ports[3],
    )  # fmt: skip
    assert out.returncode == 1
    # the whole message on one line, whatever the path's length
    assert f"--model {tmp_path.resolve()} has no config.json" in out.stdout.splitlines()[-1]
