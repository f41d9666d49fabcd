#!/usr/bin/env bash
# SGLang 0.5.23 in its own venv .venv-sglang, apart from the project's .venv so neither can break the other. Used by
# the tests that drive `hybridkv serve` with SGLang's own benchmark client (`python -m sglang.bench_serving`).
#
# SGLang 0.5.23 pins torch==2.14.1 and imports torchvision on its way to its client (sglang.srt.configs reaches
# torchvision.transforms). Both lie on this machine's disk as the CUDA builds torch 2.14.1+cu130 and torchvision
# 0.29.1+cu130, which load and run on a CPU-only machine (checked: torchvision's nms runs). They are installed here,
# in this venv only, by exact version: nothing is downloaded for them, and the project's .venv keeps its CPU torch
# 2.13.0. sglang itself is installed without its dependencies (they name GPU kernels: flashinfer, flash-attn, DeepEP),
# then the pure-Python and CPU packages its client and its memory modules import, pinned; a constraints file holds
# torch and torchvision so none of them can swap in another build.
# About 6 GB in the venv, about two minutes on a fresh machine. Idempotent: a stamp file records a finished install
# of this script's pins; a lock file beside the venv makes a second run wait for the first. Exit status: 0 when the
# client imports, 1 with one line saying why not.
set -uo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
# What `sglang.bench_serving` and `sglang.srt.mem_cache` import, at the versions sglang 0.5.23 pins where it pins one.
PINS=(
  "transformers==5.19.0" "tokenizers==0.23.2" "openai==2.8.0" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" "aiohttp==3.14.5" "datasets==5.2.0" "gguf==0.19.0" "ipython==9.19.1"
  "msgspec==0.23.0" "orjson==3.13.0" "packaging==26.4" "partial-json-parser==0.2.1.1.post7" "psutil==7.2.2"
  "pybase64==1.5.1" "pydantic==2.14.4" "python-dateutil==2.9.0.post0" "pyzmq==27.3.0" "requests==2.34.2"
  "starlette==1.10.0" "tqdm==4.70.1"
)
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv-sglang
STAMP=$VENV/.sglang-installed
LOG=$VENV/setup.log

fail() { echo "[setup_sglang] cannot install SGLang here: $1 (full log: $LOG)"; exit 1; }

mkdir -p "$VENV"
exec 9>"$VENV.lock"  # one install at a time: `make test` starts one in the background and a test may run this too
flock -w 900 9 || { echo "[setup_sglang] another install held $VENV.lock for 15 minutes"; exit 1; }
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$0" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || { echo "[setup_sglang] cannot create $VENV with $PYTHON"; exit 1; }
: >"$LOG"
CONSTRAINTS=$VENV/constraints.txt
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" >"$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -c "$CONSTRAINTS")

echo "[setup_sglang] installing torch==$TORCH_VERSION, torchvision==$TORCHVISION_VERSION, sglang==$SGLANG_VERSION into $VENV"
"${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" >>"$LOG" 2>&1 ||
  fail "pip could not install torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" >>"$LOG" 2>&1 || fail "pip could not install sglang==$SGLANG_VERSION"
"${PIP[@]}" "${PINS[@]}" >>"$LOG" 2>&1 || fail "pip could not install SGLang's client dependencies"
"$VENV/bin/python" - >>"$LOG" 2>&1 <<PY || fail "sglang installed but its client does not import"
import torch
import torchvision.ops
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", f"expected torch $TORCH_VERSION, got {torch.__version__}"
import sglang.benchmark.serving  # noqa: F401
import sglang.srt.mem_cache.registry  # noqa: F401
PY
touch "$STAMP"
echo "[setup_sglang] $VENV ready (sglang $SGLANG_VERSION, torch $TORCH_VERSION)"
