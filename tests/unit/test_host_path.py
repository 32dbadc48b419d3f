"""The rank <-> host tier path in process: offload on eviction, onboard on a miss."""

from __future__ import annotations

import torch

from kvfold.worker import PagedKVCache
from tests.unit.builders import PoolHostTier, make_config, toks


def test_evicted_blocks_offload_and_onboard_byte_exact() -> None:
    cfg = make_config(num_blocks=8)
    host = PoolHostTier(num_blocks=16, slot_nbytes=cfg.bytes_per_block(None))
    a = PagedKVCache(cfg, host_tier=host)
    b = PagedKVCache(cfg, host_tier=host)  # another rank on the same node
    assert a.add_sequence("p", toks(0, 24))  # 6 full blocks
    k = torch.randn(24, 2, 8)
    a.write_kv("p", 0, list(range(24)), k, -k)
    a.free_sequence("p")
    assert a.add_sequence("push", toks(1000, 32))  # 8 blocks: evicts all 6 cached ones
    d = a.commit_iteration().total
    assert (d.evicted_blocks, d.offloaded_blocks) == (6, 6)
    assert d.offloaded_bytes == 6 * cfg.bytes_per_block(None)
    assert b.add_sequence("same", toks(0, 24))
    d = b.commit_iteration().total
    # reusable floor(23/4) = 5 blocks all onboarded; block 5 is computed (missed)
    assert (d.onboarded_blocks, d.missed_blocks, d.reused_blocks, d.alloc_new_blocks) == (
        5,
        1,
        0,
        6,
    )
    assert d.hit_rate_with_host == 5 / 6
    gk, gv = b.gather_kv("same", 0)
    assert torch.equal(gk[:20], k[:20]) and torch.equal(gv[:20], -k[:20])
    s = host.pool.stats()
    assert (s.offloaded_blocks, s.onboarded_blocks, s.num_blocks_used) == (6, 5, 6)
    a.check_integrity()
    b.check_integrity()


def test_gpu_hits_first_then_host_then_computed() -> None:
    cfg = make_config(num_blocks=16)
    host = PoolHostTier(num_blocks=16, slot_nbytes=cfg.bytes_per_block(None))
    c = PagedKVCache(cfg, host_tier=host)
    other = PagedKVCache(cfg, host_tier=host)
    assert other.add_sequence("x", toks(0, 17))
    other.free_sequence("x")
    assert other.add_sequence("y", toks(5000, 64))  # evicts x's 4 full blocks to the host
    assert c.add_sequence("mine", toks(0, 8))  # blocks 0, 1 on this rank's GPU
    c.free_sequence("mine")
    c.commit_iteration()
    assert c.add_sequence("z", toks(0, 17))
    d = c.commit_iteration().total
    # 5 blocks: reusable floor(16/4) = 4 -> 2 from the GPU, 2 onboarded, 1 computed
    assert (d.reused_blocks, d.onboarded_blocks, d.missed_blocks) == (2, 2, 1)
