"""A request's path through the prefix cache, kvfold against vLLM 0.33's own BlockPool,
interleaved in one process (benchmarks/_vllm_anchor.py fetches vLLM's code; it is never
a dependency). Tokens are given as Python lists, 16 tokens a block, one full-attention
group, vLLM's default prefix hash (sha256) against kvfold's (sha256).

    fresh 1,000   a 1,000-block prompt nothing holds: hash, allocate, key, free
                  (a new salt each call: every call after the first evicts)
    cached 64     a 64-block prompt (+1 token) held in the cache: hash, look up, hold, free
    mix 50/50     64-block prompts, half from 16 hot ones and half never seen, through a
                  1,000-block pool (the hot set alone overflows it): look up, hold the
                  hits, allocate the rest, key, free -- the same sequence for both

kvfold's side is the whole public path (PagedKVCache.add_sequence + free_sequence), with
its stats, commitments and block events. Each round times a batch of calls of each, in
alternating order, and takes the ratio of the two medians; the median of the rounds'
ratios is the figure (target: kvfold at most 0.67 of vLLM's time, 1.5x faster).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
from _report import info, report
from _vllm_anchor import AnchorUnavailable, VllmPool
from bench_block_pool import B, make

from kvfold.worker import PagedKVCache

ROUNDS = 15
TARGET = 0.67


def kvfold_request(cache: PagedKVCache) -> Callable[[list[int], str | None], None]:
    def run(tokens: list[int], salt: str | None) -> None:
        assert cache.add_sequence("r", tokens, salt=salt)
        cache.free_sequence("r")

    return run


def timed(fn: Callable[[int], object], calls: range) -> float:
    """Median seconds per call over `calls` (each call gets its index)."""
    out = []
    for i in calls:
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def compare(
    name: str, ours: Callable[[int], object], theirs: Callable[[int], object], per_round: int
) -> bool:
    ratios, t_ours, t_theirs = [], [], []
    for rnd in range(ROUNDS):
        calls = range(rnd * per_round, (rnd + 1) * per_round)
        if rnd % 2:
            b, a = timed(theirs, calls), timed(ours, calls)
        else:
            a, b = timed(ours, calls), timed(theirs, calls)
        t_ours.append(a)
        t_theirs.append(b)
        ratios.append(a / b)
    info(f"{name}: kvfold, median per call", statistics.median(t_ours) * 1e6, "us")
    info(f"{name}: vLLM BlockPool, median per call", statistics.median(t_theirs) * 1e6, "us")
    info(f"{name}: per-round ratios, min / max", min(ratios), f"/ {max(ratios):.3f}")
    return report(f"{name}: kvfold / vLLM, median of {ROUNDS} rounds", statistics.median(ratios),
                  "x", TARGET)  # fmt: skip


def main() -> int:
    try:
        probe = VllmPool(8, B)
    except AnchorUnavailable as e:
        print(f"skipped: the vLLM anchor is unavailable: {e}")
        return 0
    print(f"anchor: {probe.describe()}")
    ok = True

    # fresh 1,000 blocks: every call a new salt, both pools of 2,000 blocks
    big = list(range(1_000 * B))
    ours, theirs = make(2_000), VllmPool(2_000, B)
    run = kvfold_request(ours)
    ok &= compare(
        "fresh 1,000-block prompt",
        lambda i: run(big, f"f{i}"),
        lambda i: theirs.fresh(big, cache_salt=f"f{i}"),
        per_round=8,
    )

    # cached 64 blocks (+1 token: every full block can be reused)
    p64 = list(range(64 * B + 1))
    ours, theirs = make(2_000), VllmPool(2_000, B)
    run = kvfold_request(ours)
    run(p64, None)
    theirs.fresh(p64)
    assert ours.add_sequence("check", p64)
    assert ours.prompt_reuse("check")[0] == 64 * B  # tokens reused
    ours.free_sequence("check")
    assert theirs.cached(p64) == 64
    ok &= compare(
        "cached 64-block prompt",
        lambda i: run(p64, None),
        lambda i: theirs.cached(p64),
        per_round=200,
    )

    # mix: 16 hot 64-block prompts and as many never seen, through 1,000 blocks
    rng = np.random.default_rng(0)
    hot = [list(range(j * 10**6, j * 10**6 + 64 * B + 1)) for j in range(16)]
    n = ROUNDS * 200
    picks = rng.integers(0, 16, n).tolist()
    fresh = rng.random(n) < 0.5
    seq = [(p64, f"m{i}") if fresh[i] else (hot[picks[i]], None) for i in range(n)]
    ours, theirs = make(1_000), VllmPool(1_000, B)
    run = kvfold_request(ours)
    ok &= compare(
        "mix 50/50, 1,000-block pool",
        lambda i: run(*seq[i]),
        lambda i: theirs.request(seq[i][0], cache_salt=seq[i][1]),
        per_round=200,
    )
    print("all targets met" if ok else "some targets missed (see MISSED above)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
