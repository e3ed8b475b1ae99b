"""The Redis key format, defined once: built by the lookup buffer, parsed by the CLI.

    <prefix>:<namespace>:<fingerprint>:<block name>              one block's value
    <prefix>:<namespace>:<fingerprint>:<block name>:claim:<id>:{<block key>}
                                                                 a block claimed by drop_select
    <prefix>:<namespace>:<fingerprint>:handoff:{<handoff id>}    a producer's commit record
    <prefix>:<namespace>:<fingerprint>:probe:<id>                a short-lived permission probe
    <prefix>:<namespace>:<fingerprint>:doc:<document id>         a warmed document's record
    <prefix>:<namespace>:generation                              the namespace's generation

A block's name (``BlockName``) is its chain hash, the namespace's generation it was saved in
(``generations``) and, for a model with several KV-cache groups, its group:
``<chain hash>[@<generation>][.g<group>]`` -- ``<hash>`` in generation 0, the names blocks always
had, ``<hash>@<n>`` after the n-th reset, ``<hash>@<n>.g<group>`` for a hybrid model's groups.
``block_name`` builds it and ``parse_block_name`` reads it; nothing else puts one together or
takes one apart. Only block names may hold "@".

Braces are Redis Cluster hash tags. A handoff id sits in them, so every tensor-parallel rank's
commit record of one handoff lives in one slot. A claim ends with its block's whole key in them,
so it lives in its block's slot: the claim script renames a block within one slot. Block keys
have no tag: a prompt's blocks spread over every shard.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from kvstore.errors import InvalidArgumentError

DEFAULT_KEY_PREFIX = "kv"
# (\Z, not $: "$" also matches before a trailing newline, which a name must not hold)
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+\Z")
BLOCK_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(@[0-9]+[A-Za-z0-9_.\-]*)?\Z")
GENERATION_MARK = "@"
GROUP_MARK = ".g"
_GROUP_SUFFIX = re.compile(r"\.g([0-9]+)\Z")
CLAIM_MARKER = ":claim:"
_HANDOFF = "handoff"
_PROBE = "probe"
_DOCUMENT = "doc"
_GENERATION = "generation"


def claim_key(block_key: str, claim_id: str) -> str:
    """The private key a claim renames a block to (``claims.Claimer``)."""
    return f"{block_key}{CLAIM_MARKER}{claim_id}:{{{block_key}}}"


def check_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidArgumentError(
            f"{what} must be a non-empty str of letters, digits, '_', '.', '-': got {name!r}"
        )
    return name


def check_block_name(name: object) -> str:
    """A block name: a name, with at most one generation mark ("@<n>") after its chain hash."""
    if not isinstance(name, str) or not BLOCK_NAME_RE.match(name):
        raise InvalidArgumentError(
            "a block name must be a non-empty str of letters, digits, '_', '.', '-' (and "
            f"'@<generation>' after the hash): got {name!r}"
        )
    return name


# A stored block's name, ``<chain hash>[@<generation>][.g<group>]``: a str wherever it reaches
# the store (its API takes any name ``check_block_name`` accepts), a type of its own for mypy,
# so a chain hash is never passed where a name is due.
BlockName = NewType("BlockName", str)


@dataclass(frozen=True)
class ParsedBlockName:
    """What a block name says: its chain hash, the generation it was saved in, and its KV-cache
    group (None: a name without one, as a model of one attention group has)."""

    chain_hash: str
    generation: int = 0
    group: int | None = None


def block_name(chain_hash: str, generation: int = 0, group: int | None = None) -> BlockName:
    """The store's name of the block at the chain position ``chain_hash`` names, saved in
    ``generation`` (no mark in generation 0: the names blocks always had), of KV-cache group
    ``group`` (None: no group in the name)."""
    name = f"{chain_hash}{GENERATION_MARK}{generation}" if generation else chain_hash
    return BlockName(name if group is None else f"{name}{GROUP_MARK}{group}")


def parse_block_name(name: str) -> ParsedBlockName:
    """``name``'s parts (``block_name``'s inverse). A name the store accepts that no connector
    makes -- text after the generation other than a group -- keeps its chain hash and
    generation; its group is None."""
    chain_hash, mark, rest = name.partition(GENERATION_MARK)
    digits = rest[: len(rest) - len(rest.lstrip("0123456789"))] if mark else ""
    if mark:  # the group is all that may follow the generation
        group = _GROUP_SUFFIX.match(rest[len(digits) :])
    else:  # in generation 0 it follows the chain hash
        group = _GROUP_SUFFIX.search(chain_hash)
        if group is not None:
            chain_hash = chain_hash[: group.start()]
    return ParsedBlockName(
        chain_hash, int(digits or 0), int(group.group(1)) if group is not None else None
    )


def in_generation(name: str, generation: int) -> BlockName:
    """``name`` as named in ``generation``: the same block saved after another reset."""
    parts = parse_block_name(name)
    return block_name(parts.chain_hash, generation, parts.group)


def generation_of(name: str) -> int:
    """The generation a block's name says it was saved in."""
    return parse_block_name(name).generation


def generation_key(prefix: str, namespace: str) -> str:
    """A namespace's generation counter (``KeySpace.generation``): one for every fingerprint,
    a reset being the namespace's."""
    return f"{prefix}:{namespace}:{_GENERATION}"


@dataclass(frozen=True)
class KeySpace:
    """The keys of one (prefix, namespace, fingerprint)."""

    prefix: str
    namespace: str
    fingerprint: str

    def __post_init__(self) -> None:
        check_name("key_prefix", self.prefix)
        check_name("namespace", self.namespace)
        check_name("fingerprint", self.fingerprint)

    def _base(self, fingerprint: str | None) -> str:
        return f"{self.prefix}:{self.namespace}:{fingerprint or self.fingerprint}"

    def block(self, name: str, fingerprint: str | None = None) -> str:
        """The key of the block named ``name`` (``BlockName``)."""
        return f"{self._base(fingerprint)}:{check_block_name(name)}"

    def fingerprints(self, given: Sequence[str] | None) -> list[str]:
        """``given`` (e.g. one per slice of a model's KV heads), or this space's own fingerprint."""
        return list(given) if given else [self.fingerprint]

    def blocks(self, names: Sequence[str], fingerprint: str | None = None) -> list[str]:
        """The keys of a non-empty list of block names."""
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise InvalidArgumentError(
                f"expected a list of block names, got {type(names).__name__}"
            )
        if not names:
            raise InvalidArgumentError("the list of block names is empty")
        return [self.block(n, fingerprint) for n in names]

    def handoff(self, handoff_id: str, fingerprint: str | None = None) -> str:
        return f"{self._base(fingerprint)}:{_HANDOFF}:{{{check_name('handoff id', handoff_id)}}}"

    def probe(self, token: str) -> str:
        return f"{self._base(None)}:{_PROBE}:{token}"

    def document(self, document_id: str, fingerprint: str | None = None) -> str:
        return f"{self._base(fingerprint)}:{_DOCUMENT}:{check_name('document id', document_id)}"

    def generation(self) -> str:
        """The namespace's generation counter (one for every fingerprint: a reset is the
        namespace's)."""
        return generation_key(self.prefix, self.namespace)

    def namespace_pattern(self) -> str:
        """The SCAN pattern of every key of this namespace, every fingerprint's."""
        return f"{self.prefix}:{self.namespace}:*"

    def pattern(self, fingerprint: str | None = None) -> str:
        """The SCAN / redis-cli pattern of every key of this space."""
        return f"{self._base(fingerprint)}:*"


@dataclass(frozen=True)
class ParsedKey:
    kind: str  # "block", "claim", "handoff", "probe", "document", "generation"
    namespace: str
    fingerprint: str  # "" for the namespace's generation counter
    name: str  # the block name (``parse_block_name``), or the handoff / probe / document id

    @property
    def generation(self) -> int:
        """The generation a block (or a claimed block) was saved in; 0 for other keys."""
        return generation_of(self.name) if self.kind in ("block", "claim") else 0


def parse_key(key: str, prefix: str = DEFAULT_KEY_PREFIX) -> ParsedKey | None:
    """What a key is, or None for a key that is not kvstore's."""
    if CLAIM_MARKER in key:  # <block key>:claim:<id>:{<block key>}
        block_key, _, claim = key.partition(CLAIM_MARKER)
        block = parse_key(block_key, prefix)
        if block is None or block.kind != "block" or not claim.endswith(f":{{{block_key}}}"):
            return None
        return ParsedKey("claim", block.namespace, block.fingerprint, block.name)
    parts = key.split(":")
    if len(parts) == 3 and parts[0] == prefix and parts[2] == _GENERATION:
        return ParsedKey("generation", parts[1], "", "")
    if len(parts) < 4 or parts[0] != prefix:
        return None
    ns, fp, rest = parts[1], parts[2], parts[3:]
    if len(rest) == 1:
        return ParsedKey("block", ns, fp, rest[0])
    if len(rest) == 2 and rest[0] == _HANDOFF:
        return ParsedKey("handoff", ns, fp, rest[1].strip("{}"))
    if len(rest) == 2 and rest[0] == _PROBE:
        return ParsedKey("probe", ns, fp, rest[1])
    if len(rest) == 2 and rest[0] == _DOCUMENT:
        return ParsedKey("document", ns, fp, rest[1])
    return None
