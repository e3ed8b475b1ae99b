from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fakeredis
import pytest

if TYPE_CHECKING:
    from testing.sim_engine import SimEngine

# any URL: the fake_redis fixture gives every store the code opens its one fakeredis server
FAKE_URL = "redis://fake:6379/0"


@pytest.fixture
def engine_defaults() -> dict[str, Any]:
    """The keywords ``engines`` gives every engine the test does not give its own; a test module
    overrides this fixture for other defaults."""
    return {"deadline_s": 30, "lookup_wait_s": 0.02}


@pytest.fixture
def engines(
    tiny_model: Path, fake_redis: fakeredis.FakeRedis, engine_defaults: dict[str, Any]
) -> Iterator[Callable[..., SimEngine]]:
    """A factory of simulated engines (``testing.sim_engine``) on one fakeredis server:
    ``engines(role="kv_both", **SimEngine keywords)``. Afterwards every gate is opened, every
    engine whose requests all finished is settled and must hold nothing of them, and every
    engine is shut down and checked (no foreign writes, no wrong values)."""
    # (imported here: it imports vLLM, which the unit tests that never use it must not need)
    from testing.sim_engine import Gate, SimEngine

    made: list[SimEngine] = []

    def make(role: str = "kv_both", **kw: Any) -> SimEngine:
        e = SimEngine(tiny_model, role, FAKE_URL, **{**engine_defaults, **kw})  # type: ignore[arg-type]
        made.append(e)
        return e

    yield make
    Gate.open_all()
    for e in made:
        if not e.sched.has_requests():  # all done: the connector must hold nothing of them
            e.settle()
            assert not e.leftovers(), e.leftovers()
        e.shutdown()
    for e in made:
        e.assert_clean()
