"""testing/zygote.py: a forked child runs its command as a fresh interpreter would (arguments,
environment, directory, log, exit status), and looks to the tests like a subprocess.Popen:
poll, wait with a timeout, and a kill of its process group. (The zygote here imports only
``this``, which prints to stdout as vLLM 0.30's logging does at import: what a real one imports
is the engines' business, checked end to end.) A child's own ``spawn`` of a process, as vLLM
starts its engine core and workers, is forked by the zygote too, behind a stand-in that passes
on its pipes, signals and exit status.)"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.stack import Proc, spawn
from testing.zygote import Zygote, cpu_list

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


SPAWNER = """
import json, multiprocessing, os, sys, time

def work(conn, code):
    conn.send({"ppid": os.getppid(), "pid": os.getpid(), "env": os.environ.get("ZYGOTE_T"),
               "cpus": sorted(os.sched_getaffinity(0))})
    print("from the spawned process", flush=True)
    if code == "sleep":
        time.sleep(60)
    sys.exit(code)

if __name__ == "__main__":
    mode = sys.argv[1]
    os.environ["ZYGOTE_T"] = "set by the spawner"
    os.environ["GOMP_CPU_AFFINITY"] = str(min(os.sched_getaffinity(0)))  # (as vLLM binds one)
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=work, args=(writer, 7 if mode == "exit" else "sleep"))
    proc.start()
    writer.close()
    info = {**reader.recv(), "stand_in": proc.pid}
    if mode == "orphan":
        print(json.dumps(info), flush=True)
        time.sleep(60)
    if mode == "terminate":
        proc.terminate()
    if mode == "kill":
        os.kill(info["pid"], 9)
    proc.join(30)
    print(json.dumps({**info, "exitcode": proc.exitcode}), flush=True)
"""


def _spawner(zygote: Zygote, tmp_path: Path, mode: str) -> tuple[Proc, Path]:
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    proc = spawn(f"spawner-{mode}", [sys.executable, str(script), mode], tmp_path,
                 fork_from=zygote)  # fmt: skip
    return proc, tmp_path / f"spawner-{mode}.log"


def _last_json(log: Path) -> dict:
    return json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])


def test_a_childs_spawned_process_is_forked_too_with_its_pipes_environment_and_status(
    zygote: Zygote, tmp_path: Path
) -> None:
    proc, log = _spawner(zygote, tmp_path, "exit")
    assert proc.popen.wait(timeout=60) == 0, log.read_text()
    info = _last_json(log)
    assert info["ppid"] == zygote.proc.pid  # forked by the zygote, not started from scratch
    assert info["stand_in"] != info["pid"]
    assert info["env"] == "set by the spawner"  # the spawner's environment when it spawned
    assert info["cpus"] == [min(os.sched_getaffinity(0))]  # as libgomp would have bound it
    assert info["exitcode"] == 7  # the spawner sees the spawned process's own status
    assert "from the spawned process" in log.read_text()  # its standard streams, passed on


@pytest.mark.parametrize(
    ("mode", "exitcode"), [("terminate", -signal.SIGTERM), ("kill", -signal.SIGKILL)]
)
def test_a_signal_to_the_stand_in_reaches_the_spawned_process_and_its_death_comes_back(
    zygote: Zygote, tmp_path: Path, mode: str, exitcode: int
) -> None:
    """terminate() signals the stand-in, which passes it on; a spawned process killed
    outright is seen so by its spawner."""
    proc, log = _spawner(zygote, tmp_path, mode)
    assert proc.popen.wait(timeout=60) == 0, log.read_text()
    info = _last_json(log)
    assert info["ppid"] == zygote.proc.pid  # (forked, not a plain spawn)
    assert info["exitcode"] == exitcode


def test_a_spawned_process_dies_with_the_process_that_spawned_it(
    zygote: Zygote, tmp_path: Path
) -> None:
    proc, log = _spawner(zygote, tmp_path, "orphan")
    # its line comes once the spawned process is up: waited for while the spawner lives (CI's
    # two lanes on two cores once took more than the 60 s this loop allowed, then read nothing)
    while not (log.exists() and '"pid"' in log.read_text()):
        assert proc.alive(), log.read_text() if log.exists() else "the spawner died"
        select.select([], [], [], 0.1)
    info = _last_json(log)
    assert info["ppid"] == zygote.proc.pid
    spawned = info["pid"]
    pidfd = os.pidfd_open(spawned)
    proc.kill()  # the spawner's whole group, its stand-in included; not the spawned process's
    ready, _, _ = select.select([pidfd], [], [], 60)
    os.close(pidfd)
    assert ready, "the spawned process outlived the process that spawned it"


@pytest.mark.parametrize(
    ("spec", "cpus"),
    [("0", {0}), ("0 1", {0, 1}), ("0,2", {0, 2}), ("0-3", {0, 1, 2, 3}), ("0-7:2", {0, 2, 4, 6})],
)
def test_gomp_cpu_affinity_lists_parse_as_libgomp_reads_them(spec: str, cpus: set[int]) -> None:
    assert cpu_list(spec) == cpus
