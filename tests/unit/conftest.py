"""Unit tests run no Ray: ray.init is forbidden here."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = sys.modules.get("ray")
    if ray is not None:

        def refuse(*a: object, **k: object) -> None:
            raise AssertionError("unit tests must not start Ray")

        monkeypatch.setattr(ray, "init", refuse)
