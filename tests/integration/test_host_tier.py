"""The node host tier on 2 simulated nodes of 2 GPUs: offload, onboard, cross-rank reuse."""

from __future__ import annotations

import numpy as np
import pytest

from kvfold.worker import KVCacheConfig
from tests.integration.conftest import running, wait_until

pytestmark = pytest.mark.integration

B = 4
CACHE = KVCacheConfig(
    tokens_per_block=B,
    num_blocks=40,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    device="auto",
)
HOST_BLOCKS = 48
PROMPT = list(range(7000, 7000 + 32 * B))  # 32 full blocks


@pytest.fixture(scope="module")
def kv():  # type: ignore[no-untyped-def]
    with running(2, 2, 4, cache=CACHE, host_num_blocks=HOST_BLOCKS) as (_, deployment):
        yield deployment


def host_stats(kv, node: int):  # type: ignore[no-untyped-def]
    import ray

    return ray.get(kv.node(node).host_stats.remote())


def test_offload_then_onboard_on_another_rank_of_the_same_node(kv) -> None:  # type: ignore[no-untyped-def]
    assert kv.topology.node_of(0) == kv.topology.node_of(1) == 0
    r0, r1, r2 = kv.rank(0), kv.rank(1), kv.rank(2)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((len(PROMPT), 2, 8)).astype(np.float32)
    v = rng.standard_normal((len(PROMPT), 2, 8)).astype(np.float32)
    assert r0.add_sequence("p", PROMPT)
    for layer in range(2):
        r0.write_kv("p", layer, list(range(len(PROMPT))), k + layer, v - layer)
    r0.free_sequence("p")  # 32 cached blocks on rank 0
    assert r0.add_sequence("push", list(range(90_000, 90_000 + 40 * B)))  # evicts all 32
    r0.free_sequence("push")
    wait_until(lambda: host_stats(kv, 0).num_blocks_used == 32, timeout_s=60)
    # the host stored them; its answers reach the rank a moment later: wait for them
    wait_until(lambda: r0.call("settle_offloads", 5.0) == 0, timeout_s=60)
    r0.report_now()
    assert r0.cumulative().total.offloaded_blocks == 32  # confirmed by the host
    # rank 1 on the same node: 31 blocks onboarded, only the last computed
    r1.report_now()
    assert r1.add_sequence("same", PROMPT)
    d = r1.cumulative().total
    assert (d.onboarded_blocks, d.missed_blocks, d.reused_blocks) == (31, 1, 0)
    assert d.onboarded_bytes == 31 * CACHE.bytes_per_block(None)
    assert d.hit_rate == 0.0 and d.hit_rate_with_host == 31 / 32
    for layer in range(2):
        gk, gv = r1.gather_kv("same", layer)
        assert gk[: 31 * B].tobytes() == (k + layer)[: 31 * B].tobytes()
        assert gv[: 31 * B].tobytes() == (v - layer)[: 31 * B].tobytes()
    r1.check_integrity()
    # rank 2 is on the other node: its host tier never saw the prompt
    assert kv.topology.node_of(2) == 1
    assert r2.add_sequence("other", PROMPT)
    d2 = r2.cumulative().total
    assert (d2.onboarded_blocks, d2.missed_blocks) == (0, 32)
    for r, sid in ((r1, "same"), (r2, "other")):
        r.free_sequence(sid, report=True)
    s = host_stats(kv, 0)
    assert (s.onboarded_blocks, s.num_blocks_used) == (31, 32)
    # the view shows each node's host tier once
    view = wait_until(
        lambda: (lambda v: v if v.nodes[0].host.onboarded_blocks == 31 else None)(kv.view())
    )
    assert view.host.num_blocks_total == 2 * HOST_BLOCKS


def test_host_lru_and_dropped_counts(kv) -> None:  # type: ignore[no-untyped-def]
    r3 = kv.rank(3)  # node 1: its tier is empty so far
    before = host_stats(kv, 1)
    assert before.num_blocks_used == 0
    # 3 prompts of 20 full blocks each, each pushed out by the next: 60 offloads into 48 slots.
    # Offload batches land in the node's data threads concurrently, so the host's LRU order
    # is the order batches arrive: each is settled before the next, to make it the order
    # they were evicted in.
    for i in range(3):
        base = 200_000 + i * 1000
        assert r3.add_sequence(f"f{i}", list(range(base, base + 20 * B + 1)))
        assert r3.call("settle_offloads", 20.0) == 0
        r3.free_sequence(f"f{i}")
    assert r3.add_sequence("flush", list(range(500_000, 500_000 + 40 * B)))
    assert r3.call("settle_offloads", 20.0) == 0
    r3.free_sequence("flush")
    wait_until(lambda: host_stats(kv, 1).offloaded_blocks >= 60, timeout_s=60)
    s = host_stats(kv, 1)
    # every offload landed: 60 full blocks of f0..f2 (+ up to 0 from flush, still on GPU)
    assert s.num_blocks_used == HOST_BLOCKS
    assert s.evicted_blocks == s.offloaded_blocks - HOST_BLOCKS
    assert s.dropped_blocks == s.evicted_blocks  # none of them was ever onboarded
    # LRU: the oldest prompt (f0) went first; the newest (f2) is still there
    assert r3.add_sequence("again2", list(range(202_000, 202_000 + 20 * B + 1)))
    assert r3.cumulative().total.onboarded_blocks == 20
    assert r3.call("settle_offloads", 20.0) == 0
    r3.free_sequence("again2")
    assert r3.add_sequence("again0", list(range(200_000, 200_000 + 20 * B + 1)))
    assert r3.cumulative().total.onboarded_blocks == 20  # f0 was dropped: nothing onboarded
    r3.free_sequence("again0")


def test_a_rank_with_another_layout_is_refused(kv) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    import ray

    bad = replace(CACHE, tokens_per_block=8).block_layout()
    assert ray.get(kv.node(0).host_put_many.remote(bad, [(None, b"k", np.zeros(1, np.uint8))])) == [
        False
    ]
    with pytest.raises(ValueError, match="does not match the host tier"):
        try:
            ray.get(kv.node(0).host_get.remote(bad, None, [b"k"]))
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None
    assert ray.get(kv.node(0).counts.remote())["host_refused_layout"] == 2


def test_a_failing_host_tier_is_a_miss_and_the_add_completes(kv) -> None:  # type: ignore[no-untyped-def]
    """The node refuses this rank's layout (a remote ValueError): every add still completes
    as if the tier held nothing, the cache balances, and the failures are counted."""
    from dataclasses import replace

    r1 = kv.rank(1)
    r1.call("bind", replace(CACHE, head_dim=4))  # node 0's tier holds head_dim 8 blocks
    before = r1.info()["host_fetch_failures"]
    prompt = list(range(7000, 7000 + 8 * B + 1))
    assert r1.add_sequence("refused", prompt)
    d = r1.cumulative().total
    assert (d.onboarded_blocks, d.missed_blocks, d.reused_blocks) == (0, 9, 0)
    r1.check_integrity()
    assert r1.info()["host_fetch_failures"] == before + 1
    kv_stats = r1.trtllm_stats()["kvCacheStats"]  # the rebound cache's own counts
    assert (kv_stats["missedBlocks"], kv_stats["reusedBlocks"], kv_stats["allocTotalBlocks"]) == (
        9,
        0,
        9,
    )
    r1.free_sequence("refused")
    r1.check_integrity()
    assert r1.stats().total.num_blocks_used == 0
    r1.call("bind", CACHE)
