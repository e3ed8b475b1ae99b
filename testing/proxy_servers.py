"""The proxy app (or a stand-in backend) served on loopback in the test's process, an address no
server listens on, and the check of the proxy's OpenAI-style errors: shared by the proxy's
tests (tests/unit/test_proxy.py, test_proxy_limits.py, test_routing.py) and the presence
tests (tests/integration/test_presence.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
from fastapi import FastAPI

from connector.proxy.server import ProxyConfig, build_app
from testing import stack
from testing.redis_server import free_port

# a URL on a port nothing listens on: a backend that is down
DOWN = f"http://127.0.0.1:{free_port()}"


def run_server(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a thread: yields its URL, stops on resuming."""
    url, stop = stack.serve_in_thread(app, log_level="error")
    yield url
    stop()


def proxy_server(cfg: ProxyConfig) -> tuple[Iterator[str], str, FastAPI]:
    """The proxy built from ``cfg``, served by ``run_server``: (its generator, URL, app)."""
    app = build_app(cfg)
    gen = run_server(app)  # a real server: ASGITransport would buffer streams
    return gen, next(gen), app


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """Check ``r`` is an OpenAI-style error of ``status`` and return its ``error`` object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and "type" in err
    return dict(err)
