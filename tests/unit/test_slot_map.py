"""What a Cluster node says of the layout, checked before redis-py acts on it
(``kvstore.net.slot_map``); hostile servers sending such replies are in
tests/integration/test_bounded_replies.py."""

from __future__ import annotations

import pytest
import redis.exceptions as rex

from kvstore.net.slot_map import SlotMapRefused, check_slot_map
from kvstore.net.wire import error_reply


def test_maps_real_servers_send_pass() -> None:
    # (as Redis 7 / Valkey 9 answer over RESP3: node id and a metadata map after the endpoint)
    check_slot_map(
        [
            [0, 8191, [b"127.0.0.1", 7000, b"id0", {}], [b"127.0.0.1", 7003, b"id3", {}]],
            [8192, 16383, [b"node-1.example.com.", 7001, b"id1", {b"hostname": b"n1"}]],
        ]
    )
    check_slot_map([[0, 16383, [b"", 7000, b"id0"]]])  # a one-node Cluster's own host
    check_slot_map([[0, 16383, [b"::1", 7000]]])
    check_slot_map([[0, 16383, [b"fe80::1%eth0", 7000]]])
    check_slot_map([])  # (no slot served yet)


def test_a_null_host_is_the_node_asked() -> None:
    """``cluster-preferred-endpoint-type unknown-endpoint``: real servers send a null host,
    meaning the node asked; redis-py reads '' so (a review found such maps refused)."""
    reply = [[0, 16383, [None, 7000, b"id0"]]]
    check_slot_map(reply)
    assert reply[0][2][0] == b""


@pytest.mark.parametrize(
    "reply",
    [
        [[0, 16384, [b"h", 1]]],  # past the last slot
        [[5, 4, [b"h", 1]]],  # backwards
        [[0, 16383, [b"h", 1]]] * 2,  # overlapping: redis-py spends CPU on every copy
        [[0, 1, [b"a..b", 1]]],  # an empty label: the resolver's UnicodeError at connect
        [[0, 1, [b"x" * 70 + b":", 1]]],  # neither IPv6 nor a name
        [[0, 1, [b"h", 0]]],
        [[0, 1, [b"h", True]]],
        [[0, 1, [b"h"]]],
    ],
)
def test_maps_no_cluster_sends_are_refused(reply: list[object]) -> None:
    with pytest.raises(SlotMapRefused):
        check_slot_map(reply)


def test_a_redirect_no_cluster_sends_is_a_plain_error() -> None:
    assert isinstance(error_reply("MOVED 3999 127.0.0.1:7000"), rex.MovedError)
    assert isinstance(error_reply("ASK 3999 [::1]:7000"), rex.AskError)
    for text in ("MOVED 99999 127.0.0.1:7000", "MOVED -1 h:1", "ASK 1 a..b:7000", "ASK 1 :0"):
        exc = error_reply(text)
        assert type(exc) is rex.ResponseError and str(exc) == text
