"""The operator tools' arguments: what a tools review passed that they took, crashed on, or
spun on (``vllm-redis-presence``, ``vllm-redis-warm``). Each is refused with a message and exit
status 2, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector import presence_cli


@pytest.mark.parametrize(
    "tokens",
    [
        ["--tokens", "1,x"],
        ["--tokens", "18446744073709551616"],  # 2**64: a traceback (OverflowError) before
        ["--tokens=-1,2"],  # negative: the proxy refuses it, the command took it
        ["--tokens", "true,2"],  # a boolean is no token id
        ["--tokens-file", "/nonexistent/tokens.json"],  # FileNotFoundError before
        ["--tokens-file", "/"],  # IsADirectoryError before
    ],
)
def test_the_presence_command_refuses_what_is_not_token_ids(
    tokens: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status = presence_cli.main(["--url", "redis://127.0.0.1:1/0", "--layout", "x", *tokens])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error:") and "Traceback" not in err


def test_the_presence_command_refuses_deeply_nested_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError before
    status = presence_cli.main(["--layout", "x", "--tokens-file", str(deep)])
    assert status == 2 and "token ids" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [["--ttl", "nan"], ["--ttl", "inf"], ["--ttl", "0.0001"], ["--ttl", "-5"],
     ["--in-flight", "0"], ["--in-flight", "-3"]],
)  # fmt: skip
def test_the_warm_command_refuses_a_ttl_or_parallelism_it_cannot_use(bad: list[str]) -> None:
    """NaN and inf were tracebacks, 0.0001 s a block without expiry, and --in-flight 0 a loop
    at full CPU warming nothing (checked on --check's parser: no vLLM needed)."""
    from connector.warm import cli

    with pytest.raises(SystemExit) as refused:
        cli.parse_args(["--check", *bad])
    assert refused.value.code == 2
    args, _ = cli.parse_args(["--check", "--ttl", "0", "--in-flight", "1"])
    assert (args.ttl, args.in_flight) == (0.0, 1)


def test_the_kvstore_command_takes_a_timeout_and_its_hint_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A server that never answers: the command waited its fixed 10 s, and the hint said to
    raise a setting the command has no option for."""
    import socket
    import time

    from kvstore import cli

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        status = cli.main(["--url", f"redis://127.0.0.1:{port}/0", "--timeout-s", "0.3", "ls"])
        waited = time.monotonic() - t0
    err = capsys.readouterr().err
    assert status == 2 and "--timeout-s" in err
    assert waited < 8  # (0.3 s a reply, a few replies: before, 10 s each)
    assert cli.main(["--timeout-s", "nan", "ls"]) == 2
