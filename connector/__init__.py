"""vLLM v1 KV connector on kvstore: ``connector.redis_connector.RedisConnector``.

Importing this package does not import vLLM; ``connector.redis_connector`` does.
"""
