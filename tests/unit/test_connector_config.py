"""kv_connector_extra_config: defaults that depend on the host."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from connector import cpu_cores
from connector.config import RedisConnectorConfig
from kvstore import InvalidArgumentError

URL = {"url": "redis://r:6379/0"}


@pytest.fixture(autouse=True)
def no_cgroup_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The host's own cgroup limits stay out of these tests; a test writes its own tree under
    the returned root (``/proc/self/cgroup`` becomes ``<root>/self-cgroup``)."""
    monkeypatch.setattr(cpu_cores, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cpu_cores, "PROC_CGROUP", tmp_path / "self-cgroup")
    return tmp_path


def _cgroup(root: Path, membership: str | bytes, files: dict[str, str]) -> None:
    if isinstance(membership, str):
        membership = membership.encode()
    (root / "self-cgroup").write_bytes(membership)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize(
    ("membership", "files", "cores"),
    [
        # a Kubernetes pod limited to 2 CPUs (cgroup v2)
        ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "200000 100000\n"}, 2.0),
        # the pod has no limit of its own; its parent's 1.5 CPUs bound it
        (
            "0::/kubepods/pod1\n",
            {"kubepods/pod1/cpu.max": "max 100000\n", "kubepods/cpu.max": "150000 100000\n"},
            1.5,
        ),
        # a container without a cgroup namespace: its path is not under its own mount
        ("0::/docker/abc\n", {"cpu.max": "400000 100000\n"}, 4.0),
        # cgroup v1, the cpu controller mounted with cpuacct
        (
            "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "300000\n",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
            },
            3.0,
        ),
        # cgroup v1 as RHEL 7's kernel lists it: the controllers in another order than the
        # mount's name
        (
            "3:cpuacct,cpu:/docker/x\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "200000\n",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
            },
            2.0,
        ),
        # no limit anywhere
        ("0::/user.slice\n", {"user.slice/cpu.max": "max 100000\n"}, None),
        (
            "3:cpu,cpuacct:/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            None,
        ),
        # unreadable or garbled: no quota, not an error
        ("0::/a\n", {"a/cpu.max": "lots\n"}, None),
        ("garbage\n", {}, None),
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_the_process_cgroup_and_its_ancestors(
    no_cgroup_quota: Path, membership: str, files: dict[str, str], cores: float | None
) -> None:
    _cgroup(no_cgroup_quota, membership, files)
    assert cpu_cores.cpu_quota_cores() == cores


def test_a_cgroup_name_the_locale_cannot_decode_is_still_read(no_cgroup_quota: Path) -> None:
    _cgroup(no_cgroup_quota, b"0::/caf\xe9\n", {})
    (no_cgroup_quota / "caf\udce9").mkdir()  # the name as Python sees it (surrogateescape)
    (no_cgroup_quota / "caf\udce9" / "cpu.max").write_text("300000 100000\n")
    assert cpu_cores.cpu_quota_cores() == 3.0


def test_a_container_cpu_limit_lowers_the_connections_default(
    monkeypatch: pytest.MonkeyPatch, no_cgroup_quota: Path
) -> None:
    monkeypatch.setattr(cpu_cores.os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert RedisConnectorConfig.from_extra(URL, "kv_both").connections == 4
    _cgroup(no_cgroup_quota, "0::/pod\n", {"pod/cpu.max": "250000 100000\n"})  # 2.5 CPUs
    assert cpu_cores.usable_cores() == 2
    assert RedisConnectorConfig.from_extra(URL, "kv_both").connections == 1
    _cgroup(no_cgroup_quota, "0::/pod\n", {"pod/cpu.max": "50000 100000\n"})  # half a CPU
    assert cpu_cores.usable_cores() == 1
    assert RedisConnectorConfig.from_extra(URL, "kv_both").connections == 1


@pytest.mark.parametrize(("cores", "connections"), [(1, 1), (2, 1), (4, 2), (8, 4), (64, 4)])
def test_connections_default_to_one_per_two_cores_up_to_four(
    monkeypatch: pytest.MonkeyPatch, cores: int, connections: int
) -> None:
    monkeypatch.setattr(cpu_cores.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    for extra in (URL, {**URL, "connections": "auto"}, {**URL, "connections": None}):
        assert RedisConnectorConfig.from_extra(extra, "kv_both").connections == connections


def test_connections_given_are_kept_and_zero_is_refused() -> None:
    assert RedisConnectorConfig.from_extra({**URL, "connections": "3"}, "kv_both").connections == 3
    with pytest.raises(InvalidArgumentError, match="connections must be >= 1"):
        RedisConnectorConfig.from_extra({**URL, "connections": 0}, "kv_both")
    with pytest.raises(InvalidArgumentError, match="connections must be a number"):
        RedisConnectorConfig.from_extra({**URL, "connections": "many"}, "kv_both")


def test_connections_default_without_sched_getaffinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(cpu_cores.os, "sched_getaffinity")  # as on macOS and Windows
    monkeypatch.setattr(cpu_cores.os, "cpu_count", lambda: 8)
    assert RedisConnectorConfig.from_extra(URL, "kv_both").connections == 4


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (float("inf"), "finite"),
        ("nan", "finite"),
        (1.9, "whole number"),
        (True, "a number"),
        (-1, ">= 1"),
        ([4], "a number"),
    ],
)
def test_a_count_that_is_not_a_positive_whole_number_is_refused(value: object, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        RedisConnectorConfig.from_extra({**URL, "io_threads": value}, "kv_both")


def test_read_ahead_is_a_count_of_at_least_one_chunk() -> None:
    config = RedisConnectorConfig.from_extra({**URL, "read_ahead_chunks": "3"}, "kv_both")
    assert config.read_ahead_chunks == 3
    with pytest.raises(InvalidArgumentError, match="read_ahead_chunks must be >= 1"):
        RedisConnectorConfig.from_extra({**URL, "read_ahead_chunks": 0}, "kv_both")


def test_times_take_numbers_given_as_strings_and_refuse_negative_ones() -> None:
    config = RedisConnectorConfig.from_extra(
        {**URL, "deadline_s": "1.5", "io_threads": 2.0}, "kv_both"
    )
    assert (config.deadlines.base_s, config.io_threads) == (1.5, 2)
    with pytest.raises(InvalidArgumentError, match="deadline_s must be >= 0"):
        RedisConnectorConfig.from_extra({**URL, "deadline_s": -0.1}, "kv_both")


@pytest.mark.parametrize("key", ["socket_timeout_s", "control_timeout_s", "connect_timeout_s"])
def test_socket_timeouts_are_bounded_and_null_keeps_the_default(key: str) -> None:
    """Each bounds a wait on Redis: 1e300 made redis-py raise OverflowError at start-up, and
    null (once checked) a TypeError (two reviews)."""
    default = getattr(RedisConnectorConfig.from_extra(URL, "kv_both"), key)
    assert getattr(RedisConnectorConfig.from_extra({**URL, key: None}, "kv_both"), key) == default
    for bad in (0, 1e300, 3601):
        with pytest.raises(InvalidArgumentError, match=key):
            RedisConnectorConfig.from_extra({**URL, key: bad}, "kv_both")


def test_the_store_url_may_come_from_the_environment_and_is_never_printed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM logs kv_connector_extra_config: a URL with a password can be named instead."""
    monkeypatch.setenv("KV_URL", "redis://decode:hunter2hunter2@10.0.0.5:6379/0")
    cfg = RedisConnectorConfig.from_extra({"url_env": "KV_URL"}, "kv_both")
    assert cfg.url.endswith("@10.0.0.5:6379/0") and "hunter2" not in repr(cfg)
    with pytest.raises(InvalidArgumentError, match="KV_URL_UNSET"):
        RedisConnectorConfig.from_extra({"url_env": "KV_URL_UNSET"}, "kv_both")
    with pytest.raises(InvalidArgumentError, match="not both"):
        RedisConnectorConfig.from_extra({"url": "redis://h:1/0", "url_env": "KV_URL"}, "kv_both")


@pytest.mark.parametrize(
    "key",
    ["io_threads", "check_access", "namespace", "mode", "max_inflight_bytes", "breaker_failures",
     "split_band_bytes", "lookup_threads", "request_load_policy", "busy_decode_weight"],
)  # fmt: skip
def test_null_keeps_a_settings_default_where_null_means_nothing_else(key: str) -> None:
    """Found by a review: null passed the checks and then was a TypeError at start-up
    (io_threads) or turned a check off (check_access: null skipped the ACL check)."""
    default = getattr(RedisConnectorConfig.from_extra(URL, "kv_both"), key)
    assert getattr(RedisConnectorConfig.from_extra({**URL, key: None}, "kv_both"), key) == default
    assert RedisConnectorConfig.from_extra({**URL, "ttl_s": None}, "kv_both").ttl_s is None
    assert RedisConnectorConfig.from_extra({**URL, "epoch": None}, "kv_both").epoch == ""


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"breaker_probe_s": 0}, "breaker_probe_s must be from 0.01"),
        ({"breaker_probe_s": 1e-6}, "breaker_probe_s must be from 0.01"),
        ({"ttl_s": 0.0001}, "ttl_s must be 0 (no expiry) or from 0.001"),
        ({"ttl_s": 1e17}, "ttl_s must be 0 (no expiry) or from 0.001"),
        ({"url": 5}, "url must be a string, got int"),
        ({"epoch": 0}, "an epoch must be a string, got int"),  # (only null means none)
        ({"url": None, "url_env": 5}, "url_env must be a string, got int"),
    ],
)
def test_settings_that_fail_later_are_refused_at_start_saying_which(
    extra: dict[str, object], says: str
) -> None:
    """Each passed the checks and failed later: the breaker with a message naming none of
    our settings; every save ("invalid expire time"); a URL "empty" or "not set"."""
    with pytest.raises(InvalidArgumentError, match=re.escape(says)):
        RedisConnectorConfig.from_extra({**URL, **extra}, "kv_both")
