"""Admission over the live cluster, a real-trace replay, and the Prometheus endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfold.stats import window_label
from kvfold.worker import KVCacheConfig
from tests.integration.conftest import running, wait_until
from tests.traces import MOONCAKE

pytestmark = pytest.mark.integration

CACHE = KVCacheConfig(
    tokens_per_block=64,
    num_blocks=2048,
    num_layers=1,
    num_kv_heads=1,
    head_dim=8,
    dtype="float16",
    device="auto",
)


@pytest.fixture(scope="module")
def kv():  # type: ignore[no-untyped-def]
    with running(2, 2, 4, cache=CACHE, host_num_blocks=256, metrics_port=0) as (_, deployment):
        yield deployment


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_endpoint_is_local_and_matches_the_view(kv) -> None:  # type: ignore[no-untyped-def]
    url = kv.client.metrics_url()
    assert url.startswith("http://127.0.0.1:")
    assert kv.rank(1).add_sequence("m1", list(range(300)), report=True)  # ceil(300/64) = 5
    wait_until(lambda: kv.view().gpu_total.num_blocks_used == 5)
    view = kv.view()
    m = scrape(url)
    for n in view.nodes:
        for w, g in n.gpu.items():
            key = (("node", str(n.node)), ("state", "used"), ("window", window_label(w)))
            assert m["kvfold_gpu_blocks"][key] == g.num_blocks_used
            cap = (("node", str(n.node)), ("window", window_label(w)))
            assert m["kvfold_gpu_capacity_blocks"][cap] == g.num_blocks_total
            assert m["kvfold_gpu_committed_blocks"][cap] == g.num_blocks_committed
        assert m["kvfold_host_blocks"][(("node", str(n.node)), ("state", "free"))] == 256
        assert m["kvfold_rank_refused_placements"][(("node", str(n.node)),)] == 0
        fresh = (("node", str(n.node)), ("state", "fresh"))
        assert m["kvfold_ranks"][fresh] == 2
    missed = m["kvfold_blocks_total"][(("kind", "missed"), ("node", "0"), ("window", "full"))]
    assert missed == view.nodes[0].counters.total.missed_blocks >= 5
    kv.rank(1).free_sequence("m1", report=True)


def test_counters_never_go_backwards_across_a_rank_restart(kv) -> None:  # type: ignore[no-untyped-def]
    import ray

    url = kv.client.metrics_url()
    key = (("kind", "alloc_new"), ("node", "1"), ("window", "full"))
    assert kv.rank(3).add_sequence("c1", list(range(1000, 1640)), report=True)  # 10 blocks
    wait_until(lambda: scrape(url)["kvfold_blocks_total"].get(key, 0) >= 10)
    before = scrape(url)["kvfold_blocks_total"][key]
    old = kv.rank(3).info()["incarnation"]
    ray.kill(kv.rank_handles[3], no_restart=False)  # a crash; Ray restarts it
    wait_until(lambda: _incarnation(kv, 3) not in (None, old), timeout_s=60)
    wait_until(lambda: kv.view().rank_summary(3)[0].incarnation not in (0, old), timeout_s=60)
    after = scrape(url)["kvfold_blocks_total"][key]
    assert after >= before  # the new incarnation starts from 0; the node keeps the sum
    assert kv.rank(3).stats().total.num_blocks_used == 0  # a restarted rank is empty
    assert kv.rank(3).add_sequence("c2", list(range(5000, 5128)), report=True)  # 2 blocks
    wait_until(lambda: scrape(url)["kvfold_blocks_total"][key] == before + 2, timeout_s=60)


def _incarnation(kv, rank: int) -> int | None:  # type: ignore[no-untyped-def]
    from kvfold.errors import RankUnavailable

    try:
        return int(kv.rank(rank).info()["incarnation"])
    except RankUnavailable:
        return None


def test_mooncake_replay_never_over_commits(kv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvfold.replay.trace_replay import ReplayConfig, replay
    from kvfold.workload.traces import load_mooncake

    workload = load_mooncake(MOONCAKE, limit=150)
    rec = replay(kv, workload, ReplayConfig(time_scale=100.0, decode_tokens_per_s=40.0))
    s = rec.summary()
    assert s["overcommits"] == 0
    assert s["rank_refusals"] == 0  # one scheduler: its promises always fit the rank
    assert s["admitted"] + s["rejected"] == 150 and s["completed"] == s["admitted"]
    assert s["decode_stalls"] == 0  # guaranteed-no-evict: every admitted request could grow
    assert s["gpu_hit_rate"] > 0  # the trace shares prefixes
    rec.write_csv(tmp_path / "r.csv")
    rec.write_png(tmp_path / "r.png")
    m = scrape(kv.client.metrics_url())
    admitted = sum(
        v for k, v in m["kvfold_admission_decisions_total"].items() if ("outcome", "admit") in k
    )
    assert admitted == s["admitted"]


def test_a_replay_the_driver_cannot_keep_up_with_shows_gaps_and_counts_overruns(  # type: ignore[no-untyped-def]
    kv, tmp_path
) -> None:
    """A 1 ms step budget no driver meets and samples due every 0.01 trace s: every
    step overruns, and each stretch of trace time a step skipped is a gap."""
    from kvfold.replay.trace_replay import ReplayConfig, replay
    from kvfold.workload.requests import shared_prefix_workload

    cfg = ReplayConfig(time_scale=50.0, step_interval_s=0.001, sample_interval_s=0.01)
    workload = shared_prefix_workload(num_requests=40, duration_s=60.0, seed=3)
    rec = replay(kv, workload, cfg)
    s = rec.summary()
    assert s["overcommits"] == 0 and s["completed"] == s["admitted"]
    assert s["driver_overruns"] == s["driver_steps"] > 0
    assert s["picture_gaps"] > 0 and s["picture_gap_max_trace_s"] > 2 * 0.01
    _, rows = rec.plot_rows()
    assert rows.count(None) == s["picture_gaps"]  # each gap breaks the line once
    assert "overran its step" in rec.format_summary()
    rec.write_png(tmp_path / "gaps.png")


def test_four_schedulers_in_four_processes_share_the_ranks(kv) -> None:  # type: ignore[no-untyped-def]
    from kvfold.replay.trace_replay import ReplayConfig, replay
    from kvfold.workload.traces import load_mooncake

    before = sum(r.num_refused for n in kv.view().nodes for r in n.ranks)
    workload = load_mooncake(MOONCAKE, limit=150)
    cfg = ReplayConfig(time_scale=100.0, decode_tokens_per_s=40.0, schedulers=4)
    s = replay(kv, workload, cfg).summary()
    assert s["schedulers"] == 4 and s["overcommits"] == 0 and s["decode_stalls"] == 0
    assert s["admitted"] + s["rejected"] == 150 and s["completed"] == s["admitted"]
    # what the replay saw refused is what the ranks counted and reported
    after = sum(r.num_refused for n in kv.view().nodes for r in n.ranks)
    assert after - before == s["rank_refusals"]
