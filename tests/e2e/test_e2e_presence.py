"""Resets, block presence and KV events on a real vLLM CPU engine: the presence API agrees with
the blocks the engine saved and the loader then loads; after ``reset_prefix_cache(
reset_connector=True)`` the engine loads nothing saved before it, saves under the new
generation, and a fresh instance loads those. A subscriber decoding vLLM's ZMQ events with
vLLM's own types sees BlockStored for the saved blocks and AllBlocksCleared for the reset."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import zmq

from connector.presence import StoredLayout, prompt_presence
from kvstore import LookupBuffer
from kvstore.values.keys import parse_key
from testing.e2e import PATIENT, finish, release, start_engine, tokens, wait_at_gate
from testing.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm]

BLOCK = 128  # vLLM's default block size on CPU
PROMPT = tokens(5 * BLOCK + 40, 11)  # 5 full blocks: a loader may load all 5
# engine core and worker in processes of their own, stepping on their own as a server does:
# a reset between phases fails while a finished request's blocks wait for a step that frees
# them, and an in-process engine steps only inside generate()
SHARE = {"role": "kv_both", "extra": {"mode": "share", **PATIENT}, "separate_processes": True}


class Subscriber:
    """A router's view: vLLM's published batches (topic, sequence, msgpack KVEventBatch),
    decoded with vLLM's own types."""

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.events: list[Any] = []
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._sock.connect(endpoint)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _, _, payload = self._sock.recv_multipart()
                self.events.extend(self._decoder.decode(payload).events)

    def close(self) -> list[Any]:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        return self.events


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("presence")
    out: dict[str, Any] = {}
    port = free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    p = [{"id": "p", "prompt_token_ids": PROMPT}]
    q = [{"id": "q", "prompt_token_ids": PROMPT}]
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        layout_file = tmp / "layout.json"
        gate = tmp / "before-reset"
        saver = start_engine(
            tmp, "saver", tiny_model, [p, "reset", q], core=0, url=server.url, **SHARE,
            gates={1: gate}, layout_file=layout_file, kv_events_endpoint=f"tcp://*:{port}",
        )  # fmt: skip
        wait_at_gate(gate)
        layout = StoredLayout.from_file(layout_file)
        with LookupBuffer.from_url(server.url, namespace=layout.namespace) as store:
            out["before"] = prompt_presence(store, layout, PROMPT)
            out["keys_before"] = sorted(k.decode() for k in client.scan_iter("kv:*"))
            release(gate)
            out["saver"] = finish(saver)
            out["events"] = subscriber.close()
            out["after"] = prompt_presence(store, layout, PROMPT)
        out["keys_after"] = sorted(k.decode() for k in client.scan_iter("kv:*"))
        loader = start_engine(tmp, "loader", tiny_model, [p], core=1, url=server.url, **SHARE)
        out["loader"] = finish(loader)
        out["layout"] = json.loads(layout_file.read_text())
    return out


def blocks_of(keys: list[str]) -> list[Any]:
    parsed = [parse_key(k) for k in keys]
    return [k for k in parsed if k is not None and k.kind == "block"]


def test_presence_agrees_with_what_the_engine_saved(run: dict[str, Any]) -> None:
    before = run["before"]
    assert before.blocks == [True] * 5 and before.loadable_blocks == 5
    assert len(blocks_of(run["keys_before"])) == 5  # the 5 blocks it says, no others
    assert before.generation == 0


def test_after_a_reset_the_engine_loads_nothing_from_before_and_saves_anew(
    run: dict[str, Any],
) -> None:
    saver = run["saver"]
    assert saver["resets"] == [True]
    # vLLM's own prefix cache was reset too: the prompt is computed in full, nothing loaded
    assert saver["prompts"]["q"]["num_cached_tokens"] == 0
    assert saver["prompts"]["q"]["token_ids"] == saver["prompts"]["p"]["token_ids"]
    blocks = blocks_of(run["keys_after"])
    # saved anew in generation 1; the older ones are unlinked deadline_max_s after the reset
    # (loads under way finish first: test_connector_resets), or expire with their TTL
    assert [b.generation for b in blocks].count(1) == 5
    assert all(b.generation in (0, 1) for b in blocks)
    after = run["after"]
    assert (after.generation, after.loadable_blocks) == (1, 5)


def test_a_fresh_instance_loads_what_was_saved_after_the_reset(run: dict[str, Any]) -> None:
    loaded = run["loader"]["prompts"]["p"]
    assert loaded["num_cached_tokens"] == 5 * BLOCK
    assert loaded["token_ids"] == run["saver"]["prompts"]["p"]["token_ids"]


def test_a_subscriber_sees_the_saved_blocks_and_the_reset(run: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    events = run["events"]
    redis_stored = [
        (i, e) for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == "CPU"
    ]
    gpu_hashes = [h for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
                  for h in e.block_hashes]  # fmt: skip
    (at, first), *later = redis_stored
    # the presence API agrees with the event: the 5 blocks it announced are loadable
    assert len(first.block_hashes) == run["before"].loadable_blocks == 5
    assert first.token_ids == PROMPT[: 5 * BLOCK] and first.block_size == BLOCK
    assert first.parent_block_hash is None
    # named by vLLM's block hashes: the same a router learns from the GPU cache's events
    assert set(first.block_hashes) <= set(gpu_hashes)
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert cleared and at < cleared[0]
    # after the reset, q's blocks (the same prompt) are saved anew and announced again
    assert [(i > cleared[0], e.block_hashes) for i, e in later] == [(True, first.block_hashes)]


HALF = PROMPT[: 3 * BLOCK] + tokens(2 * BLOCK + 40, 12)  # PROMPT's first 3 blocks, then others


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    """A reset made by someone else (``kvstore reset --no-sweep``, as a trainer would after a
    weight update) while an instance runs that looked blocks up before it; the older blocks are
    left in Redis, so only the generation keeps the instance from loading them."""
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("reset-elsewhere")
    out: dict[str, Any] = {}
    p = [{"id": "p", "prompt_token_ids": PROMPT}]
    half = [{"id": "half", "prompt_token_ids": HALF}]
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        layout_file = tmp / "layout.json"
        saver = start_engine(tmp, "saver", tiny_model, [p], core=0, url=server.url, **SHARE,
                             layout_file=layout_file)  # fmt: skip
        out["saver"] = finish(saver)
        layout = StoredLayout.from_file(layout_file)
        with LookupBuffer.from_url(server.url, namespace=layout.namespace) as store:
            out["half_before"] = prompt_presence(store, layout, HALF)
            gate = tmp / "after-half"
            runner = start_engine(tmp, "runner", tiny_model, [half, p], core=1, url=server.url,
                                  **SHARE, gates={1: gate})  # fmt: skip
            wait_at_gate(gate)  # it loaded HALF's leading blocks from Redis (generation 0)
            reset = subprocess.run(
                [sys.executable, "-m", "kvstore", "--url", server.url, "reset",
                 "--namespace", layout.namespace, "--no-sweep", "--json"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            out["reset"] = (reset.returncode, reset.stdout + reset.stderr)
            out["keys_after_reset"] = sorted(k.decode() for k in client.scan_iter("kv:*"))
            out["p_after"] = prompt_presence(store, layout, PROMPT)
        release(gate)
        out["runner"] = finish(runner)
    return out


def test_presence_of_a_partly_stored_prompt_is_what_an_instance_then_loads(
    elsewhere: dict[str, Any],
) -> None:
    before = elsewhere["half_before"]
    assert before.blocks == [True, True, True, False, False]
    assert before.loadable_blocks == 3 and before.loadable_tokens == 3 * BLOCK
    half = elsewhere["runner"]["prompts"]["half"]
    assert half["num_cached_tokens"] == 3 * BLOCK  # exactly those, from Redis
    assert half["token_ids"]  # answered


def test_a_reset_elsewhere_keeps_a_running_instance_from_loading_older_blocks_still_there(
    elsewhere: dict[str, Any],
) -> None:
    rc, text = elsewhere["reset"]
    assert rc == 0, text
    older = [b for b in blocks_of(elsewhere["keys_after_reset"]) if b.generation == 0]
    assert len(older) == 5 + 2  # nothing swept: the saver's 5, HALF's 2 the runner saved
    assert elsewhere["p_after"].loadable_blocks == 0  # presence answers in the new generation
    p = elsewhere["runner"]["prompts"]["p"]
    # its own GPU cache still has HALF's 3 blocks (a trainer would reset that too); the
    # other 2 of PROMPT's 5 are in Redis from before the reset: not loaded
    assert p["num_cached_tokens"] == 3 * BLOCK
    assert elsewhere["runner"]["metrics"].get("vllm:redis_kv_blocks_loaded", 0) == 3  # HALF's
    assert p["token_ids"] == elsewhere["saver"]["prompts"]["p"]["token_ids"]
