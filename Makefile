# r3store: `make serve` runs the service on the embedded store, `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

# torch: the small CPU build pinned here (the package itself asks only for a range a
# CUDA build satisfies); transformers for the replay tests on tiny HF MoE models.
$(STAMP): pyproject.toml
	@(ls /usr/lib/postgresql/*/bin/initdb && command -v kubectl) >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql kubectl)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,torch]' 'transformers==5.24.0'
	touch $(STAMP)

serve: setup
	$(VENV)/bin/r3store-server

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest

bench: setup
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
