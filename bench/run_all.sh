#!/usr/bin/env bash
# Run every benchmark with one torch thread; JSON results go to bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
mkdir -p bench/results
for name in memory cache transfer engine bf16 pd; do
  echo "== hybridkv bench $name"
  .venv/bin/hybridkv bench "$name" --json > "bench/results/$name.json"
done
