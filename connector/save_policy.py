"""Which prompts share mode writes to the pool (``save_policy``): everything, what has been seen
twice, or what a caller marks.

Writing every block of every prompt costs a deployment whose prompts rarely repeat on every
request (the copy out of the KV cache, the link, Redis's CPU) and fills Redis with one-shot
prompts that push out the prefixes worth keeping. SGLang's HiCache writes through selectively
(a block once it was hit a set number of times); routers (llm-d, Dynamo) know which prefixes
recur across a fleet before any one instance does, and can mark them.

- ``all``: every prompt block (what the connector always did).
- ``second_sight``: a prompt's first block -- its head -- is always written, the rest only once
  its head has been seen before: by this instance (a bounded memory of heads), or by any
  instance, as the head's presence in Redis (the lookup every request makes already says so).
  So the head is the fleet-wide "seen once" mark, and it is data too: a repeat loads it.
  A prompt seen once costs one block's write.
- ``marked``: only prompts whose request carries ``kv_transfer_params["redis_kv_save"] = true``
  (a router's or a client's choice).

Consume mode (a producer's handoff to its consumer) always writes everything: its consumer waits
for it. The policy decides only how many leading blocks of a request may be written
(``SaveAllowance``); ``save_plans.py`` writes no block past it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any

# kv_transfer_params key with which a request asks to be written (the ``marked`` policy)
SAVE_MARK_KEY = "redis_kv_save"
# heads of prompts this instance has seen: enough for a day of distinct documents on one
# instance, 64 bytes each
SEEN_HEADS = 1 << 16


class SavePolicy(enum.Enum):
    ALL = "all"
    SECOND_SIGHT = "second_sight"
    MARKED = "marked"

    @classmethod
    def parse(cls, value: object) -> SavePolicy:
        """The policy named by a config value; ``ValueError`` naming the choices."""
        if isinstance(value, SavePolicy):
            return value
        for policy in cls:
            if value == policy.value:
                return policy
        choices = ", ".join(repr(p.value) for p in cls)
        raise ValueError(f"save_policy must be one of {choices}, got {value!r}")


ALL_BLOCKS = 1 << 62  # (an allowance of every block)


def marked_for_saving(params: Any) -> bool:
    """Whether a request's kv_transfer_params ask for it to be written (``marked``)."""
    return isinstance(params, dict) and params.get(SAVE_MARK_KEY) is True


class SaveAllowance:
    """How many leading blocks of a request the policy lets share mode write; one per instance
    (thread-safe through the scheduler's single thread, as vLLM calls it)."""

    def __init__(self, policy: SavePolicy, seen_heads: int = SEEN_HEADS) -> None:
        self.policy = policy
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._capacity = seen_heads

    def blocks(self, head: str | None, head_in_redis: bool, marked: bool) -> int:
        """The allowance of a request whose chain starts with ``head`` (None: no full block),
        whose head is known to be in Redis or not, and that its caller marked or not
        (``marked_for_saving``). Called once per request, when its first save is planned: a
        second call for the same head counts as a second sight."""
        if self.policy is SavePolicy.ALL:
            return ALL_BLOCKS
        if self.policy is SavePolicy.MARKED:
            return ALL_BLOCKS if marked else 0
        if head is None:
            return 0
        seen = head_in_redis or head in self._seen
        self._seen[head] = None
        self._seen.move_to_end(head)
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return ALL_BLOCKS if seen else 1
