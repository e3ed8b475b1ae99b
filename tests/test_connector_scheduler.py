"""Scheduler-side connector logic, driven by vLLM's real Scheduler and Request objects (no model,
no worker), with the store on fakeredis. The worker is simulated by the model-runner outputs the
scheduler receives, the way vLLM's own connector unit tests do it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import kvstore.lookup_buffer
from connector.config import KVLayout
from connector.metadata import RedisConnectorMetadata
from kvstore import LookupBuffer, chain_hashes

BS = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeRedis:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    monkeypatch.setattr(
        kvstore.lookup_buffer, "make_client", lambda *a, **k: fakeredis.FakeRedis(server=server)
    )
    client.server = server  # type: ignore[attr-defined]
    return client


def make_scheduler(tiny_model: Path, role: str, **extra: Any) -> Scheduler:
    model_config = ModelConfig(model=str(tiny_model), dtype="float32", seed=0, max_model_len=4096)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=extra.pop("max_batched", 4096),
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RedisConnector",
            kv_connector_module_path="connector.redis_connector",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": "redis://fake:6379/0", "lookup_wait_s": 1, **extra},
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.block_size = BS
    kv_cache_config = KVCacheConfig(
        num_blocks=1000,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                LAYERS,
                FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = 1000
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
    )


init_none_hash(sha256)


def make_request(
    rid: str, tokens: list[int], params: dict | None = None, cache_salt: str | None = None
) -> Request:
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    sp.update_from_generation_config({}, 1)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BS, sha256),  # vLLM's own local prefix cache
    )


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(i * 7 + seed * 13) % 250 + 3 for i in range(n)]


def store_for(sched: Scheduler) -> LookupBuffer:
    conn = sched.connector
    layout: KVLayout = conn.layout  # type: ignore[union-attr]
    return LookupBuffer.from_url(
        "redis://fake:6379/0", namespace="vllm", fingerprint=layout.fingerprint(0)
    )


def seed_blocks(sched: Scheduler, tokens: list[int], n: int) -> list[str]:
    hashes = chain_hashes(tokens, BS)
    store = store_for(sched)
    for h in hashes[:n]:
        store.insert(h, {LAYERS[0]: torch.zeros(2, BS, 128), LAYERS[1]: torch.zeros(2, BS, 128)})
    return hashes


def runner_output(
    reqs: list[Request], recving: set[str] | None = None, invalid: set[int] | None = None
) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=[r.request_id for r in reqs],
        req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
        sampled_token_ids=[[5] for _ in reqs],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(
            finished_recving=recving, invalid_block_ids=invalid or set()
        )
        if (recving or invalid)
        else None,
    )


def meta_of(out: Any) -> RedisConnectorMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, RedisConnectorMetadata)
    return meta


def test_consumer_loads_present_prefix_asynchronously_and_never_the_last_token(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS)  # exactly 4 blocks: only 3 may be loaded
    hashes = seed_blocks(sched, tokens, 4)
    req = make_request("r1", tokens)
    sched.add_request(req)
    out = sched.schedule()
    meta = meta_of(out)
    assert [(s.req_id, s.hashes, s.consume) for s in meta.loads] == [("r1", hashes[:3], True)]
    assert len(meta.loads[0].block_ids) == 3
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    # the worker reports the load done; the request then runs from the loaded prefix
    sched.update_from_output(out, runner_output([], recving={"r1"}))
    out2 = sched.schedule()
    assert out2.num_scheduled_tokens == {"r1": BS}
    assert [r.num_computed_tokens for r in out2.scheduled_new_reqs] == [3 * BS]


def test_consumer_without_hits_computes_everything(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer")
    req = make_request("r1", prompt(50))
    sched.add_request(req)
    out = sched.schedule()
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"r1": 50}


def test_consumer_waits_for_producer_without_blocking_then_loads(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer", load_timeout_s=30)
    tokens = prompt(5 * BS + 3)
    hashes = seed_blocks(sched, tokens, 2)  # the producer has written 2 of its 5 blocks
    params = {"redis_kv": {"num_blocks": 5, "last_hash": hashes[4]}}
    waiting = make_request("late", tokens, params)
    other = make_request("other", prompt(20, seed=9))
    sched.add_request(waiting)
    sched.add_request(other)
    out = sched.schedule()
    # the scheduler is not blocked: the other request runs, the waiting one is asked again later
    assert out.num_scheduled_tokens == {"other": 20}
    assert meta_of(out).loads == []
    seed_blocks(sched, tokens, 5)  # the producer's remaining saves land
    sched.update_from_output(out, runner_output([other]))
    time.sleep(0.05)  # waiting requests re-poll Redis at most every 10 ms
    out = sched.schedule()
    loads = meta_of(out).loads
    assert [s.hashes for s in loads] == [hashes[:5]]


def test_consumer_gives_up_waiting_after_load_timeout(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer", load_timeout_s=0)
    tokens = prompt(5 * BS + 3)
    hashes = seed_blocks(sched, tokens, 2)
    req = make_request("r", tokens, {"redis_kv": {"num_blocks": 5, "last_hash": hashes[4]}})
    sched.add_request(req)
    out = sched.schedule()
    assert [s.hashes for s in meta_of(out).loads] == [hashes[:2]]


def test_failed_blocks_are_recomputed(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS + 1)
    seed_blocks(sched, tokens, 4)
    req = make_request("r", tokens)
    sched.add_request(req)
    out = sched.schedule()
    block_ids = meta_of(out).loads[0].block_ids
    # the worker found block 2 corrupt: it reports it with the finished load
    sched.update_from_output(out, runner_output([], recving={"r"}, invalid={block_ids[2]}))
    out2 = sched.schedule()
    assert [r.num_computed_tokens for r in out2.scheduled_new_reqs] == [2 * BS]
    assert out2.num_scheduled_tokens == {"r": 2 * BS + 1}


def test_redis_down_degrades_to_recompute(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS + 1)
    seed_blocks(sched, tokens, 4)
    fake_redis.server.connected = False  # type: ignore[attr-defined]
    req = make_request("r", tokens)
    sched.add_request(req)
    out = sched.schedule()
    assert meta_of(out).loads == [] and out.num_scheduled_tokens == {"r": 4 * BS + 1}
    assert sched.connector.scheduler.stats.lookup_errors == 1  # type: ignore[union-attr]


def test_producer_saves_full_blocks_as_they_are_computed_and_returns_params(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_producer", max_batched=2 * BS + 8)
    tokens = prompt(5 * BS + 3)
    hashes = chain_hashes(tokens, BS)
    req = make_request("p", tokens)
    sched.add_request(req)
    saved: list[str] = []
    for _ in range(5):
        out = sched.schedule()
        meta = meta_of(out)
        assert meta.loads == []  # a producer never loads
        for s in meta.saves:
            assert len(s.block_ids) == len(s.hashes)
            saved += s.hashes
        sched.update_from_output(out, runner_output([req]))
        if req.num_computed_tokens >= len(tokens):
            break
    assert saved == hashes  # every full prompt block once, in order, chunk by chunk
    _, params = sched.connector.request_finished(req, [])  # type: ignore[union-attr]
    assert params == {
        "redis_kv": {
            "num_blocks": 5,
            "last_hash": hashes[4],
            "namespace": "vllm",
            "block_size": BS,
        }
    }


def test_salt_separates_tenants(tiny_model: Path, fake_redis: fakeredis.FakeRedis) -> None:
    sched = make_scheduler(tiny_model, "kv_consumer")
    tokens = prompt(4 * BS + 1)
    seed_blocks(sched, tokens, 4)  # stored without a salt
    req = make_request("salted", tokens, cache_salt="tenant-b")
    sched.add_request(req)
    out = sched.schedule()
    assert meta_of(out).loads == []


def test_share_mode_loads_the_pool_and_saves_only_what_it_lacks(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis
) -> None:
    sched = make_scheduler(tiny_model, "kv_both")
    tokens = prompt(5 * BS + 3)
    hashes = seed_blocks(sched, tokens, 3)  # another instance cached the first 3 blocks
    req = make_request("s", tokens)
    sched.add_request(req)
    out = sched.schedule()
    load = meta_of(out).loads
    assert [(s.hashes, s.consume) for s in load] == [(hashes[:3], False)]
    sched.update_from_output(out, runner_output([], recving={"s"}))
    out = sched.schedule()
    saves = [h for s in meta_of(out).saves for h in s.hashes]
    assert saves == hashes[3:5]
    assert store_for(sched).longest_prefix(hashes) == 3  # select kept the pool's blocks


def test_unreachable_redis_at_startup_is_logged_and_requests_are_served(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstore.server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.ERROR, logger="connector"):
        sched = make_scheduler(tiny_model, "kv_consumer", url=url, connect_timeout_s=0.5)
    assert any("cannot use" in r.getMessage() and url in r.getMessage() for r in caplog.records)
    req = make_request("r", prompt(3 * BS + 1))
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 3 * BS + 1}  # computed, not loaded
