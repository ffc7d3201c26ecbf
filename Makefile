# Two commands matter: `make demo` (the main job) and `make test` (the suite CI runs).
# Both create .venv and install what they need; torch is pinned to the CPU build 2.13.0.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test verify bench plan clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvbridge demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

verify: $(STAMP)
	$(BIN)/kvbridge verify --cases 500

bench: $(STAMP)
	$(BIN)/kvbridge bench

plan: $(STAMP)
	$(BIN)/kvbridge plan llama-3-8b --prefill-tp 4 --decode-tp 2

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks
