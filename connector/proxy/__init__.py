"""The HTTP proxy in front of prefill and decode vLLM servers (``server``: ``vllm-redis-proxy``,
``python -m connector.proxy``), its cache-aware routing (``routing``) and its Prometheus metrics
(``metrics``). It uses nothing of vLLM."""
