"""``POST /kv/presence``: which leading blocks of a prompt are in Redis (``connector.presence``).
It tells whoever asks whether a prompt was seen: off unless ``--enable-kv-presence``, and
limited per client (an IPv6 one by its network) and in tokens per query."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from connector.presence import valid_token_ids
from connector.proxy.backends import Backends
from connector.proxy.bodies import Refusal, read_json
from connector.proxy.config import ProxyConfig
from connector.proxy.errors import RequestRefused, openai_error
from connector.proxy.guards import BodyHold, RequestGuards, TokenBuckets, rate_limit_key

# a prompt string longer than this many characters per allowed token is refused untokenized
# (no tokenizer averages more than a few characters per token)
_MAX_CHARS_PER_TOKEN = 16

# a presence question waits at most this for its prompt's tokens (all decode servers together)
TOKENIZE_S = 30.0


logger = logging.getLogger("vllm_redis_proxy")

# the socket and connect timeouts of the presence queries' store (seconds)
PRESENCE_TIMEOUT_S = 1.0


class PresenceService:
    """The proxy's block-presence answers: one ``LookupBuffer`` opened on first use."""

    def __init__(self, redis_url: str | None, layout_file: str | None) -> None:
        self._url = redis_url
        self._layout_file = layout_file
        self._store: Any = None
        self._layout: Any = None
        self._opening = threading.Lock()  # requests run in threads: one store, opened once

    async def answer(self, token_ids: list[int], salt: str = "") -> Response:
        from kvstore import InvalidArgumentError, InvalidURLError, KVStoreError

        if not self._url or not self._layout_file:
            return openai_error(
                501,
                "block presence needs the store: start the proxy with --redis-url and "
                "--layout-file (the JSON the connector writes to $REDIS_KV_CONNECTOR_LAYOUT_FILE)",
                "not_configured",
            )
        try:
            found = await asyncio.to_thread(self._presence, token_ids, salt)
        except (InvalidArgumentError, InvalidURLError) as exc:  # the proxy's own configuration
            return openai_error(500, str(exc), "not_configured")
        except KVStoreError as exc:
            # the caller learns what to do; where Redis is (host, port, user) stays in the log
            logger.warning("block presence: %s", exc)
            return openai_error(
                503,
                f"the store did not answer ({type(exc).__name__}); the proxy's log says why",
                "store_unavailable",
            )
        return JSONResponse(found)

    def _presence(self, token_ids: list[int], salt: str) -> dict[str, Any]:
        from connector.presence import StoredLayout, prompt_presence
        from kvstore import LookupBuffer

        with self._opening:
            if self._store is None:
                assert self._url is not None and self._layout_file is not None
                self._layout = StoredLayout.from_file(self._layout_file)
                # a router wants its answer now or not at all: a hung Redis costs a query
                # PRESENCE_TIMEOUT_S, not the default 10 s (a review: 11 s each, and 21 s for
                # those queued behind them on the threads)
                self._store = LookupBuffer.from_url(
                    self._url,
                    namespace=self._layout.namespace,
                    check=False,
                    socket_timeout_s=PRESENCE_TIMEOUT_S,
                    connect_timeout_s=PRESENCE_TIMEOUT_S,
                )
        return prompt_presence(self._store, self._layout, token_ids, salt).as_dict()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


class PresenceQueries:
    """The route's checks before the store is asked: on at all, the client's rate, the
    body's size and shape, the prompt's length (a string is tokenized by a decode server)."""

    def __init__(
        self, cfg: ProxyConfig, backends: Backends, guards: RequestGuards, refusal: Refusal
    ) -> None:
        self._cfg = cfg
        self._backends = backends
        self._guards = guards
        self._refusal = refusal
        self.service = PresenceService(cfg.redis_url, cfg.layout_file)
        self._buckets = (
            TokenBuckets(cfg.kv_presence_rate, cfg.kv_presence_burst)
            if cfg.kv_presence_rate > 0
            else None
        )

    async def answer(self, request: Request) -> Response:
        """The query's answer, its body's bytes held of the in-flight budget until then."""
        with self._guards.hold_body() as hold:
            return await self._answer(request, hold)

    async def _answer(self, request: Request, hold: BodyHold) -> Response:
        """Body ``{"token_ids": [...]}`` or ``{"prompt": "..."}`` (tokenized by a decode
        server), and the request's ``cache_salt`` / ``lora_name`` / ``lora_path`` where it has
        them."""
        cfg = self._cfg
        if not cfg.enable_kv_presence:
            return openai_error(
                404,
                "block presence is off: start the proxy with --enable-kv-presence (it tells "
                "callers which prompts were seen; give /kv/* a key with --kv-api-key)",
                "not_found",
            )
        if self._buckets is not None:
            host = request.client.host if request.client else ""
            wait = self._buckets.take(rate_limit_key(host, cfg.kv_presence_ipv6_prefix))
            if wait:
                too_many = openai_error(
                    429, f"too many presence queries from this address (at most "
                    f"{cfg.kv_presence_rate:g}/s, --kv-presence-rate; IPv6 clients count by "
                    f"their /{cfg.kv_presence_ipv6_prefix}, --kv-presence-ipv6-prefix)",
                    "rate_limit_exceeded",
                )  # fmt: skip
                too_many.headers["Retry-After"] = str(max(1, math.ceil(wait)))
                return too_many
        try:
            body = await read_json(request, hold, self._guards, self._refusal)
        except RequestRefused as refused:
            return refused.response
        token_ids = body.get("token_ids") if isinstance(body, dict) else None
        prompt = body.get("prompt") if isinstance(body, dict) else None
        limit = cfg.kv_presence_max_tokens
        if isinstance(token_ids, list) and len(token_ids) > limit:
            return _too_many_tokens(len(token_ids), limit)
        if token_ids is None and isinstance(prompt, str):
            if len(prompt) > limit * _MAX_CHARS_PER_TOKEN:  # refused untokenized
                return _too_many_tokens(None, limit)
            token_ids = await self._backends.tokenize(
                {"prompt": prompt}, min(self._backends.timeout_s, TOKENIZE_S)
            )
            if isinstance(token_ids, Response):
                return token_ids
            if len(token_ids) > limit:
                return _too_many_tokens(len(token_ids), limit)
        if not valid_token_ids(token_ids):
            return openai_error(
                400, 'give "token_ids" (a list of ints in [0, 2**63)) or "prompt" (a string)',
                "invalid_request_error", "token_ids",
            )  # fmt: skip
        assert isinstance(body, dict)  # token ids came from it
        salt_fields = {k: body.get(k) for k in ("cache_salt", "lora_name", "lora_path")}
        bad = [k for k, v in salt_fields.items() if v is not None and not isinstance(v, str)]
        if bad:
            return openai_error(400, f"{bad[0]} must be a string", "invalid_request_error", bad[0])
        from connector.presence import prompt_salt
        from kvstore import InvalidArgumentError

        try:
            salt = prompt_salt(
                lora_name=salt_fields["lora_name"],
                lora_path=salt_fields["lora_path"] or "",
                cache_salt=salt_fields["cache_salt"],
            )
        except InvalidArgumentError as exc:
            return openai_error(400, str(exc), "invalid_request_error", "lora_name")
        return await self.service.answer(token_ids, salt)

    def close(self) -> None:
        self.service.close()


def _too_many_tokens(count: int | None, limit: int) -> JSONResponse:
    said = f"{count} tokens" if count is not None else "a prompt that long"
    return openai_error(
        413, f"{said}: at most {limit} per presence query (--kv-presence-max-tokens)",
        "invalid_request_error", "token_ids",
    )  # fmt: skip
