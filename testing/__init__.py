"""Test and benchmark support, not shipped: a throwaway redis-server (``redis_server``), stacks of
real vLLM servers and the proxy (``stack``), an offline engine runner (``engine_runner``), a
pre-imported parent that forks the tests' engines and servers and the processes vLLM spawns
for them (``zygote``, ``zygote_shim``), vLLM's real Scheduler with RedisConnector and no model
(``scheduler_harness``), the cross-release block check (``cross_version``), the values
the tests store (``blocks``) and the data mover tests' caches (``kv_caches``), the proxy served
in the test's process (``proxy_servers``) and thread-timing helpers (``threads``). Used by
``tests/`` and ``scripts/``."""
