"""The least-privilege ACL rules of docs/operations.md: they match what the code needs, they are
enough on a real redis-server, and a missing command stops the connector at startup, named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
import torch

from connector.config import RedisConnectorConfig
from kvstore import LookupBuffer, StorePermissionError
from kvstore.fleet.access import acl_rule
from testing.redis_server import RedisServer, add_acl_user
from tests.conftest import ROOT

pytestmark = pytest.mark.redis

ROLES = [
    ("kv_producer", "consume", "`kv_producer`"),
    ("kv_consumer", "consume", "`kv_consumer`, consume mode"),
    ("kv_consumer", "share", "`kv_consumer`, share mode"),
    ("kv_both", "share", "`kv_both`, share mode"),
    ("kv_both", "consume", "`kv_both`, consume mode"),
]


def documented_rule(label: str) -> str:
    readme = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(rf"^\| {re.escape(label)} \| `([^`]+)` \|", readme, re.MULTILINE)
    assert m, f"no ACL row for {label} in docs/operations.md"
    return m.group(1).replace("\\|", "|")  # a pipe in a table cell is escaped


def needed(role: str, mode: str) -> list[str]:
    cfg = RedisConnectorConfig(url="redis://x", role=role, mode=mode)
    return cfg.operations("scheduler") + cfg.operations("worker")


@pytest.mark.parametrize(("role", "mode", "label"), ROLES)
def test_the_readme_rule_is_what_the_code_needs_and_enough(
    private_redis: RedisServer, role: str, mode: str, label: str
) -> None:
    rule = documented_rule(label)
    assert rule == acl_rule(needed(role, mode), "vllm")
    admin = redis.Redis.from_url(private_redis.url)
    add_acl_user(admin, "u", rule)
    url = f"redis://u:pw@127.0.0.1:{private_redis.port}/0"
    cfg = RedisConnectorConfig(url=url, role=role, mode=mode)
    for side in ("scheduler", "worker"):
        with LookupBuffer.from_url(url, namespace="vllm", check=False) as buf:
            buf.check_access(cfg.operations(side))


def test_a_missing_command_stops_the_connector_at_startup(
    private_redis: RedisServer, tiny_model: Path
) -> None:
    from testing.scheduler_harness import make_scheduler

    rule = documented_rule("`kv_consumer`, consume mode").replace(" +get ", " ")
    admin = redis.Redis.from_url(private_redis.url)
    add_acl_user(admin, "nog", rule)
    url = f"redis://nog:pw@127.0.0.1:{private_redis.port}/0"
    with pytest.raises(StorePermissionError, match="GET") as info:
        make_scheduler(tiny_model, "kv_consumer", url=url)
    assert "pw" not in str(info.value)  # the password never shows


@pytest.mark.parametrize(("role", "mode", "label"), ROLES)
def test_every_command_of_a_rule_is_probed_at_startup(
    private_redis: RedisServer, role: str, mode: str, label: str
) -> None:
    # a command the probes never run would let a rule without it start, and fail later on a
    # request (a claim script whose SET never ran on the probe key passed without +set)
    rule = documented_rule(label).split()
    admin = redis.Redis.from_url(private_redis.url)
    cfg = RedisConnectorConfig(url="redis://x", role=role, mode=mode)
    for dropped in [r for r in rule if r.startswith("+")]:
        add_acl_user(admin, "less", [r for r in rule if r != dropped])
        url = f"redis://less:pw@127.0.0.1:{private_redis.port}/0"
        with (
            pytest.raises(StorePermissionError),
            LookupBuffer.from_url(url, namespace="vllm", check=False) as buf,
        ):
            for side in ("scheduler", "worker"):
                buf.check_access(cfg.operations(side))


@pytest.mark.parametrize("lost", ["+get", "+rename"])
def test_a_consuming_read_refused_by_acl_names_the_command_and_gives_back(
    private_redis: RedisServer, lost: str
) -> None:
    # the claim and its reads go in one request: the error must name what the server refused,
    # not the script the request began with, and the blocks must stay where they were
    rule = acl_rule(["drop_select"], "vllm").replace(f" {lost} ", " ")
    assert lost not in rule.split()
    admin = redis.Redis.from_url(private_redis.url)
    add_acl_user(admin, "u", rule)
    owner = LookupBuffer.from_url(private_redis.url, namespace="vllm", fingerprint="fp")
    owner.insert("a" * 32, {"kv": torch.ones(4)})
    url = f"redis://u:pw@127.0.0.1:{private_redis.port}/0"
    buf = LookupBuffer.from_url(url, namespace="vllm", fingerprint="fp", check=False)
    with buf, pytest.raises(StorePermissionError, match=lost.upper()[1:]) as info:
        buf.drop_select(["a" * 32])
    assert info.value.command == lost.upper()[1:]
    got = owner.drop_select(["a" * 32])[0]  # still there, under its own key
    assert got is not None and torch.equal(got["kv"], torch.ones(4))
    owner.close()


def test_the_readmes_admin_rule_is_what_resets_need_and_enough(private_redis: RedisServer) -> None:
    rule = documented_rule(
        "admin: resets (vLLM's `reset_prefix_cache` with the connector, `kvstore reset`) and "
        "their sweep"
    )
    assert rule == acl_rule(["ping", "generation", "reset", "sweep"], "vllm")
    admin = redis.Redis.from_url(private_redis.url)
    add_acl_user(admin, "adm", rule)
    url = f"redis://adm:pw@127.0.0.1:{private_redis.port}/0"
    with LookupBuffer.from_url(url, namespace="vllm", fingerprint="fp") as buf:
        buf.check_access(["ping", "generation", "reset", "sweep"])
        assert buf.reset() == 1 and buf.sweep() == 0


def test_a_rule_that_cannot_read_the_counter_is_named_with_the_whole_rule(
    private_redis: RedisServer,
) -> None:
    # the probe key matches the block pattern; the counter does not: it is probed itself
    rule = documented_rule("`kv_consumer`, share mode").replace(" %R~kv:vllm:generation", "")
    admin = redis.Redis.from_url(private_redis.url)
    add_acl_user(admin, "nogen", rule)
    url = f"redis://nogen:pw@127.0.0.1:{private_redis.port}/0"
    cfg = RedisConnectorConfig(url=url, role="kv_consumer", mode="share")
    with (
        LookupBuffer.from_url(url, namespace="vllm", check=False) as buf,
        pytest.raises(StorePermissionError) as info,
    ):
        buf.check_access(cfg.operations("scheduler"))
    assert "%R~kv:vllm:generation" in str(info.value) and "pw" not in str(info.value)


def test_the_readmes_drop_select_rule_works_and_a_failed_checks_hint_is_enough(
    private_redis: RedisServer,
) -> None:
    """Found by a review: the documented rule had no +ping, so ``from_url`` (which pings)
    refused it; and ``check_access(["drop_select"])`` asked for +set (its probe key) while
    the rule its message named had none -- following the hint looped back to the error."""
    rule = documented_rule("kvstore's `drop_select`")
    assert rule == acl_rule(["ping", "drop_select"], "vllm")
    admin = redis.Redis.from_url(private_redis.url)
    add_acl_user(admin, "dropper", rule)
    owner = LookupBuffer.from_url(private_redis.url, namespace="vllm", fingerprint="fp")
    owner.insert("a" * 32, {"kv": torch.ones(4)})
    url = f"redis://dropper:pw@127.0.0.1:{private_redis.port}/0"
    with LookupBuffer.from_url(url, namespace="vllm", fingerprint="fp") as buf:
        got = buf.drop_select(["a" * 32])[0]
        assert got is not None and torch.equal(got["kv"], torch.ones(4))
        with pytest.raises(StorePermissionError, match="SET") as info:
            buf.check_access(["drop_select"])
    hinted = str(info.value).split("ACL SETUSER <user> ")[-1].split(" (")[0]
    add_acl_user(admin, "hinted", hinted)
    url = f"redis://hinted:pw@127.0.0.1:{private_redis.port}/0"
    with LookupBuffer.from_url(url, namespace="vllm", fingerprint="fp") as buf:
        buf.check_access(["drop_select"])
    owner.close()
