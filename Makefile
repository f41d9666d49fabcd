# `make demo` and `make test` do all set-up on a fresh machine (scripts/setup.sh).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test lint bench clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m hybridkv demo --out out/demo

test: setup lint
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

bench: setup
	$(PY) -m hybridkv bench memory --trace data/peer_trace.json.gz

clean:
	rm -rf .venv out .pytest_cache .hypothesis
