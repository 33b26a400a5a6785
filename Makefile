# Shardflow: `make run` trains a tracked model on the demo data; `make test` runs every check.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# The GPU variant (TensorFlow's CUDA 12 wheels, requirements-gpu.lock) goes on top of the CPU
# lock where the NVIDIA driver lists a GPU; SHARDFLOW_ACCELERATOR=gpu or cpu forces either.
LISTED_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo gpu)
ACCELERATOR := $(or $(SHARDFLOW_ACCELERATOR),$(LISTED_GPU),cpu)
ACCELERATOR_WHY := $(if $(SHARDFLOW_ACCELERATOR),SHARDFLOW_ACCELERATOR=$(SHARDFLOW_ACCELERATOR),$(if $(LISTED_GPU),nvidia-smi -L lists a GPU,nvidia-smi -L lists no GPU))
$(if $(filter-out cpu gpu,$(ACCELERATOR)),$(error SHARDFLOW_ACCELERATOR=$(ACCELERATOR): set gpu or cpu))
LOCKS := requirements.lock $(if $(filter gpu,$(ACCELERATOR)),requirements-gpu.lock)
# The choice is part of the stamp: switching installs again.
STAMP := $(VENV)/.installed-$(ACCELERATOR)-$(shell cat $(LOCKS) pyproject.toml | sha256sum | cut -c1-16)
# The GPU lock's packages, removed again by a CPU install so TensorFlow sees no GPU then.
GPU_PACKAGES := $(shell sed -n 's/^\([A-Za-z0-9._-]*\)==.*/\1/p' requirements-gpu.lock)

export PATH := $(CURDIR)/$(BIN):$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
# 3: TensorFlow C++ errors too, e.g. "failed call to cuInit" on every CPU-only machine;
# TensorFlow raises its real errors in Python, and Python warnings still show.
export TF_CPP_MIN_LOG_LEVEL := 3

.PHONY: help install run test lint demo-data serve stop team-demo ui bench gpu-check screenshots lock clean serve-model compact
.DEFAULT_GOAL := help

help:  ## list the targets (a bare `make` does this); `shardflow COMMAND --help` lists a command's options
	@awk -F':.*## ' '/^[a-z-]+:.*## /{printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(STAMP)  ## create .venv from the hash-pinned lock (plus the GPU lock where nvidia-smi lists a GPU), plus this clone's `shardflow` (idempotent)

# The reader's C++ op (tasks/contracts/raw_slice.cc) is built against the installed
# TensorFlow where g++ (or $CXX) is found; a read builds it too when its source changed, and
# reads with stock ops, saying why, where it cannot be built.
# The project goes in editable, after the lock: no dependency from anywhere but the lock
# (--no-deps), nothing downloaded to build it (--no-build-isolation: setuptools and wheel
# are in the lock). Its import hook maps only `tasks` and `flows`, to this clone's folders,
# and lives in this clone's .venv: another clone's processes import their own code. The
# clone's .dvc/config.local then names its own DVC site cache, for a `dvc` typed by hand.
$(STAMP): $(LOCKS) pyproject.toml
	@test -n "$(PYTHON)" || { echo "need python3.11 on PATH"; exit 1; }
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, found {sys.version}"'
	@echo "make install: the $(ACCELERATOR) lock ($(ACCELERATOR_WHY))"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r requirements.lock
ifeq ($(ACCELERATOR),gpu)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r requirements-gpu.lock
else
	$(BIN)/python -m pip uninstall --quiet --yes $(GPU_PACKAGES) 2>/dev/null
endif
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	$(BIN)/python -c 'import tasks.runtime.layout as l; l.keep_dvc_site_cache_in_repository()'
	$(BIN)/python -m tasks.contracts.raw_slice
	rm -f $(VENV)/.installed-*
	touch $@

demo-data: install  ## generate the demo dataset into data/demo unless it exists
	$(BIN)/python -m tasks.ingest.demo_data data/demo --if-missing

# run, serve, stop, ui and bench are `shardflow <target>` (flows/cli/shardflow.py), the installed entry point.
run: install  ## params.yaml checked, demo data if it reads data/demo and it is missing, then the whole pipeline with `dvc repro` under the workspace lock
	$(BIN)/python -m flows.cli run

compact: install  ## ingest if the sources changed, fold every shard generation into one (a rebuild), record it, rerun what follows
	$(BIN)/python -m flows.servers.prefect_server ensure
	$(BIN)/python -m tasks.runtime.workspace_lock -- bash -c \
	  '$(BIN)/dvc repro ingest && $(BIN)/python -m flows.launch.shard compact && $(BIN)/dvc commit --force shard && $(BIN)/dvc repro'


lint: install  ## ruff, mypy and the import-linter contracts (training never imports ingest or shard code)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy tasks flows bench
	$(BIN)/lint-imports

# The suite on every core, at most 4 (pytest-xdist; each worker starts its own servers): the
# end-to-end tests wait on servers and subprocesses much of the time, so two workers side by
# side beat one after the other on 2 cores; a third gains nothing while the CPU is busy
# throughout (figures: docs/performance.md). The slow tests come first (tests/conftest.py)
# and each worker takes the next test only when it is nearly idle (--maxschedchunk 1): the
# long ones are spread over the workers and none ends the run alone.
test: install lint  ## every check and test
	$(BIN)/pytest -n auto --maxprocesses 4 --dist load --maxschedchunk 1

serve: install  ## this clone's Prefect server + a process serving the deployments, on 127.0.0.1
	$(BIN)/python -m flows.cli serve

team-demo: install  ## the team setup on one machine: servers, S3, git remote, cpu+gpu workers; one pipeline/team run
	$(BIN)/python -m flows.cli team-demo

stop:  ## stop what this clone started: `make serve`'s deployment process, serve-model and ui servers, the Prefect server
	$(BIN)/python -m flows.cli stop

ui: install  ## MLflow UI over the project's tracking store on 127.0.0.1:5000 while free, else a free port (prints the runs table's address)
	$(BIN)/python -m flows.cli ui

# Each variable, when set, overrides its `shardflow serve-model` default (flows/cli/shardflow.py: a free
# port; requests up to 16 MB and 1024 rows, larger ones get HTTP 413 before parsing; 4 at
# once, one more gets HTTP 503; the champion alias read every 10 s, and its version served).
serve-model: install  ## the registered champion (MLflow's scoring app behind request limits, following the alias) on a free 127.0.0.1 port
	$(BIN)/python -m flows.cli serve-model $(if $(SERVE_MODEL_PORT),--port $(SERVE_MODEL_PORT)) \
	  $(if $(SERVE_MAX_REQUEST_MB),--max-request-mb $(SERVE_MAX_REQUEST_MB)) \
	  $(if $(SERVE_MAX_REQUEST_ROWS),--max-request-rows $(SERVE_MAX_REQUEST_ROWS)) \
	  $(if $(SERVE_MAX_CONCURRENT_REQUESTS),--max-concurrent-requests $(SERVE_MAX_CONCURRENT_REQUESTS)) \
	  $(if $(SERVE_ALIAS_POLL_S),--alias-poll-s $(SERVE_ALIAS_POLL_S))

bench: install  ## benchmarks -> reports/bench.json, reports/bench.png (BENCH_ARGS=--quick for a smoke run)
	$(BIN)/python -m flows.cli bench $(BENCH_ARGS)

# No `install` prerequisite: a fresh GPU machine may lack Python 3.11, the script installs.
gpu-check:  ## on a GPU machine: install, run the GPU bench sections (one process per model) into OUT
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=folder [GPU_CHECK_ARGS=--quick]"; exit 1; }
	bash bench/gpu_check.sh $(OUT) $(GPU_CHECK_ARGS)

screenshots: install  ## headless Chromium screenshots of the MLflow run and Prefect artifacts -> docs/
	$(BIN)/python -m docs.screenshots

# The GPU lock: for Linux x86-64 whatever machine compiles it, the CPU lock as constraints
# (a package both need gets one version), and only what the CPU lock lacks emitted.
lock:  ## recompile requirements.lock and requirements-gpu.lock from their .in files (needs uv)
	uv pip compile --python-version 3.11 --generate-hashes --no-emit-index-url \
	  --no-emit-find-links --no-header -o requirements.lock requirements.in
	uv pip compile --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --generate-hashes --no-emit-index-url --no-emit-find-links --no-header \
	  -c requirements.lock $(shell sed -n 's/^\([A-Za-z0-9._-]*\)==.*/--no-emit-package \1/p' requirements.lock) \
	  -o requirements-gpu.lock requirements-gpu.in

clean:  ## remove generated data and outputs (keeps .venv and the tracking store)
	rm -rf data/ingest data/shards models metrics plots reports .shardflow
