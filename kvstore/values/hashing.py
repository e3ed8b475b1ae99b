"""Chained prefix-block hashes that are identical on every process and host.

vLLM's own block hashes use Python's ``hash()``/pickle by default and change with
``PYTHONHASHSEED``; two instances then never agree and the hit rate is zero. Here a block's
hash is xxh3-128 over the parent hash and the block's token ids as little-endian int64, so it
only depends on the tokens (and the salt), never on the process.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from kvstore.errors import InvalidArgumentError

# Bumping this string invalidates every stored chain (a new hash family).
_CHAIN_DOMAIN = b"kvstore.chain.v1\x00"
_EXTRAS_TAG = b"\x00extras\x00"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    values = array("q", token_ids)
    if values.itemsize != 8:  # pragma: no cover - every CPython platform has 8-byte 'q'
        raise RuntimeError("array('q') is not 64-bit on this platform")
    if array("q", [1]).tobytes()[0] != 1:  # big-endian host: normalise to little-endian
        values.byteswap()
    return values.tobytes()


def _as_int_list(token_ids: Iterable[int] | Any) -> list[int]:
    tolist = getattr(token_ids, "tolist", None)  # torch tensors and numpy arrays
    if callable(tolist):
        token_ids = tolist()
    try:
        return [int(t) for t in token_ids]
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"token_ids must be a sequence of integers, got {type(token_ids).__name__}"
        ) from exc


def root_hash(salt: str = "") -> bytes:
    """The parent of block 0: the salt (tenant, cache_salt, LoRA, multimodal hashes) enters here."""
    if not isinstance(salt, str):
        raise InvalidArgumentError(f"salt must be a str, got {type(salt).__name__}")
    return xxhash.xxh3_128_digest(_CHAIN_DOMAIN + salt.encode("utf-8"))


def chain_hashes(
    token_ids: Iterable[int] | Any,
    block_size: int = 16,
    salt: str = "",
    *,
    parent: str | None = None,
    block_extras: Sequence[bytes] | None = None,
) -> list[str]:
    """One 32-char hex hash per *full* block of ``token_ids``; a trailing partial block is ignored.

    Block i's hash covers every token of blocks 0..i and the salt. ``parent`` (the hex hash of the
    block before ``token_ids[0]``) lets a caller extend a chain without rehashing its prefix.
    ``block_extras[i]``, when given and not empty, enters block i's hash too: what else its KV
    depends on (a digest of the prompt embeddings at its positions, say). A chain without extras
    hashes as it always did.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    tokens = _as_int_list(token_ids)
    n_blocks = len(tokens) // block_size
    if block_extras is not None and len(block_extras) < n_blocks:
        raise InvalidArgumentError(
            f"block_extras has {len(block_extras)} entries for {n_blocks} full blocks"
        )
    prev = bytes.fromhex(parent) if parent is not None else root_hash(salt)
    out: list[str] = []
    for i in range(n_blocks):
        data = prev + _token_bytes(tokens[i * block_size : (i + 1) * block_size])
        if block_extras is not None and block_extras[i]:
            # the token bytes have a fixed length, so the extras cannot alias other tokens
            data += _EXTRAS_TAG + bytes(block_extras[i])
        prev = xxhash.xxh3_128_digest(data)
        out.append(prev.hex())
    return out
