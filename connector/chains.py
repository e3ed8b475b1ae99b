"""What a request's KV depends on besides its token ids, and the chains of block hashes its
blocks are named by in Redis (``KVLayout.chain_names`` names them).

Two requests share a block only if everything the block's KV depends on is equal, as in vLLM's
own prefix cache: the tokens up to the block's end; the LoRA adapter (by name *and* path, as
vLLM hashes it: ``lora_int_id`` is a per-server counter, so two servers may give one id to
different adapters); ``cache_salt``; multimodal inputs; and, per block, the prompt embeddings
at its positions (with ``--enable-prompt-embeds`` those positions carry a placeholder token id,
so token ids alone would let two different prompts share blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import xxhash

from connector.presence import prompt_salt
from kvstore import chain_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request


def request_salt(request: Request) -> str:
    """Everything request-wide besides the tokens that changes the KV of a prompt: LoRA adapter,
    cache_salt, multimodal inputs (``connector.presence.prompt_salt``, which routers asking for a
    prompt's presence call with the same fields). It seeds the chain, so such prompts never
    share blocks by accident."""
    lora = getattr(request, "lora_request", None)
    return prompt_salt(
        lora_name=None if lora is None else str(getattr(lora, "lora_name", "")),
        lora_path="" if lora is None else str(getattr(lora, "lora_path", "")),
        cache_salt=str(request.cache_salt) if getattr(request, "cache_salt", None) else None,
        multimodal=[
            (str(getattr(f, "identifier", "")), str(getattr(f, "mm_position", "")))
            for f in getattr(request, "mm_features", None) or []
        ],
    )


def handoff_salt(salt: str, handoff_id: str) -> str:
    """The chain salt of a consume-mode handoff: private to one request. Unambiguous: a request
    salt is "" or a JSON list, and a handoff id has no "|" (``keys.NAME_RE``)."""
    return f"{salt}|handoff={handoff_id}"


def embedding_digests(request: Request, block_size: int) -> list[bytes] | None:
    """Per full prompt block, a digest of the prompt embeddings at its positions (and of which
    positions are token ids in a mixed prompt); None for a prompt of token ids only."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return None
    mask = getattr(request, "prompt_is_token_ids", None)
    rows = embeds.detach().to("cpu").contiguous()
    head = f"{rows.dtype}|{list(rows.shape[1:])}".encode()
    flat = rows.view(torch.uint8).reshape(rows.shape[0], -1) if rows.numel() else rows
    out = []
    for p in range(request.num_prompt_tokens // block_size):
        h = xxhash.xxh3_128(head)
        h.update(flat[p * block_size : (p + 1) * block_size].numpy().tobytes())
        if mask is not None:
            h.update(bytes(bool(m) for m in mask[p * block_size : (p + 1) * block_size]))
        out.append(h.digest())
    return out


class RequestChains:
    """A request's prompt as Redis knows it: its salt, its token ids and per-block extras, and
    the chains of block hashes built from them (the shared one, or one private to a
    handoff)."""

    def __init__(self, request: Request, block_size: int, generation: int = 0) -> None:
        self.block_size = block_size
        # the namespace's generation its blocks are named in (``kvstore.fleet.generations``)
        self.generation = generation
        self.salt = request_salt(request)
        tokens = request.prompt_token_ids
        if tokens is None:  # a prompt of embeddings only: placeholder ids, told apart by extras
            tokens = list(request.all_token_ids[: request.num_prompt_tokens])
        self.tokens: list[int] = list(tokens)
        self.extras = embedding_digests(request, block_size)

    def shared(self) -> list[str]:
        """The content chain: what share mode saves and loads."""
        return chain_hashes(self.tokens, self.block_size, self.salt, block_extras=self.extras)

    def handoff(self, handoff_id: str, num_blocks: int | None = None) -> list[str]:
        """The chain private to one handoff (consume mode), of its first ``num_blocks``."""
        n = len(self.tokens) if num_blocks is None else num_blocks * self.block_size
        return chain_hashes(
            self.tokens[:n],
            self.block_size,
            handoff_salt(self.salt, handoff_id),
            block_extras=self.extras,
        )
