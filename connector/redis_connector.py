"""RedisConnector: vLLM v1 KV connector whose store is Redis/Valkey (via kvstore).

Select it by name (the package registers it through vLLM's plugin entry point)::

    --kv-transfer-config '{"kv_connector":"RedisConnector","kv_role":"kv_producer",
                           "kv_connector_extra_config":{"url":"redis://redis:6379/0"}}'

or by module path: ``"kv_connector_module_path":"connector.redis_connector"``.
This class only dispatches: the scheduler side lives in ``scheduler.py``, the worker side in
``worker.py``, what passes between them in ``metadata.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connector.config import RedisConnectorConfig
from connector.events import (
    KVEventsEmitter,
    StoredPrefixReports,
    event_groups,
    events_wanted,
    hash_block_size,
)
from connector.layout import KVLayout
from connector.load_policy import Engine, LoadPolicy
from connector.logs import adopt_vllm_logging
from connector.metadata import RedisConnectorMetadata
from connector.scheduler import RedisConnectorScheduler
from connector.stats import RedisConnectorStats, RedisPromMetrics
from connector.versions import check_vllm_version
from connector.worker import RedisConnectorWorker
from datamover import layer_bands
from kvstore import KVStoreError, LookupBuffer, StorePermissionError, StoreTopologyError
from kvstore.values.value_auth import load_secret

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("connector")

# Refuses an older vLLM at import; a newer one loads with a warning when a connector starts.
_VERSION_WARNING = check_vllm_version(
    vllm.__version__, override=os.environ.get("REDIS_KV_CONNECTOR_SKIP_VERSION_CHECK") == "1"
)


def _optional(module: str, name: str) -> Any:
    """``module.name`` where this vLLM release has it, else None."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# vLLM 0.32+: per-source prefix-cache hit metrics
CacheHitSource = _optional("vllm.v1.metrics.cache_hit_source", "CacheHitSource")
# A load can fail per request (vLLM 0.30-0.33 all can). A hybrid model's block ids are unique
# only within a KV-cache group, so vLLM takes its load failures only this way.
KVConnectorTransferResults = _optional(
    "vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorTransferResults"
)
SupportsHMA = _optional("vllm.distributed.kv_transfer.kv_connector.v1.base", "SupportsHMA")
# The hybrid memory allocator (sliding-window layers keep only their window, hybrid models'
# groups) is declared only where vLLM can take a failed load per request; on a release without
# that, vLLM would turn it off and give the connector one group of full-size blocks.
_HMA_BASES: tuple[type, ...] = (
    (SupportsHMA,) if SupportsHMA is not None and KVConnectorTransferResults is not None else ()
)


# A path the scheduler side writes its keys' layout to at startup (JSON: namespace, block size,
# the fingerprint of every TP rank, model): how ``connector.warm`` learns which keys its engine
# writes, and a way to see which fingerprint a server uses.
LAYOUT_FILE_ENV = "REDIS_KV_CONNECTOR_LAYOUT_FILE"


def write_layout_file(path: str | None, config: RedisConnectorConfig, layout: KVLayout) -> None:
    if not path:
        return
    doc = {
        "namespace": config.namespace,
        "block_size": layout.block_size,
        "fingerprints": layout.all_fingerprints(),
        "model_id": layout.model_id,
        "dtype": layout.dtype,
        "kv_cache_dtype": layout.kv_cache_dtype,
        "tp_size": layout.tp_size,
        "store_tp_size": layout.store_tp_size,
        # the KV-cache groups: a hybrid model stores each group's block at a position under
        # "<hash>.g<index>"
        "groups": [
            {"index": g.index, "kind": str(g.kind), "layers": len(g.layer_names)}
            for g in layout.groups
        ],
    }
    with open(path, "w") as f:
        json.dump(doc, f)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests, single process)
        return 0


def cpu_threads_note(device_type: str, env: Mapping[str, str]) -> str | None:
    """Why this CPU server's bf16 outputs may differ from a connector-less one's, or None.

    vLLM's CPU backend reserves one more core when any KV connector is configured
    (``vllm/utils/ompmultiprocessing.py``), so with automatic thread binding this engine runs
    fewer (or, on 2 cores, more) OpenMP threads than the same server without a connector, and
    its sums round differently. Not this connector's doing; said once so nobody hunts for it."""
    if device_type != "cpu":
        return None
    if env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in env:
        return None
    return (
        "vLLM's CPU backend reserves one more core for any KV connector, so this server runs "
        "another OpenMP thread count than it would without one: bf16 results differ in the "
        "last bits and greedy outputs can differ on near ties. To compare with a "
        "connector-less server bit for bit, give both the same VLLM_CPU_OMP_THREADS_BIND "
        "(or VLLM_CPU_NUM_OF_RESERVED_CPU)."
    )


def load_refusal(device_type: str, use_mla: bool) -> str | None:
    """Why an engine cannot compute on top of KV loaded from outside, or None."""
    if device_type == "cpu" and use_mla:
        return (
            "vLLM's CPU MLA backend computes a prompt without the KV already in the cache (the "
            "CPU platform turns prefix caching and chunked prefill off for MLA), so a loaded "
            "prefix would give wrong outputs"
        )
    return None


def load_shape(
    kv_cache_config: KVCacheConfig, layout: KVLayout, band_bytes: int
) -> tuple[int, int]:
    """(bytes of one block, every layer, on one rank; the bands of layers a split reads it in)
    from vLLM's page sizes: the load policy's first idea of both, until the workers report what
    they read (values carry headers; a rank may read more heads than it keeps)."""
    pages = [
        int(getattr(kv_cache_config.kv_cache_groups[g.index].kv_cache_spec, "page_size_bytes", 0))
        for g in layout.groups
    ]
    block = sum(p * len(g.layer_names) for p, g in zip(pages, layout.groups, strict=True))
    first = layout.groups[0]
    return block, len(layer_bands(len(first.layer_names), pages[0], band_bytes))


def engine_shape(vllm_config: VllmConfig) -> Engine:
    """What one of vLLM's steps may hold, from its scheduler config: the load policy models
    chunked prefill with it."""
    sc = vllm_config.scheduler_config
    budget = int(getattr(sc, "max_num_batched_tokens", 0) or 0)
    chunk = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
    return Engine(
        token_budget=budget or Engine().token_budget,
        chunk_tokens=max(0, chunk),
        overlap=vllm_config.device_config.device_type != "cpu",
    )


def split_refusal(vllm_config: VllmConfig, layout: KVLayout) -> str | None:
    """Why this engine cannot take a split load (a synchronous, layer-by-layer load: a load
    that fails comes back as failed block ids of a step vLLM must undo), or None."""
    if layout.fails_per_request or len(layout.groups) != 1:
        return (
            "a model with several KV-cache groups: vLLM takes a synchronous load's failures "
            "only as block ids, which it refuses for such models"
        )
    try:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # the property may refuse a configuration; that is vLLM's to report
        v2 = True
    if v2:
        return (
            "vLLM's V2 model runner gives wrong output after a failed synchronous load "
            "(vLLM issue #49250); VLLM_USE_V2_MODEL_RUNNER=0 allows splits"
        )
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        return (
            "asynchronous scheduling does not undo a failed synchronous load's step (vLLM "
            "issue #49250); --no-async-scheduling allows splits"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism runs steps concurrently: a split must end with its step"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return (
            "speculative decoding: vLLM reports a step's failed blocks before its drafter's "
            "layers run, so a split could not say whether they read what it loaded"
        )
    return None


class RedisConnector(KVConnectorBase_V1, *_HMA_BASES):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        adopt_vllm_logging()  # our lines in vLLM's log, in its format and at its level
        if _VERSION_WARNING:
            logger.warning(_VERSION_WARNING)
        ktc = self._kv_transfer_config
        self.rc = RedisConnectorConfig.from_extra(ktc.kv_connector_extra_config, str(ktc.kv_role))
        refusal = load_refusal(
            vllm_config.device_config.device_type, bool(vllm_config.model_config.use_mla)
        )
        if refusal and self.rc.role == "kv_consumer":
            raise ValueError(f"RedisConnector cannot be a kv_consumer here: {refusal}")
        if refusal and self.rc.loads:
            if role == KVConnectorRole.SCHEDULER:
                logger.warning("RedisConnector saves but never loads on this engine: %s", refusal)
            self.rc = dataclasses.replace(self.rc, cannot_load=refusal)
        self.layout = KVLayout.from_vllm(
            vllm_config, kv_cache_config, self.rc.model_id, self.rc.store_tp_size
        )
        if self.rc.saves and not self.layout.can_write_slices:
            raise ValueError(
                f"RedisConnector: store_tp_size {self.layout.store_tp_size} cuts the KV heads "
                f"coarser than this instance's {self.layout.ranks_with_distinct_heads} ranks hold "
                "them, so no rank holds a whole slice to save. Use a multiple of "
                f"{self.layout.ranks_with_distinct_heads} (dividing the model's "
                f"{self.layout.total_kv_heads} KV heads), or kv_role kv_consumer here."
            )
        block_size = int(vllm_config.cache_config.block_size or 0)
        states = any(g.is_state for g in self.layout.groups)
        if states and role == KVConnectorRole.SCHEDULER and block_size != self.layout.block_size:
            # vLLM's align split ends prefill chunks at cache_config.block_size multiples: at
            # other sizes few chunk ends are state-block boundaries, so few states are saved
            logger.warning(
                "RedisConnector: vLLM keeps a state every %d tokens but splits prefills at "
                "--block-size %d, so few states are committed (or stored in Redis). Start vLLM "
                "with --block-size %d.",
                self.layout.block_size,
                block_size,
                self.layout.block_size,
            )
        if self.rc.loads and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "kv_load_failure_policy is %r: a block missing from Redis will fail the request. "
                'Set "kv_load_failure_policy":"recompute" to recompute it instead.',
                ktc.kv_load_failure_policy,
            )
        tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        side = "worker" if role == KVConnectorRole.WORKER else "scheduler"
        # check=False: Redis being down at startup must not stop the engine; it degrades to
        # recompute and the errors are counted and logged.
        store = LookupBuffer.from_url(
            self.rc.url,
            namespace=self.rc.namespace,
            # the first slice this rank reads; the worker reaches the others through views
            fingerprint=self.layout.fingerprint(self.layout.slices_read(tp_rank)[0].index),
            ttl_s=self.rc.ttl_s,
            compression=self.rc.compression,
            socket_timeout_s=self.rc.socket_timeout_s,
            control_timeout_s=self.rc.control_timeout_s,
            connect_timeout_s=self.rc.connect_timeout_s,
            io_threads=self.rc.io_threads,
            tls_ca_file=self.rc.tls_ca_file,
            tls_cert_file=self.rc.tls_cert_file,
            tls_key_file=self.rc.tls_key_file,
            secret=load_secret(secret_file=self.rc.secret_file, secret_env=self.rc.secret_env),
            epoch=self.rc.epoch,
            lua=self.rc.lua,
            breaker_failures=self.rc.breaker_failures,
            breaker_probe_s=self.rc.breaker_probe_s,
            check=False,
        )
        try:
            if self.rc.check_access:
                # a missing ACL permission never heals by itself: fail now, naming it
                store.check_access(self.rc.operations(side))
            else:
                store.ping()
            # a URL of the wrong kind (a Cluster node or a Sentinel behind redis://) never
            # heals either: fail now, naming the right URL form
            store.check_topology()
        except (StorePermissionError, StoreTopologyError):
            store.close()
            raise
        except KVStoreError as exc:
            logger.error(
                "RedisConnector cannot use %s now (%s). vLLM keeps serving and recomputes what it "
                "cannot load; saves and loads resume when the store answers.",
                store.safe_url,
                exc,
            )
        self.connector_scheduler: RedisConnectorScheduler | None = None
        self.connector_worker: RedisConnectorWorker | None = None
        # KV events for routers: share-mode blocks only (a handoff chain is one request's)
        events = events_wanted(vllm_config) and self.rc.saves and not self.rc.consume
        if role == KVConnectorRole.SCHEDULER:
            note = cpu_threads_note(vllm_config.device_config.device_type, os.environ)
            if note:
                logger.info(note)
            emitter = None
            if events:
                pc = vllm_config.parallel_config
                emitter = KVEventsEmitter(
                    self.layout.block_size,
                    hash_block_size(vllm_config, kv_cache_config, self.layout.block_size),
                    ranks=pc.world_size,  # every worker vLLM aggregates outputs over
                    namespace=self.rc.namespace,
                    generation=lambda: store.generation,
                    groups=event_groups(self.layout, kv_cache_config),
                )
            refusal = self._split_refusal(vllm_config, store)
            self.connector_scheduler = RedisConnectorScheduler(
                self.rc,
                self.layout,
                store,
                events=emitter,
                split_refusal=refusal,
                load_shape=load_shape(kv_cache_config, self.layout, self.rc.split_band_bytes),
                engine=engine_shape(vllm_config),
            )
            write_layout_file(os.environ.get(LAYOUT_FILE_ENV), self.rc, self.layout)
        else:
            self.connector_worker = RedisConnectorWorker(
                self.rc, self.layout, store, tp_rank, report_stored=events
            )
        logger.info(
            "RedisConnector %s: role=%s mode=%s store=%s keys=%s",
            role.name.lower(),
            self.rc.role,
            self.rc.mode,
            store.safe_url,
            store.key_pattern(),
        )

    def _split_refusal(self, vllm_config: VllmConfig, store: LookupBuffer) -> str | None:
        """Whether this engine may take split loads (scheduler side), said once; a pinned
        ``load_policy: split`` that cannot be served fails now."""
        if not self.rc.loads or self.rc.load_policy in (LoadPolicy.ASYNC, LoadPolicy.RECOMPUTE):
            return "not chosen" if self.rc.loads else None
        refusal = split_refusal(vllm_config, self.layout)
        if refusal is None and self.rc.compression != "none":
            refusal = f"compression {self.rc.compression}: values are read whole, not by layers"
        if refusal is None and self.rc.check_access and self.rc.load_policy is LoadPolicy.AUTO:
            try:  # (a pinned split checked it with the role's other commands)
                store.check_access(["select_ranges"])
            except StorePermissionError as exc:
                refusal = f"{exc} (a split reads a value's layers with GETRANGE)"
            except KVStoreError:
                pass  # Redis is not answering yet: splits fail and recompute if it refuses
        if refusal is not None and self.rc.load_policy is LoadPolicy.SPLIT:
            raise ValueError(f"RedisConnector: load_policy split cannot be served here: {refusal}")
        logger.info(
            "RedisConnector: load policy %s%s",
            self.rc.load_policy.value,
            f"; no split loads: {refusal}" if refusal else " (split loads allowed)",
        )
        return refusal

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a lost save is a later cache miss, never wrong output

    @property
    def scheduler(self) -> RedisConnectorScheduler:
        assert self.connector_scheduler is not None, "scheduler-side call on a worker connector"
        return self.connector_scheduler

    @property
    def worker(self) -> RedisConnectorWorker:
        assert self.connector_worker is not None, "worker-side call on a scheduler connector"
        return self.connector_worker

    def _meta(self) -> RedisConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RedisConnectorMetadata)
        return meta

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+ sleep mode: called before the KV cache memory is released (sleep,
        discard). Cancels loads in flight; nothing touches the KV cache until restored."""
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+ sleep mode: called after the KV cache is back (wake-up)."""
        self.worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM hands the step's metadata over before its forward pass: the pass starts."""
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and isinstance(
            connector_metadata, RedisConnectorMetadata
        ):
            self.connector_worker.forward_started(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before each attention layer: a split load's band of this layer lands first (an
        asynchronous load finished before its request was scheduled)."""
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # all layers of a block travel together, staged in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished saves and loads, and the loads that failed as a whole (several KV-cache
        groups, or a windowed one; they are among the finished too)."""
        sending, recving, failed = self.worker.take_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> StoredPrefixReports | None:
        """This rank's confirmed saves since the last step, for the scheduler side's KV
        events (``events.py``); None when there are none."""
        reports = self.worker.take_stored_reports()
        return StoredPrefixReports(reports) if reports else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.connector_worker or self.connector_scheduler
        data = side.take_stats() if side is not None else {}
        return RedisConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return RedisConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> RedisPromMetrics:
        return RedisPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM 0.32+ per-source hit metrics (``vllm:prompt_tokens_cached_by_source``): a
        handoff from a prefill instance is "p2p"; the shared pool is a remote store, which vLLM
        files under "external_unspecified". Older vLLM never calls this."""
        if num_external_tokens == 0 or CacheHitSource is None:
            return {}
        source = (
            CacheHitSource.P2P
            if self.scheduler.loads_handoff(request)
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        return {source: num_external_tokens}

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA: the same for every group (the blocks to save were planned per step)."""
        return self.scheduler.request_finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events for vLLM's publisher: blocks confirmed in Redis, resets."""
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (HTTP: ``POST
        /reset_prefix_cache?reset_external=true``): invalidate the namespace's blocks for every
        instance sharing it. vLLM calls it on the scheduler side; a worker has nothing to
        reset (None)."""
        if self.connector_scheduler is None:
            return None
        return self.connector_scheduler.reset_cache()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """vLLM 0.32+ (its KV-zeroing skips these): a load restores every group stored."""
        return tuple(group.index for group in self.layout.groups)
