"""An fp8 KV cache (``--kv-cache-dtype fp8``, which vLLM's CPU attention runs on AVX-512 or
AMX hosts) end to end: saved and loaded as the bytes it is, bit-identical to a connector-less
fp8 engine, stored one byte per element, and never loaded by an instance whose cache holds
another dtype.

Engines each in its own process with one pinned core, on one Redis (``plain`` beside ``saver``,
then the others one after another):
- ``plain``: fp8 cache, no connector; a 700-token prompt, then prompts sharing its first 640
  tokens (five 128-token blocks), which vLLM's local prefix cache serves;
- ``saver``: the same, a share-mode connector against an empty Redis (it saves);
- ``loader``: a fresh fp8 share-mode instance given only the sharing prompts: it loads them;
- ``auto_loader``: the same with the model's own dtype for its cache: nothing of fp8 is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testing.e2e import assert_loaded_like_plain, plain_saver_loader, tokens

# the worker-level fp8 tests (test_connector_worker, test_datamover) run on every release
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

PREFIX = tokens(640, 1)
FIRST = {"first": PREFIX + tokens(60, 2)}
SHARING = {f"share{i}": PREFIX + tokens(60, 10 + i) for i in range(3)}
RUN = {"dtype": "bfloat16", "max_tokens": 16, "core": 0, "kv_cache_dtype": "fp8"}


def _cpu_runs_fp8_kv() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags or "amx_bf16" in flags


pytestmark.append(
    pytest.mark.skipif(not _cpu_runs_fp8_kv(), reason="vLLM's CPU fp8 KV needs AVX-512 or AMX")
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fp8")
    return plain_saver_loader(
        tmp, tiny_model, FIRST, SHARING,
        other_loaders={"auto_loader": {"kv_cache_dtype": None}}, **RUN,
    )  # fmt: skip


def test_an_fp8_server_loading_the_prefix_from_redis_is_bit_identical(
    runs: dict[str, Any],
) -> None:
    for pid, want in runs["plain"]["prompts"].items():
        got = runs["saver"]["prompts"][pid]
        assert (got["token_ids"], got["logprobs"]) == (want["token_ids"], want["logprobs"]), pid
    assert_loaded_like_plain(runs, SHARING, len(PREFIX))
    assert runs["loader"]["metrics"].get("vllm:redis_kv_blocks_loaded", 0) >= 5


def test_blocks_are_stored_as_fp8_and_not_loaded_by_a_cache_of_another_dtype(
    runs: dict[str, Any],
) -> None:
    # the cache's own bytes, one per element, not widened (vLLM's CPU backend keeps an fp8
    # cache in uint8 storage; which fp8 it is, is in the fingerprint: kv_cache_dtype)
    assert runs["dtypes"] in (["U8"], ["F8_E4M3"])
    assert runs["auto_loader"]["metrics"].get("vllm:redis_kv_blocks_loaded", 0) == 0
    # the first is computed, not loaded (another fingerprint: other keys); the rest find the
    # prefix in its own GPU cache
    assert runs["auto_loader"]["prompts"]["share0"]["num_cached_tokens"] == 0
