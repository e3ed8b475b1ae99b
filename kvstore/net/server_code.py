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


def load_library(client: Any, library: Library, *, replace: bool = False) -> None:
    """``FUNCTION LOAD`` ``library`` (on every master of a Cluster: redis-py sends it to all
    primaries). Without ``replace``, a library of this version already loaded is left alone."""
    try:
        client.function_load(library.text(), replace=replace)
    except rex.ResponseError as exc:
        if "already exists" not in str(exc).lower():
            raise


class ServerCode:
    """Settles, once per store, whether its Lua runs as functions or as scripts (thread-safe)."""

    def __init__(self, library: Library, mode: ScriptMode, safe_url: str) -> None:
        self.library = library
        self.wanted = mode
        self._safe_url = safe_url
        self._mode: ScriptMode | None = ScriptMode.SCRIPTS if mode is ScriptMode.SCRIPTS else None
        self._server_has_functions = True  # until a server answers FCALL "unknown command"
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
        """The server lost the library (a restart without persistence): ask again."""
        with self._lock:
            if self.wanted is not ScriptMode.SCRIPTS:
                self._mode = None

    def mode(self, client: Any) -> ScriptMode:
        """FUNCTIONS or SCRIPTS for this server, asked of it on the first call (one round trip;
        a load where the library is missing). Connection errors propagate and settle nothing."""
        mode = self._mode
        if mode is not None:
            return mode
        with self._lock:
            if self._mode is None:
                self._mode = self._ask(client)
            return self._mode

    def _ask(self, client: Any) -> ScriptMode:
        try:
            digest = client.fcall(self.library.version_function, 0)
        except rex.NoPermissionError as exc:
            return self._scripts_instead(f"this user may not run FCALL ({exc})")
        except rex.ResponseError as exc:
            if _unknown_command(exc):
                self._server_has_functions = False
                return self._scripts_instead("the server has no functions (Redis < 7)")
            if not _missing_function(exc):
                raise
            return self._load(client)
        return self._check_digest(digest)

    def _check_digest(self, digest: Any) -> ScriptMode:
        got = digest.decode(errors="replace") if isinstance(digest, bytes) else str(digest)
        if got != self.library.digest:
            raise StoreCodeError(
                f"{self._safe_url}: the server's {LIBRARY_NAME} functions are not this "
                f"release's (digest {got[:16]!r}, this client's {self.library.digest}): load "
                f"this release's with `python -m kvstore functions load --replace <url>` as the "
                f"admin, once every instance runs it"
            )
        return ScriptMode.FUNCTIONS

    def _load(self, client: Any) -> ScriptMode:
        try:
            load_library(client, self.library)
        except rex.NoPermissionError as exc:
            raise StorePermissionError(
                f"{self._safe_url}: the kvstore functions ({LIBRARY_NAME}) are not loaded on "
                f"this server and this user may not load them ({exc}). Load them once as the "
                f"admin: `python -m kvstore functions load <url>`",
                command="FUNCTION LOAD",
            ) from None
        logger.info("kvstore: loaded the %s functions on %s", LIBRARY_NAME, self._safe_url)
        return self._check_digest(client.fcall(self.library.version_function, 0))

    def _scripts_instead(self, why: str) -> ScriptMode:
        if self.wanted is ScriptMode.FUNCTIONS:
            raise StoreCodeError(
                f"{self._safe_url}: lua='functions' but {why}: grant +fcall (Redis/Valkey >= 7), "
                f"or set lua='scripts' on a server without functions"
            )
        logger.warning(
            "kvstore: %s runs its Lua as EVALSHA scripts: %s. A role that may run EVALSHA and "
            "SCRIPT LOAD may run any Lua; on a server shared by tenants grant +fcall instead "
            "(docs/operations.md)",
            self._safe_url,
            why,
        )
        return ScriptMode.SCRIPTS

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
        if self._code.mode(self._client) is ScriptMode.SCRIPTS:
            try:
                return self._eval(keys=keys, args=args, client=client)
            except rex.NoPermissionError as exc:
                if self._code.grant is ScriptMode.SCRIPTS:
                    raise
                # a role refused both: what it lacks is +fcall (never steer it to the grant
                # that lets it run any Lua)
                raise rex.NoPermissionError(
                    f"this user has no permissions to run the 'fcall' command ({exc})"
                ) from None
        target = client if client is not None else self._client
        try:
            return target.fcall(self.script.function, len(keys), *keys, *args)
        except rex.ResponseError as exc:
            if not _missing_function(exc):
                raise
            self._code.forget()  # the server lost it: settled again, then sent once more
            return self(keys, args, client)

    def command_args(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command as a tuple, for a caller that sends it on a connection of its own
        (settle the mode with :meth:`ServerCode.mode` first)."""
        if self._code.settled is ScriptMode.SCRIPTS:
            return ("EVALSHA", self._eval.sha, len(keys), *keys, *args)
        return ("FCALL", self.script.function, len(keys), *keys, *args)

    def recover(self, exc: BaseException) -> bool:
        """After ``exc`` from a command built by :meth:`command_args`: True when the server
        lacked the code and now has it again (send the command again, rebuilt)."""
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
]
