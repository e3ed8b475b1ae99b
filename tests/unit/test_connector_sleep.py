"""vLLM sleep mode (0.33+): the connector says it supports it (the real-server tests of what it
does on sleep and wake-up are in tests/integration/test_connector_sleep.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from connector.redis_connector import RedisConnector

pytestmark = pytest.mark.vllm


def test_sleep_mode_is_declared_supported_where_vllm_asks() -> None:
    if not hasattr(RedisConnector, "supports_sleep_mode"):
        pytest.skip("this vLLM (< 0.33) has no sleep-mode hooks for connectors")
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="RedisConnector", kv_role="kv_both")
    assert RedisConnector.supports_sleep_mode(config)
