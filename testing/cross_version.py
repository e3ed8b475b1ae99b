"""Save KV blocks through RedisConnector under the vLLM installed here, or load and check blocks
saved under another vLLM release: the worker side, driven the way vLLM's model runner drives it
(no model runs). ``tests/integration/test_cross_version.py`` runs it in each other version's
virtualenv.

    python -m testing.cross_version save --url redis://127.0.0.1:6390/0 --model DIR
    python -m testing.cross_version load --url redis://127.0.0.1:6390/0 --model DIR

Both print one JSON line: the vLLM version, the layout fingerprint, and (load) how many blocks
arrived intact.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import vllm

from connector.metadata import CommitSpec, LoadSpec, RedisConnectorMetadata, SaveSpec
from connector.redis_connector import RedisConnector
from kvstore import chain_hashes
from kvstore.values.keys import block_name
from testing.scheduler_harness import BS, LAYERS, make_worker_connector, run_worker_step

NUM_BLOCKS = 4  # blocks saved and loaded
TOKENS = [(i * 7 + 3) % 250 for i in range(NUM_BLOCKS * BS)]


def block_value(position: int, layer: int) -> torch.Tensor:
    """The deterministic content of chain position ``position`` in ``layer``."""
    gen = torch.Generator().manual_seed(1000 * position + layer)
    return torch.randn(2, BS, 128, generator=gen)


def worker(model: Path, url: str) -> tuple[RedisConnector, dict[str, torch.Tensor]]:
    return make_worker_connector(model, url, 2 * NUM_BLOCKS)


def save(model: Path, url: str) -> dict[str, object]:
    conn, caches = worker(model, url)
    block_ids = [NUM_BLOCKS + i for i in range(NUM_BLOCKS)]  # not 0..n: ids differ per instance
    for pos, block_id in enumerate(block_ids):
        for layer, name in enumerate(LAYERS):
            caches[name][block_id].copy_(block_value(pos, layer))
    names = [block_name(h) for h in chain_hashes(TOKENS, BS)]  # generation 0, one group
    run_worker_step(
        conn,
        RedisConnectorMetadata(
            saves=[SaveSpec("x", [block_ids], [names], 0, "x")],
            commits=[CommitSpec("x", "x", NUM_BLOCKS, 0)],
        ),
    )
    conn.worker.shutdown_pending(timeout_s=30)
    fingerprint = conn.worker.store.fingerprint
    conn.shutdown()
    return {"vllm": vllm.__version__, "fingerprint": fingerprint}


def load(model: Path, url: str) -> dict[str, object]:
    conn, caches = worker(model, url)
    block_ids = list(range(NUM_BLOCKS))
    names = [block_name(h) for h in chain_hashes(TOKENS, BS)]
    run_worker_step(
        conn, RedisConnectorMetadata(loads=[LoadSpec("y", [block_ids], [names], timeout_s=30)])
    )
    deadline = time.monotonic() + 30
    while "y" not in (conn.get_finished(set())[1] or set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    failed = conn.get_block_ids_with_load_errors()
    intact = sum(
        block_id not in failed
        and all(
            torch.equal(caches[name][block_id], block_value(pos, layer))
            for layer, name in enumerate(LAYERS)
        )
        for pos, block_id in enumerate(block_ids)
    )
    fingerprint = conn.worker.store.fingerprint
    conn.shutdown()
    return {"vllm": vllm.__version__, "fingerprint": fingerprint, "intact": intact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", type=Path, required=True, help="a model dir (config only)")
    args = parser.parse_args()
    result = (save if args.action == "save" else load)(args.model, args.url)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
