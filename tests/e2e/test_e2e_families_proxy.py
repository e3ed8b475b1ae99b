"""Consume mode through the proxy, as deployed, for the model families with several KV-cache
groups: a sliding-window model (a full-attention group and a windowed one) and a gated
delta-net hybrid (an attention group and a state group per linear-attention layer). The
engine-level tests (test_e2e_sliding_window.py, test_e2e_state_groups.py) hand the producer's
``kv_transfer_params`` over directly; here vLLM's OpenAI servers and ``vllm-redis-proxy`` carry
them, the way a user runs it.

Per family: a connector-less server (every prompt twice; the second answer has its prefix from
vLLM's local cache), and prefill (``kv_producer``) + decode (``kv_consumer``) servers behind the
proxy. Each answer through the proxy must equal the warm connector-less answer, token for token
and logprob for logprob, with the prefix loaded from Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testing import stack
from testing.e2e import make_model, tokens, zygote
from testing.redis_server import RedisServer, free_port

# the families' vLLM side runs on every release in their engine-level files; this adds the
# serving path, which is release-independent glue (CI time)
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

FAMILIES: dict[str, dict[str, Any]] = {
    "sliding_window": {
        "model": ("--layers", "4", "--sliding-window", "192"),
        "server_args": [],
        "prefix": 640,
        "hit": 5 * 128,  # every 128-token block before the last token
        "blocks_loaded": 5,
    },
    "gated_delta_net": {
        "model": ("--family", "qwen3_next", "--layers", "4", "--dtype", "bfloat16"),
        # vLLM ends prefill chunks at multiples of --block-size: the state block size here
        "server_args": ["--block-size", "384", "--dtype", "bfloat16"],
        "prefix": 900,
        "hit": 2 * 384,  # the last state boundary before each prompt's last token
        "blocks_loaded": 2,
    },
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    family = FAMILIES[request.param]
    model = make_model(tmp_path_factory, f"tiny-{request.param}", *family["model"])
    logs = tmp_path_factory.mktemp(f"proxy-{request.param}")
    s = stack.Stack()
    with RedisServer() as server:
        try:
            common = {"model": str(model), "redis_url": server.url, "log_dir": logs,
                      "extra_args": family["server_args"], "fork_from": zygote()}  # fmt: skip
            plain = s.add(stack.vllm_server("plain", port=free_port(), role=None, core=0,
                                            **common))  # fmt: skip
            pre = s.add(stack.vllm_server("prefill", port=free_port(), role="kv_producer",
                                          core=1, **common))  # fmt: skip
            dec = s.add(stack.vllm_server("decode", port=free_port(), role="kv_consumer",
                                          core=0, **common))  # fmt: skip
            proxy = s.add(stack.proxy([pre.url], [dec.url], free_port(), logs))
            stack.wait_healthy([plain, pre, dec, proxy], timeout_s=900)
            yield {"family": family, "plain": plain.url, "decode": dec.url, "proxy": proxy.url}
        finally:
            s.stop()


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "logprobs": 1}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    answer = r.json()
    choice = answer["choices"][0]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return {
        "text": choice["text"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached": details.get("cached_tokens") or 0,
    }


def loaded_blocks(url: str) -> float:
    return stack.metric_totals(url, ("vllm:redis_kv_blocks_loaded_total",))[
        "vllm:redis_kv_blocks_loaded_total"
    ]


def test_consume_mode_through_the_proxy_answers_as_a_warm_connector_less_server(
    served: dict[str, Any],
) -> None:
    family = served["family"]
    prefix = tokens(family["prefix"], 1)
    prompts = {f"p{i}": prefix + tokens(20 + 10 * i, 10 + i) for i in range(2)}
    for pid, prompt in prompts.items():
        complete(served["plain"], prompt)  # cold: computes it all
        want = complete(served["plain"], prompt)  # warm: its prefix from the local cache
        assert want["cached"] >= family["hit"], (pid, want["cached"])
        got = complete(served["proxy"], prompt)
        assert (got["text"], got["logprobs"]) == (want["text"], want["logprobs"]), pid
        assert got["cached"] >= family["hit"], (pid, got["cached"])
    # the first prompt's prefix came through Redis; the second then hit it in the decode
    # server's own cache (as in the engine-level tests)
    assert loaded_blocks(served["decode"]) == family["blocks_loaded"]
