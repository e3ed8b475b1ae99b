"""kvstore's Lua as the functions of one library (kvstore/net/server_code.py), on fakeredis: loaded
once, checked against this release's, loaded again when the server lost it, and scripts only
where asked for or where a server has no functions."""

from __future__ import annotations

import logging
import threading
from typing import Any

import fakeredis
import pytest
import redis.exceptions as rex
import torch

import kvstore.cli
from kvstore import LookupBuffer, ScriptMode, StoreCodeError, chain_hashes
from kvstore.fleet.functions import LIBRARY
from kvstore.net.server_code import LIBRARY_NAME, LIBRARY_VERSION, Library, ServerScript

HASHES = chain_hashes(list(range(48)), 16)

# The digest of each version's text: a function changed without a new LIBRARY_VERSION would be
# loaded over the old one under the same name, and instances of two releases would then run
# each other's code. Change a function: bump LIBRARY_VERSION and pin its digest here.
PINNED = {1: "d34113d47ec0ac80"}


def store(client: Any, lua: ScriptMode = ScriptMode.AUTO) -> LookupBuffer:
    return LookupBuffer(client, namespace="n", fingerprint="f", ttl_s=60, lua=lua)


def functions_loaded(client: Any) -> list[bytes]:
    return [lib[1] for lib in client.function_list()]


def test_a_changed_function_needs_a_new_version() -> None:
    assert PINNED.get(LIBRARY_VERSION) == LIBRARY.digest, (
        "a kvstore function changed: bump LIBRARY_VERSION in kvstore/net/server_code.py and "
        "pin the new digest"
    )


def test_the_first_client_loads_the_library_and_every_operation_runs_on_it() -> None:
    client = fakeredis.FakeRedis()
    buf = store(client)
    buf.insert_many([(h, {"x": torch.ones(4)}) for h in HASHES])
    got = buf.drop_select(HASHES)
    assert [t["x"].tolist() for t in got] == [[1.0] * 4] * 3
    assert buf.contains(HASHES) == [False] * 3  # taken: claimed through the function
    assert buf.reset() == 1
    assert buf.server_code.settled is ScriptMode.FUNCTIONS
    assert functions_loaded(client) == [LIBRARY_NAME.encode()]
    shas = [_sha(s.lua) for s in LIBRARY.scripts]
    assert client.script_exists(*shas) == [False] * len(shas)  # nothing ran as EVALSHA


def _sha(lua: str) -> str:
    import hashlib

    return hashlib.sha1(lua.encode()).hexdigest()


def test_a_server_that_lost_its_functions_gets_them_again() -> None:
    client = fakeredis.FakeRedis()
    buf = store(client)
    buf.insert_many([(h, {"x": torch.ones(4)}) for h in HASHES[:2]])
    assert len(buf.drop_select(HASHES[:1])) == 1
    client.function_flush()  # a restart without persistence
    assert [t["x"].tolist() for t in buf.drop_select(HASHES[1:2])] == [[1.0] * 4]
    assert functions_loaded(client) == [LIBRARY_NAME.encode()]


def test_another_library_under_this_versions_name_is_refused_not_run() -> None:
    client = fakeredis.FakeRedis()
    forged = Library([ServerScript("claim", "return {}", ("allow-oom",))])
    client.function_load(forged.text())  # same kvstore_v<N> name, another text
    buf = store(client)
    buf.insert_many([(h, {"x": torch.ones(4)}) for h in HASHES[:1]])
    with pytest.raises(StoreCodeError, match="functions load --replace"):
        buf.drop_select(HASHES[:1])
    assert buf.contains(HASHES[:1]) == [True]  # nothing ran


def test_scripts_when_asked_for_never_touch_functions() -> None:
    client = fakeredis.FakeRedis()
    buf = store(client, ScriptMode.SCRIPTS)
    buf.insert_many([(h, {"x": torch.ones(4)}) for h in HASHES[:1]])
    assert len(buf.drop_select(HASHES[:1])) == 1
    assert buf.reset() == 1
    assert functions_loaded(client) == []
    assert buf.server_code.settled is ScriptMode.SCRIPTS


def no_functions(client: Any) -> None:
    def fcall(*args: object) -> object:
        raise rex.ResponseError("unknown command 'FCALL', with args beginning with: ")

    client.fcall = fcall


def test_a_server_without_functions_runs_scripts_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = fakeredis.FakeRedis()
    no_functions(client)
    buf = store(client)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert buf.reset() == 1
    assert buf.server_code.settled is ScriptMode.SCRIPTS
    assert "may run any Lua" in caplog.text
    # what to grant there is the scripts' rule (the server cannot run +fcall)
    assert buf.server_code.grant is ScriptMode.SCRIPTS


def test_functions_required_where_the_server_has_none_fail_naming_the_choice() -> None:
    client = fakeredis.FakeRedis()
    no_functions(client)
    with pytest.raises(StoreCodeError, match="lua='scripts'"):
        store(client, ScriptMode.FUNCTIONS).reset()


def test_the_cli_shows_and_loads_the_library(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = fakeredis.FakeRedis()
    monkeypatch.setattr(kvstore.cli, "make_client", lambda *a, **k: client)
    url = ["--url", "redis://fake:1/0", "--json"]
    assert kvstore.cli.main([*url, "functions", "show"]) == kvstore.cli.ExitStatus.FAILED
    assert '"server_digests": {"server": null}' in capsys.readouterr().out
    assert kvstore.cli.main([*url, "functions", "load"]) == kvstore.cli.ExitStatus.OK
    assert f'"server_digests": {{"server": "{LIBRARY.digest}"}}' in capsys.readouterr().out
    forged = Library([ServerScript("claim", "return {}")])
    client.function_load(forged.text(), replace=True)
    assert kvstore.cli.main([*url, "functions", "show"]) == kvstore.cli.ExitStatus.FAILED
    assert kvstore.cli.main([*url, "functions", "load"]) == kvstore.cli.ExitStatus.FAILED
    assert kvstore.cli.main([*url, "functions", "load", "--replace"]) == kvstore.cli.ExitStatus.OK


def test_a_mode_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="auto"):
        ScriptMode.parse("lua")


def test_a_hung_first_call_holds_no_other_caller() -> None:
    """The first call asks the server which way the Lua runs; a lock held across that round
    trip queued every other first caller behind a hung server, each paying the whole queue's
    timeouts (fresh-eyes review: 8 threads timed out after 0.5, 1.0, ... 4.0 s)."""
    client = fakeredis.FakeRedis()
    fcall, first, release = client.fcall, threading.Event(), threading.Event()

    def hung_once(*args: object) -> object:
        if not first.is_set():
            first.set()
            release.wait(10)  # the server does not answer the first caller
        return fcall(*args)

    client.fcall = hung_once
    code = store(client).server_code
    hung = threading.Thread(target=code.mode, args=(client,))
    hung.start()
    assert first.wait(10)
    assert code.mode(client) is ScriptMode.FUNCTIONS  # answered while the first still waits
    assert hung.is_alive()
    release.set()
    hung.join(10)


def test_an_answer_asked_for_before_the_mode_was_forgotten_settles_nothing() -> None:
    """A call that asked before an operator's grant (refused FCALL: scripts) and whose answer
    lands after a later call forgot the mode must not settle scripts over the grant: the
    next call asks again."""
    client = fakeredis.FakeRedis()
    code = store(client).server_code
    fcall, asked = client.fcall, threading.Event()

    def refused_while_another_forgets(*args: object) -> object:
        if not asked.is_set():
            asked.set()
            code.forget()  # another call, refused meanwhile, forgot the mode
            raise rex.NoPermissionError("this user has no permissions to run the 'fcall' command")
        return fcall(*args)

    client.fcall = refused_while_another_forgets
    assert code.mode(client) is ScriptMode.SCRIPTS  # this call's own answer
    assert code.settled is None  # stale: settles nothing
    assert code.mode(client) is ScriptMode.FUNCTIONS
    assert code.settled is ScriptMode.FUNCTIONS
