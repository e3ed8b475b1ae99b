"""docker-compose files: valid (checked by docker-compose itself when installed, as the README's
test command does) and wired right: every vLLM service points at the Redis service, roles match
the proxy's prefill/decode targets, and only the proxy is published."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FILES = ["docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.cluster.yml"]
CLUSTER_NODES = [f"store-{n}" for n in range(1, 7)]


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
    cluster = name == "docker-compose.cluster.yml"
    stores = [*CLUSTER_NODES, "store-cluster-init"] if cluster else ["redis"]
    assert set(services) == {*stores, "vllm-prefill", "vllm-decode", "proxy"}
    url = (
        "redis-cluster://store-1:6379,store-2:6379,store-3:6379"
        if cluster
        else "redis://redis:6379/0"
    )
    # the vLLM servers start once the store is ready: healthy, or the cluster created
    ready = (
        {"store-cluster-init": "service_completed_successfully"}
        if cluster
        else {"redis": "service_healthy"}
    )
    roles = {}
    for svc in ("vllm-prefill", "vllm-decode"):
        kv = kv_config(services[svc])
        assert kv["kv_connector"] == "RedisConnector"
        assert kv["kv_load_failure_policy"] == "recompute"
        assert kv["kv_connector_extra_config"]["url"] == url
        assert {d: c["condition"] for d, c in services[svc]["depends_on"].items()} == ready
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
    for store in [s for s in stores if s != "store-cluster-init"]:
        cmd = services[store]["command"]
        for flag in ("--save", "--maxmemory ", "--maxmemory-policy volatile-ttl", "--io-threads"):
            assert flag in cmd
        assert ("--cluster-enabled yes" in cmd) is cluster
        assert services[store]["image"] == "valkey/valkey:9"  # from .env: STORE_IMAGE
    if cluster:
        init = services["store-cluster-init"]
        assert init["restart"] == "no" and "--cluster-replicas 1" in init["command"][0]
        assert {d: c["condition"] for d, c in init["depends_on"].items()} == {
            n: "service_healthy" for n in CLUSTER_NODES
        }
    gpu = [
        d["device_ids"]
        for s in ("vllm-prefill", "vllm-decode")
        for d in services[s].get("deploy", {}).get("resources", {}).get("reservations", {})
        .get("devices", [])
    ]  # fmt: skip
    if name != "docker-compose.cpu.yml":
        assert gpu == [["0"], ["1"]]  # each on its own GPU (from .env)
    else:
        assert gpu == []


def test_the_store_image_is_selectable_in_every_variant(tmp_path: Path) -> None:
    """Redis instead of Valkey: image, server and CLI come from STORE_* in every file."""
    env = {"STORE_IMAGE": "redis:7.2", "STORE_SERVER": "redis-server"}
    env["STORE_CLI"] = "redis-cli"
    for name in FILES:
        out = subprocess.run(
            ["docker-compose", "-f", name, "config"], cwd=ROOT, capture_output=True, text=True,
            env={**os.environ, **env},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        stores = [s for s in services if s == "redis" or s.startswith("store-")]
        for store in stores:
            assert services[store]["image"] == "redis:7.2"
            if store != "store-cluster-init":
                assert services[store]["command"].startswith("redis-server ")
                assert services[store]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
            else:
                assert "cli=redis-cli" in services[store]["command"][0]


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


def test_a_tenant_gets_a_stack_of_its_own_by_project_name() -> None:
    """docs/operations.md ("Tenants"): hard memory isolation is a store per tenant, run as one
    compose project per tenant; the second one's port, GPUs and cache size come from the
    environment, and nothing it runs is shared with the first's."""
    env = {**os.environ, "PROXY_PORT": "8001", "PREFILL_GPU": "2", "DECODE_GPU": "3"}
    env["REDIS_MAXMEMORY"] = "4gb"
    out = subprocess.run(
        ["docker-compose", "-p", "tenant-b", "-f", "docker-compose.yml", "config"],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    services = cfg["services"]
    (port,) = services["proxy"]["ports"]  # docker-compose 1.x writes a string, 2.x a mapping
    assert ":8001:" in port if isinstance(port, str) else str(port["published"]) == "8001"
    assert "--maxmemory 4gb" in services["redis"]["command"]
    gpus = [
        services[s]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for s in ("vllm-prefill", "vllm-decode")
    ]
    assert gpus == [["2"], ["3"]]
    assert kv_config(services["vllm-decode"])["kv_connector_extra_config"]["url"] == (
        "redis://redis:6379/0"  # the redis of its own project's network
    )
