from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvstore import InvalidArgumentError, chain_hashes


def test_one_hash_per_full_block_and_partial_block_ignored() -> None:
    assert len(chain_hashes(list(range(47)), block_size=16)) == 2
    assert len(chain_hashes(list(range(48)), block_size=16)) == 3
    assert chain_hashes(list(range(15)), block_size=16) == []


def test_block_hash_depends_on_every_earlier_token() -> None:
    tokens = list(range(64))
    base = chain_hashes(tokens, 16)
    changed = tokens.copy()
    changed[20] = 999  # block 1
    other = chain_hashes(changed, 16)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:], strict=True))


def test_prefix_of_a_chain_is_the_chain_of_the_prefix() -> None:
    tokens = list(range(100))
    assert chain_hashes(tokens[:64], 16) == chain_hashes(tokens, 16)[:4]


def test_salt_enters_the_first_block() -> None:
    tokens = list(range(32))
    a, b = chain_hashes(tokens, 16, salt="tenant-a"), chain_hashes(tokens, 16, salt="tenant-b")
    assert a[0] != b[0] and a[1] != b[1]


def test_parent_extends_a_chain() -> None:
    tokens = list(range(64))
    full = chain_hashes(tokens, 16, salt="s")
    assert chain_hashes(tokens[32:], 16, parent=full[1]) == full[2:]


def test_tensor_and_list_inputs_agree() -> None:
    tokens = list(range(40))
    assert chain_hashes(torch.tensor(tokens), 8) == chain_hashes(tokens, 8)
    assert chain_hashes(tuple(tokens), 8) == chain_hashes(tokens, 8)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_block_size_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        chain_hashes([1, 2, 3], bad)  # type: ignore[arg-type]


def test_non_integer_tokens_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="integers"):
        chain_hashes(["a", "b"], 1)


def test_hashes_are_identical_across_processes_and_hash_seeds() -> None:
    code = "from kvstore import chain_hashes; print(chain_hashes(list(range(300)), 16, salt='x'))"
    outs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1
    assert outs.pop().strip() == str(chain_hashes(list(range(300)), 16, salt="x"))
