# `make demo` and `make test` do all set-up on a fresh machine (scripts/setup.sh).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test lint bench clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m hybridkv demo --out out/demo

test: setup lint
	$(PY) -m pytest -n 2 --dist loadfile

lint: setup
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m mypy src/hybridkv

bench: setup
	bench/run_all.sh

clean:
	rm -rf .venv out .pytest_cache .hypothesis
