# torpor: `make demo` and `make test` work on a fresh machine (they run `make setup` first); `make unit` is
# the fast loop.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

# the tests that need neither root, CRIU, Slurm, PyTorch nor an S3 server, and take a few seconds at most
UNIT := not criu and not root and not slurm and not torch and not s3 and not k8s and not slow
# pytest-xdist workers: both cores of the machines CI runs on. Tests that share an expensive set-up (one
# Slurm cluster, one initdb, one browser, one reference training run) or something of the machine's (the
# hot tiers every torpor cleanup looks at) are marked xdist_group("…"): --dist loadgroup runs each group on
# one worker
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadgroup

.PHONY: setup demo test lint typecheck contracts unit suite bench clean k8s

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/install-criu.sh scripts/criu-rlimits.c scripts/install-slurm.sh scripts/install-programs.sh scripts/apt-install.sh
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

# the fast loop: any user, no cache written into the checkout (it may not be the caller's). Where its
# time goes, measured on 2 cores: the tests that run the real `torpor` command (~0.2 s each, most of it
# importing torpor: the CLI imports the engine, the store and the agent's commands), collection
# (~3 s in each worker: every test module imports torpor), and on a fresh checkout compiling torpor's .pyc
# once; no test sleeps for long (a test that must is marked slow). Two workers halve all three.
unit: setup
	$(BIN)/pytest -q -p no:cacheprovider $(XDIST) -m "$(UNIT)"

# Kubernetes v1.20.2 for the cluster tests, built from Debian's source once (~14 min on 2 cores) and
# cached outside the checkout ($$TORPOR_K8S_CACHE, default /var/cache/torpor-k8s); as root
k8s:
	bash scripts/k8s/build.sh

# every test, as root; prints the slowest, and why any test was skipped. First all but the cluster
# tests, on both cores; then the cluster tests (one cluster, one test at a time), alone: a cluster's
# daemons on the same 2 cores made the other tests' jobs miss their waits. The cluster tests fail
# instead of skipping where no Kubernetes could be built
suite: setup k8s
	status=0; \
	$(BIN)/pytest -q -rs --durations=15 $(XDIST) -m "not k8s" || status=$$?; \
	TORPOR_TESTS_NEED_K8S=1 $(BIN)/pytest -q -rs --durations=10 -m k8s || status=$$?; \
	exit $$status

test: lint typecheck contracts suite

bench: setup
	$(BIN)/python scripts/bench.py
	$(BIN)/python scripts/bench_freeze.py
	$(BIN)/python scripts/bench_store.py
	$(BIN)/python scripts/bench_slurm.py
	$(BIN)/python scripts/bench_agent.py
	$(BIN)/python scripts/bench_scheduler.py
	$(BIN)/python scripts/bench_scheduler_runs.py
	$(BIN)/python scripts/bench_warmstart.py
	$(BIN)/python scripts/bench_kube.py
	$(BIN)/python scripts/bench_migrate.py
	$(BIN)/python scripts/bench_writetrack.py
	$(BIN)/python scripts/bench_precopy.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
