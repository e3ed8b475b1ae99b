"""The engine that prefills documents: vLLM with RedisConnector in share mode (``kv_both``), fed
a few prompts at a time so each document's outcome is known as soon as it finishes."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from connector.config import TRANSFER_PARAMS_KEY
from connector.redis_connector import LAYOUT_FILE_ENV


@dataclass(frozen=True)
class StoreLayout:
    """Where the engine's connector puts blocks, as it reported at startup."""

    namespace: str
    block_size: int
    fingerprints: list[str]  # one per stored KV-head slice (store_tp_size)
    model_id: str


@dataclass
class Finished:
    key: str  # the caller's name for the prompt
    params: dict[str, Any] | None  # the connector's kv_transfer_params (None: nothing saved)
    error: str | None = None


class WarmEngine:
    """An offline vLLM engine whose connector saves every prefilled prompt's blocks."""

    def __init__(self, engine_kwargs: dict[str, Any], connector_config: dict[str, Any]) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kv = KVTransferConfig(
            kv_connector="RedisConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={**connector_config, "mode": "share"},
        )
        fd, path = tempfile.mkstemp(prefix="redis-kv-layout-", suffix=".json")
        os.close(fd)
        os.environ[LAYOUT_FILE_ENV] = path  # read by the connector in the engine's process
        try:
            self.llm = LLM(**engine_kwargs, kv_transfer_config=kv)
            with open(path) as f:
                text = f.read()
        finally:
            os.environ.pop(LAYOUT_FILE_ENV, None)
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not text:
            raise RuntimeError(
                "the engine started without this package's RedisConnector reporting its layout; "
                "is another package registered as RedisConnector?"
            )
        doc = json.loads(text)
        if len(doc.get("groups", [None])) > 1:
            raise RuntimeError(
                "this model has several KV-cache groups (sliding-window or hybrid layers); the "
                "warm command does not support such models yet: warm it by sending its prompts "
                "to a share-mode server instead"
            )
        self.layout = StoreLayout(
            doc["namespace"], int(doc["block_size"]), list(doc["fingerprints"]), doc["model_id"]
        )
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.tokenizer = self.llm.get_tokenizer()
        self._ids = itertools.count()

    def prefill(
        self, prompts: Sequence[tuple[str, list[int]]], in_flight: int
    ) -> Iterator[list[Finished]]:
        """Prefill each prompt once (``max_tokens`` 1), at most ``in_flight`` at a time. Yields
        after every engine step the prompts that finished in it (often none)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=1, temperature=0)
        queue = list(prompts)
        running: dict[str, str] = {}  # request id -> key
        while queue or running:
            done: list[Finished] = []
            while queue and len(running) < in_flight:
                key, tokens = queue.pop(0)
                request_id = f"warm-{next(self._ids)}"
                try:
                    engine.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), params)
                except ValueError as exc:  # refused by vLLM's input checks
                    done.append(Finished(key, None, f"vLLM refused it: {exc}"))
                    continue
                running[request_id] = key
            for out in engine.step() if running else []:
                key = running.get(out.request_id, "")
                if key and out.finished:
                    del running[out.request_id]
                    ours = (getattr(out, "kv_transfer_params", None) or {}).get(TRANSFER_PARAMS_KEY)
                    done.append(Finished(key, ours))
            yield done
