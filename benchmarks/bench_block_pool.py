"""Block pool speed: add + free with hashing, cached-prefix lookup, stats() at two sizes.

The request path against its anchor, vLLM's own BlockPool measured in the same run, is
benchmarks/bench_vs_vllm.py (its targets are ratios: machines differ 2-3x). Here (a) is
printed for reference; (c) is a ratio to the same figure at 1,000 blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, median_time_s, report

from kvfold.worker import KVCacheConfig, PagedKVCache
from kvfold.worker.hashing import block_keys

B = 16


def make(num_blocks: int) -> PagedKVCache:
    cfg = KVCacheConfig(
        tokens_per_block=B,
        num_blocks=num_blocks,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype="float16",
        device="cpu",
    )
    return PagedKVCache(cfg)


def main() -> int:
    ok = True
    cache = make(2_000)
    prompt = list(range(1_000 * B))
    counter = [0]

    def add_free() -> None:
        counter[0] += 1
        # a fresh salt each cycle: every block is hashed and newly allocated
        assert cache.add_sequence("s", prompt, salt=str(counter[0]))
        cache.free_sequence("s")

    add_free()
    t = median_time_s(add_free, repeats=40)
    info("(a) add + free, 1,000-block prompt, hashing included", t * 1e3, "ms")
    print("    (against vLLM's BlockPool in the same run: bench_vs_vllm.py, fresh 1,000)")

    lookup_cache = make(256)
    p64 = list(range(64 * B + 1))
    assert lookup_cache.add_sequence("warm", p64)
    lookup_cache.free_sequence("warm")
    keys = block_keys(p64, B)
    pool = lookup_cache.pools[None]

    def lookup() -> int:
        get = pool.key_to_block.get
        n = 0
        for k in keys:
            if get(k) is None:
                break
            n += 1
        return n

    assert lookup() == 64
    t = median_time_s(lookup, repeats=50, number=200)
    ok &= report("(b) look up a cached 64-block prefix (keys computed)", t * 1e6, "us", 20.0)

    small, big = make(1_000), make(100_000)
    for c in (small, big):
        assert c.add_sequence("x", list(range(100 * B)))
    t_small = median_time_s(small.stats, repeats=50, number=200)
    t_big = median_time_s(big.stats, repeats=50, number=200)
    report("(c) stats() at 1,000 blocks", t_small * 1e6, "us", t_small * 1e6 * 1.5)
    ok &= report(
        "(c) stats() at 100,000 blocks (target: 1.5x the 1,000 figure)",
        t_big * 1e6,
        "us",
        t_small * 1e6 * 1.5,
    )
    print("all targets met" if ok else "some targets missed (see MISSED above)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
