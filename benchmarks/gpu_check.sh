#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU, the CUDA test subset, the triton backend's tile
# sweep, then the GPU benchmarks (benchmarks/gpu.py); under 8 minutes on one H100/H200. It uses
# the machine's own python with CUDA torch and triton (PYTHON=...) and qkv from src/ (nothing
# is installed). Logs and JSON go to $OUT (default benchmarks/results), named after the GPU.
# Each step has a time limit (TRITON_SECONDS, TILES_SECONDS, FLEX_TILES_SECONDS, TEST_SECONDS,
# MOVED_SECONDS, BENCH_SECONDS, OVERHEAD_SECONDS, HOST_SECONDS, COMPILED_SECONDS, DECODE_SECONDS; 0 skips the
# last two; BENCH_ARGS="--groups alibi,decode" runs some
# groups of benchmarks/gpu.py, OVERHEAD_ARGS="" drops the profile); a step cut by it is interrupted
# (SIGINT), so pytest still prints its summary and the benchmark still writes its JSON.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  || exit 1
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
summary() { grep -E "^(FAILED|ERROR)|passed|failed|error" "$1" | cut -c1-240 | tail -${2:-40}; }

echo "== 1. the triton kernels, compiled (tests/attention/test_triton*.py)"
QKV_TEST_DEVICE=cuda timeout -s INT "${TRITON_SECONDS:-90}" $PY -m pytest -q -p no:cacheprovider \
  -n 8 -rfE --tb=short tests/attention/test_triton_paged.py tests/attention/test_triton.py \
  tests/attention/test_triton_flex.py tests/attention/test_triton_plan.py \
  >"$OUT/gpu-triton-$gpu.log" 2>&1
summary "$OUT/gpu-triton-$gpu.log" 20

echo "== 2. tile sweep (benchmarks/triton_tiles.py; TILES_SECONDS=0 skips it)"
if [ "${TILES_SECONDS:-60}" != 0 ]; then
  timeout -s INT "${TILES_SECONDS:-60}" $PY benchmarks/triton_tiles.py \
    --out "$OUT/tiles-$gpu.json" 2>&1 | grep -v -i warn | tail -32
fi

echo "== 2b. flex tile sweep (benchmarks/triton_tiles.py --flex; FLEX_TILES_SECONDS=0 skips it)"
if [ "${FLEX_TILES_SECONDS:-60}" != 0 ]; then
  timeout -s INT "${FLEX_TILES_SECONDS:-60}" $PY benchmarks/triton_tiles.py --flex \
    --out "$OUT/flex-tiles-$gpu.json" 2>&1 | grep -v -i warn | tail -16
fi

echo "== 3. the CUDA subset (tests/cuda_subset.txt), CUDA as the default device"
QKV_TEST_DEVICE=cuda timeout -s INT "${TEST_SECONDS:-150}" $PY -m pytest -q -p no:cacheprovider \
  -n "${TEST_WORKERS:-12}" -rfE --tb=short $(grep -v -e test_triton -e _moved tests/cuda_subset.txt) \
  >"$OUT/gpu-tests-$gpu.log" 2>&1
summary "$OUT/gpu-tests-$gpu.log" 60

echo "== 3b. models moved to the GPU by hand: decoding, training, inspection, Whisper (tests/*/test_*_moved.py)"
QKV_TEST_DEVICE=cuda timeout -s INT "${MOVED_SECONDS:-60}" $PY -m pytest -q -p no:cacheprovider \
  -n 4 -rfEs --tb=short $(grep _moved tests/cuda_subset.txt) >"$OUT/gpu-moved-$gpu.log" 2>&1
summary "$OUT/gpu-moved-$gpu.log" 30

echo "== 4. benchmarks (benchmarks/gpu.py)"
timeout -s INT "${BENCH_SECONDS:-240}" $PY benchmarks/gpu.py --device cuda \
  --out "$OUT/gpu-$gpu.json" --max-seconds "$(( ${BENCH_SECONDS:-240} - 30 ))" ${BENCH_ARGS:-} \
  2>&1 | grep -v -i warn

echo "== 5. host time per decoding-size call (benchmarks/call_overhead.py)"
timeout -s INT "${OVERHEAD_SECONDS:-40}" $PY benchmarks/call_overhead.py --device cuda --calls 500 \
  ${OVERHEAD_ARGS:---profile} 2>&1 | grep -v -i warn | tee "$OUT/overhead-$gpu.log" | head -120
echo "== 5b. the host-side parts of a triton decoding step (benchmarks/triton_host.py: qkv's own, Triton's JIT)"
timeout -s INT "${HOST_SECONDS:-30}" $PY benchmarks/triton_host.py --calls 2000 2>&1 \
  | grep -v -i warn | tee "$OUT/triton-host-$gpu.log"

echo "== 6. compiled decoding on CUDA: CUDA graphs (tests/generate/test_compiled.py)"
if [ "${COMPILED_SECONDS:-60}" != 0 ]; then
  QKV_TEST_DEVICE=cuda timeout -s INT "${COMPILED_SECONDS:-60}" $PY -m pytest -q \
    -p no:cacheprovider -n 4 -rfEs --tb=short tests/generate/test_compiled.py \
    >"$OUT/gpu-compiled-$gpu.log" 2>&1
  summary "$OUT/gpu-compiled-$gpu.log" 20
fi
echo "== 7. ms a token: eager, CUDA graphs, compiled; transformers eager and static (decode_step.py)"
if [ "${DECODE_SECONDS:-90}" != 0 ]; then
  timeout -s INT "${DECODE_SECONDS:-90}" $PY benchmarks/decode_step.py --device cuda \
    --models gpt2-124m --modes eager,graphs,hf,compiled,hf-static --repeats 1 --steps 64 \
    --out "$OUT/decode-gpu-$gpu.json" 2>&1 | grep -v -i warn
fi
