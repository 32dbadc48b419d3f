"""check_cache_integrity: recount a PagedKVCache from its block tables.

Invariants (DESIGN 3.3): used + cached + free == total per window; every reference
count equals the number of block tables holding the block; no block both free and
referenced; counters equal a recount (alloc_total + reused - released == held
references); each sequence holds exactly the blocks its window says; status
counts match; every taken block was fresh or evicted (alloc_total == alloc_new + evicted).
Raises IntegrityError with the numbers that failed to balance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfold.errors import IntegrityError
from kvfold.stats import SequenceStatus

if TYPE_CHECKING:
    from kvfold.worker.cache import PagedKVCache


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_cache_integrity(cache: PagedKVCache) -> None:
    B = cache.block_size
    for w, pool in cache.pools.items():
        expected = [0] * pool.num_blocks
        for seq in cache._seqs.values():
            for b in seq.tables.get(w, ()):
                expected[b] += 1
        pool.check_integrity(expected)
        cum = cache.cumulative().windows[w]
        refs = sum(expected)
        balance = cum.alloc_total_blocks + cum.reused_blocks - cache._released_refs[w]
        if balance != refs:
            raise IntegrityError(
                f"window {w!r}: alloc_total {cum.alloc_total_blocks} + reused "
                f"{cum.reused_blocks} - released {cache._released_refs[w]} = {balance} "
                f"!= held references {refs}"
            )
        if cum.alloc_new_blocks + cum.evicted_blocks != cum.alloc_total_blocks:
            raise IntegrityError(
                f"window {w!r}: alloc_new {cum.alloc_new_blocks} + evicted "
                f"{cum.evicted_blocks} != alloc_total {cum.alloc_total_blocks}"
            )
        if cum.onboarded_blocks > cum.alloc_total_blocks:
            raise IntegrityError(
                f"window {w!r}: onboarded {cum.onboarded_blocks} > alloc_total "
                f"{cum.alloc_total_blocks}"
            )
    counts = dict.fromkeys(SequenceStatus, 0)
    for seq in cache._seqs.values():
        counts[seq.status] += 1
        for w in cache.windows:
            held = len(seq.tables.get(w, ()))
            if not seq.holds_blocks:
                if held:
                    raise IntegrityError(
                        f"seq {seq.seq_id!r} is {seq.status.name} but holds {held} blocks"
                    )
                continue
            n = _ceil_div(seq.num_tokens, B)
            want = n - seq.first[w]
            lo = 0 if w is None else max(0, seq.num_tokens - w) // B
            if held != want or seq.first[w] < lo:
                raise IntegrityError(
                    f"seq {seq.seq_id!r} window {w!r}: holds {held} blocks from "
                    f"{seq.first[w]}, expected {want} from >= {lo} for {seq.num_tokens} tokens"
                )
    if counts != cache._status_counts:
        raise IntegrityError(f"status counts {cache._status_counts} != recount {counts}")
