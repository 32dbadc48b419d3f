"""Ray settings that make local multi-node tests fast and stable; set before any `import ray`."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# embedded clusters run with token auth (kvfold.ray_env): one token for this process,
# set before anything imports Ray, since Ray's client reads it once at import
if not os.environ.get("RAY_AUTH_TOKEN"):
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = os.urandom(24).hex()
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
