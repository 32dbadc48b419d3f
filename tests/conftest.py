"""Ray settings that make local multi-node tests fast and stable; set before any `import ray`."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
