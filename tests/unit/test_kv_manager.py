"""The seed's facade: the seed's semantics exactly (DESIGN 3.7)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfold.kv_manager import (
    HostKVUtilization,
    InMemoryBackend,
    KVCacheManager,
    KVStats,
    KVUtilizationRequest,
    PagedCacheBackend,
    RankStatusCounts,
    should_trigger_prefill,
)
from kvfold.stats import HostStats, SequenceStatus
from tests.unit.builders import make_cache, toks

S = SequenceStatus


class SeedBackend:  # inherits nothing: any object with the two methods will do
    def __init__(self, host: KVStats, gpu: KVStats | None) -> None:
        self.host, self.gpu = host, gpu

    def get_host_stats(self) -> KVStats:
        return self.host

    def get_gpu_stats(self) -> KVStats | None:
        return self.gpu


class SeedBatch:  # the seed's global_batch: sequence objects per rank and status
    def __init__(self, seqs: dict[tuple[int, SequenceStatus], list[str]]) -> None:
        self.seqs = seqs

    def get_sequences_for_rank_with_status(self, rank: int, status: SequenceStatus) -> list[str]:
        return self.seqs.get((rank, status), [])


def test_free_pages_from_a_real_cache_and_an_unbound_one() -> None:
    cache = make_cache(num_blocks=16)
    assert cache.add_sequence("a", toks(0, 9))  # 3 blocks
    mgr = KVCacheManager(PagedCacheBackend(cache))
    assert mgr.get_gpu_free_pages() == 13  # 16 - 3
    assert mgr.get_host_free_pages() == 0  # no host tier
    unbound = KVCacheManager(SeedBackend(KVStats(60, 40, 100), None))
    assert unbound.get_gpu_free_pages() == 0
    assert unbound.get_host_free_pages() == 60


def test_host_utilization_of_a_partial_node_counts_host_sequences_of_every_rank() -> None:
    # world 10, 4 GPUs a node: rank 9 is on node 2, which holds ranks 8 and 9 only
    batch = SeedBatch(
        {
            (8, S.PREFILLED): ["a", "b"],
            (9, S.ON_HOLD): ["c"],
            (9, S.IN_DECODE): ["d", "e", "f"],
            (8, S.IN_PREFILL): ["not-in-host"],
            (9, S.QUEUEING): ["not-in-host"],
            (8, S.COMPLETED): ["not-in-host"],
            (7, S.IN_DECODE): ["node 1"],
            (10, S.IN_DECODE): ["beyond the world"],
        }
    )
    mgr = KVCacheManager(
        backend=SeedBackend(
            KVStats(num_free_pages=33, num_used_pages=67, num_total_pages=100), None
        )
    )
    util = mgr.get_host_utilization(KVUtilizationRequest(9, 10, 1, 4, batch))
    assert util == HostKVUtilization(
        rank=9,
        node_id=2,
        num_free_pages=33,  # the HOST tier's pages, not the GPU's
        num_total_pages=100,
        num_used_pages=67,
        free_percent=33,  # int(33 / 100 * 100)
        num_in_decode=3,
        num_onhold=1,
        num_prefilled=2,
        num_valid_sequences=6,  # 2 + 1 + 3; IN_PREFILL, QUEUEING, COMPLETED excluded
    )
    assert isinstance(util.free_percent, int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        util.free_percent = 5  # type: ignore[misc]


def test_free_percent_is_an_int_and_100_for_an_empty_tier() -> None:
    def pct(free: int, total: int) -> int:
        mgr = KVCacheManager(InMemoryBackend(host=KVStats(free, total - free, total)))
        return mgr.get_host_utilization(KVUtilizationRequest(0, 1, 0, 1)).free_percent

    assert pct(0, 0) == 100
    assert pct(2, 3) == 66  # int(66.66...)
    assert pct(1, 1000) == 0  # int(0.1)
    assert pct(1000, 1000) == 100


@given(
    world=st.integers(1, 40),
    gpus=st.integers(1, 9),
    data=st.data(),
)
def test_node_range_is_clamped_to_the_world_for_every_rank(world: int, gpus: int, data) -> None:  # type: ignore[no-untyped-def]
    rank = data.draw(st.integers(0, world - 1))
    counts = {r: {S.IN_DECODE: 1} for r in range(world + gpus)}  # 1 per rank, past the world too
    mgr = KVCacheManager(InMemoryBackend())
    util = mgr.get_host_utilization(
        KVUtilizationRequest(rank, world, 0, gpus, RankStatusCounts(counts))
    )
    start = (rank // gpus) * gpus
    assert util.node_id == rank // gpus
    assert util.num_in_decode == min(start + gpus, world) - start  # ranks on the node, no phantoms


def test_the_seeds_prefill_trigger() -> None:
    def node(free: int, total: int) -> HostKVUtilization:
        used = total - free
        return HostKVUtilization(
            0, 0, free, total, used, int(free / total * 100) if total else 100, 0, 0, 0, 0
        )

    nodes = [node(10, 100), node(70, 100)]  # 10 % and 70 % free
    t = should_trigger_prefill(nodes, 50, has_queued=True)
    assert t.should_trigger and t.max_free_percent == 70
    assert (t.used_pages, t.total_pages, t.free_percent, t.num_nodes) == (
        120,
        200,
        40,
        2,
    )  # 100 - int(60.0)
    assert not should_trigger_prefill(nodes, 50, has_queued=False).should_trigger  # nothing waits
    assert should_trigger_prefill(nodes, 50, has_queued=False, has_evicted=True).should_trigger
    assert not should_trigger_prefill(nodes, 70, has_queued=True).should_trigger  # not above
    empty = should_trigger_prefill([], 50, has_queued=True)
    assert not empty.should_trigger and empty.max_free_percent is None


def test_kvfold_stats_types_convert_and_bad_input_is_named() -> None:
    mgr = KVCacheManager(
        PagedCacheBackend(None, host=type("H", (), {"stats": lambda self: HostStats(100, 40)})())
    )
    assert mgr.get_host_free_pages() == 60
    assert mgr.get_gpu_free_pages() == 0
    with pytest.raises(TypeError, match="backend"):
        KVCacheManager(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank must be in"):
        KVUtilizationRequest(10, 10, 0, 4)
    with pytest.raises(ValueError, match="num_gpus_per_node"):
        KVUtilizationRequest(0, 10, 0, 0)
    with pytest.raises(TypeError, match="global_batch"):
        KVUtilizationRequest(0, 10, 0, 4, global_batch=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_free_pages"):
        KVCacheManager(SeedBackend(object(), None)).get_host_free_pages()  # type: ignore[arg-type]


def test_host_utilizations_of_a_view_take_fresh_nodes_only() -> None:
    from kvfold.aggregator.fold import fold_cluster, fold_node
    from kvfold.kv_manager import host_utilizations
    from kvfold.topology import Topology
    from kvfold.view import SourceState
    from tests.unit.builders import make_report

    topo = Topology(10, 4)
    reports = {
        r: make_report(r, statuses={S.PREFILLED: 1, S.IN_DECODE: 2, S.IN_PREFILL: 5})
        for r in range(10)
    }
    nodes = {
        n: fold_node(topo, n, {r: reports[r] for r in topo.ranks_on(n)}, HostStats(100, 10 * n))
        for n in range(3)
    }
    view = fold_cluster(
        topo, nodes, {0: SourceState.FRESH, 1: SourceState.STALE, 2: SourceState.FRESH}
    )
    utils = host_utilizations(view)
    assert [u.node_id for u in utils] == [0, 2]  # node 1 is stale: left out
    n2 = utils[1]
    assert (n2.rank, n2.num_free_pages, n2.free_percent) == (8, 80, 80)  # host 100 - 20 used
    assert (n2.num_prefilled, n2.num_in_decode, n2.num_valid_sequences) == (2, 4, 6)  # 2 ranks
    assert should_trigger_prefill(utils, 90, has_queued=True).should_trigger  # node 0: 100 %
