from __future__ import annotations

import pytest

from kvfold.stats import BlockGauges, HostStats, KVStats, SequenceStatus
from kvfold.topology import Topology
from kvfold.worker.kv_manager import (
    InMemoryBackend,
    KVCacheManager,
    KVUtilizationRequest,
    PagedCacheBackend,
)
from tests.unit.builders import make_cache, toks


def test_free_pages_from_a_real_cache() -> None:
    cache = make_cache(num_blocks=16)
    assert cache.add_sequence("a", toks(0, 9))  # 3 blocks
    mgr = KVCacheManager(PagedCacheBackend(cache), Topology(1, 1))
    assert mgr.get_gpu_free_pages() == 13  # 16 - 3
    assert mgr.get_host_free_pages() == 0  # no host tier


def test_unbound_gpu_counts_zero() -> None:
    mgr = KVCacheManager(InMemoryBackend(gpu=None, host=HostStats(100, 40)), Topology(10, 4))
    assert mgr.get_gpu_free_pages() == 0
    assert mgr.get_host_free_pages() == 60


def test_host_utilization_of_partial_node() -> None:
    host = HostStats(num_blocks_total=100, num_blocks_used=10)
    mgr = KVCacheManager(InMemoryBackend(host=host), Topology(10, 4))
    statuses = dict.fromkeys(SequenceStatus, 1)
    stats = KVStats({None: BlockGauges(16, 4, 0, 4)}, statuses)
    util = mgr.get_host_utilization(KVUtilizationRequest(node=2, rank_stats={8: stats, 9: None}))
    assert (util.node_rank_start, util.node_rank_end) == (8, 10)  # clamped, not 12
    assert util.host == host  # once for the node
    assert util.num_valid_sequences == 4  # rank 8: one per valid status; rank 9 unbound
    assert util.gpu_total.num_blocks_total == 16
    empty = mgr.get_host_utilization(KVUtilizationRequest(node=1))
    assert empty.free_percent == 0.0
    with pytest.raises(ValueError, match="rank 3 is not on node 2"):
        mgr.get_host_utilization(KVUtilizationRequest(node=2, rank_stats={3: stats}))
    with pytest.raises(TypeError, match="backend"):
        KVCacheManager(object(), Topology(1, 1))  # type: ignore[arg-type]
