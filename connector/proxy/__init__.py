"""The HTTP proxy in front of prefill and decode vLLM servers (``server``: ``vllm-redis-proxy``,
``python -m connector.proxy``). It uses nothing of vLLM. By job, imports pointing one way (down
this list):

- ``server``: the command line; ``config``: its options (``ProxyConfig``);
- ``app``: ``build_app``, the FastAPI app and its routes;
- ``completions``: a completion through prefill and decode servers (or a pool);
  ``kv_presence``: ``/kv/presence``;
- ``backends``: the servers (credentials, sending, marking down and probing, ``/health``);
- ``metrics``: ``/metrics``; ``routing``: each role's ``Pool`` and cache-aware routing;
- ``bodies``: a client's JSON, read within the ``guards``' limits (API keys, rate limits,
  bounds on what a client may make the proxy hold); ``errors``: OpenAI-style errors."""
