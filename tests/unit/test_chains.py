"""What names a request's blocks (connector/chains.py): everything the KV depends on, and no
way for one request's inputs to pass for another's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from connector.chains import RequestChains, embedding_digests, handoff_salt, request_salt

pytestmark = pytest.mark.vllm


def request(**kw: Any) -> Any:
    fields = {
        "lora_request": None,
        "cache_salt": None,
        "mm_features": None,
        "prompt_embeds": None,
        "prompt_is_token_ids": None,
        "prompt_token_ids": list(range(40)),
        "all_token_ids": list(range(40)),
        "num_prompt_tokens": 40,
    }
    fields.update(kw)
    return SimpleNamespace(**fields)


def lora(name: str, path: str, int_id: int = 1) -> Any:
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=int_id)


def image(identifier: str, position: str) -> Any:
    return SimpleNamespace(identifier=identifier, mm_position=position)


def test_a_plain_prompt_has_no_salt() -> None:
    assert request_salt(request()) == ""  # the chains every release and instance agree on


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"lora_request": lora("a@b", "/c")}, {"lora_request": lora("a", "b@/c")}),
        (
            {"lora_request": lora("x", "/p|salt=s")},
            {"lora_request": lora("x", "/p"), "cache_salt": "s"},
        ),
        ({"cache_salt": "t|mm=img@P"}, {"cache_salt": "t", "mm_features": [image("img", "P")]}),
        ({"lora_request": lora("x", "/p", 1)}, {"lora_request": lora("y", "/p", 1)}),
    ],
)
def test_different_inputs_never_give_the_same_salt(a: dict, b: dict) -> None:
    assert request_salt(request(**a)) != request_salt(request(**b))


def test_the_same_adapter_under_another_id_gives_the_same_salt() -> None:
    first = request(lora_request=lora("alice", "/a", 1))
    second = request(lora_request=lora("alice", "/a", 7))
    assert request_salt(first) == request_salt(second)


def test_a_handoff_salt_cannot_be_forged_with_a_cache_salt() -> None:
    victim = handoff_salt(request_salt(request()), "abc")
    forged = request_salt(request(cache_salt="|handoff=abc"))
    assert victim != forged and handoff_salt("", "abc") == victim


def test_embeddings_name_each_block_by_what_it_holds() -> None:
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(40, 8, generator=gen)
    other = embeds.clone()
    other[20] += 1  # block 1 of 16-token blocks
    a = request(prompt_embeds=embeds, prompt_token_ids=None, all_token_ids=[0] * 40)
    b = request(prompt_embeds=other, prompt_token_ids=None, all_token_ids=[0] * 40)
    da, db = embedding_digests(a, 16), embedding_digests(b, 16)
    assert da is not None and db is not None and len(da) == 2
    assert da[0] == db[0] and da[1] != db[1]
    ca, cb = RequestChains(a, 16).shared(), RequestChains(b, 16).shared()
    assert ca[0] == cb[0] and ca[1] != cb[1]
    plain = RequestChains(request(prompt_token_ids=[0] * 40, all_token_ids=[0] * 40), 16)
    assert plain.shared()[0] != ca[0]  # placeholder ids alone never pass for embeddings


def test_a_mixed_prompt_tells_token_positions_from_embedding_positions() -> None:
    embeds = torch.zeros(40, 8)
    as_tokens = request(prompt_embeds=embeds, prompt_is_token_ids=[True] * 40)
    as_embeds = request(prompt_embeds=embeds, prompt_is_token_ids=[False] * 40)
    assert embedding_digests(as_tokens, 16) != embedding_digests(as_embeds, 16)
