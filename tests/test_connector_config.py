"""kv_connector_extra_config: defaults that depend on the host."""

from __future__ import annotations

import pytest

from connector import config as config_module
from connector.config import RedisConnectorConfig
from kvstore import InvalidArgumentError

URL = {"url": "redis://r:6379/0"}


@pytest.mark.parametrize(("cores", "connections"), [(1, 1), (2, 1), (4, 2), (8, 4), (64, 4)])
def test_connections_default_to_one_per_two_cores_up_to_four(
    monkeypatch: pytest.MonkeyPatch, cores: int, connections: int
) -> None:
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    for extra in (URL, {**URL, "connections": "auto"}, {**URL, "connections": None}):
        assert RedisConnectorConfig.from_extra(extra, "kv_both").connections == connections


def test_connections_given_are_kept_and_zero_is_refused() -> None:
    assert RedisConnectorConfig.from_extra({**URL, "connections": "3"}, "kv_both").connections == 3
    with pytest.raises(InvalidArgumentError, match="connections must be >= 1"):
        RedisConnectorConfig.from_extra({**URL, "connections": 0}, "kv_both")
    with pytest.raises(InvalidArgumentError, match="connections must be a number"):
        RedisConnectorConfig.from_extra({**URL, "connections": "many"}, "kv_both")


def test_connections_default_without_sched_getaffinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(config_module.os, "sched_getaffinity")  # as on macOS and Windows
    monkeypatch.setattr(config_module.os, "cpu_count", lambda: 8)
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


def test_times_take_numbers_given_as_strings_and_refuse_negative_ones() -> None:
    config = RedisConnectorConfig.from_extra(
        {**URL, "deadline_s": "1.5", "io_threads": 2.0}, "kv_both"
    )
    assert (config.deadline_s, config.io_threads) == (1.5, 2)
    with pytest.raises(InvalidArgumentError, match="deadline_s must be >= 0"):
        RedisConnectorConfig.from_extra({**URL, "deadline_s": -0.1}, "kv_both")
