#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU, the CUDA test subset, then the GPU benchmarks
# (benchmarks/gpu.py). Fits in 8 minutes on one H100/H200. It uses the machine's own python
# with CUDA torch and triton (PYTHON=...), and qkv from src/ (nothing is installed).
# Logs and JSON go to $OUT (default benchmarks/results); the JSON is named after the GPU.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" || exit 1
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")

# 1) The CUDA subset: the core grids with CUDA as the default device (tests/conftest.py).
GPU_TESTS=${GPU_TESTS:-$(cat tests/cuda_subset.txt)}  # the files, one a line
echo "== CUDA tests (QKV_TEST_DEVICE=cuda)"
QKV_TEST_DEVICE=cuda timeout "${TEST_SECONDS:-200}" $PY -m pytest -q -p no:cacheprovider \
  -n "${TEST_WORKERS:-6}" -rfE --tb=line $GPU_TESTS >"$OUT/gpu-tests-$gpu.log" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests-$gpu.log" | cut -c1-300 | tail -60

# 2) The benchmarks: triton, auto, torch's SDPA kernels, torch.compile(flex_attention).
echo "== GPU benchmarks"
timeout "${BENCH_SECONDS:-300}" $PY benchmarks/gpu.py --device cuda \
  --out "$OUT/gpu-$gpu.json" --max-seconds "${BENCH_BUDGET:-240}" ${BENCH_ARGS:-}
echo "bench exit $?"
