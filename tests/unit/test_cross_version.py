"""A block saved under one vLLM release loads under another when the layout matches: RedisConnector
saves in this process and loads in each other version's virtualenv, and the other way round.

The other versions' virtualenvs are the ones ``VLLM_VERSION=... bash scripts/setup.sh`` builds
(``.ci/run`` builds them and runs this test under each); without any, this test is skipped."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis

pytest.importorskip("vllm")

import vllm

from testing import cross_version

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def peer_pythons() -> list[tuple[str, Path]]:
    """(vLLM version, python) of every project virtualenv whose vLLM differs from ours."""
    peers = []
    for python in [ROOT / ".venv" / "bin" / "python", *sorted(ROOT.glob(".venvs/*/bin/python"))]:
        if not python.exists():
            continue
        version = subprocess.run(
            [str(python), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if version and version != vllm.__version__:
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
    peers = peer_pythons()
    if not peers:
        pytest.skip(
            f"no virtualenv with another vLLM than {vllm.__version__}; build one with "
            "VLLM_VERSION=0.30.0 bash scripts/setup.sh"
        )
    for version, python in peers:
        redis.Redis.from_url(redis_url).flushall()
        theirs = run_peer(python, "save", redis_url, tiny_model)
        ours = cross_version.load(tiny_model, redis_url)
        assert theirs["vllm"] == version
        assert ours["fingerprint"] == theirs["fingerprint"], version
        assert ours["intact"] == cross_version.NUM_BLOCKS, f"saved under {version}"

        redis.Redis.from_url(redis_url).flushall()
        cross_version.save(tiny_model, redis_url)
        back = run_peer(python, "load", redis_url, tiny_model)
        assert back["intact"] == cross_version.NUM_BLOCKS, f"loaded under {version}"
