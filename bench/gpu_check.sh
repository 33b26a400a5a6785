#!/usr/bin/env bash
# `make gpu-check OUT=folder`: on a GPU machine, install and run the GPU bench sections
# (bench/gpu_check.py) into OUT. A fresh machine may have no TensorFlow and a Python other
# than 3.11: with 3.11 both hash-pinned locks go in as `make install` installs them; with
# another Python, the same top-level requirements and TensorFlow's CUDA 12 wheels at the
# lock's TensorFlow version, resolved for that Python. Arguments after OUT go to
# bench/gpu_check.py (--quick, --images N, --budget-s S).
set -euo pipefail
out=${1:?usage: bench/gpu_check.sh OUT [--quick] [--images N] [--budget-s S]}
shift
cd "$(dirname "$0")/.."
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true
export DVC_NO_ANALYTICS=1 TF_CPP_MIN_LOG_LEVEL=3
python=$(command -v python3.11 || command -v python3)
venv=.venv
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
echo "gpu-check: Python $version ($python); nvidia-smi -L:"
nvidia-smi -L || echo "  (no nvidia-smi)"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
if "$venv/bin/python" -c 'import tensorflow' 2>/dev/null; then
  echo "gpu-check: TensorFlow already installed in $venv"
elif [ "$version" = 3.11 ]; then
  "${pip[@]}" --require-hashes --no-deps -r requirements.lock -r requirements-gpu.lock
else
  tensorflow=$(sed -n 's/^tensorflow==\([^ ]*\) .*/\1/p' requirements.lock)
  echo "gpu-check: Python $version, not the locks' 3.11: requirements.in, tensorflow $tensorflow"
  "${pip[@]}" -r requirements.in "tensorflow[and-cuda]==$tensorflow"
fi
# The project from this folder, not installed: any Python, no build step.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/$venv/bin:$PATH"
# The reader's C++ op, as `make install` builds it (the stock ops read where it cannot be).
"$venv/bin/python" -m tasks.contracts.raw_slice
# The bench's shard flows run on this clone's Prefect server, as `make bench` runs them.
"$venv/bin/python" -m flows.servers.prefect_server ensure
trap '"$venv/bin/python" -m flows.servers.prefect_server stop || true' EXIT
"$venv/bin/python" -m bench.gpu_check --out "$out" "$@"
