"""Fault tests: each module gets its own local cluster; timings go to KVFOLD_FAULT_LOG."""

from __future__ import annotations

import json
import os
import time

import pytest


def record(fault: str, **figures: float) -> None:
    """Append one fault's measured figures (seconds) for docs/reliability.md."""
    print(f"{fault}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    path = os.environ.get("KVFOLD_FAULT_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"fault": fault, "at": time.time(), **figures}) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)
