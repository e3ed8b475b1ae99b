"""Is this URL and this ACL user right for the job? Checked once, at startup, so a mistake fails
there with a message naming the fix, instead of as misses later: the URL's kind against the
server's (:func:`check_topology`) and each operation's commands against the user's permissions
(:func:`check_access`, :data:`ACCESS`, :func:`acl_rule`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable

from kvstore.errors import (
    InvalidArgumentError,
    StoreCodeError,
    StoreCommandError,
    StorePermissionError,
    StoreTopologyError,
)
from kvstore.fleet.generations import Generations
from kvstore.fleet.handoff import HandoffRecords
from kvstore.net.connection import StoreAddress, permission_error
from kvstore.net.guard import Guard
from kvstore.net.server_code import ScriptMode, ServerCode
from kvstore.net.transport import Transport
from kvstore.values.drop_select import Claimer
from kvstore.values.keys import DEFAULT_KEY_PREFIX, KeySpace

logger = logging.getLogger("kvstore")

# The permission probe's key: it lives for the few milliseconds check_access takes; a role
# that may not delete leaves it to expire.
_PROBE_TTL_MS = 1_000

# What each operation needs the ACL user to be allowed, for check_access / acl_rule (and the
# ACL table in docs/operations.md).
ACCESS: dict[str, tuple[str, ...]] = {
    "ping": ("PING",),
    "insert": ("SET",),
    "select": ("GET",),
    # a value's tensors a range at a time (tensor_reads.py: layer by layer loads)
    "select_ranges": ("GETRANGE",),
    "lookup": ("EXISTS",),
    "delete": ("UNLINK",),
    "handoff_read": ("GET",),
    # FCALL: the kvstore functions the admin loaded (net/server_code.py; the commands after it
    # are the ones the function runs, checked against the same rule)
    "handoff_claim": ("FCALL", "GET", "SET"),
    # (TIME: a claim the server runs after its caller gave up takes nothing,
    # ``values/drop_select.py``)
    "drop_select": (
        "FCALL",
        "STRLEN",
        "RENAME",
        "EXISTS",
        "GET",
        "UNLINK",
        "TIME",
    ),
    "block_info": ("STRLEN", "PTTL"),
    "renew": ("PEXPIRE", "PERSIST"),
    # the namespace's generation, read with lookups (only "reset" writes it)
    "generation": ("GET",),
    "reset": ("FCALL", "GET", "SET"),  # kvstore reset, vLLM's reset_cache
    "sweep": ("SCAN", "UNLINK"),  # unlinking an older generation's blocks
}

# what writes: a role with none of these gets read-only key patterns
_WRITES = frozenset(("insert", "handoff_claim", "drop_select", "delete", "renew", "reset", "sweep"))


def commands_of(operation: str, lua: ScriptMode = ScriptMode.FUNCTIONS) -> tuple[str, ...]:
    """What ``operation`` needs granted; where the Lua runs as scripts (a server without
    functions), ``EVALSHA`` and ``SCRIPT LOAD`` in place of ``FCALL``."""
    commands = ACCESS[operation]
    if lua is not ScriptMode.SCRIPTS or "FCALL" not in commands:
        return commands
    at = commands.index("FCALL")
    return (*commands[:at], "EVALSHA", "SCRIPT LOAD", *commands[at + 1 :])


def acl_rule(
    operations: Iterable[str],
    namespace: str = "*",
    key_prefix: str = DEFAULT_KEY_PREFIX,
    lua: ScriptMode = ScriptMode.FUNCTIONS,
) -> str:
    """The least-privilege ``ACL SETUSER`` rule for these operations (keys of :data:`ACCESS`)
    in one namespace (a tenant: its own keys, counter and secret; "*" for every namespace).
    With ``lua=ScriptMode.SCRIPTS`` (servers without functions) the scripted operations are
    granted ``+evalsha +script|load``, which lets the role run any Lua: it trusts the role.

    A namespace's keys are ``<prefix>:<ns>:<fingerprint>:...`` (``~<prefix>:<ns>:*:*``) and
    its generation counter ``<prefix>:<ns>:generation``, which that pattern does not match:
    only a rule with "reset" may write it; the others read it (``%R~``, Redis >= 7, Valkey).
    A rule without any write gets read-only keys."""
    ops = list(dict.fromkeys(operations))
    unknown = set(ops) - set(ACCESS)
    if unknown:
        raise InvalidArgumentError(f"unknown operations {sorted(unknown)}; known: {ACCESS}")
    commands = dict.fromkeys(c for op in ops for c in commands_of(op, lua))
    perms = " ".join("+" + c.lower().replace(" ", "|") for c in commands)
    base = f"{key_prefix}:{namespace}"
    writes = any(op in _WRITES for op in ops)
    patterns = [f"{'~' if writes else '%R~'}{base}:*:*"]
    if "reset" in ops:
        patterns.append(f"~{base}:generation")
    elif "generation" in ops:
        patterns.append(f"%R~{base}:generation")
    return f"{perms} {' '.join(patterns)}"


def check_topology(address: StoreAddress | None, transport: Transport, guard: Guard) -> None:
    """Fail, naming the right URL form, when the URL's kind does not match the server: a plain
    URL that reaches a Cluster node (most keys would be refused with MOVED) or a Sentinel (which
    holds no data). Skipped when the ACL user may not run ``INFO`` or the server has none."""
    if address is None or address.topology != "standalone":
        return
    try:
        info = guard.call("INFO", lambda: transport.control.info("server"))
    except (StorePermissionError, StoreCommandError) as exc:  # NOPERM, or no INFO at all
        logger.debug("kvstore: the URL's topology is not checked (INFO: %s)", exc)
        return
    mode = str(info.get("redis_mode", "standalone"))
    where = f"{address.host}:{address.port}"
    if mode == "cluster":
        raise StoreTopologyError(
            f"{guard.safe_url} is a node of a Redis/Valkey Cluster: use a cluster URL, "
            f"redis-cluster://{where} (rediss-cluster:// with TLS)"
        )
    if mode == "sentinel":
        raise StoreTopologyError(
            f"{guard.safe_url} is a Sentinel, which holds no data: use "
            f"redis-sentinel://{where}/<service> (the master's name in sentinel.conf)"
        )


def check_access(
    operations: Iterable[str],
    transport: Transport,
    guard: Guard,
    keys: KeySpace,
    claims: Claimer,
    handoffs: HandoffRecords,
    generations: Generations,
    code: ServerCode,
) -> None:
    """Run each operation's commands once against a short-lived probe key; raises
    :class:`StorePermissionError` naming the first command refused."""
    ops = list(dict.fromkeys(operations))
    unknown = set(ops) - set(ACCESS)
    if unknown:
        raise InvalidArgumentError(f"unknown operations {sorted(unknown)}; known: {ACCESS}")
    probe_only = ""
    if ("drop_select" in ops or "handoff_claim" in ops or "reset" in ops) and "insert" not in ops:
        # the claim scripts only run their commands (SET, RENAME, ...) on a present key
        ops.append("insert")
        probe_only = " (+set is for this check's probe key: the claim scripts run their "
        probe_only += "commands only on a key that is there; check=False checks nothing)"
    probe = keys.probe(uuid.uuid4().hex)
    c, ctl = transport.client, transport.control
    steps: dict[str, Callable[[], object]] = {
        "ping": ctl.ping,
        "insert": lambda: c.set(probe, b"probe", px=_PROBE_TTL_MS),
        "select": lambda: c.get(probe),
        "select_ranges": lambda: c.getrange(probe, 0, 0),
        "lookup": lambda: ctl.exists(probe),
        "handoff_read": lambda: ctl.get(probe),
        "handoff_claim": lambda: handoffs.check_script(probe, _PROBE_TTL_MS),
        "drop_select": lambda: claims.check_scripts(probe),
        "reset": generations.check_script,
        "delete": lambda: ctl.unlink(probe),
    }
    # operations of several commands outside a script: each command probed on its own, so
    # the error names the one refused
    commands: dict[str, list[tuple[str, Callable[[], object]]]] = {
        "block_info": [
            ("STRLEN", lambda: ctl.strlen(probe)),
            ("PTTL", lambda: ctl.pttl(probe)),
        ],
        "renew": [
            ("PEXPIRE", lambda: ctl.pexpire(probe, _PROBE_TTL_MS)),
            ("PERSIST", lambda: ctl.persist(probe)),
            ("PEXPIRE", lambda: ctl.pexpire(probe, _PROBE_TTL_MS)),  # never left forever
        ],
        # the counter itself: a rule may reach the namespace's blocks but not its counter
        "generation": [("GET", lambda: ctl.get(keys.generation()))],
        "sweep": [
            ("SCAN", lambda: ctl.scan(0, match=probe, count=1)),
            ("UNLINK", lambda: ctl.unlink(probe)),
        ],
    }
    order = ["ping", "insert", "select", "select_ranges", "lookup", "handoff_read"]
    order += ["handoff_claim"]
    order += ["block_info", "renew", "generation", "reset", "drop_select", "sweep", "delete"]
    assert set(order) == set(ACCESS), "every operation has a probe"

    def lua() -> ScriptMode:  # what to grant, as the first scripted probe found the server
        return code.grant

    try:
        for op in (o for o in order if o in ops):
            _probe(op, guard, steps, commands, lua)
    except StorePermissionError as exc:
        # (what this check runs: a rule without +set for a drop_select-only user fails it
        # asking for +set, and the rule it named looped back to the same error -- a review)
        # (+ping too: ``from_url`` pings as it connects)
        rule = acl_rule(["ping", *ops], keys.namespace, keys.prefix, lua())
        raise StorePermissionError(
            f"{exc}\nThe whole rule for what this instance does in namespace "
            f"{keys.namespace!r}: ACL SETUSER <user> {rule}{probe_only}",
            command=exc.command,
        ) from None


def _probe(
    op: str,
    guard: Guard,
    steps: dict[str, Callable[[], object]],
    commands: dict[str, list[tuple[str, Callable[[], object]]]],
    lua: Callable[[], ScriptMode],
) -> None:
    if op in commands:
        for command, step in commands[op]:
            guard.call(command, step)
        return
    scripted = "FCALL" in ACCESS[op]
    command = " ".join(commands_of(op, lua())) if scripted else ACCESS[op][0]
    try:
        guard.call(command, steps[op])
    except StoreCodeError:
        raise  # the functions themselves: loading them is the fix, not a grant
    except StoreCommandError as exc:
        if not scripted:
            raise
        # inside a script a refused command is a plain script error (no NOPERM code)
        command = " ".join(commands_of(op, lua()))  # as the probe settled it
        raise permission_error(guard.safe_url, command, str(exc), guard.scope) from None
