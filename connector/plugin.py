"""vLLM plugin entry point (``vllm.general_plugins``): registers ``RedisConnector`` by name.

vLLM loads general plugins in every process it starts, so ``"kv_connector":"RedisConnector"``
works without ``kv_connector_module_path`` once this package is installed.
"""

from __future__ import annotations

CONNECTOR_NAME = "RedisConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "connector.redis_connector", "RedisConnector"
        )
