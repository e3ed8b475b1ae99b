#!/usr/bin/env bash
# Installs everything (scripts/setup.sh), then runs lint, format check, types and every test,
# including the end-to-end tests on real vLLM CPU engines. Extra arguments go to pytest.
# VLLM_VERSION=0.30.0 (0.31.0, 0.33.0) does the same in that vLLM's own virtualenv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
VENV="$(bash scripts/setup.sh --venv-path)"
export PATH="$VENV/bin:$PATH"
# KVSTORE_LINT=0: no lint (scripts/test_versions.sh lints once, not per release); =only: lint
# and types, no tests (.ci/run lints before its two lanes of tests)
if [ "${KVSTORE_LINT:-1}" != 0 ]; then
  echo "== ruff"
  ruff check kvstore datamover connector scripts testing tests
  ruff format --check kvstore datamover connector scripts testing tests
  echo "== mypy"
  mypy kvstore datamover connector testing scripts
  if [ "${KVSTORE_LINT:-1}" = only ]; then exit 0; fi
fi
echo "== pytest"
set +e
python -m pytest -ra --durations=30 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "pytest collected no tests: that is a failure here" >&2; exit 1; fi
exit "$rc"
