"""Issue 52: in a namespace without a secret (the default) anyone who can write to Redis can
plant a value whose header's fingerprint or block hash holds newlines and terminal escapes. The
warning about the invalid value quoted them raw into vLLM's log: a forged line, a terminal's
title rewritten. Each path that reads a header (whole values, and heads read in parts by the
data mover's split loads) warns with the planted text escaped, on one line."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import fakeredis
import pytest
import torch

from kvstore import LookupBuffer, chain_hashes
from kvstore.values.codec import encode_value, read_header
from kvstore.values.tensor_reads import HeadMiss

# a line of vLLM's log, a terminal title and a screen clear: what a planter would try
PLANTED = "\nINFO 01-01 00:00:00 [forged.py:1] all is well\x1b]0;pwned\x07\x1b[2J"
FINGERPRINT = "good"
HASH = chain_hashes(list(range(16)), 16)[0]
TENSORS = {"k": torch.zeros(64)}


class _Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """The kvstore logger's warnings, taken at the logger itself: whatever an earlier test did
    to its propagation (the connector hands it to vLLM's handlers)."""
    logger = logging.getLogger("kvstore")
    handler, level = _Collected(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def buf(fake_client: fakeredis.FakeRedis) -> LookupBuffer:
    return LookupBuffer(fake_client, namespace="ns", fingerprint=FINGERPRINT)  # no secret


def _plant(buf: LookupBuffer, field: str) -> None:
    """A value under HASH's key whose header's ``field`` holds the planted text."""
    fingerprint = FINGERPRINT + PLANTED if field == "fingerprint" else FINGERPRINT
    block_hash = HASH + PLANTED if field == "block_hash" else HASH
    value = encode_value(TENSORS, fingerprint=fingerprint, block_hash=block_hash)
    buf.client.set(buf.redis_key(HASH), bytes(value))


def _assert_one_escaped_line(messages: list[str]) -> None:
    invalid = [m for m in messages if "ignoring invalid value" in m]
    assert len(invalid) == 1, messages
    (message,) = invalid
    assert "\n" not in message and "\x1b" not in message and "\x07" not in message
    # the planted text is still there to see, spelled out
    assert "\\nINFO 01-01 00:00:00 [forged.py:1] all is well\\x1b]0;pwned\\x07\\x1b[2J" in message


@pytest.mark.parametrize("field", ["fingerprint", "block_hash"])
def test_a_planted_header_field_is_logged_escaped_on_one_line(
    buf: LookupBuffer, warnings: list[str], field: str
) -> None:
    _plant(buf, field)
    assert buf.select([HASH]) == [None]  # a counted miss, as before
    _assert_one_escaped_line(warnings)


@pytest.mark.parametrize("field", ["fingerprint", "block_hash"])
def test_a_planted_header_read_in_parts_is_logged_escaped_on_one_line(
    buf: LookupBuffer, warnings: list[str], field: str
) -> None:
    """The data mover's split loads read a value's head first (GETRANGE), then its tensors."""
    expected = read_header(encode_value(TENSORS, fingerprint=FINGERPRINT, block_hash=HASH))
    _plant(buf, field)
    room = torch.empty(expected.header_bytes + expected.tensors[-1].end, dtype=torch.uint8)
    got = buf.select_head_into(
        [HASH],
        [room],
        header_bytes=expected.header_bytes,
        entries=expected.tensors,
        tensors=len(expected.tensors),
    )
    assert got == [HeadMiss.INVALID]
    _assert_one_escaped_line(warnings)
