"""Which leading blocks of a prompt are in the store, for routers and people.

A router (llm-d's precise prefix-cache scorer, Dynamo's KV router, the proxy here) asks: given
a prompt's token ids, how many of its leading blocks could an instance load instead of
computing? The answer needs the layout the connector stores blocks in, which its scheduler
writes to ``$REDIS_KV_CONNECTOR_LAYOUT_FILE`` (namespace, block size, every TP rank's
fingerprint, the KV-cache groups): ``StoredLayout.from_file``. One pipelined round trip then
answers (two right after a reset, when the generation read with it was newer than the one the
names were made in).

What a hit needs, per group kind (the connector's rule, ``usable_prefix``): a full-attention
group every block before the hit's end; a sliding-window or chunked-local group only the
blocks its window still sees; a state group (Mamba, gated delta-net) the one state at the hit's
end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from connector.group_kinds import FULL, GroupKind, names_carry_groups
from kvstore.errors import InvalidArgumentError
from kvstore.values.hashing import chain_hashes
from kvstore.values.keys import BlockName, block_name

if TYPE_CHECKING:
    from kvstore.lookup_buffer import LookupBuffer

# the store hashes token ids as int64 (kvstore.values.hashing); a larger one cannot be a token
TOKEN_ID_LIMIT = 2**63


def valid_token_ids(values: Any) -> TypeGuard[list[int]]:
    """A list of token ids: ints (not bools) in [0, 2**63)."""
    return isinstance(values, list) and all(
        type(t) is int and 0 <= t < TOKEN_ID_LIMIT for t in values
    )


def usable_prefix(
    kinds: Sequence[GroupKind],
    block_size: int,
    present: Callable[[int, int], bool],
    start: int,
    end: int,
) -> int:
    """The longest hit (in leading blocks, ``start`` at least) whose every needed block is
    present: ``present(g, p)`` says whether group ``g`` (an index into ``kinds``) has chain
    position ``p``."""
    for g, kind in enumerate(kinds):
        if not kind.windowed:  # every position up to the hit's end
            p = start
            while p < end and present(g, p):
                p += 1
            end = p
    windows = [(g, kind) for g, kind in enumerate(kinds) if kind.windowed]
    for n in range(end, start, -1):
        if all(
            present(g, p)
            for g, kind in windows
            for p in range(max(start, kind.first_needed(n, block_size)), n)
        ):
            return n
    return start


@dataclass(frozen=True)
class StoredLayout:
    """How a connector names one model's blocks: what a presence question needs."""

    namespace: str
    block_size: int
    fingerprints: tuple[str, ...]  # a block is stored when every one has it (TP slices)
    group_kinds: tuple[GroupKind, ...] = (FULL,)
    group_indices: tuple[int, ...] = (0,)  # vLLM's group index, in the name of a hybrid model

    def names(self, chain_hash: str, generation: int) -> list[BlockName]:
        """Each group's block name at the position ``chain_hash`` names, in ``generation``."""
        if not names_carry_groups(self.group_kinds):
            return [block_name(chain_hash, generation)]
        return [block_name(chain_hash, generation, i) for i in self.group_indices]

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StoredLayout:
        try:
            groups = doc.get("groups") or [{"index": 0, "kind": "full"}]
            return cls(
                namespace=str(doc["namespace"]),
                block_size=int(doc["block_size"]),
                fingerprints=tuple(str(f) for f in doc["fingerprints"]),
                group_kinds=tuple(GroupKind.parse(str(g["kind"])) for g in groups),
                group_indices=tuple(int(g["index"]) for g in groups),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"not a connector layout ({exc!r}): use the JSON file the connector's scheduler "
                "writes to $REDIS_KV_CONNECTOR_LAYOUT_FILE"
            ) from None

    @classmethod
    def from_file(cls, path: str | Path) -> StoredLayout:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read the layout file {path}: {exc}") from None
        return cls.from_dict(doc)


@dataclass(frozen=True)
class Presence:
    """What the store holds of one prompt."""

    blocks: list[bool]  # per full block of the prompt: every group of it stored
    loadable_blocks: int  # the longest leading hit a connector would load (its groups' needs)
    block_size: int
    generation: int  # the namespace's generation the blocks were looked up in

    @property
    def loadable_tokens(self) -> int:
        return self.loadable_blocks * self.block_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "blocks": self.blocks,
            "loadable_blocks": self.loadable_blocks,
            "loadable_tokens": self.loadable_tokens,
            "block_size": self.block_size,
            "generation": self.generation,
        }


def prompt_salt(
    *,
    lora_name: str | None = None,
    lora_path: str = "",
    cache_salt: str | None = None,
    multimodal: Sequence[tuple[str, str]] = (),
) -> str:
    """The salt that seeds a prompt's chain: everything request-wide besides the tokens that
    changes its KV (the connector's ``request_salt`` is this of a vLLM request). JSON, so that
    no value can pass for another field; "" when there is none, so a plain prompt's chain is
    the same everywhere. ``multimodal``: (identifier, position) per input, as vLLM names them."""
    if lora_path and lora_name is None:
        raise InvalidArgumentError(
            "a LoRA path without the adapter's name: give lora_name too (as vLLM names the "
            "adapter); the path alone names no chain"
        )
    parts: list[list[str]] = []
    if lora_name is not None:
        parts.append(["lora", lora_name, lora_path])
    if cache_salt:
        parts.append(["salt", cache_salt])
    parts += [["mm", identifier, position] for identifier, position in multimodal]
    return json.dumps(parts, separators=(",", ":")) if parts else ""


def prompt_presence(
    store: LookupBuffer, layout: StoredLayout, token_ids: Sequence[int], salt: str = ""
) -> Presence:
    """Which of the prompt's full blocks are stored, and how long a hit they make, in one
    round trip. ``salt``: the connector's request salt (LoRA, cache_salt, multimodal inputs;
    "" for a plain prompt)."""
    chain = chain_hashes(list(token_ids), layout.block_size, salt)
    groups = len(layout.group_kinds)
    for _ in range(3):  # a reset in between: name the blocks in the generation read, again
        generation = store.generation
        names = [n for h in chain for n in layout.names(h, generation)]
        found = store.survey([names], fingerprints=list(layout.fingerprints))
        if found.generation == generation:
            break
    present = found.presences[0]

    def has(g: int, p: int) -> bool:
        return present[p * groups + g]

    # the connector never loads a prompt's last token: vLLM must compute one to sample from
    end = min(len(chain), max(0, len(token_ids) - 1) // layout.block_size)
    loadable = usable_prefix(layout.group_kinds, layout.block_size, has, 0, end)
    blocks = [all(has(g, p) for g in range(groups)) for p in range(len(chain))]
    return Presence(blocks, loadable, layout.block_size, generation)
