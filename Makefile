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
# make test runs two tests at a time (pytest-xdist, --dist worksteal; the longest first and the mixed-split test
# alone: tests/conftest.py): 22-27 min of pytest on 2 busy cores (BENCHMARKS.md, "The test suite on 2 busy cores").
# TEST_WORKERS=0 runs them one after the other (about 25 min there before the cuts that brought two at a time
# under 20 min)
TEST_WORKERS ?= 2

.PHONY: demo test test-unit test-integration lint bench-overhead bench-quick clean install

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

# --tb=native: pytest's own tracebacks parse each frame's source with ast, and on CPython 3.11 a failing test whose
# report ran while a leaked object's __del__ raised (an asyncio subprocess transport after its loop closed) made that
# parse raise SystemError ("AST constructor recursion depth mismatch"): the worker crashed and the run stopped with
# 230 tests not run (a fresh-clone run at 927243c). Native tracebacks show the same frames and assertion messages.
test: $(STAMP)
	$(PY) -m pytest -q -ra --tb=native --durations=50 -n $(TEST_WORKERS) --dist worksteal tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q -ra tests/integration

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench-overhead: $(STAMP)
	$(PY) benchmarks/overhead.py

# The cheap benchmarks, rerun and recorded in benchmarks/results/quick/<name>/report.txt with the commit and the
# command (benchmarks/record.py): peer overhead, pipeline P=2 vs P=1, the plan of the paper's setting, compression
# bytes, learning quality --quick. Under 15 minutes on 2 cores.
RECORD := $(PY) benchmarks/record.py
bench-quick: $(STAMP)
	$(RECORD) quick/overhead -- $(PY) benchmarks/overhead.py --steps 200 --repeats 3
	$(RECORD) quick/pipeline -- $(PY) benchmarks/pipeline.py --steps 20 --repeats 1
	$(RECORD) quick/plan -- $(VENV)/bin/p2p-diloco plan --paper
	$(RECORD) quick/compression-bytes -- $(PY) benchmarks/compression.py --only bytes --out runs/bench-quick/compression
	$(RECORD) quick/quality -- $(PY) benchmarks/quality.py --quick --rows alone,none/none,delayed/adaptive \
		--jobs 2 --eval-batches 32 --out benchmarks/results/quick/quality

clean:
	rm -rf $(VENV) runs .pytest_cache
