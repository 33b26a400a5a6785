# Shardflow: `make run` trains a tracked model on the demo data; `make test` runs every check.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)

export PATH := $(CURDIR)/$(BIN):$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
# 3: TensorFlow C++ errors too, e.g. "failed call to cuInit" on every CPU-only machine;
# TensorFlow raises its real errors in Python, and Python warnings still show.
export TF_CPP_MIN_LOG_LEVEL := 3

.PHONY: help install run test lint demo-data serve stop team-demo ui bench screenshots lock clean serve-model compact
.DEFAULT_GOAL := help

help:  ## list the targets (a bare `make` does this); `shardflow COMMAND --help` lists a command's options
	@awk -F':.*## ' '/^[a-z-]+:.*## /{printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(STAMP)  ## create .venv from the hash-pinned lock, plus this clone's `shardflow` (idempotent)

# The project goes in editable, after the lock: no dependency from anywhere but the lock
# (--no-deps), nothing downloaded to build it (--no-build-isolation: setuptools and wheel
# are in the lock). Its import hook maps only `tasks` and `flows`, to this clone's folders,
# and lives in this clone's .venv: another clone's processes import their own code. The
# clone's .dvc/config.local then names its own DVC site cache, for a `dvc` typed by hand.
$(STAMP): requirements.lock pyproject.toml
	@test -n "$(PYTHON)" || { echo "need python3.11 on PATH"; exit 1; }
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, found {sys.version}"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	$(BIN)/python -c 'import tasks.layout as l; l.keep_dvc_site_cache_in_repository()'
	rm -f $(VENV)/.installed-*
	touch $@

demo-data: install  ## generate the demo dataset into data/demo unless it exists
	$(BIN)/python -m tasks.demo_data data/demo --if-missing

# run, serve, stop, ui and bench are `shardflow <target>` (flows/cli.py), the installed entry point.
run: install  ## params.yaml checked, demo data if it reads data/demo and it is missing, then the whole pipeline with `dvc repro` under the workspace lock
	$(BIN)/python -m flows.cli run

compact: install  ## ingest if the sources changed, fold every shard generation into one (a rebuild), record it, rerun what follows
	$(BIN)/python -m flows.server ensure
	$(BIN)/python -m tasks.workspace_lock -- bash -c \
	  '$(BIN)/dvc repro ingest && $(BIN)/python -m flows.shard compact && $(BIN)/dvc commit --force shard && $(BIN)/dvc repro'


lint: install  ## ruff, mypy and the import-linter contract (training never imports shard code)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy tasks flows bench
	$(BIN)/lint-imports

# The suite on every core, at most 4 (pytest-xdist; each worker starts its own servers): the
# end-to-end tests wait on servers and subprocesses much of the time, so two side by side on
# 2 cores took 17.4 minutes where one after the other took 25.6 (16.0 minutes of pytest in a
# fresh clone on 2026-11-29, 18.4 with install and lint, as fast as the VM is that day); a
# third worker on 2 cores gains nothing (17.1 minutes measured), the CPU is busy throughout.
# The slow tests come first (tests/conftest.py) and each worker takes the next test only
# when it is nearly idle (--maxschedchunk 1): the long ones are spread
# over the workers and none ends the run alone.
test: install lint  ## every check and test
	$(BIN)/pytest -n auto --maxprocesses 4 --dist load --maxschedchunk 1

serve: install  ## this clone's Prefect server + a process serving the deployments, on 127.0.0.1
	$(BIN)/python -m flows.cli serve

team-demo: install  ## the team setup on one machine: servers, S3, git remote, cpu+gpu workers; one pipeline/team run
	$(BIN)/python -m flows.cli team-demo

stop:  ## stop the Prefect server that this clone's `make run`/`make serve` started
	$(BIN)/python -m flows.cli stop

ui: install  ## MLflow UI on a free 127.0.0.1 port (printed) over the project's tracking store
	$(BIN)/python -m flows.cli ui

# Each variable, when set, overrides its `shardflow serve-model` default (flows/cli.py: a free
# port; requests up to 16 MB and 1024 rows, larger ones get HTTP 413 before parsing; 4 at
# once, one more gets HTTP 503).
serve-model: install  ## the registered champion (MLflow's scoring app behind request limits) on a free 127.0.0.1 port
	$(BIN)/python -m flows.cli serve-model $(if $(SERVE_MODEL_PORT),--port $(SERVE_MODEL_PORT)) \
	  $(if $(SERVE_MAX_REQUEST_MB),--max-request-mb $(SERVE_MAX_REQUEST_MB)) \
	  $(if $(SERVE_MAX_REQUEST_ROWS),--max-request-rows $(SERVE_MAX_REQUEST_ROWS)) \
	  $(if $(SERVE_MAX_CONCURRENT_REQUESTS),--max-concurrent-requests $(SERVE_MAX_CONCURRENT_REQUESTS))

bench: install  ## benchmarks -> reports/bench.json, reports/bench.png (BENCH_ARGS=--quick for a smoke run)
	$(BIN)/python -m flows.cli bench $(BENCH_ARGS)

screenshots: install  ## headless Chromium screenshots of the MLflow run and Prefect artifacts -> docs/
	$(BIN)/python -m docs.screenshots

lock:  ## recompile requirements.lock from requirements.in (needs uv)
	uv pip compile --python-version 3.11 --generate-hashes --no-emit-index-url \
	  --no-emit-find-links --no-header -o requirements.lock requirements.in

clean:  ## remove generated data and outputs (keeps .venv and the tracking store)
	rm -rf data/ingest data/shards models metrics plots reports .shardflow
