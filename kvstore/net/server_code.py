"""The project's Lua on the server: functions of one library the admin loads once, or scripts.

**Functions** (Redis >= 7, Valkey): the library ``kvstore_v<N>`` is loaded with ``FUNCTION
LOAD`` by a user allowed to (the admin, or the default user where no ACLs are set up: then the
first client loads it); every role is granted ``+fcall`` and cannot load code of its own. A
role with ``+evalsha +script|load`` may run any Lua it likes -- a busy loop, or ``allow-oom``
writes past ``maxmemory`` -- so on a shared server that grant trusts every tenant.

**Scripts** (``EVALSHA``, loaded with ``SCRIPT LOAD`` when the server lost them) remain for
servers without functions (Redis 6) and for roles still granted the old rule; a role that may
run ``FCALL`` is never moved to them silently.

Which one a store uses (:class:`ScriptMode`) is settled on its first call (:class:`ServerCode`):
``FCALL <lib>_version`` answers the loaded library's digest, which must be this client's (a
library changed without a new version is refused, never run); a library missing where the user
may run ``FCALL`` is loaded when the user may load it, otherwise the call fails with a
:class:`~kvstore.errors.StorePermissionError` naming ``kvstore functions load``. A server that
lost its functions (restarted without persistence) is asked again on the next call.

Bodies are written as scripts read them (``KEYS``, ``ARGV``): each becomes a function
``local function <name>(KEYS, ARGV)``, so one text serves both ways.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rex

from kvstore.errors import InvalidArgumentError, StoreCodeError, StorePermissionError

logger = logging.getLogger("kvstore")

# Bumped whenever any function's body, flags or name changes: two releases then load side by
# side during a rolling upgrade (function names are global on a server, so they carry it too).
# tests/unit/test_server_code.py pins the digest of each version's text.
LIBRARY_VERSION = 1
LIBRARY_NAME = f"kvstore_v{LIBRARY_VERSION}"


class ScriptMode(enum.Enum):
    """How a store runs its Lua (``LookupBuffer(lua=...)``, the connector's ``lua``)."""

    AUTO = "auto"  # functions where the server has them; scripts where it does not
    FUNCTIONS = "functions"  # functions only: a server or role without them fails at startup
    SCRIPTS = "scripts"  # EVALSHA only (trusts every role that may run it with any Lua)

    @classmethod
    def parse(cls, text: str | ScriptMode) -> ScriptMode:
        if isinstance(text, ScriptMode):
            return text
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise InvalidArgumentError(
                f"lua={text!r} is not one of {[m.value for m in cls]}"
            ) from None


@dataclass(frozen=True)
class ServerScript:
    """One piece of server-side Lua: a function of the library, or a script."""

    name: str  # within the library: the function is ``<LIBRARY_NAME>_<name>``
    lua: str  # reads KEYS and ARGV
    # function flags: "allow-oom" where it only renames, deletes or writes a few bytes (a claim
    # under maxmemory must still free memory), "no-writes" where it writes nothing
    flags: tuple[str, ...] = ()

    @property
    def function(self) -> str:
        return f"{LIBRARY_NAME}_{self.name}"


class Library:
    """The functions of one release, as ``FUNCTION LOAD`` takes them."""

    def __init__(self, scripts: Sequence[ServerScript]) -> None:
        names = [s.name for s in scripts]
        if len(set(names)) != len(names) or "version" in names:
            raise InvalidArgumentError(f"function names must be unique, not 'version': {names}")
        self.scripts = tuple(scripts)
        body = "\n".join(f"{s.name}|{','.join(s.flags)}|{s.lua}" for s in self.scripts)
        self.digest = hashlib.sha256(f"{LIBRARY_NAME}\n{body}".encode()).hexdigest()[:16]

    @property
    def version_function(self) -> str:
        return f"{LIBRARY_NAME}_version"

    def text(self) -> str:
        parts = [f"#!lua name={LIBRARY_NAME}"]
        for s in self.scripts:
            flags = ", ".join(f"'{f}'" for f in s.flags)
            parts.append(f"local function {s.name}(KEYS, ARGV)\n{s.lua}\nend")
            parts.append(
                f"redis.register_function{{function_name='{s.function}', callback={s.name}, "
                f"flags={{{flags}}}}}"
            )
        parts.append(
            f"redis.register_function{{function_name='{self.version_function}', "
            f"callback=function() return '{self.digest}' end, flags={{'no-writes'}}}}"
        )
        return "\n".join(parts) + "\n"


def _missing_function(exc: BaseException) -> bool:
    return "function not found" in str(exc).lower()


def _unknown_command(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "unknown command" in text or "unknown subcommand" in text


def _out_of_memory(exc: BaseException) -> bool:
    return str(exc).startswith("OOM") or "maxmemory" in str(exc)


def servers(client: Any) -> list[tuple[str, Any]]:
    """``(name, client)`` of every server that must hold the library: each master of a Cluster
    (functions are not copied between shards, only to a shard's replicas), else the one. A
    zero-key ``FCALL`` through a Cluster client reaches one master at random, and redis-py's
    ``FUNCTION LOAD`` stops at the first master that answers an error."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
    return [("", client)]


def server_digest(server: Any, library: Library) -> str | None:
    """The digest of the library of this version on one server; None where it has none."""
    try:
        digest = server.fcall(library.version_function, 0)
    except rex.ResponseError as exc:
        if _missing_function(exc):
            return None
        raise
    return digest.decode(errors="replace") if isinstance(digest, bytes) else str(digest)


def load_library(client: Any, library: Library, *, replace: bool = False) -> None:
    """``FUNCTION LOAD`` ``library`` on every server that must hold it (each master of a
    Cluster, one by one). Without ``replace``, a library of this version already there is
    left alone; a server over ``maxmemory`` (which refuses the load) passes where it already
    holds this very library."""
    for _, server in servers(client):
        try:
            server.function_load(library.text(), replace=replace)
        except rex.ResponseError as exc:
            if "already exists" in str(exc).lower():
                continue
            if _out_of_memory(exc) and server_digest(server, library) == library.digest:
                continue
            raise


class ServerCode:
    """Settles, once per store, whether its Lua runs as functions or as scripts (thread-safe)."""

    def __init__(self, library: Library, mode: ScriptMode, safe_url: str) -> None:
        self.library = library
        self.wanted = mode
        self.safe_url = safe_url  # (the URL without its password: for messages)
        self._mode: ScriptMode | None = ScriptMode.SCRIPTS if mode is ScriptMode.SCRIPTS else None
        self._server_has_functions = True  # until a server answers FCALL "unknown command"
        # bumped by each forget(): an answer asked for before it is stale and settles nothing
        # (a background call that asked before the operator's grant must not undo it)
        self._asked_since = 0
        self._lock = threading.Lock()

    @property
    def settled(self) -> ScriptMode | None:
        """FUNCTIONS or SCRIPTS once a call settled it; None before."""
        return self._mode

    @property
    def grant(self) -> ScriptMode:
        """What a permission hint grants: ``+fcall`` (FUNCTIONS), unless scripts were asked
        for or the server has no functions -- never ``+evalsha +script|load`` merely because a
        role lacked ``+fcall``."""
        if self.wanted is ScriptMode.SCRIPTS or not self._server_has_functions:
            return ScriptMode.SCRIPTS
        return ScriptMode.FUNCTIONS

    def forget(self) -> None:
        """Ask the server again at the next call: it lost the library (a restart without
        persistence), or a role refused FCALL may have been granted it since."""
        with self._lock:
            if self.wanted is not ScriptMode.SCRIPTS:
                self._mode = None
                self._asked_since += 1

    def mode(self, client: Any) -> ScriptMode:
        """FUNCTIONS or SCRIPTS for these servers, asked of them on the first call (a round
        trip per master; a load where the library is missing). Connection errors propagate and
        settle nothing. No lock is held while asking: concurrent first calls each ask (loading
        is idempotent), so one hung server costs each caller its own timeout, not a queue's."""
        mode = self._mode
        if mode is not None:
            return mode
        asked_since = self._asked_since
        asked = self._ask(client)
        with self._lock:
            if self._mode is None and asked_since == self._asked_since:
                self._mode = asked
            return self._mode or asked

    def _ask(self, client: Any) -> ScriptMode:
        modes = {self._ask_one(server, name) for name, server in servers(client)}
        if len(modes) > 1:
            raise StoreCodeError(
                f"{self.safe_url}: some masters have functions and some do not: run one "
                f"server version across the Cluster"
            )
        return modes.pop()

    def _where(self, name: str) -> str:
        return f"{self.safe_url} (master {name})" if name else self.safe_url

    def _ask_one(self, server: Any, name: str) -> ScriptMode:
        try:
            digest = server_digest(server, self.library)
        except rex.NoPermissionError as exc:
            return self._scripts_instead(f"this user may not run FCALL ({exc})")
        except rex.ResponseError as exc:
            if not _unknown_command(exc):
                raise
            self._server_has_functions = False
            return self._scripts_instead("the server has no functions (Redis < 7)")
        if digest is None:
            return self._load(server, name)
        return self._check_digest(digest, name)

    def _check_digest(self, digest: str | None, name: str) -> ScriptMode:
        if digest != self.library.digest:
            raise StoreCodeError(
                f"{self._where(name)}: the server's {LIBRARY_NAME} functions are not this "
                f"release's (digest {str(digest)[:16]!r}, this client's {self.library.digest}): "
                f"load this release's with `python -m kvstore functions load --replace` as the "
                f"server's operator, once every instance runs it"
            )
        return ScriptMode.FUNCTIONS

    def _load(self, server: Any, name: str) -> ScriptMode:
        try:
            load_library(server, self.library)
        except rex.NoPermissionError as exc:
            raise StorePermissionError(
                f"{self._where(name)}: the kvstore functions ({LIBRARY_NAME}) are not loaded on "
                f"this server and this user may not load them ({exc}). Load them once as the "
                f"server's operator -- the default user, or a user of its own with "
                f"+function|load, never a namespace's role (it could then load any Lua): "
                f"`python -m kvstore --url <operator's url> functions load`",
                command="FUNCTION LOAD",
            ) from None
        except rex.ResponseError as exc:
            if not _out_of_memory(exc):
                raise
            raise StoreCodeError(
                f"{self._where(name)}: the kvstore functions are not loaded and the server, "
                f"over maxmemory, refuses to load them ({exc}): free memory or raise maxmemory, "
                f"then `python -m kvstore functions load`"
            ) from None
        logger.info("kvstore: loaded the %s functions on %s", LIBRARY_NAME, self._where(name))
        return self._check_digest(server_digest(server, self.library), name)

    def _scripts_instead(self, why: str) -> ScriptMode:
        if self.wanted is ScriptMode.FUNCTIONS:
            hint = (
                "set lua='scripts' on a server without functions"
                if not self._server_has_functions
                else "grant +fcall"
            )
            raise StoreCodeError(f"{self.safe_url}: lua='functions' but {why}: {hint}")
        advice = (
            "a role that may run EVALSHA and SCRIPT LOAD may run any Lua: on a server shared by "
            "tenants use Redis or Valkey >= 7 and grant +fcall"
            if not self._server_has_functions
            else "a role that may run EVALSHA and SCRIPT LOAD may run any Lua; on a server "
            "shared by tenants grant +fcall instead (docs/operations.md)"
        )
        logger.warning("kvstore: %s runs its Lua as EVALSHA scripts: %s. %s",
                       self.safe_url, why, advice)  # fmt: skip
        return ScriptMode.SCRIPTS

    def refused(self, exc: rex.NoPermissionError, client: Any) -> rex.NoPermissionError | None:
        """After an EVALSHA refused: what to raise, or None to send the call once more, as
        FCALL. A role that was refused FCALL too lacks +fcall (never steer it to the grant that
        runs any Lua); the servers are asked again at once, and where the role was granted
        ``+fcall`` after the scripts were settled (by this call, or by a concurrent one that
        asked before the grant), the refused call -- which ran nothing -- goes again: an
        operator's grant serves the very next call."""
        text = str(exc).lower()
        if self.grant is ScriptMode.SCRIPTS or not ("evalsha" in text or "script" in text):
            return exc  # (a refusal of another command -- a GET read with the claim -- as is)
        self.forget()
        if self.mode(client) is ScriptMode.FUNCTIONS:
            return None
        return rex.NoPermissionError("this user has no permissions to run the 'fcall' command")

    def bind(self, script: ServerScript, client: Any) -> BoundScript:
        return BoundScript(self, script, client)


class BoundScript:
    """One :class:`ServerScript` on one client, called like redis-py's ``Script``:
    ``script(keys=..., args=..., client=...)`` (a pipeline queues it)."""

    def __init__(self, code: ServerCode, script: ServerScript, client: Any) -> None:
        self._code = code
        self.script = script
        self._client = client
        self._eval = client.register_script(script.lua)

    @property
    def command(self) -> str:
        """The command it is sent as (for errors and permission hints)."""
        return "EVALSHA" if self._code.settled is ScriptMode.SCRIPTS else "FCALL"

    def __call__(
        self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None
    ) -> Any:
        return self._call(keys, args, client, settle_again=True)

    def _call(
        self, keys: Sequence[Any], args: Sequence[Any], client: Any, settle_again: bool
    ) -> Any:
        if self._code.mode(self._client) is ScriptMode.SCRIPTS:
            try:
                return self._eval(keys=keys, args=args, client=client)
            except rex.NoPermissionError as exc:
                error = self._code.refused(exc, self._client)
                if error is not None:
                    raise error from None
                # (granted +fcall since: sent again below, as FCALL)
        target = client if client is not None else self._client
        try:
            return target.fcall(self.script.function, len(keys), *keys, *args)
        except rex.ResponseError as exc:
            if not _missing_function(exc):
                raise
            if not settle_again:
                raise StoreCodeError(
                    f"{self._code.safe_url}: {self.script.function} is still missing after "
                    f"the functions were loaded again ({exc}): on a Cluster every master needs "
                    f"them: `python -m kvstore functions load` as the server's operator"
                ) from None
            self._code.forget()  # the server lost it: settled again, then sent once more
            return self._call(keys, args, client, settle_again=False)

    def command_args(
        self, keys: Sequence[Any], args: Sequence[Any], mode: ScriptMode | None = None
    ) -> tuple[Any, ...]:
        """The command as a tuple, for a caller that sends it on a connection of its own, in
        ``mode`` -- what :meth:`ServerCode.mode` answered it (an answer that came after a
        forget is the caller's, not settled) -- or else as settled."""
        if (mode or self._code.settled) is ScriptMode.SCRIPTS:
            return ("EVALSHA", self._eval.sha, len(keys), *keys, *args)
        return ("FCALL", self.script.function, len(keys), *keys, *args)

    def recover(self, exc: BaseException) -> bool:
        """After ``exc`` from a command built by :meth:`command_args`: True when the server
        lacked the code and now has it again (send the command again, rebuilt, once)."""
        if isinstance(exc, rex.NoScriptError):
            self._client.script_load(self.script.lua)
            return True
        if isinstance(exc, rex.ResponseError) and _missing_function(exc):
            self._code.forget()
            self._code.mode(self._client)
            return True
        return False


__all__ = [
    "LIBRARY_NAME",
    "LIBRARY_VERSION",
    "BoundScript",
    "Library",
    "ScriptMode",
    "ServerCode",
    "ServerScript",
    "load_library",
    "server_digest",
    "servers",
]
