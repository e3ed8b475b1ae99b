"""What the proxy is told (``ProxyConfig``, from the command line or a test) and the defaults
of its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.proxy.guards import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_KV_PRESENCE_IPV6_PREFIX,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_JSON_CONTAINERS,
    DEFAULT_MAX_JSON_DEPTH,
)

# A 1M-token prompt sent as token ids is ~7 MiB of JSON, a few base64 images some MiB more;
# prompt_embeds or many images need more (raise --max-body-bytes).
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# the most of a backend's answer the proxy reads whole (a prefill answer, a decode answer
# without stream, /tokenize): bounded, since each request in flight may hold one
DEFAULT_MAX_ANSWER_BYTES = 64 * 1024 * 1024
DEFAULT_KV_PRESENCE_MAX_TOKENS = 131072
DEFAULT_KV_PRESENCE_RATE = 10.0  # per client address, per second
DEFAULT_KV_PRESENCE_BURST = 20


@dataclass
class ProxyConfig:
    prefill: list[str]  # empty: the decode servers are a pool that answers requests whole
    decode: list[str]
    policy: str = "round_robin"
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # the block-presence endpoint (``POST /kv/presence``): the store and the connector's layout
    redis_url: str | None = None
    layout_file: str | None = None
    # policy cache_aware: server URL -> the ZMQ endpoint of its KV events
    events: dict[str, str] = field(default_factory=dict)
    # None: no key asked for. The kv key defaults to the API key (repr=False: never printed)
    api_key: str | None = field(default=None, repr=False)
    kv_api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    # what clients' requests may hold at once, and for how long (``guards.py``); None: the
    # budget of body bytes is DEFAULT_IN_FLIGHT_BODIES bodies of max_body_bytes
    max_in_flight_body_bytes: int | None = None
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_json_containers: int = DEFAULT_MAX_JSON_CONTAINERS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    # /kv/presence tells whoever asks whether a prompt was seen: off unless asked for
    enable_kv_presence: bool = False
    kv_presence_rate: float = DEFAULT_KV_PRESENCE_RATE  # 0: unlimited
    kv_presence_burst: int = DEFAULT_KV_PRESENCE_BURST
    kv_presence_max_tokens: int = DEFAULT_KV_PRESENCE_MAX_TOKENS
    # IPv6 clients are rate-limited by their network of this prefix length (IPv4: by address)
    kv_presence_ipv6_prefix: int = DEFAULT_KV_PRESENCE_IPV6_PREFIX
    # how often a server marked down is asked for /health
    probe_interval_s: float = 1.0
