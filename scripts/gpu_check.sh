#!/usr/bin/env bash
# GPU readiness in one command (at most 8 minutes on one GPU; per-check time limits add up to 480 s):
#   cuda-tests    every CUDA-only test (pytest -m cuda), but the nccl world below
#   host-sync     every host-sync test (pytest -m host_sync) on the GPU: HYBRIDKV_TEST_DEVICE=cuda builds
#                 their memory / cache / engine there and runs what they count under
#                 torch.cuda.set_sync_debug_mode("error") (tests/devices.py)
#   nccl-engine   a TP/PP engine world over nccl on CUDA, token-exact against transformers
#                 (tests/engine/parallel/test_parallel_cuda.py); the PD server's workers initialise
#                 gloo only (engine/disagg/procs.py), so a PD run cannot take nccl yet
#   bench-memory  hybridkv bench memory on a real arena on the GPU (full+state: ~35 GiB), no host sync
#   bench-engine  hybridkv bench engine with the engine on the GPU, every request token-exact
# One line per check: PASS / FAIL / SKIP, seconds, and where its log is (out/gpu_check/<check>.log).
# Without CUDA nothing can run on a GPU: every check says SKIP after proving its command exists and
# parses (pytest --collect-only, --help), and the script exits 0; a broken command fails it anyway.
# Exit status: 0 when no check failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
HKV=${HYBRIDKV:-.venv/bin/hybridkv}
OUT=${GPU_CHECK_OUT:-out/gpu_check}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  CUDA=1
  "$PY" -c 'import torch; p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}")'
else
  CUDA=0
  echo "gpu_check: no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')): checking that every command exists and parses, running none"
fi

BENCH_ENGINE_REQUESTS=16
CHECKS=(cuda-tests host-sync nccl-engine bench-memory bench-engine)
declare -A LIMIT RUN PREFLIGHT
LIMIT[cuda-tests]=60
RUN[cuda-tests]="$PY -m pytest -m cuda -k 'not nccl_world' -p no:cacheprovider"
PREFLIGHT[cuda-tests]="$PY -m pytest -m cuda -k 'not nccl_world' -p no:cacheprovider --collect-only -q"

LIMIT[host-sync]=150
RUN[host-sync]="HYBRIDKV_TEST_DEVICE=cuda $PY -m pytest -m host_sync -p no:cacheprovider"
PREFLIGHT[host-sync]="$PY -m pytest -m host_sync -p no:cacheprovider --collect-only -q"

LIMIT[nccl-engine]=120
RUN[nccl-engine]="$PY -m pytest tests/engine/parallel/test_parallel_cuda.py -p no:cacheprovider"
PREFLIGHT[nccl-engine]="$PY -m pytest tests/engine/parallel/test_parallel_cuda.py -p no:cacheprovider --collect-only -q"

LIMIT[bench-memory]=75
RUN[bench-memory]="$HKV bench memory --device cuda --config full+state --json > $OUT/bench_memory.json && $PY -c \"
import json; r = json.load(open('$OUT/bench_memory.json'))['configs']['full+state']
print(json.dumps({k: r[k] for k in ('hybridkv', 'static_baseline', 'speedup_vs_baseline')}, indent=1))
assert r['hybridkv']['host_syncs'] == 0, f'host syncs on the GPU: {r[\\\"hybridkv\\\"][\\\"host_sync_kinds\\\"]}'
\""
PREFLIGHT[bench-memory]="$HKV bench memory --device cuda --config full+state --json --help | grep -q -- --device"

LIMIT[bench-engine]=75
RUN[bench-engine]="$HKV bench engine --device cuda --model tiny-qwen3-next --model tiny-gemma3 --requests $BENCH_ENGINE_REQUESTS --max-new-tokens 8 --json > $OUT/bench_engine.json && $PY -c \"
import json; rows = json.load(open('$OUT/bench_engine.json'))['models']
for r in rows: print(r['model'], 'exact', r['exact'], '/', $BENCH_ENGINE_REQUESTS, 'tok/s', r['engine_tokens_per_s'], 'vs transformers', r['transformers_tokens_per_s'])
assert all(r['exact'] == $BENCH_ENGINE_REQUESTS for r in rows), 'a request differs from transformers'
\""
PREFLIGHT[bench-engine]="$HKV bench engine --device cuda --model tiny-qwen3-next --requests 1 --json --help | grep -q -- --device"

now() { date +%s%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) / 1e9 }'; }

failed=0
for name in "${CHECKS[@]}"; do
  log="$OUT/$name.log"
  start=$(now)
  if [ "$CUDA" = 1 ]; then
    timeout --kill-after=10 "${LIMIT[$name]}" bash -c "${RUN[$name]}" >"$log" 2>&1
    rc=$?
    took=$(secs "$start" "$(now)")
    if [ $rc -eq 0 ]; then
      echo "PASS $name ${took}s"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      echo "FAIL $name ${took}s (past its ${LIMIT[$name]} s limit; see $log)"
      failed=$((failed + 1))
    else
      echo "FAIL $name ${took}s (exit $rc; see $log)"
      failed=$((failed + 1))
    fi
  else
    timeout --kill-after=10 120 bash -c "${PREFLIGHT[$name]}" >"$log" 2>&1
    rc=$?
    took=$(secs "$start" "$(now)")
    if [ $rc -ne 0 ]; then
      echo "FAIL $name ${took}s (its command does not parse here, exit $rc; see $log)"
      failed=$((failed + 1))
      continue
    fi
    # pytest -q lists node ids (a::b), -qq counts per file (path: N): add up either
    collected=$(awk '/::/ { n++ } /^tests\/[^ ]*: [0-9]+$/ { n += $NF } END { print n + 0 }' "$log")
    if [[ "${PREFLIGHT[$name]}" == *collect-only* ]] && [ "$collected" -eq 0 ]; then
      echo "FAIL $name ${took}s (selects no test; see $log)"
      failed=$((failed + 1))
    elif [[ "${PREFLIGHT[$name]}" == *collect-only* ]]; then
      echo "SKIP $name ${took}s (no CUDA; command checked: $collected tests collected)"
    else
      echo "SKIP $name ${took}s (no CUDA; command checked: it parses, --device is an option)"
    fi
  fi
done

if [ "$CUDA" = 0 ]; then
  if [ $failed -eq 0 ]; then
    echo "gpu_check: SKIPPED, no CUDA device: nothing ran on a GPU; all ${#CHECKS[@]} commands exist and parse (exit 0)"
  else
    echo "gpu_check: no CUDA device, and $failed of ${#CHECKS[@]} commands are broken (exit 1)"
  fi
else
  echo "gpu_check: $((${#CHECKS[@]} - failed)) of ${#CHECKS[@]} checks passed (logs in $OUT)"
fi
[ $failed -eq 0 ]
