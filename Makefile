# `make demo` and `make test` do all set-up on a fresh machine (scripts/setup.sh).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test lint bench clean

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m hybridkv demo --out out/demo

# lm-eval's own venv (tests/server/test_lmeval.py; about a minute on a fresh machine) installs while lint runs;
# the test runs the same idempotent script again and skips, naming why, if it failed. SGLang's venv
# (tests/server/test_sglang_client.py; about two minutes) installs then too, the same way; the tests start once
# both are done, so no install loads the machine under the timing-bound fault tests. Neither needs the project's
# .venv, so both start first and overlap its set-up too (lint runs setup)
test:
	@scripts/setup_lmeval.sh >/dev/null 2>&1 & lmeval=$$!; \
	scripts/setup_sglang.sh >/dev/null 2>&1 & sglang=$$!; \
	$(MAKE) --no-print-directory lint; lint=$$?; wait $$lmeval $$sglang; \
	[ $$lint -eq 0 ] && $(PY) -m pytest -n 2 --dist loadfile

lint: setup
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m mypy src/hybridkv

bench: setup
	bench/run_all.sh

clean:
	rm -rf .venv .venv-lmeval .venv-sglang .venv-sglang.lock out .pytest_cache .hypothesis
