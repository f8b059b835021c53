# torpor: `make demo` and `make test` work on a fresh machine (they run `make setup` first).
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test lint typecheck contracts unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/install-criu.sh scripts/install-slurm.sh
	bash scripts/setup.sh

demo: setup
	$(BIN)/python -m torpor.apps.demo

lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

typecheck: setup
	$(BIN)/mypy

contracts: setup
	$(BIN)/lint-imports

unit: setup
	$(BIN)/pytest -q

test: lint typecheck contracts unit

bench: setup
	$(BIN)/python scripts/bench.py
	$(BIN)/python scripts/bench_store.py
	$(BIN)/python scripts/bench_slurm.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
