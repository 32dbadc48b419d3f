"""`kvfold demo` and `kvfold replay` configure the embedded cluster before Ray is
imported, so it runs with token auth (kvfold.ray_env): nothing on their path up to
`start_local_cluster` may import Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys
import kvfold.cluster as cluster

def stop_here(*args, **kwargs):
    print("ray imported" if "ray" in sys.modules else "ray not imported")
    raise SystemExit(0)

cluster.start_local_cluster = stop_here
from kvfold import cli
cli.main(sys.argv[1:])
"""


@pytest.mark.parametrize("command", ["demo", "replay", "compare", "bench-serve"])
def test_nothing_before_the_embedded_cluster_imports_ray(command: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    row = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}
    trace.write_text(json.dumps(row) + "\n")
    args = {
        "demo": ["demo"],
        "replay": ["replay", str(trace), "--schedulers", "2"],
        "compare": ["compare", str(trace), "--limit", "1"],
        "bench-serve": ["bench-serve", str(trace), "--limit", "1", "--arms", "round_robin"],
    }[command]
    res = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ray not imported" in res.stdout, res.stdout + res.stderr[-2000:]
