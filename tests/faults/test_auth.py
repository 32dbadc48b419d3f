"""The embedded cluster is closed to the network: it listens on loopback only (or, where
anything listens beyond it, token auth is on), and a client without its token is refused."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

# the default embedded cluster, as `kvfold demo` starts it: nothing about auth is set
SERVER = r"""
import sys
from kvfold.cluster import launch, start_local_cluster
c = start_local_cluster(2, 1, namespace="kvfold")
kv = launch(2, 1)
print(c.address, c.token_path, flush=True)
sys.stdin.read()  # until the test closes our stdin
kv.shutdown(); c.shutdown()
"""


def env(kvfold_home: Path, drop: tuple[str, ...] = ()) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", *drop))}
    e.update(KVFOLD_HOME=str(kvfold_home))
    return e


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening(root: psutil.Process) -> list[tuple[str, int, str, bool]]:
    """(ip, port, process name, token auth on) of every listening socket of the tree."""
    out = []
    procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for conn in psutil.net_connections(kind="inet"):
        p = procs.get(conn.pid) if conn.pid is not None else None
        if p is None or conn.status != psutil.CONN_LISTEN:
            continue
        try:
            token = p.environ().get("RAY_AUTH_MODE") == "token"
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        out.append((conn.laddr.ip, conn.laddr.port, name, token))
    return out


def stop_tree(root: psutil.Process) -> None:
    """End `root` and every process under it, by PID: a start that hung leaves Ray's behind."""
    procs = [root]
    with contextlib.suppress(psutil.NoSuchProcess):
        procs += root.children(recursive=True)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)


def start_server(
    script: str,
    kvfold_home: Path,
    fields: int,
    *,
    up_within_s: float = 120.0,
    drop: tuple[str, ...] = (),
) -> tuple[Any, list[str]]:
    """Run `script` (an embedded cluster) in its own process, its stderr to a file beside
    its KVFOLD_HOME and `drop`ped variables out of its environment; return the process
    and the fields of the line it prints when up (within `up_within_s`, or the test fails)."""
    log = kvfold_home.parent / f"{kvfold_home.name}.err"
    server = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=env(kvfold_home, drop),
    )
    assert server.stdout is not None  # stdout=PIPE
    ready, _, _ = select.select([server.stdout], [], [], up_within_s)
    line = server.stdout.readline().split() if ready else []
    if len(line) != fields:
        stop_tree(psutil.Process(server.pid))
        server.wait(timeout=30)
        why = "printed " + repr(line) if ready else f"was not up within {up_within_s:.0f} s"
        pytest.fail(f"the embedded cluster {why}: {log.read_text()[-1500:]}")
    return server, line


def test_embedded_cluster_listens_on_loopback_with_token_auth(tmp_path: Path) -> None:
    home, stranger_home = tmp_path / "owner", tmp_path / "stranger"
    server, (address, token_path) = start_server(SERVER, home, 2)
    try:
        assert Path(token_path).is_file() and Path(token_path).stat().st_mode & 0o077 == 0
        sockets = listening(psutil.Process(server.pid))
        assert len(sockets) >= 3  # the GCS, two raylets at least
        exposed = [s for s in sockets if not is_loopback(s[0]) and not s[3]]
        assert not exposed, f"listening beyond loopback without token auth: {exposed}"
        assert all(is_loopback(ip) for ip, *_ in sockets), sockets  # and in fact loopback only
        ray_procs = [s for s in sockets if s[2] in ("gcs_server", "raylet")]
        assert ray_procs and all(s[3] for s in ray_procs)  # token auth on for the cluster

        status = [sys.executable, "-m", "kvfold.cli", "status", "--json", "--address", address]
        # the owner's `kvfold status` finds the token the cluster saved for its address
        owner = subprocess.run(status, capture_output=True, text=True, env=env(home), timeout=120)
        assert owner.returncode == 0, owner.stderr[-1500:]
        assert json.loads(owner.stdout)["world_size"] == 2
        # so does anyone handed the token file
        handed = subprocess.run(
            [*status, "--auth-token-file", token_path],
            capture_output=True,
            text=True,
            env=env(stranger_home),
            timeout=120,
        )
        assert handed.returncode == 0, handed.stderr[-1500:]
        # without it, the cluster refuses the client, and kvfold says why
        refused = subprocess.run(
            status, capture_output=True, text=True, env=env(stranger_home), timeout=180
        )
        assert refused.returncode != 0
        assert "InvalidAuthToken" in refused.stderr, refused.stderr[-1500:]  # Ray's own words
        assert "refused this client: pass --auth-token-file" in refused.stderr
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=60)
    assert not Path(token_path).exists()  # the cluster's token goes with it


# a process that imported Ray before kvfold configured it, in an environment that says
# nothing about Ray: Ray read its settings at import (on Linux: advertise the machine's
# external address; no token auth), and the embedded cluster must still come up, closed
SERVER_RAY_FIRST = r"""
import ray  # the first line of most Ray programs
import sys
from kvfold.cluster import launch, start_local_cluster
c = start_local_cluster(1, 1)
kv = launch(1, 1)
assert ray.get(ray.remote(lambda: 1 + 1).remote()) == 2
print(c.address, c.token_path, kv.view().world_size, flush=True)
sys.stdin.read()  # until the test closes our stdin
kv.shutdown(); c.shutdown()
"""


def test_ray_imported_first_comes_up_closed_and_goes_away(tmp_path: Path) -> None:
    home = tmp_path / "owner"
    start_s = time.monotonic()
    server, (address, token_path, world_size) = start_server(
        SERVER_RAY_FIRST, home, 3, drop=("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",)
    )
    up_s = time.monotonic() - start_s
    root = psutil.Process(server.pid)
    tree = [root, *root.children(recursive=True)]
    try:
        assert address.startswith("127.0.0.1:") and world_size == "1"
        assert Path(token_path).is_file() and Path(token_path).stat().st_mode & 0o077 == 0
        sockets = listening(root)
        assert len(sockets) >= 2  # the GCS and the raylet at least
        assert all(is_loopback(ip) for ip, *_ in sockets), sockets
        ray_procs = [s for s in sockets if s[2] in ("gcs_server", "raylet")]
        assert ray_procs and all(s[3] for s in ray_procs)  # token auth on for the cluster
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stop_tree(root)
            raise
    total_s = time.monotonic() - start_s
    assert server.returncode == 0, (tmp_path / "owner.err").read_text()[-1500:]
    _, alive = psutil.wait_procs(tree, timeout=30)  # everything the cluster started ends
    assert not alive, alive
    assert not Path(token_path).exists()
    print(f"ray imported first: up in {up_s:.1f} s, down after {total_s:.1f} s")
