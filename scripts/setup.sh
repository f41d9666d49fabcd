#!/usr/bin/env bash
# One-shot set-up on a fresh machine: Debian's libibverbs1 (the Mooncake transfer engine
# links it), a .venv with torch 2.13.0 (the CPU build on this disk, installed first and
# alone so nothing can pull a CUDA build), then hybridkv itself with its extras.
# Idempotent: a stamp file records a finished install of the current pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
STAMP=.venv/.hybridkv-installed

if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  echo "[setup] installing libibverbs1 (needed by the Mooncake transfer engine)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q libibverbs1 >/dev/null
fi

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,mooncake,engine,server]"
.venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
PY
# the engine's C++ CPU kernels, built once into torch's extension cache (else the first use builds them)
.venv/bin/python -c "from hybridkv.engine.ops.native import native; native()"
touch "$STAMP"
echo "[setup] .venv ready (torch $(.venv/bin/python -c 'import torch;print(torch.__version__)'))"
