"""vLLM v1 KV connector on kvstore (see redis_connector.py)."""
