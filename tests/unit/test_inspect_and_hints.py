"""Issue 52, two defects a security review found.

``kvstore inspect`` reported a signed value it had no secret to check as valid (exit 0), so a
value planted by a writer without the namespace's secret looked good to an operator. Now
without the secret it is "unverified" (its own exit status), and with ``--secret-file`` its MAC
is verified as the connector verifies it: "verified", or "forged / wrong secret".

The hints of permission errors told operators to grant ``+evalsha ~kv:*``: every tenant's
keys, and a write on each namespace's generation counter. Now a hint names the refused
command with the key patterns of its own namespace (the ACL table of docs/operations.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis.exceptions as rex
import torch

import kvstore.cli
import kvstore.lookup_buffer
from kvstore import LookupBuffer, StorePermissionError
from kvstore.net.connection import translated_errors

SECRET = b"correct horse battery staple"
OTHER = b"another secret, just as long"
NAMESPACE = "tenant"
H1, H2 = "ab" * 16, "cd" * 16
MAC_FIELD = re.compile(rb'"kvstore\.mac":"([0-9a-f]{32})"')


# ---------------------------------------------------------------- inspect
@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> fakeredis.FakeRedis:
    c = fakeredis.FakeRedis()
    monkeypatch.setattr(kvstore.cli, "make_client", lambda *a, **k: c)
    return c


def secret_file(tmp_path: Path, secret: bytes, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_bytes(secret + b"\n")  # as `openssl rand -base64 32 > file` writes it
    path.chmod(0o600)
    return str(path)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(2, 16, generator=g), "v": torch.randn(2, 16, generator=g)}


def write(client: fakeredis.FakeRedis, secret: bytes | None, block: str = H1, seed: int = 0) -> str:
    """A value written as the connector writes it (signed with ``secret``, if any); its key."""
    store = LookupBuffer(client, namespace=NAMESPACE, fingerprint="fp", secret=secret)
    store.insert(block, tensors(seed))
    return store.redis_key(block)


def stored(client: fakeredis.FakeRedis, key: str) -> bytes:
    value = client.get(key)
    assert isinstance(value, bytes), key
    return value


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``kvstore inspect`` as a user runs it: exit status, stdout, stderr."""
    rc = kvstore.cli.main(["--url", "redis://fake:1/0", "inspect", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def verdict_of(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc, out, err = inspect(capsys, *args, "--json")
    assert SECRET.decode() not in out + err and OTHER.decode() not in out + err
    return rc, json.loads(out)


def with_flipped_mac(value: bytes) -> bytes:
    """``value`` with one hex digit of its header's MAC changed, as a writer without the
    secret would try: the length and layout stay the same."""
    mac = MAC_FIELD.search(value)
    assert mac is not None, "the value is signed"
    at = mac.start(1)
    flipped = b"0" if value[at : at + 1] != b"0" else b"1"
    return value[:at] + flipped + value[at + 1 :]


def test_a_signed_value_without_the_secret_is_unverified_never_valid(client, capsys) -> None:
    key = write(client, SECRET)
    rc, out, _ = inspect(capsys, key)
    assert rc == kvstore.cli.ExitStatus.UNVERIFIED == 3
    assert "unverified" in out and "--secret-file" in out
    assert not re.search(r"\bvalid\b", out.split("\n")[0])  # the verdict line says no "valid"
    rc, info = verdict_of(capsys, key)
    assert rc == 3 and info["verdict"] == "unverified" and info["valid"] is False
    assert info["signed"] and info["mac_ok"] is None


def test_the_right_secret_file_verifies_the_value(client, capsys, tmp_path) -> None:
    key = write(client, SECRET)
    path = secret_file(tmp_path, SECRET)
    rc, out, err = inspect(capsys, key, "--secret-file", path)
    assert rc == kvstore.cli.ExitStatus.OK == 0 and "verified" in out and "unverified" not in out
    assert SECRET.decode() not in out + err
    rc, info = verdict_of(capsys, key, "--secret-file", path)
    assert rc == 0 and info["verdict"] == "verified" and info["valid"] is True
    assert info["mac_ok"] is True and info["checksum_ok"] is True


def test_a_wrong_secret_file_says_forged_and_fails(client, capsys, tmp_path) -> None:
    key = write(client, SECRET)
    path = secret_file(tmp_path, OTHER)
    rc, out, err = inspect(capsys, key, "--secret-file", path)
    assert rc == kvstore.cli.ExitStatus.FAILED == 1 and "forged / wrong secret" in out
    assert SECRET.decode() not in out + err and OTHER.decode() not in out + err
    rc, info = verdict_of(capsys, key, "--secret-file", path)
    assert rc == 1 and info["verdict"] == "forged / wrong secret" and info["valid"] is False
    assert info["mac_ok"] is False and info["reason"] == "forged"


def test_inspect_verifies_in_the_connectors_epoch_and_no_other(client, capsys, tmp_path) -> None:
    """A value signed in an epoch (the weights' version) verifies with that epoch only; an
    epoch without the secret is an error, not ignored."""
    store = LookupBuffer(client, namespace=NAMESPACE, fingerprint="fp", secret=SECRET, epoch="s2")
    store.insert(H1, tensors())
    key = store.redis_key(H1)
    path = secret_file(tmp_path, SECRET)
    rc, info = verdict_of(capsys, key, "--secret-file", path, "--epoch", "s2")
    assert rc == 0 and info["verdict"] == "verified"
    for other in ([], ["--epoch", "s1"]):  # no epoch, or another
        rc, info = verdict_of(capsys, key, "--secret-file", path, *other)
        assert rc == 1 and info["verdict"] == "forged / wrong secret", other
    rc, _, err = inspect(capsys, key, "--epoch", "s2")
    assert rc == kvstore.cli.ExitStatus.ERROR and "--secret-file" in err


def plant_flipped_mac(client: fakeredis.FakeRedis) -> str:
    key = write(client, SECRET)
    client.set(key, with_flipped_mac(stored(client, key)))
    return key


def plant_other_secret(client: fakeredis.FakeRedis) -> str:
    return write(client, OTHER)  # a writer with another secret, under the namespace's key


def plant_flipped_payload(client: fakeredis.FakeRedis) -> str:
    key = write(client, SECRET)
    value = bytearray(stored(client, key))
    value[-1] ^= 1  # the header (and its MAC) untouched: the payload's keyed checksum fails
    client.set(key, bytes(value))
    return key


def plant_replayed_block(client: fakeredis.FakeRedis) -> str:
    """Another block's genuinely signed value copied under this block's key."""
    key = write(client, SECRET, block=H1)
    client.set(key, stored(client, write(client, SECRET, block=H2, seed=1)))
    return key


@pytest.mark.parametrize(
    ("plant", "verdict", "without_secret"),
    [
        (plant_flipped_mac, "forged / wrong secret", "unverified"),
        (plant_other_secret, "forged / wrong secret", "unverified"),
        (plant_flipped_payload, "forged / wrong secret", "unverified"),
        # its header names another block: wrong whether or not its MAC is checked
        (plant_replayed_block, "INVALID", "INVALID"),
    ],
)
def test_a_forged_value_is_never_reported_valid(
    client,
    capsys,
    tmp_path,
    plant: Callable[[fakeredis.FakeRedis], str],
    verdict: str,
    without_secret: str,
) -> None:
    key = plant(client)
    rc, info = verdict_of(capsys, key)  # no secret: the MAC is not checked
    assert rc != kvstore.cli.ExitStatus.OK and not info["valid"]
    assert info["verdict"] == without_secret
    path = secret_file(tmp_path, SECRET)
    rc, info = verdict_of(capsys, key, "--secret-file", path)
    assert rc == kvstore.cli.ExitStatus.FAILED and not info["valid"]
    assert info["verdict"] == verdict
    rc, out, err = inspect(capsys, key, "--secret-file", path)  # the human output says it too
    assert rc == 1 and verdict in out and "verified" not in out
    assert SECRET.decode() not in out + err and OTHER.decode() not in out + err


def test_an_unsigned_value_where_the_namespace_has_a_secret_is_not_valid(
    client, capsys, tmp_path
) -> None:
    key = write(client, None)  # a writer without the secret: no MAC at all
    rc, info = verdict_of(capsys, key, "--secret-file", secret_file(tmp_path, SECRET))
    assert rc == kvstore.cli.ExitStatus.FAILED and info["verdict"] == "unsigned"
    assert not info["valid"] and info["reason"] == "unsigned"
    # without the secret inspect cannot know the namespace has one: it says how to check
    rc, out, _ = inspect(capsys, key)
    assert rc == 0 and "unsigned" in out and "--secret-file" in out


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"short secret", "must hold 16"),  # too short to be a namespace secret
        (None, "cannot read the namespace secret file"),  # no such file
    ],
)
def test_a_bad_secret_file_is_an_error_naming_the_file_never_its_content(
    client, capsys, tmp_path, content: bytes | None, says: str
) -> None:
    key = write(client, SECRET)
    path = tmp_path / "bad-secret"
    if content is not None:
        path.write_bytes(content)
        path.chmod(0o600)
    rc, out, err = inspect(capsys, key, "--secret-file", str(path))
    err = " ".join(err.split())  # rich wraps long lines
    assert rc == kvstore.cli.ExitStatus.ERROR == 2 and out == ""
    assert says in err and "bad-secret" in err and "short secret" not in err + out


def test_a_secret_for_a_key_whose_namespace_cannot_be_told_is_an_error(
    client, capsys, tmp_path
) -> None:
    client.set("not-a-kvstore-key", b"x")
    rc, out, err = inspect(
        capsys, "not-a-kvstore-key", "--secret-file", secret_file(tmp_path, SECRET)
    )
    assert rc == 2 and "--prefix" in " ".join(err.split())
    assert SECRET.decode() not in out + err


def test_inspect_help_lists_its_exit_statuses(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        kvstore.cli.main(["inspect", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0 and "--secret-file" in out
    for status, verdict in ((0, "verified"), (1, "forged / wrong secret"), (3, "unverified")):
        assert re.search(rf"\b{status} .*{re.escape(verdict)}", out), (status, out)


# ---------------------------------------------------------------- permission hints
def assert_scoped(message: str, namespace: str, keyed: bool = True) -> None:
    """The hint grants keys of ``namespace`` alone (``keyed``: a command that names keys; one
    that names none gets no key pattern at all), and never writes its generation counter."""
    assert (f"kv:{namespace}:" in message) is keyed, message
    assert "~kv:*" not in message, message  # every namespace's keys (%R~kv:* included)
    assert not re.search(rf"(?<!%R)~kv:{namespace}:generation", message), message


# what Redis 7 answers (redis-py strips the NOPERM code), as a real redis-server said it
REFUSED = [
    ("EVALSHA", "this user has no permissions to run the 'evalsha' command",
     "+evalsha +script|load ~kv:tenant:*:*."),
    ("EVALSHA", "this user has no permissions to access one of the keys used as arguments",
     "+evalsha +script|load ~kv:tenant:*:*."),
    ("SET", "this user has no permissions to run the 'set' command", "+set ~kv:tenant:*:*"),
    ("GET", "this user has no permissions to run the 'get' command",
     "+get %R~kv:tenant:*:* %R~kv:tenant:generation"),
    ("EVALSHA", "this user has no permissions to run the 'script|load' command",
     "+script|load. "),  # names no keys: no key pattern
]  # fmt: skip


@pytest.mark.parametrize(("command", "server_text", "grant"), REFUSED)
def test_a_refused_call_names_its_own_namespaces_rule(
    command: str, server_text: str, grant: str
) -> None:
    # the store's calls go through its guard, which knows the namespace it serves
    store = LookupBuffer(fakeredis.FakeRedis(), namespace=NAMESPACE, fingerprint="fp")

    def refused() -> None:
        raise rex.NoPermissionError(server_text)

    with pytest.raises(StorePermissionError) as info:
        store.guard.call(command, refused)
    message = str(info.value)
    assert grant in message and "ACL SETUSER <user>" in message
    assert "+script " not in message  # SCRIPT LOAD alone, never all of SCRIPT (FLUSH, KILL)
    assert_scoped(message, NAMESPACE, keyed="script|load" not in server_text)


def test_the_cli_hint_names_the_inspected_keys_namespace(client, capsys, monkeypatch) -> None:
    key = write(client, None)

    def refused(*args: object, **kwargs: object) -> None:
        raise rex.NoPermissionError("this user has no permissions to run the 'strlen' command")

    monkeypatch.setattr(client, "strlen", refused)  # (inspect reads a value a piece at a time)
    rc, _, err = inspect(capsys, key)
    err = " ".join(err.split())
    assert rc == 2 and "may not run STRLEN" in err and "+strlen %R~kv:tenant:*:*" in err
    assert_scoped(err, NAMESPACE)


def test_a_planted_keys_namespace_never_reaches_a_hint(client, capsys, monkeypatch) -> None:
    """Found by a review: the hint took the inspected key's namespace as it was, so a key named
    'kv:x +@all nopass ~*:fp:abcd' made a hint that, pasted, gave the user every command
    without a password. A namespace that is not a valid name is the placeholder."""

    def refused(*args: object, **kwargs: object) -> None:
        raise rex.NoPermissionError("this user has no permissions to run the 'strlen' command")

    monkeypatch.setattr(client, "strlen", refused)
    for planted in ("kv:x +@all nopass ~*:fp:" + "ab" * 16, "kv:x\n:fp:" + "ab" * 16):
        rc, _, err = inspect(capsys, planted)
        assert rc == 2 and "+@all" not in err and "nopass" not in err, err
        assert "<namespace>" in " ".join(err.split()), err


def test_a_refused_reset_names_the_admins_rule_for_that_namespace(
    client, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(
        kvstore.lookup_buffer.LookupBuffer,
        "from_url",
        classmethod(lambda cls, url, *, check=True, **kw: cls(client, **kw)),
    )

    def refused(*args: object, **kwargs: object) -> None:
        raise rex.NoPermissionError(
            "this user has no permissions to access one of the keys used as arguments"
        )

    fcall = client.fcall

    def refused_bump(function: str, *args: object) -> object:
        if function.endswith("_bump_generation"):  # the counter's key is refused
            refused()
        return fcall(function, *args)

    monkeypatch.setattr(client, "fcall", refused_bump)
    rc = kvstore.cli.main(["--url", "redis://fake:1/0", "reset", "--namespace", NAMESPACE])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "may not run FCALL" in err
    # the admin alone writes the counter: its whole rule, for this namespace only
    assert "~kv:tenant:*:* ~kv:tenant:generation" in err and "~kv:*" not in err
    assert "+fcall ~kv:tenant:*:*." in err  # the refused command's own hint
    assert "evalsha" not in err  # never the grant that runs any Lua


def test_a_hint_where_the_namespace_is_not_known_asks_for_it_instead_of_every_one() -> None:
    with pytest.raises(StorePermissionError) as info, translated_errors("redis://h:1/0"):
        raise rex.NoPermissionError("this user has no permissions to run the 'strlen' command")
    message = str(info.value)
    assert "+strlen %R~kv:<namespace>:*:*" in message and "~kv:*" not in message


def test_a_scripted_probe_names_each_of_its_commands() -> None:
    # check_access's probe of a script names all it runs; the hint grants each
    from kvstore.net.connection import AclScope, permission_error

    error = permission_error(
        "redis://h:1/0", "EVALSHA SCRIPT LOAD GET SET", "script error", AclScope(NAMESPACE)
    )
    assert "+evalsha +script|load +get +set ~kv:tenant:*:* %R~kv:tenant:generation" in str(error)
    assert_scoped(str(error), NAMESPACE)


def test_the_generation_key_pattern_of_a_hint_is_the_one_keys_py_names() -> None:
    # the hint's patterns must match the keys the store uses, or the grant fixes nothing
    from kvstore.net.connection import AclScope
    from kvstore.values.keys import KeySpace

    keys = KeySpace("kv", NAMESPACE, "fp")
    scope = AclScope(NAMESPACE)
    assert scope.generation == keys.generation()
    assert re.fullmatch(scope.blocks.replace("*", "[^:]+"), keys.block(H1))
