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
	@if [ "$$(id -u)" = 0 ] && ! { ldconfig -p | grep -q librdmacm.so.1 && ldconfig -p | grep -q libibverbs.so.1; }; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null; fi
	$(BIN)/python -m pip install -q -e '.[test,nixl,mooncake]'
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
