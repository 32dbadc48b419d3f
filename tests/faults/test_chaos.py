"""A replay through faults injected at seeded random times: ranks killed with and without
restart, a node actor killed, the aggregator killed, a node removed. The replay must
finish and account for every request; admission never over-commits; the view comes
back fresh (the removed node dead); counters never go backwards.

KVFOLD_CHAOS_SEED=N replays a failing run's schedule.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest

from kvfold.errors import KVFoldError
from kvfold.view import SourceState
from tests.faults.conftest import record
from tests.integration.conftest import wait_until
from tests.unit.builders import make_config

SEED = int(os.environ.get("KVFOLD_CHAOS_SEED", "7"))
CACHE = make_config(
    256,
    tokens_per_block=16,
    num_layers=1,
    num_kv_heads=1,
    head_dim=4,
    dtype="float16",
    device="auto",
)


@pytest.fixture(scope="module")
def deployment():  # type: ignore[no-untyped-def]
    from kvfold.cluster import launch, start_local_cluster

    cluster = start_local_cluster(num_nodes=3, gpus_per_node=2)
    try:
        kv = launch(
            6,
            2,
            cache=CACHE,
            host_num_blocks=64,
            report_interval_s=0.1,
            stale_after_s=0.3,
            dead_after_s=1.5,
        )
        try:
            kv.wait_until_fresh()
            yield cluster, kv
        finally:
            kv.shutdown()
    finally:
        cluster.shutdown()


def inject(cluster: Any, kv: Any, rnd: random.Random, log: list[str]) -> threading.Thread:
    """Start the faults, each at a seeded random time in the replay's first seconds."""
    import ray

    head = cluster.nodes[0].node_id
    removable = next(n for n in (2, 1) if kv.ray_node_ids[n] != head)
    ranks = [r for r in range(6) if kv.topology.node_of(r) != removable]
    restart_rank, kill_rank = rnd.sample(ranks, 2)
    node_actor = rnd.choice([n for n in range(3) if n != removable])
    faults = [
        (
            "rank killed, restarts",
            lambda: ray.kill(kv.rank_handles[restart_rank], no_restart=False),
        ),
        ("rank killed for good", lambda: ray.kill(kv.rank_handles[kill_rank], no_restart=True)),
        ("node actor killed, restarts", lambda: ray.kill(kv.node(node_actor), no_restart=False)),
        ("aggregator killed, restarts", lambda: ray.kill(kv.aggregator, no_restart=False)),
        (
            "node removed",
            lambda: cluster.remove_node(
                next(
                    i
                    for i, n in enumerate(cluster.nodes)
                    if n.node_id == kv.ray_node_ids[removable]
                )
            ),
        ),
    ]
    rnd.shuffle(faults)
    schedule = sorted(rnd.uniform(1.0, 8.0) for _ in faults)

    def run() -> None:
        t0 = time.monotonic()
        for at, (name, act) in zip(schedule, faults, strict=True):
            time.sleep(max(0.0, at - (time.monotonic() - t0)))  # the schedule, not a wait
            act()
            log.append(f"{time.monotonic() - t0:.1f}s {name}")

    thread = threading.Thread(target=run, name="chaos", daemon=True)
    thread.start()
    thread.removable = removable  # type: ignore[attr-defined]
    thread.gone_ranks = {kill_rank, *kv.topology.ranks_on(removable)}  # type: ignore[attr-defined]
    return thread


def test_a_replay_keeps_going_through_faults_and_accounts_for_every_request(deployment) -> None:  # type: ignore[no-untyped-def]
    from kvfold.replay.trace_replay import ReplayConfig, replay
    from kvfold.workload.requests import shared_prefix_workload

    cluster, kv = deployment
    rnd = random.Random(SEED)
    workload = shared_prefix_workload(num_requests=150, duration_s=10.0, seed=SEED)
    log: list[str] = []
    counters: list[int] = []

    chaos: list[threading.Thread] = []

    def watch(view: Any, rec: Any, wall: float) -> None:
        counters.append(view.counters.total.alloc_total_blocks)
        if not chaos:  # the replay is up: the faults start now
            chaos.append(inject(cluster, kv, rnd, log))

    t0 = time.monotonic()
    rec = replay(
        kv,
        workload,
        ReplayConfig(decode_tokens_per_s=40.0, time_scale=2.0, max_wall_s=300.0),
        on_sample=watch,
    )
    assert chaos, "the replay never sampled a view"
    chaos[0].join(timeout=30)
    took = time.monotonic() - t0
    s = rec.summary()
    context = f"seed {SEED}, faults {log}, summary {s}"
    assert len(log) == 5, context
    # none in limbo (a run takes 20-30 s on two cores; the wall limit stops a stuck one)
    assert s["completed"] + s["rejected"] + s["failed"] == 150, context
    assert s["overcommits"] == 0, context
    assert all(r for r in s["failures"]), context  # every failure says why
    assert sum(s["faults"].values()) > 0 and s["restarted"] > 0, context
    assert counters == sorted(counters), context  # never backwards, through every fault

    removable, gone = chaos[0].removable, chaos[0].gone_ranks  # type: ignore[attr-defined]

    def settled() -> object:
        try:
            v = kv.view()
        except KVFoldError:
            return False
        states = v.rank_states()
        live = all(states[r] is SourceState.FRESH for r in range(6) if r not in gone)
        return live and v.node_states[removable] is SourceState.DEAD and v

    t1 = time.monotonic()
    wait_until(settled, timeout_s=90)
    record(
        "chaos replay",
        replay_s=took,
        settled_s=time.monotonic() - t1,
        restarted=float(s["restarted"]),
        failed=float(s["failed"]),
    )
