"""The connector's and kvstore's log lines appear in vLLM's log, in vLLM's format and at vLLM's
level, and never carry a password. A connector is created in a fresh process the way vLLM's
engine processes do it: logging configured by vLLM first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

SCRIPT = """
import logging, sys
import vllm.logger
vllm.logger._configure_vllm_root_logger()  # what vLLM does when its processes start
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from connector.redis_connector import RedisConnector
from testing.scheduler_harness import make_configs
url = "redis://alice:hunter2@127.0.0.1:1/0"  # nothing listens: the connector says so
vllm_config, kv_cache_config = make_configs(sys.argv[1], "kv_both", url=url, check_access=False)
RedisConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config).shutdown()
logging.getLogger("kvstore.lookup_buffer").debug("kvstore-debug-line")
"""


def run(model: Path, level: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": level},
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_connector_and_kvstore_lines_appear_in_vllms_format_and_level_without_secrets(
    tiny_model: Path,
) -> None:
    out = run(tiny_model, "DEBUG")  # our loggers alone would stop at WARNING
    stamp = r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\]"
    assert re.search(rf"INFO {stamp} RedisConnector scheduler: role=kv_both", out), out
    assert re.search(rf"ERROR {stamp} RedisConnector cannot use redis://alice:\*\*\*@", out), out
    assert re.search(rf"DEBUG {stamp} kvstore-debug-line", out), out
    assert out.count("RedisConnector scheduler: role=kv_both") == 1  # once, not via root too
    assert "hunter2" not in out
