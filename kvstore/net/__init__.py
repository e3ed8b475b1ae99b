"""How bytes reach Redis: connections and URLs (``connection``), the one place values are sent
and replies received (``transport``, ``wire``: RESP straight into the caller's buffers), which
Cluster master holds a key (``shards``), recycled receive buffers (``buffer_pool``), and the one
error policy (``guard``, ``breaker``: the circuit breaker)."""
