"""The Ray runtime on 3 simulated nodes of 4 GPUs, world size 10 (a partial last node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvfold.errors import PlacementError
from kvfold.stats import SequenceStatus
from kvfold.view import SourceState
from kvfold.worker import KVCacheConfig
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration

CACHE = KVCacheConfig(
    tokens_per_block=4,
    num_blocks=64,
    windows=(None, 8),
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    device="auto",
)
HOST_BLOCKS = 16


@pytest.fixture(scope="module")
def kv(local_cluster):  # type: ignore[no-untyped-def]
    from kvfold.cluster import launch

    deployment = launch(10, 4, cache=CACHE, host_num_blocks=HOST_BLOCKS)
    yield deployment
    deployment.shutdown()


def test_view_has_three_nodes_of_4_4_2_all_fresh(kv) -> None:  # type: ignore[no-untyped-def]
    view = kv.wait_until_fresh()
    assert [n.num_ranks_expected for n in view.nodes] == [4, 4, 2]
    assert [(n.rank_start, n.rank_end) for n in view.nodes] == [(0, 4), (4, 8), (8, 10)]
    assert all(s is SourceState.FRESH for s in view.node_states)
    assert view.stale_ranks == view.dead_ranks == view.missing_ranks == ()
    # GPU: 10 ranks x 2 windows x 64 blocks; host: 3 nodes x 16, once per node, not per rank
    assert view.gpu_total.num_blocks_total == 10 * 2 * 64
    assert view.host.num_blocks_total == 3 * HOST_BLOCKS
    for n in view.nodes:
        assert n.host is not None and n.host.num_blocks_total == HOST_BLOCKS
    # each rank sits on the Ray node its node actor is pinned to
    for r in (0, 5, 9):
        info = kv.rank(r).info()
        assert info["node"] == kv.topology.node_of(r)
        assert info["ray_node_id"] == kv.ray_node_ids[info["node"]]


def test_a_node_pushes_once_a_round_of_its_ranks_is_in(kv) -> None:  # type: ignore[no-untyped-def]
    """Ranks report on their node's phase, and the node pushes once each has reported: about
    one push per interval, not one per rank report (node 0 has 4 ranks; before, 3.5)."""
    import ray

    kv.wait_until_fresh()
    node, ranks = kv.node_handles[0], kv.rank_handles[:4]

    def seqs() -> list[int]:
        return [info["seq"] for info in ray.get([h.info.remote() for h in ranks])]

    seq0, pushes0 = seqs(), ray.get(node.counts.remote())["pushes"]
    wait_until(lambda: min(s - s0 for s, s0 in zip(seqs(), seq0, strict=True)) >= 20, timeout_s=60)
    pushes = ray.get(node.counts.remote())["pushes"] - pushes0
    rounds = max(s - s0 for s, s0 in zip(seqs(), seq0, strict=True))
    # a rank late for its round (a busy machine) makes the node push half an interval on:
    # at most two pushes per interval, never one per rank
    assert pushes <= 2 * rounds + 2, (pushes, rounds)


def test_sequences_show_up_with_exact_block_counts(kv) -> None:  # type: ignore[no-untyped-def]
    before = kv.view()
    # rank 1: 10 tokens -> full: ceil(10/4) = 3; window 8: blocks meeting [2, 10) = 0..2 -> 3
    # rank 5: 17 tokens -> full: 5; window 8: [9, 17) -> blocks 2..4 -> 3
    # rank 9: 16 tokens -> full: 4; window 8: [8, 16) -> blocks 2..3 -> 2
    plan = {1: (10, 3, 3), 5: (17, 5, 3), 9: (16, 4, 2)}
    t0 = time.monotonic()
    for r, (n, _, _) in plan.items():
        assert kv.rank(r).add_sequence(f"seq-{r}", list(range(1000 * r, 1000 * r + n)), report=True)

    def visible():  # type: ignore[no-untyped-def]
        v = kv.wait_for_version(before.version, timeout_s=1.0) or kv.view()
        ok = all(
            v.rank_summary(r)[0].gpu[None].num_blocks_used == full  # type: ignore[index]
            for r, (_, full, _) in plan.items()
        )
        return v if ok else None

    view = wait_until(visible, timeout_s=60)
    latency_s = time.monotonic() - t0
    for r, (_, full, win) in plan.items():
        summary, node_state = view.rank_summary(r)
        assert node_state is SourceState.FRESH
        assert summary.gpu[None].num_blocks_used == full
        assert summary.gpu[8].num_blocks_used == win
        assert summary.num_valid_sequences == 1
    node1, node2 = view.nodes[1], view.nodes[2]
    assert node1.gpu[None].num_blocks_used == 5 and node1.gpu[8].num_blocks_used == 3
    assert node2.gpu_total.num_blocks_used == 4 + 2
    assert view.nodes[0].gpu_total.num_blocks_used == 3 + 3
    assert view.gpu_total.num_blocks_used == (3 + 3) + (5 + 3) + (4 + 2)
    assert view.num_sequences_by_status[SequenceStatus.IN_PREFILL] == 3
    assert view.counters.total.missed_blocks == 3 + 3 + 5 + 3 + 4 + 2
    print(f"change visible after {latency_s * 1000:.0f} ms")
    for r in plan:
        kv.rank(r).free_sequence(f"seq-{r}", report=True)
    wait_until(lambda: kv.view().gpu_total.num_blocks_used == 0)


def test_second_driver_and_status_json(kv, local_cluster) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ)
    code = (
        "import json, sys\n"
        "from kvfold.aggregator.client import KVFoldClient\n"
        f"c = KVFoldClient(address={local_cluster.address!r}, namespace={kv.namespace!r})\n"
        "v = c.view()\n"
        "print(json.dumps([v.world_size, [n.num_ranks_expected for n in v.nodes],\n"
        "                  v.gpu_total.num_blocks_total, v.host.num_blocks_total]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [10, [4, 4, 2], 1280, 48]

    cli = [
        sys.executable,
        "-m",
        "kvfold.cli",
        "status",
        "--json",
        "--address",
        local_cluster.address,
        "--namespace",
        kv.namespace,
    ]
    out = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    assert status["world_size"] == 10
    assert [n["num_ranks_expected"] for n in status["nodes"]] == [4, 4, 2]
    assert status["totals"]["gpu"]["num_blocks_total"] == 1280


def test_too_many_gpus_fails_in_time_and_leaves_nothing(kv) -> None:  # type: ignore[no-untyped-def]
    import ray

    from kvfold.cluster import launch

    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"missing \d+ GPU") as e:
        launch(20, 4, cache=CACHE, namespace="too-big", placement_timeout_s=3.0)
    assert time.monotonic() - t0 < 120  # fails (placement timeout 3 s), never hangs
    assert "20 ranks" in str(e.value)
    names = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "too-big"
    ]
    assert names == []
    pending = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
    assert len(pending) == 1  # only the running deployment's group
    assert kv.view().gpu_total.num_blocks_total == 1280  # the running one is untouched


def test_up_status_top_down_from_other_processes(kv, local_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import ray

    cli = [sys.executable, "-m", "kvfold.cli"]
    where = ["--address", local_cluster.address, "--namespace", "kv-up"]
    env = dict(os.environ)
    up = subprocess.run(
        [
            *cli,
            "up",
            *where,
            "--world-size",
            "2",
            "--gpus-per-node",
            "4",
            "--num-blocks",
            "32",
            "--host-blocks",
            "0",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert up.returncode == 0, up.stderr[-2000:]
    assert "kvfold is up in namespace 'kv-up'" in up.stdout
    # detached: still there after the `up` process exited
    names = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "kv-up"
    }
    assert {"kvfold:aggregator", "kvfold:rank:0", "kvfold:rank:1"} <= names
    top = subprocess.run(
        [*cli, "top", *where, "--iterations", "2", "--interval", "0.2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert top.returncode == 0, top.stderr[-2000:]
    assert "cluster v" in top.stdout
    again = subprocess.run(
        [*cli, "up", *where, "--world-size", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 2 and "already running" in again.stderr
    # replay a trace on the kvfold that `up` started, from yet another process; it stays up
    trace = tmp_path / "tiny.jsonl"
    rows = [{"timestamp": 10 * i, "input_length": 100, "output_length": 3,
             "hash_ids": [i % 2]} for i in range(6)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replayed = subprocess.run(
        [*cli, "replay", str(trace), *where, "--time-scale", "20", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    summary = json.loads((tmp_path / "replay-tiny.json").read_text())
    assert (summary["admitted"], summary["completed"], summary["overcommits"]) == (6, 6, 0)
    assert {"kvfold:aggregator", "kvfold:rank:0"} <= {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "kv-up"
    }
    down = subprocess.run(
        [*cli, "down", *where], capture_output=True, text=True, env=env, timeout=120
    )
    assert down.returncode == 0, down.stderr[-2000:]
    assert "kvfold:aggregator" in down.stdout
    wait_until(
        lambda: (
            not [
                a
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "kv-up"
            ]
        ),
        timeout_s=60,
    )
    status = subprocess.run(
        [*cli, "status", *where], capture_output=True, text=True, env=env, timeout=120
    )
    assert status.returncode == 2 and "no kvfold aggregator" in status.stderr
    assert kv.view().world_size == 10  # the other deployment is untouched
