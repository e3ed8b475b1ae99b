"""The connector behind another tier, composed by vLLM's ``MultiConnector`` on a real vLLM CPU
engine. vLLM's OffloadingConnector (its CPU tier) runs on CUDA and XPU only, so the first child
here is vLLM's ``ExampleConnector`` (KV in files), which runs on the CPU build and answers as a
local tier does: first, for what it holds.

One engine, one prompt four times, vLLM's own prefix cache cleared in between: computed and
saved by both children; loaded by the first child, which holds it; then -- the first child's
files gone -- loaded from Redis. Each load is bit for bit the computed run, and Redis is read
only when the first child has nothing (MultiConnector lets the first child with a hit load)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from testing.e2e import PATIENT, finish, release, start_engine, tokens, wait_at_gate

# default release only (CI time): MultiConnector's choice of child is the same code in 0.32 and
# 0.33, and this connector's side of it (a hit it reported, then 0 tokens allocated) is
# covered on every release by the scheduler tests
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

BLOCK = 128  # vLLM's default block size on CPU
PROMPT = tokens(2 * BLOCK + 30, 23)  # two full blocks either child may load


def test_behind_a_local_tier_redis_loads_only_what_the_tier_lacks_bit_for_bit(
    tmp_path: Path, tiny_model: Path, redis_url: str
) -> None:
    storage = tmp_path / "example-kv"
    children = {
        "connectors": [
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)},
            },
            {
                "kv_connector": "RedisConnector",
                "kv_connector_module_path": "connector.redis_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"url": redis_url, "mode": "share", **PATIENT},
            },
        ]
    }
    gate = tmp_path / "tier-emptied"
    phases = [
        [{"id": "computed", "prompt_token_ids": PROMPT}],
        "reset-local",
        [{"id": "from-tier", "prompt_token_ids": PROMPT}],
        "reset-local",  # the gate: the test empties the first child before this phase
        [{"id": "from-redis", "prompt_token_ids": PROMPT}],
    ]
    job = start_engine(
        tmp_path,
        "multi",
        tiny_model,
        phases,  # type: ignore[arg-type]
        0,
        role="kv_both",
        url=redis_url,
        extra=children,
        connector="MultiConnector",
        gates={3: gate},
        # stepping on its own as a server does: an in-process engine steps only inside
        # generate(), and a request's saves then outlast its phase
        separate_processes=True,
    )
    wait_at_gate(gate)
    assert storage.exists() and any(storage.iterdir()), "the first child saved nothing"
    shutil.rmtree(storage)  # the local tier lost it (evicted, another host)
    release(gate)
    run = finish(job)

    got = run["prompts"]
    computed = got["computed"]
    assert computed["num_cached_tokens"] == 0
    for name in ("from-tier", "from-redis"):
        assert got[name]["num_cached_tokens"] == 2 * BLOCK, name  # an external hit, loaded
        assert got[name]["token_ids"] == computed["token_ids"], name
        assert got[name]["logprobs"] == computed["logprobs"], name  # bit for bit
    metrics = run["metrics"]
    # Redis saved both blocks once, and loaded them only when the first child had nothing
    assert metrics["vllm:redis_kv_blocks_saved"] == 2
    assert metrics["vllm:redis_kv_blocks_loaded"] == 2
    assert metrics["vllm:redis_kv_blocks_load_failed"] == 0
    assert storage.exists(), "the first child saved the prompt again after Redis loaded it"
