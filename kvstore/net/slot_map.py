"""What a Cluster node says of the Cluster's layout -- its ``CLUSTER SLOTS`` reply, and the
slot and address of a ``MOVED`` / ``ASK`` -- checked before redis-py acts on it.

redis-py builds its slot cache from the reply as it comes: one entry per slot of every range, so
a 61-byte reply naming slots 0 to 2**62 grew a process past 2.5 GiB (a review's); a slot, port
or host of the wrong type raised ``ValueError``, ``TypeError``, ``KeyError`` or ``IndexError``
past every typed handler; a host that the resolver's IDNA codec refuses (a label over 63
characters, U+202E) was cached, and every later call failed with ``UnicodeError`` until restart;
2,000 masters named in a 140 KB reply opened 2,020 connections. A reply outside the bounds
below is refused whole (:class:`SlotMapRefused`, a ``RedisError``), and the cache keeps what it
had; a redirect outside them is a plain error reply (``wire.error_reply``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import redis.exceptions as rex

from kvstore.text import printable

SLOTS = 16384  # a Redis / Valkey Cluster's hash slots, 0 to 16383
# the most masters and replicas one map may name: Redis documents 1,000 nodes as the Cluster's
# design ceiling
MAX_NODES = 1000
_MAX_HOST_CHARS = 253  # a DNS name's most
# what a node's endpoint may be: a DNS name, an IPv4 or IPv6 address (with a zone); also ''
# (the asked node's own host, which redis-py puts in) and '?' (an endpoint the node does not
# know: redis-py's connection to it then fails typed, as to any unreachable node)
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]*|\?")


class SlotMapRefused(rex.InvalidResponse):
    """A ``CLUSTER SLOTS`` reply outside the bounds a Cluster's can have: refused whole."""


def refused(why: str) -> SlotMapRefused:
    return SlotMapRefused(f"a slot map no Cluster sends, not used ({why}; CLUSTER SLOTS)")


def is_slot(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SLOTS


def endpoint_problem(host: object, port: object) -> str | None:
    """What is wrong with a node's ``host`` and ``port`` as a Cluster names them (None:
    nothing)."""
    if isinstance(host, bytes):
        try:
            host = host.decode("ascii")
        except UnicodeDecodeError:
            return "a host that is not ASCII"
    if not isinstance(host, str):
        return f"a host of type {type(host).__name__}"
    if len(host) > _MAX_HOST_CHARS or not _HOST.fullmatch(host) or not _resolvable(host):
        return f"the host {printable(host, 60)!r}"
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"the port {printable(port, 20)}"
    return None


def _resolvable(host: str) -> bool:
    """Whether the resolver takes ``host`` without raising: an IPv6 address (a zone allowed),
    or a name its IDNA codec encodes (no empty label, none over 63 characters: ``a..b`` and a
    long label raised ``UnicodeError`` at connect, a review's). '' and '?' pass (see ``_HOST``)."""
    if host in ("", "?"):
        return True
    if ":" in host:
        try:
            ipaddress.IPv6Address(host.strip("[]"))
        except ValueError:
            return False
        return True
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


def check_slot_map(reply: Any) -> None:
    """Raise :class:`SlotMapRefused` unless ``reply`` is a ``CLUSTER SLOTS`` answer within a
    Cluster's bounds: ranges ``[start, end, node, replicas...]`` with ``0 <= start <= end <
    16384`` covering at most 16384 slots in all (16,384 copies of the whole range cost redis-py
    40 s of CPU per learning, a review's), each node ``[host, port, ...]`` with a plausible
    endpoint, at most :data:`MAX_NODES` of them. A null host (``cluster-preferred-endpoint-type
    unknown-endpoint``: "the node asked") becomes '', which redis-py reads so."""
    if not isinstance(reply, list):
        raise refused(f"a reply of type {type(reply).__name__} where an array is due")
    covered = 0
    nodes: set[tuple[Any, Any]] = set()
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            raise refused("a range that is not [start, end, node, ...]")
        start, end = entry[0], entry[1]
        if not (is_slot(start) and is_slot(end) and start <= end):
            raise refused(f"the range {printable(start, 20)}-{printable(end, 20)}")
        covered += end - start + 1
        if covered > SLOTS:
            raise refused(f"ranges covering over {SLOTS} slots")
        for node in entry[2:]:
            if not isinstance(node, list) or len(node) < 2:
                raise refused("a node that is not [host, port, ...]")
            if node[0] is None:
                node[0] = b""
            problem = endpoint_problem(node[0], node[1])
            if problem:
                raise refused(problem)
            nodes.add((node[0], node[1]))
        if len(nodes) > MAX_NODES:
            raise refused(f"over {MAX_NODES} nodes")


def redirect_problem(exc: rex.AskError) -> str | None:
    """What is wrong with a parsed ``MOVED`` / ``ASK``'s slot and address (None: nothing)."""
    if not is_slot(exc.slot_id):
        return f"the slot {printable(exc.slot_id, 20)}"
    return endpoint_problem(exc.host, exc.port)
