"""testing/zygote.py: a forked child runs its command as a fresh interpreter would (arguments,
environment, directory, log, exit status), and looks to the tests like a subprocess.Popen:
poll, wait with a timeout, and a kill of its process group. (The zygote here imports only
``this``, which prints to stdout as vLLM 0.30's logging does at import: what a real one imports
is the engines' business, checked end to end.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.stack import Proc, spawn
from testing.zygote import Zygote

SCRIPT = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_T"),
                  "pgid": os.getpgid(0) == os.getpid(), "main": __name__}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"), preload=["this", "no_such_module_here"])
    yield z
    z.stop()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(SCRIPT)
    return path


def test_output_at_import_goes_to_the_log_and_a_missing_module_is_left_to_the_children(
    zygote: Zygote,
) -> None:
    assert zygote.missing == ["no_such_module_here"]
    assert "Beautiful is better than ugly" in zygote.log_tail()  # not taken for its answer


def test_a_child_runs_its_script_with_its_own_arguments_environment_directory_and_log(
    zygote: Zygote, script: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "ZYGOTE_T": "seen"}
    child = zygote.spawn([str(script), "exit", "3"], env, tmp_path, tmp_path / "child.log")
    assert child.wait(timeout=30) == 3
    assert child.poll() == 3
    log = (tmp_path / "child.log").read_text()
    assert '"argv": ["exit", "3"]' in log
    assert f'"cwd": "{tmp_path}"' in log
    assert '"env": "seen"' in log  # exactly the environment asked for
    assert '"pgid": true' in log  # a session of its own: killpg reaches it and what it starts
    assert '"main": "__main__"' in log


def test_a_child_does_not_see_the_zygotes_environment_beyond_what_it_was_given(
    zygote: Zygote, script: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ZYGOTE_T"}
    child = zygote.spawn([str(script), "exit", "0"], env, tmp_path, tmp_path / "child.log")
    assert child.wait(timeout=30) == 0
    assert '"env": null' in (tmp_path / "child.log").read_text()


def test_a_running_child_polls_none_times_out_a_wait_and_dies_by_its_group(
    zygote: Zygote, script: Path, tmp_path: Path
) -> None:
    proc = spawn("sleeper", [sys.executable, str(script), "sleep", "0"], tmp_path,
                 fork_from=zygote)  # fmt: skip
    assert proc.alive()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=0.2)
    proc.kill()
    assert proc.popen.returncode == -signal.SIGKILL
    assert not proc.alive()


def test_a_module_runs_as_python_dash_m_would(zygote: Zygote, tmp_path: Path) -> None:
    child = zygote.spawn(["-m", "json.tool", "--help"], dict(os.environ), tmp_path,
                         tmp_path / "m.log")  # fmt: skip
    assert child.wait(timeout=30) == 0
    assert "json.tool" in (tmp_path / "m.log").read_text()


def test_children_started_together_each_get_their_own_status(
    zygote: Zygote, script: Path, tmp_path: Path
) -> None:
    procs = [
        Proc(f"c{i}", zygote.spawn([str(script), "exit", str(i)], dict(os.environ), tmp_path,
                                   tmp_path / f"c{i}.log"), tmp_path / f"c{i}.log")
        for i in range(5)
    ]  # fmt: skip
    assert [p.popen.wait(timeout=30) for p in procs] == list(range(5))


def test_a_child_outliving_its_zygote_is_seen_running_until_it_ends(
    tmp_path: Path, script: Path
) -> None:
    z = Zygote(tmp_path, preload=["json"])
    child = z.spawn([str(script), "sleep", "0"], dict(os.environ), tmp_path, tmp_path / "s.log")
    z.proc.kill()
    z.proc.wait()
    assert child.poll() is None  # not "exited" because nobody reports it now
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL  # (its real status died with the zygote)
    with pytest.raises(RuntimeError, match="zygote exited"):
        z.spawn([str(script), "exit", "0"], dict(os.environ), tmp_path, tmp_path / "x.log")
