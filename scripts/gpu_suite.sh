#!/usr/bin/env bash
# The GPU suite on a machine with PyTorch + CUDA but no vLLM and no internet (the device).
#   here:   bash scripts/gpu_suite.sh --prepare      wheels + redis-server .debs into .gpu/
#   there:  bash scripts/gpu_suite.sh [OUT_DIR]      carry .gpu; runs `pytest -m cuda`,
#                                                    scripts/bench_gpu.py (standalone, 1/2/4
#                                                    masters, server I/O threads on/off),
#                                                    bench_shards.py and
#                                                    bench_datamover.py x1/x2/x4 connections,
#                                                    figures to OUT_DIR/suite.tgz
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .gpu/wheels .gpu/debs
  # what the suite needs beyond the device image (which has torch, pytest, xxhash, numpy,
  # sortedcontainers): the Redis client, its parser, and fakeredis for the unit tests
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/wheels \
    redis==8.1.0 hiredis==3.5.0 fakeredis==2.40.0 lz4==4.4.5
  (cd .gpu/debs && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1)
  # Valkey 9.1 as scripts/setup.sh unpacked it, for the I/O-threads comparison (issue 39)
  if [ -x .venv/servers/valkey-9.1/valkey-server ]; then
    mkdir -p .gpu/servers && cp -r .venv/servers/valkey-9.1 .gpu/servers/
  fi
  du -sh .gpu
  exit 0
fi
OUT_DIR="${1:-${OUT:-/tmp/gpu-suite}}"
mkdir -p "$OUT_DIR"
if ! command -v redis-server >/dev/null; then
  for f in .gpu/debs/*.deb; do dpkg -x "$f" /tmp/redis-root; done
  export PATH="/tmp/redis-root/usr/bin:$PATH"
  export LD_LIBRARY_PATH="/tmp/redis-root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
if [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/wheels/*.whl
  export PYTHONPATH="/tmp/site:$ROOT"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
set +e
python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/test_datamover.py tests/test_layered_loads.py 2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
timeout 300 python3 -m scripts.bench_gpu --out "$OUT_DIR/gpu.json" 2>&1 | tee "$OUT_DIR/bench.log"
brc=${PIPESTATUS[0]}
# issue 39: save / load GB/s into and out of GPU memory against 1, 2 and 4 Cluster masters and
# with the server's I/O threads on and off (Redis; Valkey where .gpu/servers has it)
VALKEY="$ROOT/.gpu/servers/valkey-9.1/valkey-server"
mrc=0
run_masters() {  # name, then bench_gpu's arguments
  local name="$1"; shift
  timeout 120 python3 -m scripts.bench_gpu --quick --rounds 3 --out "$OUT_DIR/masters-$name.json" \
    "$@" 2>&1 | tail -n 30 > "$OUT_DIR/masters-$name.log"
  [ "${PIPESTATUS[0]}" = 0 ] || { mrc=1; echo "masters-$name failed"; tail -5 "$OUT_DIR/masters-$name.log"; }
}
run_masters standalone-io4 --server-io-threads 4
for m in 1 2 4; do run_masters "cluster$m" --masters "$m"; done
run_masters cluster4-io4 --masters 4 --server-io-threads 4
run_masters cluster4-io4-x8 --masters 4 --server-io-threads 4 --connections 8
if [ -x "$VALKEY" ]; then
  run_masters valkey-standalone --server "$VALKEY"
  run_masters valkey-standalone-io4 --server "$VALKEY" --server-io-threads 4
  run_masters valkey-cluster4-io4 --server "$VALKEY" --masters 4 --server-io-threads 4
fi
python3 - "$OUT_DIR" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("masters-*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:32s} save {r['save_GBps']:6.2f} GB/s  load {r['load_GBps']:6.2f} GB/s")
PY
# the device's 16 cores give each Cluster master its own: issue 20's 3-master scaling target
# cannot be shown on the 2-core VM, where the shards and the client share two cores. 96 blocks:
# with 48 (16 a master) the batch is too short to keep three masters busy (1.44x against
# 1.83-2.20x on an H200 host, 2026-11-26)
timeout 240 python3 -m scripts.bench_shards --blocks 96 --rounds 7 --json "$OUT_DIR/shards.json" 2>&1 \
  | tee "$OUT_DIR/shards.log"
src=${PIPESTATUS[0]}
# how many connections a load and a save should use on a many-core host (the connector's
# `connections`, 4 by default; 1 is faster on the 2-core VM)
drc=0
for c in 1 2 4; do
  timeout 90 python3 -m scripts.bench_datamover --blocks 64 --rounds 5 --connections "$c" \
    --json "$OUT_DIR/datamover-x$c.json" 2>&1 | tee "$OUT_DIR/datamover-x$c.log"
  [ "${PIPESTATUS[0]}" = 0 ] || drc=1
done
echo "pytest exit $rc, bench exit $brc, masters exit $mrc, shards exit $src, datamover exit $drc"
# the device tool brings back only a few files: everything goes home in one archive
(cd "$OUT_DIR" && tar czf /tmp/gpu-suite.tgz --exclude=suite.tgz . && find . -type f -delete \
  && mv /tmp/gpu-suite.tgz suite.tgz)
[ "$rc" = 0 ] && [ "$brc" = 0 ] && [ "$src" = 0 ] && [ "$drc" = 0 ]
