# p2p-diloco: one-command set-up, demo and tests.
#   make demo   - a local swarm (bootstrap node + 3 peers) that trains for about 2 minutes on CPU
#   make test   - the whole test suite (unit + integration with real hivemind DHTs)
# Both create .venv if it is missing and install torch first, then the project.
# GPU users: make demo TORCH_VERSION=2.5.1 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.p2p-diloco-installed

.PHONY: demo test test-unit test-integration lint bench-overhead clean install

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/p2p-diloco swarm

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=20 tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q -ra tests/integration

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench-overhead: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
