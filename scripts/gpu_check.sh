#!/usr/bin/env bash
# GPU verification on the lent H200 (run from the repository root there):
#   bash scripts/gpu_check.sh [bench_layer seq lengths...]
# Installs a carried megatron-core wheel from .whl/ when the machine lacks it, runs the
# GPU-marked op tests, the layer tests (which run on CUDA when it is there) and the layer
# benchmark, writing logs and results under ${OUT:-outputs/gpu_check}.
set -uo pipefail
out=${OUT:-outputs/gpu_check}
mkdir -p "$out"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$(pwd):${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
date -u | tee -a "$out/device.txt"
timeout 200 python3 -m pytest -q -m gpu tests/ops -p no:cacheprovider 2>&1 | tail -25 | tee "$out/gpu_ops.log"
timeout 120 python3 -m pytest -q tests/layers -p no:cacheprovider 2>&1 | tail -15 | tee "$out/layers.log"
seqs=${*:-8192 16384 32768 65536 131072}
timeout 240 python3 scripts/bench_layer.py --seq $seqs --repeats 1 --out "$out" 2>&1 | tee "$out/bench_layer.log"
