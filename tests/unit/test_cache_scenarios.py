"""Exact scenarios of one rank's cache (B = 4 tokens per block, 16 blocks, full attention)."""

from __future__ import annotations

from kvfold.stats import SequenceStatus
from kvfold.worker import PagedKVCache
from kvfold.worker.hashing import block_keys
from tests.unit.builders import make_cache, toks


def test_cold_prompt_then_decode_opens_a_block() -> None:
    cache = make_cache()
    assert cache.add_sequence("a", toks(0, 8))
    d = cache.commit_iteration().total
    assert (d.alloc_new_blocks, d.missed_blocks, d.reused_blocks) == (2, 2, 0)
    assert d.alloc_total_blocks == 2  # 2 new + 0 reused
    assert d.hit_rate == 0.0  # 0 / (0 + 2)
    assert cache.append_tokens("a", [100])  # token 9 of 9 opens block 2
    d = cache.commit_iteration().total
    assert (d.gen_alloc_blocks, d.alloc_new_blocks, d.missed_blocks) == (1, 1, 0)
    assert cache.stats().total.num_blocks_used == 3
    cache.check_integrity()


def test_add_that_does_not_fit_changes_nothing() -> None:
    cache = make_cache(num_blocks=4)
    assert cache.add_sequence("a", toks(0, 8))  # 2 blocks
    before = (cache.stats(), cache.block_table("a"), list(cache.pools[None].ref_counts))
    assert not cache.add_sequence("b", toks(50, 12))  # needs 3, 2 free
    assert not cache.has_sequence("b")
    assert (cache.stats(), cache.block_table("a"), list(cache.pools[None].ref_counts)) == before
    d = cache.commit_iteration().total
    assert (d.alloc_new_blocks, d.missed_blocks) == (2, 2)  # only "a" counted
    cache.check_integrity()


def test_last_token_is_always_computed() -> None:
    cache = make_cache()
    assert cache.add_sequence("a", toks(0, 12))  # 3 full blocks, all keyed
    cache.free_sequence("a")
    cache.commit_iteration()
    assert cache.add_sequence("b", toks(0, 12))
    d = cache.commit_iteration().total
    assert d.reused_blocks == 2  # floor((12 - 1) / 4) = 2
    assert d.missed_blocks == 1
    cache.free_sequence("b")
    assert cache.add_sequence("c", [*toks(0, 12), 99])
    d = cache.commit_iteration().total
    assert d.reused_blocks == 3  # floor((13 - 1) / 4) = 3
    assert d.missed_blocks == 1  # the partial block of token 12
    assert d.hit_rate == 0.75  # 3 / (3 + 1)
    cache.check_integrity()


def test_eviction_order_unkeyed_then_lru_shared_head_last() -> None:
    cache = make_cache(num_blocks=8)
    # a: [p0 p1 a2 a3]   b: [p0 p1 b2 b3(partial)]   -> 6 distinct blocks, 2 never used
    assert cache.add_sequence("a", toks(0, 16))
    assert cache.add_sequence("b", [*toks(0, 8), *toks(500, 6)])
    p0, p1, a2, a3 = cache.block_table("a")
    assert cache.block_table("b")[:2] == [p0, p1]
    b2, b3 = cache.block_table("b")[2:]
    cache.free_sequence("a")  # releases a3, a2 (tail first); p0, p1 still held by b
    cache.free_sequence("b")  # releases b3 (unkeyed: free), b2, p1, p0
    assert list(cache.pools[None].evictable) == [a3, a2, b2, p1, p0]
    order = cache.pools[None].take(8)
    assert order is not None
    unkeyed = order[:3]  # the 2 never-used blocks and b3
    assert set(unkeyed) == {6, 7, b3}
    assert order[3:] == [a3, a2, b2, p1, p0]  # least recently released first, head last
    cache.pools[None].release(order)


def test_salts_share_nothing() -> None:
    cache = make_cache()
    assert cache.add_sequence("a", toks(0, 12), salt="tenant-1")
    cache.free_sequence("a")
    cache.commit_iteration()
    assert cache.add_sequence("b", toks(0, 12), salt="tenant-2")
    assert cache.commit_iteration().total.reused_blocks == 0
    assert cache.add_sequence("c", toks(0, 12), salt="tenant-1")
    assert cache.commit_iteration().total.reused_blocks == 2
    cache.check_integrity()


def test_sliding_window_reuses_only_inside_and_releases_as_it_grows() -> None:
    cache = make_cache(windows=(8,), num_layers=1)
    assert cache.add_sequence("a", toks(0, 16))  # window [8, 16): blocks 2, 3
    assert cache.first_block_index("a", 8) == 2
    assert len(cache.block_table("a", 8)) == 2
    d = cache.commit_iteration().total
    assert (d.alloc_new_blocks, d.missed_blocks, d.reused_blocks) == (2, 2, 0)  # 0, 1 untouched
    cache.free_sequence("a")
    assert cache.add_sequence("b", toks(0, 16))
    d = cache.commit_iteration().total
    # reusable: floor(15/4) = 3 -> blocks 0..2; inside the window: block 2 only
    assert d.reused_blocks == 1
    assert d.missed_blocks == 1  # block 3 is computed; blocks 0, 1 are neither
    for t in range(20):
        assert cache.append_tokens("b", [1000 + t])
        assert cache.stats().total.num_blocks_used <= 3  # ceil(8/4) + 1
        cache.check_integrity()
    # 36 tokens: window [28, 36) -> blocks 7, 8
    assert cache.first_block_index("b", 8) == 7
    assert len(cache.block_table("b", 8)) == 2


def test_two_windows_count_separately_and_sum() -> None:
    cache = make_cache(windows=(None, 8))
    assert cache.add_sequence("a", toks(0, 8))
    it = cache.commit_iteration()
    for w in (None, 8):
        assert (it.windows[w].alloc_new_blocks, it.windows[w].missed_blocks) == (2, 2)
    assert it.total.alloc_new_blocks == 4  # 2 + 2, not 8 and not 2
    assert cache.stats().total.num_blocks_total == 32  # 16 + 16
    cache.check_integrity()


def test_statuses_and_preemption() -> None:
    cache = make_cache()
    cache.queue_sequence("q")
    assert cache.add_sequence("a", toks(0, 8))
    cache.set_status("a", SequenceStatus.IN_DECODE)
    counts = cache.stats().num_sequences_by_status
    assert counts[SequenceStatus.QUEUEING] == 1 and counts[SequenceStatus.IN_DECODE] == 1
    assert cache.stats().num_valid_sequences == 1
    cache.set_status("a", SequenceStatus.QUEUEING)  # preempted: blocks released
    assert cache.stats().total.num_blocks_used == 0
    assert cache.add_sequence("a", toks(0, 8))  # re-admitted
    assert cache.add_sequence("q", toks(0, 9))  # a queued sequence gets its blocks
    cache.set_status("q", SequenceStatus.COMPLETED)
    assert cache.stats().num_sequences_by_status[SequenceStatus.COMPLETED] == 1
    assert cache.stats().num_valid_sequences == 1
    cache.check_integrity()
    cache.free_sequence("a")
    cache.free_sequence("q")
    assert cache.stats().total.num_blocks_used == 0
    cache.check_integrity()


def test_reuse_off_keys_nothing() -> None:
    cache = make_cache(reuse=False)
    assert cache.add_sequence("a", toks(0, 12))
    cache.free_sequence("a")
    cache.commit_iteration()
    assert cache.add_sequence("b", toks(0, 12))  # takes a's 3 blocks again (top of free)
    d = cache.commit_iteration().total
    # TensorRT-LLM keys no block without block reuse, so every take is new: 3, not 0
    assert (d.reused_blocks, d.missed_blocks, d.alloc_new_blocks) == (0, 3, 3)
    assert cache.stats().total.num_blocks_cached == 0
    cache.check_integrity()


def test_decode_blocks_become_reusable() -> None:
    cache = make_cache()
    assert cache.add_sequence("a", toks(0, 6))
    assert cache.append_tokens("a", toks(6, 7))  # 13 tokens: 3 full blocks now keyed
    cache.free_sequence("a")
    cache.commit_iteration()
    assert cache.add_sequence("b", toks(0, 13))
    assert cache.commit_iteration().total.reused_blocks == 3
    cache.check_integrity()


def test_eviction_counted_when_cached_blocks_are_reclaimed() -> None:
    cache = make_cache(num_blocks=4)
    assert cache.add_sequence("a", toks(0, 16))  # 4 keyed blocks
    cache.free_sequence("a")
    cache.commit_iteration()
    assert cache.add_sequence("b", toks(100, 8))  # takes 2 cached blocks
    d = cache.commit_iteration().total
    assert d.evicted_blocks == 2
    assert cache.stats().total.num_blocks_cached == 2
    cache.check_integrity()


def test_counters_mean_what_tensorrt_llm_means() -> None:
    """DESIGN 3.3: alloc_total = blocks taken from the free list (a cache hit is not
    taken); alloc_new = of those, blocks that had never held a token (TensorRT-LLM's
    `getFreeBlock`: a block whose unique tokens are empty)."""
    cache = make_cache(num_blocks=8)
    assert cache.add_sequence("a", toks(0, 10))  # blocks 0, 1 full and keyed; 2 partial
    cache.free_sequence("a")  # 0, 1 cached; 2 free (unkeyed), having held tokens 8, 9
    cache.commit_iteration()
    assert cache.add_sequence("b", toks(0, 10))
    d = cache.commit_iteration().total
    # reused floor((10 - 1) / 4) = 2; block 2 taken again: taken, not new (the old code: 1)
    assert (d.reused_blocks, d.alloc_total_blocks, d.alloc_new_blocks) == (2, 1, 0)
    cache.free_sequence("b")
    cache.commit_iteration()
    assert cache.add_sequence("big", toks(1000, 32))  # 8 blocks into an 8-block pool
    d = cache.commit_iteration().total
    # 5 never used (3..7) + block 2 (free, used before) + 2 reclaimed from the cache:
    # total 5 + 1 + 2 = 8, new 5, evicted 2 (the old code: new 8 - 2 = 6)
    assert (d.alloc_total_blocks, d.alloc_new_blocks, d.evicted_blocks) == (8, 5, 2)
    cache.check_integrity()


def test_a_freed_partial_tail_is_not_new_when_taken_again() -> None:
    """Issue 22, example 1 (2 blocks of 4 tokens): a 6-token prompt, freed, then 6 other
    tokens. TensorRT-LLM's getFreeBlock counts alloc_new = 2: block 0 keeps tokens 0-3
    and block 1 token 4 (it keys L - 1 = 5 tokens), so neither is new the second time."""
    cache = make_cache(num_blocks=2)
    assert cache.add_sequence("a", toks(0, 6))  # block 0 full (keyed), block 1 holds 4, 5
    cache.free_sequence("a")  # block 0 cached; block 1 free (unkeyed), not new
    assert cache.add_sequence("b", toks(100, 6))  # takes block 1, then evicts block 0
    d = cache.cumulative().total
    # taken 2 + 2 = 4; new 2 + 0 = 2 (the old code counted block 1 again: 3); evicted 1
    assert (d.alloc_total_blocks, d.alloc_new_blocks, d.evicted_blocks) == (4, 2, 1)
    assert cache.trtllm_stats()["kvCacheStats"]["allocNewBlocks"] == 2
    cache.check_integrity()


def test_a_freed_decode_block_is_not_new_when_taken_again() -> None:
    """Issue 22, example 2 (2 blocks of 4 tokens): a 4-token prompt decodes 2 tokens, is
    freed, then 6 other tokens. TensorRT-LLM counts alloc_new = 2: on release it keys
    L - 1 = 5 tokens, tokens 0-3 in block 0 and token 4 in block 1."""
    cache = make_cache(num_blocks=2)
    assert cache.add_sequence("a", toks(0, 4))  # block 0, full and keyed
    assert cache.append_tokens("a", [50, 51])  # block 1 (gen_alloc), tokens 4, 5
    cache.free_sequence("a")  # block 0 cached; block 1 free (unkeyed), not new
    assert cache.add_sequence("b", toks(100, 6))  # takes block 1, then evicts block 0
    d = cache.cumulative().total
    # taken 1 + 1 + 2 = 4; new 1 + 1 + 0 = 2 (the old code: 1 + 1 + 1 = 3); evicted 1
    assert (d.alloc_total_blocks, d.alloc_new_blocks, d.evicted_blocks) == (4, 2, 1)
    assert d.gen_alloc_blocks == 1
    cache.check_integrity()


def test_only_a_new_pool_has_new_blocks() -> None:
    """Evicting a block does not make it new again (TensorRT-LLM's freeLeafBlock unlinks
    a block from the radix tree and keeps its tokens); a cache built afresh (a rank's
    rebind) starts with every block new."""
    cache = make_cache(num_blocks=2)
    assert cache.add_sequence("a", toks(0, 8))  # 2 full blocks, keyed
    cache.free_sequence("a")  # both cached
    assert cache.add_sequence("b", toks(100, 8))  # evicts both
    d = cache.cumulative().total
    assert (d.alloc_total_blocks, d.alloc_new_blocks, d.evicted_blocks) == (4, 2, 2)  # 2 + 0
    fresh = PagedKVCache(cache.config)
    assert fresh.add_sequence("b", toks(100, 8))
    assert fresh.cumulative().total.alloc_new_blocks == 2  # a new pool: both never used
    cache.check_integrity()
    fresh.check_integrity()


def test_trtllm_stats_has_tensorrt_llms_names_and_meanings() -> None:
    import json

    from tests.unit.builders import PoolHostTier, make_config

    cfg = make_config(num_blocks=8)
    host = PoolHostTier(num_blocks=16, slot_nbytes=cfg.bytes_per_block(None))
    a, b = PagedKVCache(cfg, host_tier=host), PagedKVCache(cfg, host_tier=host)
    assert a.add_sequence("p", toks(0, 12))
    a.free_sequence("p")
    assert a.add_sequence("push", toks(500, 32))  # evicts p's 3 cached blocks to the host
    assert b.add_sequence("q", toks(0, 8))  # block 0 onboarded (floor(7/4) = 1), 1 computed
    b.free_sequence("q")
    assert b.add_sequence("r", toks(0, 13))  # 2 reused on the GPU, 1 onboarded, 1 computed
    s = json.loads(json.dumps(b.trtllm_stats()))
    kv = s["kvCacheStats"]
    assert kv == {
        "maxNumBlocks": 8,
        "freeNumBlocks": 4,  # 8 - 4 held by r
        "usedNumBlocks": 4,
        "tokensPerBlock": 4,
        "allocTotalBlocks": 2 + 2,  # q took 2; r took 2 (onboarded into counts: taken)
        "allocNewBlocks": 2 + 2,  # every block b took had never held a token
        "reusedBlocks": 1 + (2 + 1),  # GPU hits + host onboards, as TensorRT-LLM counts them
        "missedBlocks": 1 + 1,  # q's block 1, r's partial last block
        "cacheHitRate": 4 / 6,
    }
    assert s["kvCacheStatsPerWindow"] == {"full": kv}


def test_a_block_that_fills_and_leaves_the_window_in_one_growth_is_not_reusable() -> None:
    """Window 4, 2 tokens a block. Growing "a" from 1 token to 6 in one append fills
    block 0 (positions 0-1) and slides the window past it at once: position 1 was never
    written in the window group, so its block must not be offered for reuse there
    (Hypothesis found the wrong bytes reused, and offloaded)."""
    cache = make_cache({None: 8, 4: 8}, windows=(None, 4), tokens_per_block=2)
    assert cache.add_sequence("a", [0])
    assert cache.append_tokens("a", [1, 2, 3, 4, 5])
    k0 = block_keys([0, 1], 2)[0]
    assert k0 in cache.pools[None].key_to_block  # full attention holds it, written
    assert k0 not in cache.pools[4].key_to_block
    cache.commit_iteration()
    assert cache.add_sequence("b", [0, 1, 9])
    d = cache.commit_iteration().windows
    assert (d[None].reused_blocks, d[4].reused_blocks) == (1, 0)
