#!/usr/bin/env bash
# A separate .venv-lmeval with lm-evaluation-harness (its API-model client, lm-eval[api]) and transformers (the
# tokenizer a loglikelihood task needs), pinned; no torch: lm-eval's core needs none, and a constraint naming a
# version that does not exist makes pip fail rather than pull one (then `import torch` is checked to fail too).
# Used by tests/server/test_lmeval.py: lm_eval --model local-completions against `hybridkv serve`.
# Idempotent: a stamp file records a finished install of this script's pins. On failure: one line, exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv-lmeval
STAMP=$VENV/.lmeval-installed
PINS=("lm-eval[api]==0.4.13" "transformers==5.23.0")

if [ -f "$STAMP" ] && [ "$STAMP" -nt "$0" ]; then
  exit 0
fi

fail() {
  echo "[setup_lmeval] cannot install ${PINS[*]} into $VENV: $1" >&2
  exit 1
}

[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV >/dev/null 2>&1 || fail "'$PYTHON -m venv' failed"
echo "torch===not-in-$VENV" >$VENV/no-torch.txt
$VENV/bin/python -m pip install -q --disable-pip-version-check -c $VENV/no-torch.txt "${PINS[@]}" >$VENV/pip.log 2>&1 ||
  fail "pip failed (its output: $VENV/pip.log)"
if $VENV/bin/python -c "import torch" >/dev/null 2>&1; then
  fail "torch got installed there (it must not be)"
fi
$VENV/bin/lm_eval --help >/dev/null 2>&1 || fail "$VENV/bin/lm_eval does not run"
touch "$STAMP"
echo "[setup_lmeval] $VENV ready (lm-eval $($VENV/bin/python -c 'from importlib.metadata import version; print(version("lm_eval"))'))"
