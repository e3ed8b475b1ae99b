#!/usr/bin/env bash
# The main job: installs what is needed (scripts/setup.sh), then runs the demo.
# Extra arguments go to the demo (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "${KVSTORE_VENV:-$ROOT/.venv}/bin/python" scripts/demo_store.py "$@"
