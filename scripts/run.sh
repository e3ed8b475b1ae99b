#!/usr/bin/env bash
# The main job: installs what is needed (scripts/setup.sh), then starts the serving stack
# (Redis, prefill + decode vLLM CPU servers with RedisConnector, proxy) and sends requests:
# one prompt's KV through Redis, the same prompt on the decode server computed there against
# loaded from Redis (with what the load policy chose and why), and requests through the proxy.
# Extra arguments go to the demo (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "${KVSTORE_VENV:-$ROOT/.venv}/bin/python" -m scripts.serve_demo "$@"
