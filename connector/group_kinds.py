"""What a KV-cache group keeps (``GroupKind``), read once where it enters -- from vLLM's spec
(``layout.py``), or from the layout file a router reads (``presence.py``) -- and asked of
everywhere else: which blocks a hit needs of it, whether it is a state group.

Its text (``str(kind)``) is what fingerprints, the layout file and logs have always held --
"full", "sliding_window=<tokens>", "chunked_local=<tokens>", "state=<mamba type>", or another
attention spec's class name -- so parsing it changes no stored name or fingerprint.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Family(enum.Enum):
    FULL = "full"  # every block before a hit's end
    SLIDING_WINDOW = "sliding_window"  # the blocks its window still sees
    CHUNKED_LOCAL = "chunked_local"  # the blocks of the hit's last local chunk
    STATE = "state"  # Mamba / gated delta-net: one state per block, the hit's last alone
    OTHER = "other"  # another attention spec (its class name): read as full attention is


@dataclass(frozen=True)
class GroupKind:
    """A KV-cache group's kind: its family, and its span in tokens (a sliding window's, a local
    chunk's) or its state's type (vLLM's enum name, "MAMBA2", "GDN_ATTN"), or the class name
    of an attention spec of no known family."""

    family: Family
    tokens: int = 0
    detail: str = ""

    @classmethod
    def parse(cls, text: str) -> GroupKind:
        """The kind ``text`` names (``str``'s inverse); ``ValueError`` for a span that is not a
        whole number."""
        name, mark, arg = text.partition("=")
        if text == Family.FULL.value:
            return FULL
        if mark and name in (Family.SLIDING_WINDOW.value, Family.CHUNKED_LOCAL.value):
            return cls(Family(name), tokens=int(arg))
        if mark and name == Family.STATE.value:
            return cls(Family.STATE, detail=arg)
        return cls(Family.OTHER, detail=text)

    def freed_before(self, computed: int, block_size: int) -> int:
        """How many leading blocks vLLM may have freed (given back to its pool: another
        request may own them) once ``computed`` tokens were computed: those its attention no
        longer sees. At least vLLM's own count (``get_num_skipped_tokens`` of the tokens it
        has processed, which are never more than ``computed``)."""
        if self.family is Family.SLIDING_WINDOW and self.tokens > 0:
            skipped = max(0, computed - self.tokens + 1)
        elif self.family is Family.CHUNKED_LOCAL and self.tokens > 0:
            skipped = computed // self.tokens * self.tokens
        else:
            return 0
        return skipped // block_size

    def __str__(self) -> str:
        if self.family is Family.FULL:
            return Family.FULL.value
        if self.family is Family.OTHER:
            return self.detail
        arg = self.detail if self.family is Family.STATE else str(self.tokens)
        return f"{self.family.value}={arg}"

    @property
    def is_full(self) -> bool:
        return self.family is Family.FULL

    @property
    def is_state(self) -> bool:
        """A Mamba / gated delta-net group: one recurrent state per block, not tokens' KV."""
        return self.family is Family.STATE

    @property
    def windowed(self) -> bool:
        """Whether a hit needs only some of its blocks before the hit's end (a state group:
        the hit's last alone)."""
        return self.family in (Family.SLIDING_WINDOW, Family.CHUNKED_LOCAL, Family.STATE)

    def first_needed(self, blocks: int, block_size: int) -> int:
        """The first chain position a hit of ``blocks`` leading blocks needs from a group of
        this kind: vLLM gives the positions before it the null block (its
        ``get_num_skipped_tokens``)."""
        tokens = blocks * block_size
        if self.family is Family.STATE:  # the state after the hit's last block, nothing before
            return max(0, blocks - 1)
        if self.family is Family.SLIDING_WINDOW:
            return max(0, tokens - self.tokens + 1) // block_size
        if self.family is Family.CHUNKED_LOCAL:
            return tokens // self.tokens * self.tokens // block_size
        return 0


FULL = GroupKind(Family.FULL)


def names_carry_groups(kinds: Sequence[GroupKind]) -> bool:
    """Whether a model's block names carry their KV-cache group (``keys.block_name``): several
    groups, or a state group. A model of one attention group keeps the names (and the
    fingerprint) it always had."""
    return len(kinds) > 1 or kinds[0].is_state
