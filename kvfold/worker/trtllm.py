"""One rank's KV-cache stats in TensorRT-LLM's `kvCacheStats` shape.

Tools written for TensorRT-LLM's `LLM.get_stats()` read `stat["kvCacheStats"]`:
gauges of the primary pool plus counters cumulative since the cache was built.
kvfold keeps host-tier onboards apart (`onboarded_blocks`); TensorRT-LLM counts a
block found in secondary memory as reused, so here reusedBlocks = reused + onboarded
and cacheHitRate = reusedBlocks / (reusedBlocks + missedBlocks).
"""

from __future__ import annotations

from typing import Any

from kvfold.stats import BlockDeltas, BlockGauges, IterationStats, KVStats, ratio, window_label


def kv_cache_stats(gauges: BlockGauges, counters: BlockDeltas) -> dict[str, Any]:
    """TensorRT-LLM's kvCacheStats fields from one pool's (or a sum of pools') counts."""
    reused = counters.reused_blocks + counters.onboarded_blocks
    return {
        "maxNumBlocks": gauges.num_blocks_total,
        "freeNumBlocks": gauges.num_blocks_free,
        "usedNumBlocks": gauges.num_blocks_used,
        "tokensPerBlock": gauges.tokens_per_block,
        "allocTotalBlocks": counters.alloc_total_blocks,
        "allocNewBlocks": counters.alloc_new_blocks,
        "reusedBlocks": reused,
        "missedBlocks": counters.missed_blocks,
        "cacheHitRate": ratio(reused, reused + counters.missed_blocks),
    }


def trtllm_stats(stats: KVStats, counters: IterationStats) -> dict[str, Any]:
    """`{"kvCacheStats": summed over windows, "kvCacheStatsPerWindow": {label: ...}}`;
    JSON-ready (labels "full" or the window size in tokens)."""
    return {
        "kvCacheStats": kv_cache_stats(stats.total, counters.total),
        "kvCacheStatsPerWindow": {
            window_label(w): kv_cache_stats(g, counters.windows.get(w, BlockDeltas()))
            for w, g in stats.windows.items()
        },
    }
