"""Ray token authentication: a client without the cluster's token is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SERVER = r"""
import os, sys, time
from kvfold.cluster import launch, start_local_cluster
c = start_local_cluster(1, 1, namespace="kvfold")
kv = launch(1, 1)
print(c.address, flush=True)
sys.stdin.read()  # until the test closes our stdin
kv.shutdown(); c.shutdown()
"""


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    e.update(extra)
    return e


def test_client_without_token_is_refused(tmp_path: Path) -> None:
    token = "kvfold-test-token-" + os.urandom(8).hex()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    secured = env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=secured,
    )
    try:
        address = server.stdout.readline().strip()  # type: ignore[union-attr]
        if not address:
            pytest.fail("the token-secured cluster did not start")
        status = [sys.executable, "-m", "kvfold.cli", "status", "--json", "--address", address]
        ok = subprocess.run(
            [*status, "--auth-token-file", str(token_file)],
            capture_output=True,
            text=True,
            env=env(),
            timeout=120,
        )
        assert ok.returncode == 0, ok.stderr[-1500:]
        assert '"world_size": 1' in ok.stdout
        t0 = time.monotonic()
        refused = subprocess.run(
            status, capture_output=True, text=True, env=env(RAY_AUTH_MODE="disabled"), timeout=180
        )
        took = time.monotonic() - t0
        assert refused.returncode != 0
        assert "kvfold status" in refused.stderr or "onnection" in refused.stderr
        print(f"unauthenticated client refused after {took:.1f} s")
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=60)
