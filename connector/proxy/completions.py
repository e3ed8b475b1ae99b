"""The completion routes' work (``/v1/completions``, ``/v1/chat/completions``): a client's body,
read within the guards' limits and checked, goes to a prefill server as a one-token copy; the
``kv_transfer_params`` of its answer go with the original request to a decode server, whose
answer is streamed back unchanged. With a pool (no prefill servers) the request goes, whole, to
one server. A client that leaves before its answer starts cancels the backends' work."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from connector.config import TRANSFER_PARAMS_KEY
from connector.logs import FailureCounts
from connector.presence import valid_token_ids
from connector.proxy.backends import BackendAnswer, Backends
from connector.proxy.bodies import (
    Refusal,
    finite_float,
    read_json,
    refuse_constant,
)
from connector.proxy.errors import BackendError, RequestRefused, openai_error
from connector.proxy.guards import BodyHold, RequestGuards
from connector.proxy.routing import PrefixIndex
from connector.save_policy import SAVE_MARK_KEY, marked_for_saving

logger = logging.getLogger("vllm_redis_proxy")

# fields of a client's body that are the proxy's to set: kv_transfer_params names a handoff (a
# client could load another request's KV with it, or pin a load policy); request_id would
# name the request at the backend as X-Request-Id does
_PROXY_OWNED_FIELDS = ("kv_transfer_params", "ec_transfer_params", "request_id")
# vLLM copies vllm_xargs into the request's extra args, where the same names would reach the
# connector
_XARGS = "vllm_xargs"
# a client's X-Request-Id is echoed back only if it looks like an id
_ECHOABLE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# a routing hint is worth at most this wait for the prompt's tokens: past it, route by load
ROUTING_TOKENIZE_S = 1.0


class CompletionProxy:
    """Proxies completion requests through ``backends``; ``indexes`` are the cache-aware
    policy's (empty: requests are routed by load alone, their prompts never tokenized)."""

    def __init__(
        self,
        backends: Backends,
        guards: RequestGuards,
        refusal: Refusal,
        indexes: dict[str, PrefixIndex],
    ) -> None:
        self._backends = backends
        self._guards = guards
        self._refusal = refusal
        self._indexes = indexes

    async def handle(self, request: Request, path: str) -> Response:
        # the body counts against --max-in-flight-body-bytes until the answer starts: the
        # body, parsed and forwarded, is dropped by then
        with self._guards.hold_body() as hold:
            return await self._proxy_request(request, path, hold)

    async def _proxy_request(self, request: Request, path: str, hold: BodyHold) -> Response:
        try:
            body = await read_json(request, hold, self._guards, self._refusal)
        except RequestRefused as refused:
            return refused.response
        problem = validate_body(body, path)
        if problem:
            return openai_error(400, problem[0], "invalid_request_error", problem[1])
        # the proxy names the request at the backends (the client's id could be another's) and
        # sets the transfer params itself, from the prefill answer
        body = without_proxy_owned(body)
        req_id = f"proxy-{uuid.uuid4().hex}"
        client_id = request.headers.get("x-request-id")
        shown_id = client_id if client_id and _ECHOABLE_REQUEST_ID.fullmatch(client_id) else req_id
        # the backends' work runs in a cancel scope of its own, cancelled if the client
        # leaves: anyio's cancellation respects httpcore's shielded closes, where a plain
        # Task.cancel landing in one left its pooled connection in use for ever (a review:
        # 5 of 5 leaked, and at 512 the proxy had none left)
        scope = anyio.CancelScope()
        stream = bool(body.get("stream"))

        async def pipeline() -> Response | BackendAnswer | None:
            with scope:
                return await self._pipeline(body, path, req_id, stream)
            return None  # (cancelled)

        work = asyncio.ensure_future(pipeline())
        gone = asyncio.ensure_future(_client_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            # the client left before the answer: stop the backends' work (closing the
            # connection makes vLLM abort the request) instead of computing for nobody
            scope.cancel()
            answer = await work
            if answer is None:
                logger.info("request %s: the client left; cancelled", req_id)
                return Response(status_code=499)
            if isinstance(answer, BackendAnswer):  # (it came as the scope was cancelled)
                await answer.finish()
            return Response(status_code=499)
        answer = work.result()
        if answer is None:  # (the scope is cancelled only above)
            raise RuntimeError("the proxy's pipeline ended without an answer")
        if isinstance(answer, BackendAnswer):
            resp = answer.response
            # relayed byte for byte: a server that compressed them anyway (it is asked not
            # to) says so to the client, which then can read them
            encoding = resp.headers.get("content-encoding")
            answer = RelayedStream(
                self._backends.relay(resp, answer.finish, str(resp.request.url)),
                answer.finish,
                self._backends.timeout_s,
                media_type=resp.headers.get("content-type", "text/event-stream"),
                headers={"content-encoding": encoding} if encoding else None,
            )
        answer.headers["x-request-id"] = shown_id
        return answer

    async def _pipeline(
        self, body: dict, path: str, req_id: str, stream: bool
    ) -> Response | BackendAnswer:
        """Prefill, then decode (a pool: the answer alone): an answer, or the decode server's
        stream, up to its headers (``handle`` relays it if the client is still there)."""
        backends = self._backends
        prefill, decode = backends.prefill, backends.decode
        token_ids = await self._routing_tokens(body, path) if self._indexes else None
        try:
            dec = dict(body)
            if prefill.urls:
                answer = await backends.send(prefill, path, prefill_request(body),
                                             req_id + "-prefill", stream=False,
                                             token_ids=token_ids)  # fmt: skip
                await answer.finish()
                params = transfer_params(answer)
                if params:
                    dec["kv_transfer_params"] = params
            answer = await backends.send(decode, path, dec, req_id, stream=stream,
                                         token_ids=token_ids)  # fmt: skip
        except BackendError as err:
            return err.response
        if answer.body is None:
            return answer  # a stream
        await answer.finish()
        return Response(
            content=answer.body,
            status_code=answer.response.status_code,
            media_type=answer.response.headers.get("content-type", "application/json"),
        )

    async def _routing_tokens(self, body: dict, path: str) -> list[int] | None:
        """The prompt's token ids, to match against the servers' caches; None (route by load)
        when they cannot be had."""
        if not any(len(index) for index in self._indexes.values()):
            return None  # nothing learned yet: no /tokenize round trip
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str):
            tokens = await self._backends.tokenize({"prompt": prompt}, ROUTING_TOKENIZE_S)
        elif path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
            messages = {"messages": body["messages"]}
            tokens = await self._backends.tokenize(messages, ROUTING_TOKENIZE_S)
        else:
            return None
        return tokens if isinstance(tokens, list) else None


def validate_body(body: Any, path: str) -> tuple[str, str | None] | None:
    """What is wrong with a completion request's body, and the field at fault; None: nothing
    the proxy checks."""
    if not isinstance(body, dict):
        return "request body must be a JSON object", None
    if path.endswith("/chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list", "messages"
    elif "prompt" not in body:
        return "'prompt' is required", "prompt"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            return f"'{key}' must be a positive integer", key
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(p, str) for p in prompt):
        # token ids, or a list of lists of them: ids no tokenizer has are refused here
        sequences = prompt if all(isinstance(p, list) for p in prompt) else [prompt]
        if not all(valid_token_ids(s) for s in sequences):
            return "'prompt' token ids must be integers in [0, 2**63)", "prompt"
    return None


def without_proxy_owned(body: dict[str, Any]) -> dict[str, Any]:
    """A client's body without the fields that are the proxy's to set, at the top level or in
    ``vllm_xargs``. Of a client's ``kv_transfer_params`` only the save mark passes
    (``{"redis_kv_save": true}``, the ``marked`` save policy's): it asks the pool to write the
    prompt, which ``save_policy: all`` does for every request, and names no one's KV."""
    mark = body.get("kv_transfer_params")
    body = {k: v for k, v in body.items() if k not in _PROXY_OWNED_FIELDS}
    xargs = body.get(_XARGS)
    if isinstance(xargs, dict):
        body[_XARGS] = {k: v for k, v in xargs.items() if k not in _PROXY_OWNED_FIELDS}
    if marked_for_saving(mark):
        body["kv_transfer_params"] = {SAVE_MARK_KEY: True}
    return body


def prefill_request(body: dict) -> dict:
    """The copy of a request sent to a prefill server: one token, one sequence, no stream.
    Options that would make it invalid with one token (``min_tokens`` > 1) or repeat work
    (``n``, ``best_of``) are dropped; the decode server gets them unchanged."""
    pre = {
        k: v
        for k, v in body.items()
        if k not in ("stream", "stream_options", "min_tokens", "n", "best_of")
    }
    pre.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def transfer_params(answer: BackendAnswer) -> dict | None:
    """The connector's own params of a prefill answer's ``kv_transfer_params``, to pass on to
    the decode server; BackendError (502) if the answer is not what a prefill server sends.
    Only ``redis_kv`` is passed on, and only as the producer writes it: a flat object of a few
    short scalars (the decode server checks what they say; a prefill server cannot make the
    proxy send it a 100 MiB object, or params of another connector)."""
    url = str(answer.response.request.url)
    try:
        doc = json.loads(answer.body or b"", parse_constant=refuse_constant,
                         parse_float=finite_float)  # fmt: skip
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise BackendError(openai_error(
            502, f"prefill server {url} answered with something other than a JSON object "
            "(or with a number out of range)", "backend_error",
        ))  # fmt: skip
    params = doc.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise BackendError(openai_error(
            502, f"prefill server {url} answered with kv_transfer_params that are not an "
            "object", "backend_error",
        ))  # fmt: skip
    ours = params.get(TRANSFER_PARAMS_KEY)
    if ours is None:
        return None
    problem = handoff_params_problem(ours)
    if problem:
        raise BackendError(openai_error(
            502, f"prefill server {url} answered with kv_transfer_params.{TRANSFER_PARAMS_KEY} "
            f"that are not a connector's: {problem}", "backend_error",
        ))  # fmt: skip
    return {TRANSFER_PARAMS_KEY: ours}


# what a producer's params are (``connector.transfer_params.producer_params``), with room
MAX_HANDOFF_FIELDS = 32
MAX_HANDOFF_TEXT = 256


def handoff_params_problem(ours: Any) -> str | None:
    """What makes ``ours`` not a producer's handoff params; None: it may be one."""
    if not isinstance(ours, dict):
        return "not an object"
    if len(ours) > MAX_HANDOFF_FIELDS:
        return f"{len(ours)} fields (at most {MAX_HANDOFF_FIELDS})"
    for key, value in ours.items():
        if len(key) > MAX_HANDOFF_TEXT:
            return "a field name too long"
        if isinstance(value, str):
            if len(value) > MAX_HANDOFF_TEXT:
                return f"field {key[:40]!r} too long"
        elif value is not None and not isinstance(value, (bool, int, float)):
            return f"field {key[:40]!r} is not a number, string, boolean or null"
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            return f"field {key[:40]!r} is out of range"
    return None


class RelayedStream(StreamingResponse):
    """A decode server's stream relayed to the client; the server is given back however the
    response ends. (The relay's own ``finally`` runs only once its generator has started: a
    server speaking ASGI 2.4 never starts the generator of a stream whose client left before
    its first byte -- a review -- and the backend's connection and slot would stay held.)

    A client that stops reading is given ``send_timeout_s`` (the proxy's ``--timeout-s``) to
    take each chunk, then dropped: before, it held its concurrency slot and the backend's
    connection for as long as it kept the socket open (a review's two idle readers locked a
    proxy of two slots out)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        finish: Callable[[], Awaitable[None]],
        send_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._finish = finish
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stalled = False

        async def send_within(message: Any) -> None:
            nonlocal stalled
            try:
                with anyio.fail_after(self._send_timeout_s):
                    await send(message)
            except TimeoutError:
                stalled = True
                raise

        try:
            await super().__call__(scope, receive, send_within)
        except Exception:
            # (Starlette turns the timeout, an OSError, into ClientDisconnect)
            if not stalled:
                raise
            total = _DROPPED.add("stalled stream")
            if total:
                logger.warning(
                    "a client stopped reading its stream for %.0f s (--timeout-s): dropped "
                    "(%d so far)",
                    self._send_timeout_s,
                    total,
                )
        finally:
            await self._finish()  # (once: the relay's finally may have given it back)


_DROPPED = FailureCounts()  # streams dropped because their client stopped reading


async def _client_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
