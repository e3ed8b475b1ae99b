"""``SimEngine`` for a gated delta-net hybrid in vLLM's align cache mode: the attention group of
``scheduler_harness`` and ``states`` state groups, one layer each.

The stand-in model reads a request's running state from slot ``cdiv(computed, BS) - 1`` of each
state group's block table (as vLLM's align-mode state indices do) and writes the state after the
step's last token into slot ``cdiv(end, BS) - 1``. A state is a value determined by every token
it covers, so a state read that is not the request's own -- what a wrong loaded or saved state
would make the model compute from -- is a value violation. The connector's writes are checked
against vLLM's ownership in every group (``SimEngine._check_writes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import xxhash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from .scheduler_harness import BS, LAYERS, STATE_BYTES, STATE_LAYERS, Role
from .sim_engine import SimEngine, block_identities, block_value, position_ids


def state_identity(request: Request, tokens: int) -> int:
    """What the state after ``tokens`` tokens depends on: all of them (and the salt, LoRA)."""
    lora = request.lora_request
    seed = f"{request.cache_salt or ''}|{lora.lora_name if lora else ''}".encode()
    digest = xxhash.xxh3_64_digest(seed + b"".join(position_ids(request)[:tokens]))
    return int.from_bytes(digest, "little")


def state_value(identity: int, layer: int) -> torch.Tensor:
    """The stand-in model's state for one layer: ``[1, 1, STATE_BYTES]`` of int8."""
    gen = torch.Generator().manual_seed((identity + 7919 * layer) % (1 << 62))
    return torch.randint(-128, 128, (1, 1, STATE_BYTES), generator=gen).to(torch.int8)


class StateSimEngine(SimEngine):
    def __init__(self, model: Path, role: Role, url: str, *, states: int = 2, **kw: Any) -> None:
        super().__init__(model, role, url, state_layers=states, **kw)
        self.layers = [self.caches[name] for name in LAYERS]  # the attention checks' layers
        self.state_caches = [self.caches[name] for name in STATE_LAYERS[:states]]
        self.state_reads = 0  # states the stand-in model read (and checked)

    def _table(self, rid: str, group: int) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[group])

    def _forward(self, out: SchedulerOutput) -> None:
        for rid, computed, scheduled in self._scheduled(out):
            req = self.sched.requests[rid]
            end = computed + scheduled
            first, last = computed // BS, end // BS
            if last > first:  # attention: the blocks this step completes
                ids = block_identities(req, last)
                blocks = self._table(rid, 0)
                for p in range(first, last):
                    for layer, cache in enumerate(self.layers):
                        cache[blocks[p]].copy_(block_value(ids[p], layer))
            for s, cache in enumerate(self.state_caches):
                table = self._table(rid, 1 + s)
                if computed > 0:  # continue from the state after `computed` tokens
                    slot = -(-computed // BS) - 1
                    block = table[slot]
                    want = state_value(state_identity(req, computed), s)
                    self.state_reads += 1
                    if block == 0 or not torch.equal(cache[block], want):
                        self.value_violations.append(
                            f"{rid}: state group {1 + s} slot {slot} (block {block}) does not "
                            f"hold the state after {computed} tokens"
                        )
                slot = -(-end // BS) - 1
                block = table[slot]
                assert block != 0, (rid, s, slot, table)  # vLLM allocates the running state
                cache[block].copy_(state_value(state_identity(req, end), s))
