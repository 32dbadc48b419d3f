"""Ray settings that make local multi-node tests fast and stable; set before any `import ray`.
And a guard: no thread outlives its test module."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

THREAD_END_WAIT_S = 10.0  # for all of a module's threads together

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# embedded clusters run with token auth (kvfold.ray_env): one token for this process,
# set before anything imports Ray, since Ray's client reads it once at import
if not os.environ.get("RAY_AUTH_TOKEN"):
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = os.urandom(24).hex()
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="kvr", dir="/tmp"))


@pytest.fixture(scope="module", autouse=True)
def no_thread_outlives_its_module() -> Iterator[None]:
    """After each test module (each ends its own Ray cluster), nothing but the main thread
    runs in this process. A thread that uses Ray across a ray.shutdown() may reach into the
    core worker that shutdown freed (ray-project/ray#31145), and one left running into the
    interpreter's exit races its teardown: either can crash the process after every test
    has passed. This names the thread instead. Together they get THREAD_END_WAIT_S to
    finish what they were told to stop doing (a dropped controller's refresher ends once
    the controller is collected: collected first). Threads started outside Python (Ray's,
    gRPC's) are not Python's to join: their stand-ins are left out."""
    yield
    gc.collect()
    others = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread() and not isinstance(t, threading._DummyThread)
    ]
    deadline = time.monotonic() + THREAD_END_WAIT_S
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [f"{t.name} (target {getattr(t, '_target', None)!r})" for t in others if t.is_alive()]
    assert not alive, f"threads still running after the module's tests: {alive}"
