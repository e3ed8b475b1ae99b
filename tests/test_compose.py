"""docker-compose files: valid (checked by docker-compose itself when installed, as the README's
test command does) and wired right: every vLLM service points at the Redis service, roles match
the proxy's prefill/decode targets, and only the proxy is published."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]


def resolved(name: str) -> dict:
    if not shutil.which("docker-compose"):
        pytest.fail("docker-compose is not installed; the README's test command installs it")
    out = subprocess.run(
        ["docker-compose", "-f", name, "config"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def kv_config(service: dict) -> dict:
    args = [a for a in service["command"] if a.startswith("--kv-transfer-config=")]
    assert len(args) == 1
    return json.loads(args[0].split("=", 1)[1])


@pytest.mark.parametrize("name", FILES)
def test_compose_file_is_valid_and_wired(name: str) -> None:
    cfg = resolved(name)
    services = cfg["services"]
    assert set(services) == {"redis", "vllm-prefill", "vllm-decode", "proxy"}
    roles = {}
    for svc in ("vllm-prefill", "vllm-decode"):
        kv = kv_config(services[svc])
        assert kv["kv_connector"] == "RedisConnector"
        assert kv["kv_load_failure_policy"] == "recompute"
        assert kv["kv_connector_extra_config"]["url"] == "redis://redis:6379/0"
        assert services[svc]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "healthcheck" in services[svc]
        assert "--port=8000" in services[svc]["command"]
        roles[svc] = kv["kv_role"]
    assert roles == {"vllm-prefill": "kv_producer", "vllm-decode": "kv_consumer"}
    proxy = services["proxy"]
    cmd = proxy["command"]
    assert cmd[cmd.index("--prefill") + 1] == "http://vllm-prefill:8000"
    assert cmd[cmd.index("--decode") + 1] == "http://vllm-decode:8000"
    assert {d: c["condition"] for d, c in proxy["depends_on"].items()} == {
        "vllm-prefill": "service_healthy",
        "vllm-decode": "service_healthy",
    }
    published = {s: v.get("ports") for s, v in services.items() if v.get("ports")}
    assert list(published) == ["proxy"]
    redis_cmd = services["redis"]["command"]
    for flag in ("--save", "--maxmemory ", "--maxmemory-policy volatile-ttl", "--io-threads"):
        assert flag in redis_cmd
    gpu = [
        d["device_ids"]
        for s in ("vllm-prefill", "vllm-decode")
        for d in services[s].get("deploy", {}).get("resources", {}).get("reservations", {})
        .get("devices", [])
    ]  # fmt: skip
    if name == "docker-compose.yml":
        assert gpu == [["0"], ["1"]]  # each on its own GPU (from .env)
    else:
        assert gpu == []


def test_env_file_documents_every_variable_the_compose_files_use() -> None:
    import re

    env = {
        line.split("=", 1)[0]
        for line in (ROOT / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    }
    used = set()
    for name in FILES:
        used |= set(re.findall(r"\$\{([A-Z_]+)", (ROOT / name).read_text()))
    assert used <= env, f"not in .env: {sorted(used - env)}"
