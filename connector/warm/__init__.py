"""Pre-warm a corpus into the shared pool: ``python -m connector.warm`` (see ``cli``).

``inputs`` reads documents and renders the prompt text requests will start with, ``engine``
prefills them on a vLLM engine with RedisConnector in share mode, ``cli`` plans, reports and
checks. The records it leaves in Redis are ``connector.warm.records``.
"""
