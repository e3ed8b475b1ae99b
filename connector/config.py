"""The connector's settings: ``kv_connector_extra_config``, parsed and checked."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from connector.cpu_cores import usable_cores
from connector.load_policy import LoadPolicy
from connector.save_policy import SavePolicy
from kvstore import InvalidArgumentError, parse_url
from kvstore.net.connection import MAX_TIMEOUT_S
from kvstore.net.server_code import ScriptMode
from kvstore.values.value_auth import check_epoch, load_secret

MODES = ("consume", "share")
# kv_transfer_params key that the producer fills and a proxy copies into the decode request.
TRANSFER_PARAMS_KEY = "redis_kv"
# kv_transfer_params key with which a request pins how its hit is served ("async", "split",
# "recompute", "auto"), honoured only where request_load_policy is on
LOAD_POLICY_KEY = "redis_kv_load"
# the settings of a request's deadline (``Deadlines``), by the field each sets
_DEADLINE_SETTINGS = {
    "deadline_s": "base_s",
    "deadline_per_1k_tokens_s": "per_1k_tokens_s",
    "deadline_max_s": "max_s",
}


# settings that count things: 0 of them cannot work
_AT_LEAST_ONE = (
    "lookup_threads",
    "io_threads",
    "connections",
    "read_ahead_chunks",
    "breaker_failures",
    "store_tp_size",
)


# the socket timeouts (``kvstore.net.connection.check_timeouts`` holds every client to them)
_TIMEOUTS = ("socket_timeout_s", "control_timeout_s", "connect_timeout_s")
# the shortest expiry Redis takes (it counts in whole milliseconds), and a longest far inside
# its 64-bit count of them (31 years: longer is "no expiry", 0)
MIN_TTL_S = 0.001
MAX_TTL_S = 1e9
# an open breaker's probes at most this often (1e-6 s made 4,163 connection attempts a second)
MIN_PROBE_S = 0.01


def _number(key: str, value: Any, *, whole: bool) -> int | float:
    """A setting's value as a finite number (a whole one for counts); JSON and YAML give
    numbers, environment-style configs strings."""
    try:
        if isinstance(value, bool):  # a bool is an int to Python, never a count or a time here
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{key} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InvalidArgumentError(f"{key} must be a finite number, got {value!r}")
    if not whole:
        return number
    if number != int(number):
        raise InvalidArgumentError(f"{key} must be a whole number, got {value!r}")
    return int(number)


def default_connections() -> int:
    """Connections a batch of blocks is spread over when the config does not say: one per two
    cores this process may run on, 1 to 4. More connections overlap more socket reads and
    writes, but each needs a core: on a 2-core host one connection loaded 64 Llama-3-8B blocks
    at 3.1 GB/s and four at 2.5 (``scripts/bench_datamover.py --connections``); on a 16-core
    GPU host four did best (1.16 GB/s against 0.96 for one)."""
    return min(4, max(1, usable_cores() // 2))


@dataclass(frozen=True)
class Deadlines:
    """Everything Redis-related for one request -- the lookup, waiting for the producer's
    commit, the load -- ends by its deadline: ``base_s`` plus ``per_1k_tokens_s`` per 1,000
    prompt tokens, at most ``max_s`` (the settings ``deadline_s``,
    ``deadline_per_1k_tokens_s``, ``deadline_max_s``). Then the request recomputes what is
    missing. ``max_s`` also bounds what outlives a request's wait: a dropped handoff's wait for
    its producer, a reset's loads under way."""

    base_s: float = 2.0
    per_1k_tokens_s: float = 1.0
    max_s: float = 30.0

    def for_prompt(self, num_prompt_tokens: int) -> float:
        """The Redis time budget of a request with this many prompt tokens."""
        budget = self.base_s + self.per_1k_tokens_s * num_prompt_tokens / 1000
        return min(self.max_s, budget)


@dataclass(frozen=True)
class RedisConnectorConfig:
    """Parsed ``kv_connector_extra_config``; see docs/configuration.md for meanings and defaults."""

    url: str = field(repr=False)  # may hold a password: never printed
    role: str  # kv_producer | kv_consumer | kv_both
    namespace: str = "vllm"
    mode: str = "share"
    ttl_s: float | None = 3600.0
    compression: str = "none"
    # each request's deadline for everything Redis-related (deadline_s,
    # deadline_per_1k_tokens_s, deadline_max_s)
    deadlines: Deadlines = field(default_factory=Deadlines)
    # a consumer that finds no handoff record at all (evicted, or the producer never wrote
    # one) waits this long for it, then loads what is there; "pending" is waited for
    handoff_grace_s: float = 0.1
    max_inflight_bytes: int = 256 << 20
    lookup_wait_s: float = 0.005
    model_id: str | None = None
    socket_timeout_s: float = 5.0
    # socket timeout of lookups, handoff records and deletes (small, latency-critical calls)
    control_timeout_s: float = 0.5
    connect_timeout_s: float = 2.0
    io_threads: int = 4
    # connections one batch of blocks is spread over, so socket reads and writes overlap
    connections: int = field(default_factory=default_connections)
    # chunks a load receives ahead while it copies one into the cache: more keep several
    # masters and connections busy across chunk boundaries, each at a staging buffer's cost
    # (1: measured best on the 2-core VM; scripts/gpu_suite.sh measures 1, 2 and 4)
    read_ahead_chunks: int = 1
    lookup_threads: int = 4
    # how many KV-head slices a block is stored as (see connector.layout): instances of
    # different TP sizes that set the same value share blocks. None: this instance's TP size
    # (at most the model's KV heads)
    store_tp_size: int | None = None
    breaker_failures: int = 3
    breaker_probe_s: float = 0.5
    check_access: bool = True
    # how a prompt's blocks found in Redis are served: "auto" chooses per request from what
    # the instance measures (load_policy.py); "async", "split" or "recompute" pins one way
    load_policy: LoadPolicy = LoadPolicy.AUTO
    # which prompts share mode writes to the pool (save_policy.py): "all", "second_sight" (a
    # prompt's head at once, the rest once it is seen again), "marked" (only requests whose
    # kv_transfer_params carry "redis_kv_save": true)
    save_policy: SavePolicy = SavePolicy.ALL
    # let each request pin its way in kv_transfer_params["redis_kv_load"] (benchmarks, routers
    # you trust): off, a client cannot choose what its request costs the others
    request_load_policy: bool = False
    # what a second of a decode's delay counts for in the load policy, against a second of a
    # request's time to first token (0: the policy never delays a first token to spare the
    # decodes' inter-token gaps; raise it to favour throughput on engines full of decodes)
    busy_decode_weight: float = 0.0
    # a split reads each block in bands of layers of at least this many bytes per value (one
    # GETRANGE each): smaller bands overlap more, each costs a command (bench_layer_reads.py)
    split_band_bytes: int = 32 << 10
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # the namespace's secret (value_auth.py): every value is signed with it, and only values
    # signed with it are loaded. From a file or an environment variable, never in this config
    # (vLLM logs it) or the URL; at most one of the two
    secret_file: str | None = None
    secret_env: str | None = None
    # the weights' version (a checkpoint step, a date; value_auth.py): with a secret, only
    # values signed in this epoch are loaded, whatever the namespace's generation counter
    # says -- Redis data a writer with raw access could set back. An RL loop that resets the
    # pool after each weight update gives the new weights' version to the instances it starts
    epoch: str = ""
    # how kvstore's Lua runs (kvstore/net/server_code.py): "auto" (functions where the server
    # has them, the admin having loaded them; scripts where it has none), "functions" (fail at
    # startup without them), "scripts" (EVALSHA: Redis 6; the role may then run any Lua)
    lua: ScriptMode = ScriptMode.AUTO
    # the environment variable holding the store URL, instead of url: a password in it then
    # never reaches vLLM's log of its arguments
    url_env: str | None = None
    # set by the connector, not by users: why this engine cannot compute on top of loaded KV
    # (it then saves but never loads)
    cannot_load: str | None = None

    @property
    def saves(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.role in ("kv_consumer", "kv_both") and self.cannot_load is None

    @property
    def consume(self) -> bool:
        return self.mode == "consume"

    def operations(self, side: str) -> list[str]:
        """What this role needs Redis to allow on ``side`` ("scheduler" or "worker"): keys of
        ``kvstore.fleet.access.ACCESS``, checked at startup."""
        ops = ["ping"]
        if side == "scheduler":
            ops += ["generation"]  # blocks are named by the namespace's generation
        if side == "scheduler" and self.saves:
            ops += ["insert"]  # the "pending" handoff record
        if side == "scheduler" and self.loads:
            ops += ["lookup", "handoff_read"]
            # (auto checks it once, and splits only if allowed)
            if self.load_policy is LoadPolicy.SPLIT:
                ops += ["select_ranges"]
            if self.consume:
                ops += ["handoff_claim", "delete"]
        if side == "worker":
            if self.saves:
                ops += ["insert"]  # blocks and handoff commit records
            if self.loads:  # a consumer claims the handoff it reads (the scheduler deletes)
                ops += ["select"] + (["handoff_claim"] if self.consume else [])
                if self.load_policy is LoadPolicy.SPLIT:
                    ops += ["select_ranges"]
        return ops

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, role: str) -> RedisConnectorConfig:
        extra = dict(extra or {})
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise InvalidArgumentError(
                f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}"
            )
        url = extra.pop("url", None)
        url_env = extra.get("url_env")
        for key, value in (("url", url), ("url_env", url_env)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(
                    f"kv_connector_extra_config.{key} must be a string, got "
                    f"{type(value).__name__}"  # (not the value: it may hold a password)
                )
        if url and url_env:
            raise InvalidArgumentError("give url or url_env, not both")
        if url_env:
            # vLLM logs kv_connector_extra_config: a URL with a password belongs in the
            # environment, named here
            if not isinstance(url_env, str) or not os.environ.get(url_env):
                raise InvalidArgumentError(
                    f"url_env names the environment variable holding the store URL, and "
                    f"{url_env!r} is not set"
                )
            url = os.environ[url_env]
        if not url:
            raise InvalidArgumentError(
                "RedisConnector needs kv_connector_extra_config.url (or url_env: the name of "
                'an environment variable holding it), e.g. {"url": "redis://redis:6379/0"}'
            )
        parse_url(url)  # a bad URL fails here, at startup, with a redacted message
        # an unreadable or short secret fails here too, naming its source, never its bytes
        secret = load_secret(
            secret_file=extra.get("secret_file"), secret_env=extra.get("secret_env")
        )
        # (null: none, as every null below; any other value not a string is refused)
        check_epoch("" if extra.get("epoch") is None else extra["epoch"])
        if extra.get("epoch") and secret is None:
            raise InvalidArgumentError(
                "kv_connector_extra_config.epoch needs the namespace's secret (secret_file or "
                "secret_env): the epoch keys the values' MACs, and without a secret values are "
                "not authenticated"
            )
        if "load_timeout_s" in extra:  # the name before per-request deadlines
            extra.setdefault("deadline_s", extra.pop("load_timeout_s"))
        fields = cls.__dataclass_fields__
        known = {f for f in fields if f not in ("url", "role", "cannot_load", "deadlines")}
        known |= set(_DEADLINE_SETTINGS)
        unknown = set(extra) - known
        if unknown:
            raise InvalidArgumentError(
                f"unknown kv_connector_extra_config key(s) {sorted(unknown)}; "
                f"known: url, {', '.join(sorted(known))}"
            )
        for key, f in fields.items():
            # null keeps a setting's default where null means nothing else (a review: null
            # io_threads was a TypeError at start-up, null check_access skipped the ACL check)
            if key in extra and extra[key] is None and "None" not in str(f.type):
                del extra[key]
        # A producer/consumer pair hands each request over once (consume); instances that
        # both save and load share a pool of prefixes (share).
        extra.setdefault("mode", "share" if role == "kv_both" else "consume")
        if extra["mode"] not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {extra['mode']!r}")
        try:
            if "load_policy" in extra:
                extra["load_policy"] = LoadPolicy.parse(extra["load_policy"])
            if "save_policy" in extra:
                extra["save_policy"] = SavePolicy.parse(extra["save_policy"])
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if "lua" in extra:
            extra["lua"] = ScriptMode.parse(extra["lua"])
        if extra.get("connections") == "auto":
            del extra["connections"]  # the default: from this host's cores
        types = {key: str(f.type) for key, f in fields.items()}
        types.update(dict.fromkeys(_DEADLINE_SETTINGS, "float"))
        for key, kind in types.items():
            if key not in extra or extra[key] is None:
                continue
            if kind in ("float", "float | None", "int", "int | None"):
                extra[key] = _number(key, extra[key], whole=kind.startswith("int"))
                least = 1 if key in _AT_LEAST_ONE else 0
                if extra[key] < least:
                    raise InvalidArgumentError(f"{key} must be >= {least}, got {extra[key]}")
            elif kind == "bool" and not isinstance(extra[key], bool):
                raise InvalidArgumentError(f"{key} must be true or false, got {extra[key]!r}")
        for key in _TIMEOUTS:  # each bounds a wait on Redis: above 0, at most an hour
            if key in extra and not 0 < extra[key] <= MAX_TIMEOUT_S:
                raise InvalidArgumentError(
                    f"{key} must be above 0 and at most {MAX_TIMEOUT_S:g} seconds, got {extra[key]}"
                )
        if extra.get("ttl_s") == 0:
            extra["ttl_s"] = None  # 0 means: no expiry
        elif extra.get("ttl_s") is not None and not MIN_TTL_S <= extra["ttl_s"] <= MAX_TTL_S:
            raise InvalidArgumentError(  # (Redis expires in whole milliseconds of a 64-bit
                # count: 0 and 1e17 s are refused on every save)
                f"ttl_s must be 0 (no expiry) or from {MIN_TTL_S} to {MAX_TTL_S:g} s, got "
                f"{extra['ttl_s']}"
            )
        probe = extra.get("breaker_probe_s")
        if probe is not None and not MIN_PROBE_S <= probe <= MAX_TIMEOUT_S:
            raise InvalidArgumentError(
                f"breaker_probe_s must be from {MIN_PROBE_S} to {MAX_TIMEOUT_S:g} seconds (how "
                f"often an open circuit breaker probes the store), got {probe}"
            )
        given = {name: extra.pop(key) for key, name in _DEADLINE_SETTINGS.items() if key in extra}
        # (a deadline given as null keeps its default: a Deadlines field is never None)
        deadlines = Deadlines(**{name: v for name, v in given.items() if v is not None})
        return cls(url=url, role=role, deadlines=deadlines, **extra)
