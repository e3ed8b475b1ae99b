"""One vLLM engine in a process, without a model: vLLM's real Scheduler with the real
RedisConnector on both sides (scheduler and worker), stepped the way vLLM's engine core and
model runner step them (0.30-0.33's order: bind metadata; start loads before the forward pass
when the step has synchronous loads, after it otherwise; the forward pass, which calls
``wait_for_layer_load`` before each layer; stage saves; report finished transfers, failed blocks
and the workers' stats; clear).

The stand-in model's forward pass writes every block it computes a value determined by what
the block's KV depends on -- the tokens (or prompt embeddings) up to the block's end, the LoRA
adapter and, deliberately, the cache salt -- so a block that holds anything else was loaded
from the wrong key or overwritten. Like a real model, it turns a wrong context into wrong
output: a request whose attention in some layer reads a block that does not hold its own KV
computes wrong KV in every later layer (a value no right block ever holds) and samples a wrong
token, so KV computed over a failed load is wrong wherever it ends up. The simulator checks, as
it runs:

- every block the connector writes (its loads' scatters) is owned at that moment by the
  request loading it, and by no other, in vLLM's own block tables, while the request waits for
  it -- or, for a split load, during its step's forward pass and only in layers that have not
  run yet (``write_violations``);
- every block a request is scheduled on holds that request's value (``value_violations``); a
  split's blocks, in each layer, when that layer runs;
- no load is still held past its deadline (``deadline_violations``);
- no token vLLM hands out was sampled over a wrong context (``value_violations``): vLLM must
  drop the step's token of every request that ran on a block whose load failed.

Used by tests/unit/test_request_lifecycle.py and the stateful fuzzer
(tests/integration/test_fuzz_lifecycle.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import xxhash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from connector.metadata import RedisConnectorMetadata
from connector.redis_connector import RedisConnector
from connector.worker import RedisConnectorWorker
from kvstore import LookupBuffer

from .scheduler_harness import (
    BS,
    LAYERS,
    Role,
    make_request,
    make_scheduler,
    make_worker_connector,
)

SAMPLED_TOKEN = 7
# what a request samples when its attention read KV that was not its own (a wrong context)
WRONG_TOKEN = 8
_BLOCK_NUMEL = 2 * BS * 128  # one layer's block: [kv_heads=2, BS, 2 * head_size]


def position_ids(request: Request) -> list[bytes]:
    """What each position of the request's KV depends on: its token id, or for a position
    given as an embedding, a digest of that embedding row."""
    tokens = list(request.all_token_ids)
    out = [t.to_bytes(8, "little", signed=True) for t in tokens]
    embeds = request.prompt_embeds
    if embeds is not None:
        mask = request.prompt_is_token_ids
        for i in range(min(len(embeds), request.num_prompt_tokens)):
            if mask is None or not mask[i]:
                row = embeds[i].contiguous().view(torch.uint8).numpy().tobytes()
                out[i] = b"e" + xxhash.xxh3_64_digest(row)
    return out


def block_identities(request: Request, n_blocks: int) -> list[int]:
    """A 20-bit identity per full block: the chain of everything its KV depends on."""
    lora = request.lora_request
    seed = f"{request.cache_salt or ''}|{lora.lora_name if lora else ''}".encode()
    positions = position_ids(request)
    out, prev = [], xxhash.xxh3_64_digest(seed)
    for p in range(n_blocks):
        prev = xxhash.xxh3_64_digest(prev + b"".join(positions[p * BS : (p + 1) * BS]))
        out.append(int.from_bytes(prev, "little") % (1 << 20))
    return out


def block_value(identity: int, layer: int) -> torch.Tensor:
    """The stand-in model's KV for one block of one layer: integers, exact in float32."""
    base = torch.arange(_BLOCK_NUMEL, dtype=torch.float32) + float(identity + 7 * layer)
    return base.view(2, BS, 128)


def wrong_value(identity: int, layer: int) -> torch.Tensor:
    """What the stand-in model computes for a block after its attention read a wrong context:
    no right block of any identity ever holds it (half-integers)."""
    return block_value(identity, layer) + 0.5


@dataclass
class StepResult:
    output: SchedulerOutput
    params: dict[str, dict | None] = field(default_factory=dict)  # finished -> transfer params
    finished: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    sending: set[str] = field(default_factory=set)
    invalid: set[int] = field(default_factory=set)


class _Recorder:
    """Stands in for vLLM's KV-event publisher: keeps what it would send."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


class SimEngine:
    def __init__(
        self,
        model: Path,
        role: Role,
        url: str,
        *,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_batched: int = 256,
        layer_waits: bool = True,
        full_graphs: bool = False,
        **extra: Any,
    ) -> None:
        """``layer_waits=False``: the model's attention never calls the connector's per-layer
        wait (a backend without the hook); ``full_graphs``: a pass whose every request
        computes one token is replayed as vLLM replays a uniform decode batch on a GPU, as a
        full CUDA graph, which runs no Python: no per-layer wait either."""
        self.role = role
        self.layer_waits, self.full_graphs = layer_waits, full_graphs
        cfg = {"num_blocks": num_blocks, "max_num_seqs": max_num_seqs, **extra}
        self.sched = make_scheduler(model, role, url=url, max_batched=max_batched, **cfg)
        self.worker_conn, self.caches = make_worker_connector(model, url, role=role, **cfg)
        self.layers = list(self.caches.values())
        # Held while vLLM's scheduler changes block ownership and while the connector writes a
        # block: each write is checked against the ownership of that moment.
        self.world = threading.RLock()
        self.owners: dict[int, set[tuple[str, int]]] = {}
        self.write_violations: list[str] = []
        self.value_violations: list[str] = []
        self.deadline_violations: list[str] = []
        self.aborted: set[str] = set()
        # requests whose clients go away while the next step's forward pass runs: vLLM's
        # EngineCore takes such aborts after the pass and before its output (``step``)
        self.aborts_during_step: set[str] = set()
        self.finished_params: dict[str, dict | None] = {}
        self.finish_reasons: dict[str, str] = {}  # request -> vLLM's reason ("length", "error")
        # req id -> (latest moment its load may still run, the load's block ids)
        self._load_deadlines: dict[str, float] = {}
        self._tls = threading.local()
        # this step's forward pass: the layers that ran, and the split loads it carries
        self._layers_run: set[int] = set()
        self._splits: dict[str, list[int]] = {}  # request -> the block ids it loads
        self._admitted: set[str] = set()
        self._split_checks: list[tuple[str, int, str]] = []  # (request, block, violation)
        self.layers_waited: list[str] = []  # wait_for_layer_load calls, in order (all steps)
        # requests whose attention read a wrong context in this step's forward pass: their KV
        # from the next layer on, and their sampled token, are wrong
        self._wrong_context: set[str] = set()
        # block id -> how it came to hold KV computed over a wrong context (who computed it, in
        # which step, over which block): a violation's story, as timing-dependent failures in
        # CI cannot be replayed
        self._wrong_origin: dict[int, str] = {}
        self._why_wrong: dict[str, str] = {}
        self.steps = 0
        # whether this step's pass calls the per-layer waits, and the split blocks written into
        # layers that had run without them (they must come back failed)
        self._waits = True
        self._late_split_writes: set[int] = set()
        # the scheduler side's counters, as vLLM reports them after each step (vLLM takes them;
        # ``take_stats`` hands them to a test)
        self._reported: dict[str, int] = {}
        # the KV events vLLM's publisher would send, in order (with ``kv_events=True``)
        self.published: list[Any] = []
        self.sched.kv_event_publisher = _Recorder(self.published)  # type: ignore[assignment]
        self._instrument()

    def __repr__(self) -> str:  # in a failing fuzz example's steps
        return f"SimEngine({self.role}, {id(self):#x})"

    # ------------------------------------------------------------------ instrumentation
    @property
    def worker(self) -> RedisConnectorWorker:
        w = self.worker_conn.connector_worker
        assert w is not None
        return w

    @property
    def connector(self) -> RedisConnector:
        conn = self.sched.connector
        assert isinstance(conn, RedisConnector)
        return conn

    def _instrument(self) -> None:
        worker = self.worker
        real_copy_in = worker._whole_loads.copy_in
        tls = self._tls

        def copy_in(job: Any, group: int, head_slice: int, chunk: Any) -> bool:
            tls.req_id = job.spec.req_id
            try:
                return real_copy_in(job, group, head_slice, chunk)
            finally:
                tls.req_id = None

        def checked(real_scatter: Any, group: int) -> Any:
            def scatter(ids: torch.Tensor, src: torch.Tensor, first_layer: int = 0) -> None:
                layers = range(first_layer, first_layer + int(src.shape[1]))
                req_id = getattr(tls, "req_id", None) or self._split_of(ids.tolist())
                with self.world:
                    self._check_writes(req_id, group, ids.tolist(), layers)
                    real_scatter(ids, src, first_layer)
                    loaded = f"loaded from Redis by {req_id} in step {self.steps}"
                    for b in ids.tolist():  # what it holds now came from Redis
                        self._wrong_origin[b] = loaded

            return scatter

        worker._whole_loads.copy_in = copy_in  # type: ignore[method-assign]
        for layout_group, movers in enumerate(worker.movers_by_group):
            group = worker.layout.groups[layout_group].index
            for mover in movers:
                mover.kv.scatter = checked(mover.kv.scatter, group)  # type: ignore[method-assign]

    def _split_of(self, block_ids: list[int]) -> str | None:
        """The request whose split load of this step writes ``block_ids`` (a split's writes
        run on the connector's loader thread, outside ``copy_in``)."""
        for rid, ids in self._splits.items():
            if set(block_ids) <= set(ids):
                return rid
        return None

    def _check_writes(
        self, req_id: str | None, group: int, block_ids: list[int], layers: range
    ) -> None:
        """A load's write into ``block_ids`` of vLLM's KV-cache group ``group``: the blocks
        must be that request's alone, in that group (block ids are unique in vLLM's one block
        pool, which every group's pages overlay), while it waits for them -- or, a split,
        during its step's forward pass, into layers that have not run yet."""
        req = self.sched.requests.get(req_id) if req_id else None
        split = req_id in self._splits
        for b in block_ids:
            owners = self.owners.get(b, set())
            if split:
                # vLLM caches a synchronous load's blocks when it allocates them, so a request
                # admitted later in the same step may run on them as a prefix-cache hit: it
                # reads each layer after that layer's wait, once the split's band landed
                owners = {o for o in owners if o[0] not in self._admitted or o[0] == req_id}
            if req is None or owners != {(req_id, group)}:
                self.write_violations.append(
                    f"group {group} block {b} written for {req_id} while vLLM gives it to "
                    f"{sorted(owners)}"
                )
            elif split and self._layers_run.intersection(layers) and self._waits:
                self.write_violations.append(
                    f"block {b} written for {req_id} in layers {sorted(layers)} after layers "
                    f"{sorted(self._layers_run.intersection(layers))} ran"
                )
            elif split and self._layers_run.intersection(layers):
                # a pass that waits for nothing: the load cannot know its layers ran, so the
                # split must come back failed (checked after the step)
                self._late_split_writes.add(b)
            elif not split and not (
                req.status == RequestStatus.WAITING_FOR_REMOTE_KVS or req.is_finished()
            ):
                self.write_violations.append(
                    f"block {b} written for {req_id} while the request is {req.status.name}"
                )

    def _refresh_owners(self) -> None:
        """Block id -> (request, group) holding it, from vLLM's block tables (under
        ``world``); the null block is no one's."""
        owners: dict[int, set[tuple[str, int]]] = {}
        manager = self.sched.kv_cache_manager
        for rid in self.sched.requests:
            for group, ids in enumerate(manager.get_block_ids(rid)):
                for b in ids:
                    if b != 0:
                        owners.setdefault(b, set()).add((rid, group))
        self.owners = owners

    # ------------------------------------------------------------------ requests
    def add(self, rid: str, tokens: list[int] | None, **kw: Any) -> Request:
        req = make_request(rid, tokens, **kw)
        with self.world:
            self.sched.add_request(req)
            self._refresh_owners()
        return req

    def abort(self, rid: str) -> bool:
        """The client went away (vLLM's ``finish_requests`` with FINISHED_ABORTED)."""
        with self.world:
            done = self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            self._refresh_owners()
        if done:
            self.aborted.add(rid)
        return bool(done)

    def preempt(self, rid: str) -> bool:
        """Preempt a running request the way vLLM does under KV-cache pressure."""
        with self.world:
            req = self.sched.requests.get(rid)
            if req is None or req not in self.sched.running:
                return False
            self.sched.running.remove(req)
            self.sched._preempt_request(req, time.monotonic())
            self._refresh_owners()
        return True

    # ------------------------------------------------------------------ a step
    def step(self) -> StepResult:
        self.steps += 1
        with self.world:
            out = self.sched.schedule()
            self._refresh_owners()
        meta = out.kv_connector_metadata
        assert isinstance(meta, RedisConnectorMetadata)
        conn = self.worker_conn
        conn.bind_connector_metadata(meta)
        self._layers_run = set()
        self._splits = {s.req_id: list(s.block_ids[0]) for s in meta.loads if s.layered}
        # requests whose block table vLLM (re)built in this step's scheduling
        cached = out.scheduled_cached_reqs
        self._admitted = {r.req_id for r in out.scheduled_new_reqs} | set(cached.resumed_req_ids)
        self._split_checks = []
        if out.has_sync_kv_loads:  # a synchronous load feeds this step's forward pass
            conn.start_load_kv(None)  # type: ignore[arg-type]
        self._forward(out)
        if not out.has_sync_kv_loads:
            conn.start_load_kv(None)  # type: ignore[arg-type]
        for spec in meta.loads:  # the worker gives each load at most timeout_s from here
            if not spec.layered:
                self._load_deadlines[spec.req_id] = time.monotonic() + spec.timeout_s
        conn.wait_for_save()
        asked = time.monotonic()
        results = conn.get_transfer_results(out.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        worker_stats = conn.get_kv_connector_stats()
        conn.clear_connector_metadata()
        # after the forward: vLLM may give a request blocks another request of the same step
        # computes (they are cached when allocated; the forward writes every layer's KV before
        # attention reads it); a split's blocks that failed are recomputed (vLLM drops the
        # step's output for that request), whatever they hold
        self._check_values(out, set(invalid))
        self.value_violations += [v for rid, b, v in self._split_checks if b not in invalid]
        self.write_violations += [
            f"split block {b} written after its layers ran (no wait) and not reported failed"
            for b in sorted(self._late_split_writes - set(invalid))
        ]
        self._late_split_writes = set()
        self._splits = {}
        recving, sending = set(results.finished_recving), set(results.finished_sending)
        failed = set(getattr(results, "failed_recving", ()) or ())
        for rid in recving:
            self._load_deadlines.pop(rid, None)
        for rid, until in self._load_deadlines.items():
            if asked > until:
                self.deadline_violations.append(
                    f"{rid}: its load was still held {asked - until:.3f}s past its deadline"
                )
        result = StepResult(out, recving=recving, sending=sending, invalid=set(invalid))
        runner = self._runner_output(out, recving, sending, set(invalid), worker_stats)
        if failed:  # loads failed as a whole (several KV-cache groups, or a windowed one)
            assert runner.kv_connector_output is not None
            runner.kv_connector_output.failed_recving = failed
        # (EngineCore.step: execute_model, _process_aborts_queue, then update_from_output)
        for rid in sorted(self.aborts_during_step):
            self.abort(rid)
        self.aborts_during_step.clear()
        with self.world:
            outputs = self.sched.update_from_output(out, runner)
            self._refresh_owners()
        for eco in outputs.values():
            reported = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            for key, value in (reported or {}).items():
                if isinstance(value, int):  # (not the latency histograms)
                    self._reported[key] = self._reported.get(key, 0) + value
            for o in eco.outputs:
                if WRONG_TOKEN in (o.new_token_ids or ()):
                    self.value_violations.append(
                        f"{o.request_id}: vLLM handed out a token sampled over KV that was not "
                        "the request's own"
                    )
                if o.finished:
                    result.finished.add(o.request_id)
                    result.params[o.request_id] = o.kv_transfer_params
                    self.finished_params[o.request_id] = o.kv_transfer_params
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
        return result

    def take_stats(self) -> dict[str, int]:
        """Counters both sides reported since the last call: the scheduler side's as vLLM
        reported them, and the worker's (those of steps not run yet included)."""
        out, self._reported = self._reported, {}
        for key, value in self.worker.stats.take().items():
            if isinstance(value, int):
                out[key] = out.get(key, 0) + value
        return out

    def _worker_counts(self, stats: Any) -> None:
        """The worker's counters of a step, as vLLM would report them."""
        for key, value in (stats.data if stats is not None else {}).items():
            if isinstance(value, int):
                self._reported[key] = self._reported.get(key, 0) + value

    def _scheduled(self, out: SchedulerOutput) -> list[tuple[str, int, int]]:
        """(request id, tokens computed before this step, tokens scheduled now)."""
        rows = [
            (new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
            for new in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            rows.append((rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid]))
        return rows

    def _blocks(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def _check_values(self, out: SchedulerOutput, invalid: set[int]) -> None:
        """Every full block a scheduled request has computed holds that request's value, up to
        the first block whose load failed: vLLM rewinds the request to it and computes it and
        every later one again for that request (what stays cached there is the taint screen's
        to catch, when another request runs on it)."""
        for rid, computed, _ in self._scheduled(out):
            req = self.sched.requests.get(rid)
            if req is None:
                continue
            n = computed // BS
            ids = block_identities(req, n)
            blocks = self._blocks(rid)
            for p in range(n):
                if blocks[p] in invalid:
                    # (a reader of blocks its split's own request computed over the failed one
                    # was flagged here, though vLLM drops its step: a review's)
                    break
                for layer, cache in enumerate(self.layers):
                    if not torch.equal(cache[blocks[p]], block_value(ids[p], layer)):
                        first = float(cache[blocks[p]].flatten()[0].item()) - 7 * layer
                        held = (
                            f"KV {first:.0f}"
                            if first.is_integer()
                            else "KV computed over a wrong context"
                        )
                        origin = self._wrong_origin.get(blocks[p])
                        self.value_violations.append(
                            f"{rid}: block {blocks[p]} (position {p}, layer {layer}) holds "
                            f"{held}, not this request's {ids[p]}"
                            + (f" ({origin})" if origin and not first.is_integer() else "")
                        )
                        break

    def _forward(self, out: SchedulerOutput) -> None:
        """The stand-in model, layer by layer as vLLM's: before a layer runs, the connector
        waits for its loads (``wait_for_layer_load``, vLLM's attention wrapper); a split's
        loaded blocks then hold their values in that layer (checked); the layer writes the
        KV of each block completed by this step's tokens (every request's, as vLLM writes a
        layer's keys and values before attending), then each request attends to its context:
        one that reads a full block not holding its own KV computes wrong KV in the layers
        after and samples a wrong token."""
        rows = self._scheduled(out)
        wrong = self._wrong_context = set()
        self._why_wrong = {}
        uniform_decode = bool(rows) and all(n == 1 for _, _, n in rows)
        waits = self._waits = self.layer_waits and not (self.full_graphs and uniform_decode)
        for layer, (name, cache) in enumerate(self.caches.items()):
            if name not in LAYERS:
                continue
            if waits:
                self.worker_conn.wait_for_layer_load(name)
                self.layers_waited.append(name)
            with self.world:
                self._layers_run.add(layer)
            for rid, blocks in self._splits.items():
                req = self.sched.requests[rid]
                ids = block_identities(req, len(self._blocks(rid)))
                table = self._blocks(rid)
                for b in blocks:
                    p = table.index(b)
                    if not torch.equal(cache[b], block_value(ids[p], layer)):
                        self._split_checks.append(
                            (rid, b, f"{rid}: split block {b} (position {p}) not landed in "
                             f"layer {layer} when it ran")
                        )  # fmt: skip
            for rid, computed, scheduled in rows:
                req = self.sched.requests[rid]
                end = computed + scheduled
                first, last = computed // BS, end // BS  # blocks [first, last) complete now
                if last <= first:
                    continue
                ids = block_identities(req, last)
                blocks = self._blocks(rid)
                value = wrong_value if rid in wrong else block_value
                for p in range(first, last):
                    cache[blocks[p]].copy_(value(ids[p], layer))
                    if rid in wrong:
                        self._wrong_origin[blocks[p]] = (
                            f"computed by {rid} in step {self.steps} from layer {layer} on, "
                            f"over {self._why_wrong.get(rid)}"
                        )[:600]  # (a chain of such stories, cut short)
                    elif layer == 0:
                        self._wrong_origin.pop(blocks[p], None)
            for rid, computed, scheduled in rows:  # attention over the context
                if rid in wrong:
                    continue
                req = self.sched.requests[rid]
                context = (computed + scheduled) // BS  # full blocks (a partial one: not modelled)
                ids = block_identities(req, context)
                blocks = self._blocks(rid)
                bad = next(
                    (
                        p
                        for p in range(context)
                        if not torch.equal(cache[blocks[p]], block_value(ids[p], layer))
                    ),
                    None,
                )
                if bad is not None:
                    wrong.add(rid)
                    b = blocks[bad]
                    held = float(cache[b].flatten()[0].item()) - 7 * layer
                    split = next((r for r, ids in self._splits.items() if b in ids), None)
                    self._why_wrong[rid] = (
                        f"block {b} (position {bad}) in layer {layer}, holding "
                        + (f"KV {held:.0f}" if held.is_integer() else "wrong-context KV")
                        + (f", loaded by {split}'s split" if split else "")
                        + (f" [{self._wrong_origin[b]}]" if b in self._wrong_origin else "")
                    )

    def _runner_output(
        self,
        out: SchedulerOutput,
        recving: set[str],
        sending: set[str],
        invalid: set[int],
        worker_stats: Any,
    ) -> ModelRunnerOutput:
        rows = self._scheduled(out)
        sampled = []
        for rid, computed, scheduled in rows:
            req = self.sched.requests[rid]
            token = WRONG_TOKEN if rid in self._wrong_context else SAMPLED_TOKEN
            sampled.append([token] if computed + scheduled >= req.num_tokens else [])
        kv_out = None
        events = self.worker_conn.get_kv_connector_kv_cache_events()
        # the worker's stats go to the scheduler side with the output, as in vLLM (its load
        # samples feed the load policy); the counters are kept here for take_stats
        self._worker_counts(worker_stats)
        if recving or sending or invalid or events or worker_stats is not None:
            kv_out = KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                invalid_block_ids=invalid,
                kv_cache_events=events,
                kv_connector_stats=_samples_only(worker_stats),
            )
        return ModelRunnerOutput(
            req_ids=[r[0] for r in rows],
            req_id_to_index={r[0]: i for i, r in enumerate(rows)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )

    # ------------------------------------------------------------------ running out
    def run_until_idle(self, max_steps: int = 2000, pause_s: float = 0.002) -> None:
        """Step until no request is left (vLLM's engine loop pauses when nothing ran), then
        wait for the worker's writes and commit records to land."""
        for _ in range(max_steps):
            if not self.sched.has_requests():
                self.settle()
                return
            res = self.step()
            if not res.output.num_scheduled_tokens:
                time.sleep(pause_s)
        raise AssertionError(f"requests left after {max_steps} steps: {list(self.sched.requests)}")

    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until the worker's transfers (saves, commit records, deletes) and the handoffs
        the scheduler side dropped are done."""
        deadline = time.monotonic() + timeout_s
        assert self.worker.shutdown_pending(timeout_s) == 0, "transfers still running"
        while self.connector.scheduler._drops.waiting:
            assert time.monotonic() < deadline, "dropped handoffs still waiting"
            time.sleep(0.01)

    def leftovers(self) -> list[str]:
        """Per-request state the connector still holds once every request is gone (a leak)."""
        sched, worker = self.connector.scheduler, self.worker
        held: dict[str, dict[Any, Any]] = {
            "scheduler requests": sched._reqs,
            "scheduler loads": sched._loads.loading,
            "scheduler load blocks": sched._loads.blocks,
            "scheduler load outcomes": sched._loads.outcomes,
            "scheduler consumed handoffs": sched._handoffs.loading,
            "scheduler splits": dict.fromkeys(sched._splits_planned + sched._splits_running),
            "worker loads and saves": {r: True for r in worker.tracked_requests()},
            "worker splits": worker._splits,
        }
        return [f"{what}: {sorted(map(str, v))[:5]}" for what, v in held.items() if v]

    def assert_clean(self) -> None:
        assert not self.write_violations, self.write_violations[:5]
        assert not self.value_violations, self.value_violations[:5]
        assert not self.deadline_violations, self.deadline_violations[:5]

    def shutdown(self) -> None:
        self.worker_conn.shutdown()
        self.connector.shutdown()


def _samples_only(stats: Any) -> Any:
    """The worker's stats with only what the scheduler side reads (the load policy's samples):
    its counters reach the test through ``take_stats``, not twice."""
    if stats is None:
        return None
    from connector.stats import SAMPLES, RedisConnectorStats

    kept = {k: v for k, v in stats.data.items() if k in SAMPLES}
    return RedisConnectorStats(data=kept) if kept else None


class Gate:
    """Holds every call of a store's method until opened: a load or lookup in flight. A gate
    made with ``Gate.hold`` is opened by the ``engines`` fixture (tests/unit/conftest.py)
    before it checks and shuts down its engines, if the test left it shut."""

    held: ClassVar[list[Gate]] = []

    def __init__(self, store: LookupBuffer, method: str = "select_into") -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        real = getattr(store, method)

        def gated(*a: Any, **k: Any) -> Any:
            self.entered.set()
            self.opened.wait(30)
            return real(*a, **k)

        setattr(store, method, gated)

    @classmethod
    def hold(cls, store: LookupBuffer, method: str = "select_into") -> Gate:
        gate = cls(store, method)
        cls.held.append(gate)
        return gate

    @classmethod
    def open_all(cls) -> None:
        """Open every gate ``hold`` made."""
        for gate in cls.held:
            gate.opened.set()
        cls.held.clear()


def produce(engines: Callable[..., SimEngine], tokens: list[int], rid: str = "p") -> dict[str, Any]:
    """Run ``tokens`` on a new producer from ``engines`` (one token); its kv_transfer_params."""
    producer = engines("kv_producer")
    producer.add(rid, tokens, max_tokens=1)
    producer.run_until_idle()
    params = producer.finished_params[rid]
    assert params is not None
    return params
