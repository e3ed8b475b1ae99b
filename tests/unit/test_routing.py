"""Cache-aware routing: the proxy's index of each server's GPU-cached blocks, fed by vLLM's own
ZMQ KV-event publisher, and the proxy sending a prompt to the server holding its prefix."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

pytest.importorskip("vllm")

from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVEventBatch,
)

from connector.proxy.routing import CacheAwareChooser, PrefixIndex, decode_batch
from connector.proxy.server import ProxyConfig, build_app
from testing.proxy_servers import run_server
from testing.redis_server import free_port

BS = 4


def stored(tokens: list[int], first: int, end: int, medium: str | None = "GPU") -> BlockStored:
    """BlockStored for blocks [first, end) of ``tokens``, hashed as a stand-in chain."""
    hashes = [hash(tuple(tokens[: (i + 1) * BS])) & 0xFFFFFFFF for i in range(end)]
    return BlockStored(
        block_hashes=hashes[first:end],
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tokens[first * BS : end * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def encoded(*events: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=list(events)))


def test_the_index_follows_vllm_encoded_events() -> None:
    doc = list(range(100, 100 + 6 * BS))
    index = PrefixIndex()
    for e in decode_batch(encoded(stored(doc, 0, 3), stored(doc, 3, 5))):
        index.apply(e)
    assert index.cached_blocks(doc) == 5
    assert index.cached_blocks(doc[: 2 * BS] + [1] * BS) == 2  # diverges at block 2
    assert index.cached_blocks(list(range(7, 7 + 3 * BS))) == 0
    removed = BlockRemoved(block_hashes=stored(doc, 3, 4).block_hashes, medium="GPU")
    for e in decode_batch(encoded(removed)):
        index.apply(e)
    assert index.cached_blocks(doc) == 3
    # the connector's blocks in Redis are every instance's: they do not steer routing
    for e in decode_batch(encoded(AllBlocksCleared(), stored(doc, 0, 5, medium="CPU"))):
        index.apply(e)
    assert index.cached_blocks(doc) == 0 and len(index) == 0


@pytest.mark.parametrize(
    "poison",
    [
        {"block_hashes": [{"x": 1}, 7]},  # a map: unhashable, it failed every later lookup
        {"parent_block_hash": {"x": 1}},
        {"extra_keys": [[{"x": 1}], None]},
        {"token_ids": [1, 2, 3, "4", 5, 6, 7, 8]},
        {"lora_name": ["a"]},
        {"block_size": 0},
    ],
)
def test_an_event_of_the_wrong_shape_is_dropped_whole_and_lookups_go_on(
    poison: dict[str, Any],
) -> None:
    """A hostile or broken feed: the event is refused (the feed counts it undecodable) before
    any of it is indexed, and the prompts it names still look up (a review's poisoned index
    answered their completions with 500)."""
    doc = list(range(1, 1 + 2 * BS))
    index = PrefixIndex()
    good = decode_batch(encoded(stored(list(range(100, 100 + 2 * BS)), 0, 2)))[0]
    index.apply(good)
    bad = {**decode_batch(encoded(stored(doc, 0, 2)))[0], **poison}
    with pytest.raises((ValueError, TypeError)):
        index.apply(bad)
    assert len(index) == 2 and index.cached_blocks(doc) == 0
    assert index.cached_blocks(list(range(100, 100 + 2 * BS))) == 2


def partial(tokens: list[int], after: int, count: int) -> BlockStored:
    """What vLLM 0.32 announces for a KV block cached at a finer hash block size: the first
    ``count`` tokens of block ``after`` (one hash, ``block_size`` its token count)."""
    full = stored(tokens, 0, after)
    return BlockStored(
        block_hashes=[0xABCDEF],
        parent_block_hash=full.block_hashes[-1] if after else None,
        token_ids=tokens[after * BS : after * BS + count],
        block_size=count,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_partial_block_events_neither_match_nor_change_the_block_size() -> None:
    doc = list(range(100, 100 + 6 * BS))
    index = PrefixIndex()
    for e in decode_batch(encoded(stored(doc, 0, 4), partial(doc, 4, BS // 2))):
        index.apply(e)
    assert index.block_size == BS and index.cached_blocks(doc) == 4
    # a server whose first events were partial blocks: its whole blocks set the size
    index = PrefixIndex()
    for e in decode_batch(encoded(partial(doc, 0, BS // 2), stored(doc, 0, 3))):
        index.apply(e)
    assert index.block_size == BS and index.cached_blocks(doc) == 3


def test_the_oldest_blocks_go_first_when_the_index_is_full() -> None:
    index = PrefixIndex(max_blocks=4)
    a, b = list(range(3 * BS)), list(range(500, 500 + 3 * BS))
    for e in decode_batch(encoded(stored(a, 0, 3), stored(b, 0, 3))):
        index.apply(e)
    assert len(index) == 4 and index.cached_blocks(b) == 3 and index.cached_blocks(a) == 0


def test_a_busy_server_holding_the_prefix_loses_to_an_idle_one() -> None:
    doc = list(range(3 * BS))
    index = PrefixIndex()
    for e in decode_batch(encoded(stored(doc, 0, 3))):
        index.apply(e)
    load = {"a": 0, "b": 2}
    chooser = CacheAwareChooser({"b": index}, load.__getitem__, max_imbalance=4)
    assert chooser.order(["a", "b"], doc) == ["b", "a"]
    load["b"] = 5
    assert chooser.order(["a", "b"], doc) == ["a", "b"]  # beyond max_imbalance: by load


@pytest.fixture
def backends() -> Iterator[tuple[list[str], list[str]]]:
    """Two stand-in servers recording which requests they got."""
    seen: list[str] = []
    urls = []
    gens = []
    for name in ("a", "b"):
        app = FastAPI()

        def handler(name: str = name) -> Any:
            async def completions(request: Request) -> JSONResponse:
                body = await request.json()
                if body.get("max_tokens") != 1:  # the decode leg (the prefill leg asks for 1)
                    seen.append(name)
                return JSONResponse({"choices": [{"text": "x"}]})

            return completions

        app.post("/v1/completions")(handler())
        gen = run_server(app)
        urls.append(next(gen))
        gens.append(gen)
    yield urls, seen
    for gen in gens:
        next(gen, None)


def test_the_proxy_routes_a_prompt_to_the_server_whose_events_show_its_prefix(
    backends: tuple[list[str], list[str]],
) -> None:
    (a, b), seen = backends
    port = free_port()
    # as vLLM is usually started: it binds ("*"), the proxy connects
    publisher = EventPublisherFactory.create(
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}")
    )
    endpoint = f"tcp://127.0.0.1:{port}"
    doc = list(range(50, 50 + 4 * BS))
    cfg = ProxyConfig([a, b], [a, b], policy="cache_aware", events={b: endpoint})

    async def go() -> dict[str, Any]:
        app = build_app(cfg)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                # the subscriber may join after a first batch: publish until it has one
                deadline = time.monotonic() + 60
                while (await c.get("/kv/routing")).json()["servers"][b]["blocks"] == 0:
                    assert time.monotonic() < deadline, "no KV event reached the proxy"
                    publisher.publish(KVEventBatch(ts=time.time(), events=[stored(doc, 0, 4)]))
                    await asyncio.sleep(0.05)
                for tail in range(6):
                    body = {"model": "m", "prompt": [*doc, tail], "max_tokens": 5}
                    assert (await c.post("/v1/completions", json=body)).status_code == 200
                return dict((await c.get("/kv/routing")).json())

    try:
        routing = asyncio.run(go())
    finally:
        publisher.shutdown()
    assert seen == ["b"] * 6  # round-robin or least-loaded would have split them
    assert routing["routed_by_cache"]["decode"] == 6


def test_a_feed_skips_a_bad_message_and_forgets_a_restarted_publisher() -> None:
    import zmq

    from connector.proxy.routing import EventFeed

    port = free_port()
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    feed = EventFeed(f"tcp://127.0.0.1:{port}", index)
    doc, other = list(range(2 * BS)), list(range(900, 900 + 2 * BS))
    try:
        seq = 0
        deadline = time.monotonic() + 60
        while feed.undecodable == 0:  # the subscriber joins a moment after it connects
            assert time.monotonic() < deadline, "the feed never received a message"
            pub.send_multipart((b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"))
            seq += 1
            time.sleep(0.05)
        pub.send_multipart((b"", seq.to_bytes(8, "big"), encoded(stored(doc, 0, 2))))
        while index.cached_blocks(doc) != 2:
            assert time.monotonic() < deadline and feed.alive, "a bad message stopped the feed"
            time.sleep(0.02)
        # the publisher restarted (its sequence starts again): what it held before is gone
        pub.send_multipart((b"", (0).to_bytes(8, "big"), encoded(stored(other, 0, 2))))
        while index.cached_blocks(other) != 2:
            assert time.monotonic() < deadline, "the restarted publisher's batch never came"
            time.sleep(0.02)
        assert index.cached_blocks(doc) == 0 and feed.restarts == 1
    finally:
        feed.close()
        pub.close(linger=0)


def test_blocks_of_a_lora_or_another_group_never_match_a_plain_prompt() -> None:
    doc = list(range(2 * BS))
    index = PrefixIndex()
    lora = stored(doc, 0, 2)
    lora.lora_name = "adapter"
    window = stored(doc, 0, 2)
    window.group_idx = 1
    for e in decode_batch(encoded(lora, window)):
        index.apply(e)
    assert index.cached_blocks(doc) == 0


def test_events_of_a_server_named_with_a_trailing_slash_are_used() -> None:
    a = f"http://127.0.0.1:{free_port()}"
    cfg = ProxyConfig([a], [a], policy="cache_aware", events={a + "/": "tcp://127.0.0.1:1"})

    async def go() -> dict[str, Any]:
        app = build_app(cfg)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                return dict((await c.get("/kv/routing")).json())

    assert asyncio.run(go())["servers"][a]["events"] == "tcp://127.0.0.1:1"
