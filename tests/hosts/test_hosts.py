"""kvfold across separate network hosts on this machine (tests/hosts/harness.py): three
Linux network namespaces on a bridge, a Ray head on host 0 and a Ray node with two GPUs
(logical) on hosts 1 and 2, token authentication on everywhere. kvfold is started across
them with `kvfold up` from host 0 (a rank per GPU, a node actor and host tier per host,
the aggregator on the head) and read with `kvfold status` from host 1.

Needs root for network namespaces (CI has it); where a machine forbids them, each test
says so in one line and skips."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.hosts.harness import RAY_PORT, Hosts, RayHost, namespaces_allowed, wait_for

pytestmark = pytest.mark.integration

WHY_NOT = namespaces_allowed()
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NAMESPACE = "kvfold-hosts"
GPUS_PER_HOST = 2
WORKERS = 2  # hosts 1 and 2; host 0 holds the head
# Ray declares a silent node dead after health_check_failure_threshold missed checks of
# health_check_period_ms (Ray's defaults: 5 x 3 s); shorter here, so a cut is seen in time
RAY_HEAD_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "5",
}


@dataclass
class Cluster:
    hosts: Hosts
    nodes: list[RayHost]
    token: str

    @property
    def address(self) -> str:
        return f"{self.hosts.address(0)}:{RAY_PORT}"

    def kvfold(
        self, i: int, *args: str, token: str | None = None, timeout_s: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        """`kvfold ARGS --address HEAD --namespace kvfold-hosts` run from host i."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(REPO))
        if token is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        where = ["--address", self.address, "--namespace", NAMESPACE]
        argv = ["ip", "netns", "exec", self.hosts.names[i], str(BIN / "python"), "-m",
                "kvfold.cli", *args, *where]  # fmt: skip
        return subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO
        )

    def status(self, i: int = 1) -> dict[str, Any]:
        done = self.kvfold(i, "status", "--json", token=self.token)
        assert done.returncode == 0, done.stderr[-3000:]
        return dict(json.loads(done.stdout))


@dataclass
class Watch:
    """tests/hosts/watch_loop.py running on host 1: a scheduler loop's record, a line a step."""

    log: Path

    def lines(self) -> list[dict[str, Any]]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        out = []
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the last line, half written
        return out

    def steps(self, after: float = 0.0) -> list[dict[str, Any]]:
        return [x for x in self.lines() if "t" in x and x["t"] > after]

    def node_of_host(self, ip: str) -> int:
        first = next(x for x in self.lines() if "hosts" in x)
        return next(int(n) for n, addr in first["hosts"].items() if addr == ip)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    token = os.urandom(24).hex()
    with Hosts(1 + WORKERS) as hosts:
        head = RayHost(hosts, 0, token, env=dict(RAY_HEAD_ENV))
        head.start(str(BIN / "ray"))
        nodes = [head]
        for i in range(1, 1 + WORKERS):
            node = RayHost(hosts, i, token, head=f"{hosts.address(0)}:{RAY_PORT}",
                           num_gpus=GPUS_PER_HOST)  # fmt: skip
            node.start(str(BIN / "ray"))
            nodes.append(node)
        c = Cluster(hosts, nodes, token)
        up = c.kvfold(0, "up", "--world-size", str(WORKERS * GPUS_PER_HOST),
                      "--gpus-per-node", str(GPUS_PER_HOST), "--host-blocks", "64",
                      "--num-blocks", "256", token=token)  # fmt: skip
        assert up.returncode == 0, up.stderr[-3000:] + "\n" + head.log_tail()
        try:
            yield c
        finally:
            c.kvfold(0, "down", token=token)


@pytest.fixture(scope="module")
def watch(cluster: Cluster) -> Iterator[Watch]:
    log = Path(cluster.nodes[1].temp_dir or "/tmp") / "watch_loop.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=cluster.token, PYTHONPATH=str(REPO),
               RAY_USAGE_STATS_ENABLED="0")  # fmt: skip
    proc = cluster.hosts.run(
        1, [str(BIN / "python"), str(REPO / "tests" / "hosts" / "watch_loop.py"),
            "--address", cluster.address, "--namespace", NAMESPACE], env=env, log=log,
    )  # fmt: skip
    w = Watch(log)

    def all_fresh() -> bool:
        steps = w.steps()
        return bool(steps) and len(steps[-1].get("fresh_ranks", [])) == WORKERS * GPUS_PER_HOST

    wait_for(all_fresh, 120, f"the scheduler loop on host 1 sees every rank fresh ({log})")
    yield w
    from tests.hosts.harness import end_group

    end_group(proc)


def test_kvfold_runs_across_the_hosts_and_another_host_reads_it(cluster: Cluster) -> None:
    def fresh() -> dict[str, Any] | None:
        view = cluster.status(1)
        ranks = [r for n in view["nodes"] for r in n["ranks"]]
        return view if ranks and all(r["state"] == "fresh" for r in ranks) else None

    view: Any = wait_for(fresh, 60, "every rank fresh, read from host 1")
    assert len(view["nodes"]) == WORKERS, view
    assert sorted(r["rank"] for n in view["nodes"] for r in n["ranks"]) == list(range(4))


def test_a_driver_without_the_token_is_refused(cluster: Cluster) -> None:
    t0 = time.monotonic()
    done = cluster.kvfold(2, "status", "--json", token=None, timeout_s=120)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "auth" in (done.stdout + done.stderr).lower(), done.stderr[-2000:]
    assert time.monotonic() - t0 < 120


def _checked(lines: list[dict[str, Any]], cut_node: int, ranks_of_cut: set[int]) -> None:
    """What holds at every line of the scheduler loop's record, whatever the faults:
    - no decision admits onto a rank its view does not count fresh, nor onto the cut
      host's ranks while its node is not fresh;
    - every request that ended either completed or failed naming its rank;
    - the cluster's counters never go backwards, view after view;
    - the view's GPU total is the sum over its fresh ranks (nothing counted twice,
      nothing stale or dead counted)."""
    last: dict[str, float] = {}
    for x in lines:
        if x.get("kind") == "step" and "decision" in x:
            d = x["decision"]
            if d["outcome"] == "admit":
                assert d["rank"] in x["fresh_ranks"], x
                if x["nodes"].get(str(cut_node)) != "fresh":
                    assert d["rank"] not in ranks_of_cut, x
            for _rid, how in x["ended"]:
                assert how == "completed" or (how.startswith("failed: ") and "rank" in how), how
        if x.get("kind") == "view" and "counters" in x:
            for name, value in x["counters"].items():
                if isinstance(value, int):
                    assert value >= last.get(name, 0), (name, value, last.get(name), x["t"])
                    last[name] = value
            assert x["gpu_total"] == sum(x["gpu_by_rank"].values()), x


BRIEF_CUT_S = 1.5  # longer than kvfold's stale-after (0.3 s), shorter than its dead-after (3 s)


def test_a_brief_cut_makes_the_host_stale_and_it_comes_back(cluster: Cluster, watch: Watch) -> None:
    """Host 2's link cut for BRIEF_CUT_S, then restored: its node is stale (not dead) in the
    view while cut, no decision counts its capacity, and it comes back fresh, the same Ray
    node (Ray's health checks give up after 5 s here)."""
    node = watch.node_of_host(cluster.hosts.address(2))
    view = cluster.status(1)
    ranks_of_cut = {r["rank"] for r in view["nodes"][node]["ranks"]}
    t_cut = time.time()
    cluster.hosts.cut(2)
    try:
        time.sleep(BRIEF_CUT_S)  # the fault's own length, not a wait for a condition
    finally:
        cluster.hosts.heal(2)
    t_heal = time.time()

    def views(after: float) -> list[dict[str, Any]]:
        return [x for x in watch.steps(after) if x.get("kind") == "view" and "nodes" in x]

    def fresh_again() -> bool:
        v = views(t_heal)
        return bool(v) and ranks_of_cut <= set(v[-1]["fresh_ranks"])

    wait_for(fresh_again, 60, f"node {node} (host 2) fresh again after its link came back")
    during = [x for x in views(t_cut) if x["t"] < t_heal]
    states = [x["nodes"][str(node)] for x in during]
    assert "stale" in states, states  # seen stale while cut
    t_stale = next(x["t"] for x in during if x["nodes"][str(node)] != "fresh") - t_cut
    t_back = next(x["t"] for x in views(t_heal) if ranks_of_cut <= set(x["fresh_ranks"])) - t_heal
    _checked(watch.lines(), node, ranks_of_cut)
    print(
        f"brief cut of {BRIEF_CUT_S} s: host 2's node {node} stale {t_stale:.2f} s after the "
        f"cut (states seen: {sorted(set(states))}), fresh {t_back:.2f} s after the heal"
    )


def _listeners(hosts: Hosts, i: int) -> list[tuple[str, int, int, str]]:
    """Every listening TCP socket in host i: (address, port, pid, process)."""
    import psutil

    done = subprocess.run(["ip", "netns", "exec", hosts.names[i], "ss", "-ltnpH"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    out = []
    for line in done.stdout.splitlines():
        parts = line.split()
        local = parts[3]
        addr, port = local.rsplit(":", 1)
        for pid in (int(p) for p in re.findall(r"pid=(\d+)", line)):
            try:
                name = " ".join(psutil.Process(pid).cmdline())[:60]
            except psutil.Error:
                name = "?"
            out.append((addr.strip("[]"), int(port), pid, name))
    return out


KVFOLD_ACTORS = ("ray::ClusterAggregator", "ray::RankWorker", "ray::HostKVActor",
                 "ray::EngineRankActor", "ray::RackActor", "ray::DoorActor")  # fmt: skip


def test_nothing_kvfold_starts_listens_beyond_what_ray_opens(cluster: Cluster) -> None:
    """Every listening socket on every host, by process. What listens beyond loopback is
    Ray's own (GCS, raylet, its agents, Ray Client on the head, each worker's gRPC server);
    a process that holds a kvfold actor listens there on one port only, its Ray worker's:
    kvfold itself opens nothing another host could reach (its metrics endpoint, off here,
    binds 127.0.0.1 unless told otherwise)."""
    seen = []
    for i in range(1 + WORKERS):
        wide: dict[int, list[tuple[str, int]]] = {}
        for addr, port, pid, name in _listeners(cluster.hosts, i):
            seen.append((i, addr, port, name.split()[0]))
            if addr.removeprefix("::ffff:").startswith("127.") or addr == "::1":
                continue
            if name.startswith(KVFOLD_ACTORS):
                wide.setdefault(pid, []).append((addr, port))
        for pid, socks in wide.items():
            assert len(socks) == 1, (i, pid, socks)  # its Ray worker's gRPC server alone
    actors = {row[3] for row in seen if row[3].startswith(KVFOLD_ACTORS)}
    assert {"ray::ClusterAggregator", "ray::RankWorker", "ray::HostKVActor"} <= actors, seen
