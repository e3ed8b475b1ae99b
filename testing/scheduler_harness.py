"""vLLM's real Scheduler with RedisConnector, and the request and model-runner objects it
consumes, without a model or a worker: the connector's scheduler side, driven the way vLLM's own
connector unit tests drive it. Used by the scheduler tests and scripts/admission_latency.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from connector.chains import handoff_salt
from connector.layout import KVLayout
from connector.metadata import RedisConnectorMetadata
from connector.redis_connector import RedisConnector
from kvstore import LookupBuffer, chain_hashes

BS = 16
# the placeholder URL of the unit tests' fake_redis fixture, which gives every store one
# fakeredis server whatever its URL
FAKE_URL = "redis://fake:6379/0"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
# state layers (``make_configs(state_layers=n)``): each a gated delta-net layer with a KV-cache
# group of its own, as vLLM gives Qwen3-Next's; a state is a bf16 conv state and an fp32
# recurrent state packed into one page, padded as vLLM pads it to an attention page
STATE_LAYERS = [f"model.layers.{2 + i}.linear_attn" for i in range(4)]
STATE_SHAPES = ((3, 24), (2, 8, 8))
STATE_DTYPES = (torch.bfloat16, torch.float32)
STATE_BYTES = 3 * 24 * 2 + 2 * 8 * 8 * 4  # 656
STATE_PAGE = 1024


def state_spec(
    mode: str = "align", speculative_blocks: int = 0, mamba_type: str = "GDN_ATTN"
) -> MambaSpec:
    """A gated delta-net layer's state spec, as vLLM builds it for Qwen3-Next (or, with
    ``mamba_type="MAMBA2"``, a Mamba2 layer's of the same geometry)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaSpec(
        block_size=BS,
        shapes=STATE_SHAPES,
        dtypes=STATE_DTYPES,
        page_size_padded=STATE_PAGE,
        mamba_type=MambaAttentionBackendEnum[mamba_type],
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative_blocks,
    )


init_none_hash(sha256)


Role = Literal["kv_producer", "kv_consumer", "kv_both"]


def make_configs(
    model: Path,
    role: Role,
    *,
    num_blocks: int = 1000,
    max_num_seqs: int = 16,
    failure_policy: Literal["recompute", "fail"] = "recompute",
    sliding_window: int | None = None,
    sliding_only: bool = False,
    state_layers: int = 0,
    state_type: str = "GDN_ATTN",
    attention: bool = True,
    kv_events: bool = False,
    **extra: Any,
) -> tuple[VllmConfig, KVCacheConfig]:
    """A VllmConfig with RedisConnector and the KV-cache config of a 2-layer model
    (``num_blocks`` blocks); with ``sliding_window``, its second layer sees only that many
    tokens and has a KV-cache group of its own, as under vLLM's hybrid allocator (with
    ``sliding_only``, both layers slide: one windowed group); with ``state_layers``, that many
    gated delta-net layers follow, one state group each, in vLLM's align cache mode (with
    ``attention=False``, the model is those alone: a Mamba model); with ``kv_events``, vLLM
    publishes KV events (to its null publisher: a test swaps in its own). ``extra``
    (``url`` among them) goes to ``kv_connector_extra_config``. Lookups are waited for up to
    1 s in the step that starts them, unless ``lookup_wait_s`` says otherwise. Every hit is
    loaded whole (``load_policy: async``) unless ``load_policy`` says otherwise: these tests
    are about a request's life, and ``auto`` recomputes a share-mode hit until it has
    measured the store (the policy's own tests say when it loads)."""
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=4096)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=extra.pop("max_batched", 4096),
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            # the simulator steps synchronously, as vLLM's CPU platform does (0.33 would
            # otherwise default to asynchronous scheduling)
            async_scheduling=False,
        ),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RedisConnector",
            kv_connector_module_path="connector.redis_connector",
            kv_role=role,
            kv_load_failure_policy=failure_policy,
            kv_connector_extra_config={"lookup_wait_s": 1, "load_policy": "async", **extra},
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.block_size = BS
    if kv_events:
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    geometry: dict[str, Any] = {
        "block_size": BS,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float32,
    }
    groups = [KVCacheGroupSpec(LAYERS, FullAttentionSpec(**geometry))]
    if sliding_window and sliding_only:
        groups = [
            KVCacheGroupSpec(LAYERS, SlidingWindowSpec(**geometry, sliding_window=sliding_window))
        ]
    elif sliding_window:
        groups = [
            KVCacheGroupSpec(LAYERS[:1], FullAttentionSpec(**geometry)),
            KVCacheGroupSpec(
                LAYERS[1:], SlidingWindowSpec(**geometry, sliding_window=sliding_window)
            ),
        ]
    if state_layers:
        vllm_config.cache_config.mamba_cache_mode = "align"
        vllm_config.cache_config.mamba_block_size = BS
        states = [
            KVCacheGroupSpec([name], state_spec(mamba_type=state_type))
            for name in STATE_LAYERS[:state_layers]
        ]
        groups = groups + states if attention else states
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return vllm_config, kv_cache_config


def make_worker_connector(
    model: Path, url: str, num_blocks: int, role: Role = "kv_both", **extra: Any
) -> tuple[RedisConnector, dict[str, torch.Tensor]]:
    """RedisConnector in the worker role with a KV cache of ``num_blocks`` CPU blocks per
    layer, registered the way vLLM's model runner registers it."""
    vllm_config, kv_cache_config = make_configs(
        model, role, url=url, num_blocks=num_blocks, **extra
    )
    conn = RedisConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    caches = {name: torch.zeros(num_blocks, 2, BS, 128) for name in LAYERS}
    for name in STATE_LAYERS[: extra.get("state_layers", 0)]:
        caches[name] = state_pages(num_blocks)
    conn.register_kv_caches(caches)
    return conn, caches


def state_pages(num_blocks: int) -> torch.Tensor:
    """A state layer's cache as vLLM's model runner presents it: ``[blocks, 1, 1, state
    bytes]`` of int8, a view whose blocks lie a padded page apart."""
    raw = torch.zeros(num_blocks * STATE_PAGE, dtype=torch.int8)
    return raw.as_strided(
        (num_blocks, 1, 1, STATE_BYTES), (STATE_PAGE, STATE_BYTES, STATE_BYTES, 1)
    )


def run_worker_step(conn: RedisConnector, meta: RedisConnectorMetadata) -> None:
    """What vLLM's model runner does with the connector around a forward pass."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.wait_for_save()
    conn.clear_connector_metadata()


def transfer_results(conn: RedisConnector, req: str, timeout_s: float = 60) -> Any:
    """A worker-role connector's report (``get_transfer_results``) once ``req`` has finished
    loading; fails after ``timeout_s`` (a generous bound: the load is the event waited on)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = conn.get_transfer_results(set())
        if req in results.finished_recving:
            return results
        time.sleep(0.01)
    raise AssertionError(f"{req} never finished loading")


def committed_blocks(conn: RedisConnector, url: str, handoff: str, chain: list[str]) -> int | None:
    """What the commit record of ``handoff`` (chain hashes ``chain``, generation 0) that
    ``conn``'s layout publishes says: the blocks a consumer may load, or None while there is
    none."""
    layout = conn.layout
    store = LookupBuffer.from_url(url, namespace="vllm", fingerprint=layout.fingerprint(0))
    try:
        names = layout.chain_names(chain, 0).by_position()
        return store.read_handoff(handoff, names).committed
    finally:
        store.close()


def make_scheduler(model: Path, role: Role, **extra: Any) -> Scheduler:
    """vLLM's real Scheduler (no model runs) with RedisConnector (see ``make_configs``)."""
    vllm_config, kv_cache_config = make_configs(model, role, **extra)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
    )


def prompt(n: int, seed: int = 1) -> list[int]:
    """``n`` prompt token ids (3 to 252), the same for the same ``seed``."""
    return [(i * 7 + seed * 13) % 250 + 3 for i in range(n)]


def zero_block() -> dict[str, torch.Tensor]:
    """A block's value for the store, as the worker saves it: zeros in each of ``LAYERS``."""
    return {name: torch.zeros(2, BS, 128) for name in LAYERS}


def make_request(
    rid: str,
    tokens: list[int] | None,
    params: dict | None = None,
    cache_salt: str | None = None,
    *,
    max_tokens: int = 4,
    lora: tuple[str, int, str] | None = None,
    prompt_embeds: torch.Tensor | None = None,
    prompt_is_token_ids: list[bool] | None = None,
) -> Request:
    """A request as vLLM's engine core builds it; ``lora`` is (name, int id, path)."""
    from vllm.lora.request import LoRARequest

    sp = SamplingParams(
        max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None
    )
    sp.update_from_generation_config({}, 1)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        cache_salt=cache_salt,
        lora_request=LoRARequest(lora[0], lora[1], lora[2]) if lora else None,
        prompt_embeds=prompt_embeds,
        prompt_is_token_ids=prompt_is_token_ids,
        block_hasher=get_request_block_hasher(BS, sha256),  # vLLM's own local prefix cache
    )


def model_output(reqs: list[Request], **kw: Any) -> ModelRunnerOutput:
    """``runner_output`` for a step that ran ``reqs``, with a token sampled only for those whose
    prompt is now computed: vLLM discards a partial prefill's sample (call it after
    ``schedule()``, which counts the step's tokens as computed)."""
    out = runner_output(reqs, **kw)
    out.sampled_token_ids = [[5] if r.num_computed_tokens >= r.num_tokens else [] for r in reqs]
    return out


def runner_output(
    reqs: list[Request],
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
    failed: set[str] | None = None,
) -> ModelRunnerOutput:
    """``failed``: loads that failed as a whole (reported finished too)."""
    connector_output = None
    if recving or invalid or failed:
        connector_output = KVConnectorOutput(
            finished_recving=(recving or set()) | (failed or set()),
            invalid_block_ids=invalid or set(),
        )
        if failed:
            connector_output.failed_recving = failed
    return ModelRunnerOutput(
        req_ids=[r.request_id for r in reqs],
        req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
        sampled_token_ids=[[5] for _ in reqs],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=connector_output,
    )


def fake_redis_scheduler(model: Path, role: Role, **extra: Any) -> Scheduler:
    """``make_scheduler``, by default on the fake_redis fixture's placeholder URL (``FAKE_URL``),
    with lookups answered within the step that starts them."""
    return make_scheduler(model, role, **{"url": FAKE_URL, **extra})


def store_for(sched: Scheduler) -> LookupBuffer:
    """The store a ``fake_redis_scheduler``'s connector reads, under its layout's fingerprint."""
    conn = sched.connector
    layout: KVLayout = conn.layout  # type: ignore[union-attr]
    return LookupBuffer.from_url(FAKE_URL, namespace="vllm", fingerprint=layout.fingerprint(0))


def seed_blocks(sched: Scheduler, tokens: list[int], n: int) -> list[str]:
    """Put the first ``n`` blocks of the shared (share-mode) chain in the store."""
    hashes = chain_hashes(tokens, BS)
    store_for(sched).insert_many([(h, zero_block()) for h in hashes[:n]])
    return hashes


def hand_off(
    sched: Scheduler,
    tokens: list[int],
    written: int,
    *,
    announced: int | None = None,
    commit: int | None = None,
    pending: bool = False,
    handoff: str = "feed1234",
    opened: bool = True,
) -> tuple[dict[str, Any], list[str]]:
    """What a consume-mode producer leaves: ``written`` blocks of a chain private to this
    handoff, its record (a ``commit`` of that many blocks, or ``pending``: still writing, or
    none at all) and the params it returns (``announced`` blocks)."""
    chain = chain_hashes(tokens, BS, handoff_salt("", handoff))
    store = store_for(sched)
    store.insert_many([(h, zero_block()) for h in chain[:written]])
    if pending:
        store.open_handoff(handoff)
    if commit is not None:
        store.publish_handoff(handoff, commit)
    n = announced if announced is not None else written
    params = {
        "redis_kv": {
            "handoff": handoff,
            "scope": "handoff",
            "num_blocks": n,
            "last_hash": chain[n - 1],
            "namespace": "vllm",
            "block_size": BS,
            "opened": opened,
        }
    }
    return params, chain


def meta_of(out: Any) -> RedisConnectorMetadata:
    """The connector metadata of a ``schedule()`` output (asserted to be RedisConnector's)."""
    meta = out.kv_connector_metadata
    assert isinstance(meta, RedisConnectorMetadata)
    return meta


def connector_of(sched: Scheduler) -> Any:
    """The scheduler side of ``sched``'s RedisConnector."""
    return sched.connector.scheduler  # type: ignore[union-attr]
