"""check_cache_integrity: recount a paged KV cache from its block tables.

Invariants (DESIGN 3.3): used + cached + free == total per window; every reference
count equals the number of block tables holding the block; no block both free and
referenced; counters equal a recount (alloc_total + reused - released == held
references); every taken block was fresh or evicted (alloc_total == alloc_new +
evicted); committed blocks recount from the sequences' declared ends and lie within
[used, total]; each sequence holds exactly the blocks its window says; status counts
match. Raises IntegrityError with the numbers that failed to balance.

Reads the cache through `CacheState` (what PagedKVCache exposes), so this module
and the cache do not import each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvfold.errors import IntegrityError
from kvfold.stats import VALID_STATUSES, IterationStats, SequenceStatus, Window
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.windows import WindowManager


class SequenceState(Protocol):
    @property
    def seq_id(self) -> object: ...
    @property
    def status(self) -> SequenceStatus: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def tables(self) -> Mapping[Window, list[int]]: ...
    @property
    def first(self) -> Mapping[Window, int]: ...
    @property
    def end(self) -> int: ...


class CacheState(Protocol):
    @property
    def pools(self) -> Mapping[Window, BlockPool]: ...
    @property
    def managers(self) -> Mapping[Window, WindowManager]: ...
    @property
    def seqs(self) -> Mapping[Any, SequenceState]: ...
    @property
    def status_counts(self) -> Mapping[SequenceStatus, int]: ...
    @property
    def released_refs(self) -> Mapping[Window, int]: ...
    @property
    def commit_sums(self) -> Mapping[Window, int]: ...

    def cumulative(self) -> IterationStats: ...


def check_cache_integrity(cache: CacheState) -> None:
    cum = cache.cumulative()
    for w, pool in cache.pools.items():
        expected = [0] * pool.num_blocks
        for seq in cache.seqs.values():
            for b in seq.tables.get(w, ()):
                expected[b] += 1
        pool.check_integrity(expected)
        _check_counters(w, cum, sum(expected), cache.released_refs[w])
        _check_new_blocks(w, cum, pool)
        _check_commitments(cache, w, pool)
    counts = dict.fromkeys(SequenceStatus, 0)
    for seq in cache.seqs.values():
        counts[seq.status] += 1
        _check_tables(cache, seq)
    if counts != dict(cache.status_counts):
        raise IntegrityError(f"status counts {dict(cache.status_counts)} != recount {counts}")


def _check_counters(w: Window, cumulative: IterationStats, refs: int, released: int) -> None:
    c = cumulative.windows[w]
    balance = c.alloc_total_blocks + c.reused_blocks - released
    if balance != refs:
        raise IntegrityError(
            f"window {w!r}: alloc_total {c.alloc_total_blocks} + reused {c.reused_blocks} "
            f"- released {released} = {balance} != held references {refs}"
        )
    if c.onboarded_blocks > c.alloc_total_blocks:
        raise IntegrityError(
            f"window {w!r}: onboarded {c.onboarded_blocks} > alloc_total {c.alloc_total_blocks}"
        )


def _check_new_blocks(w: Window, cumulative: IterationStats, pool: BlockPool) -> None:
    """TensorRT-LLM's `getFreeBlock` counts a taken block as new when it holds no tokens;
    here a block holds tokens from its first take on (kvfold.worker.block_pool)."""
    c = cumulative.windows[w]
    if pool.records_tokens:
        held = pool.num_blocks - pool.num_never_used
        if c.alloc_new_blocks != held:
            raise IntegrityError(
                f"window {w!r}: alloc_new {c.alloc_new_blocks} != blocks that have held "
                f"tokens {held} (total {pool.num_blocks} - never used {pool.num_never_used})"
            )
    elif c.alloc_new_blocks != c.alloc_total_blocks:
        raise IntegrityError(
            f"window {w!r}: blocks record no tokens, but alloc_new {c.alloc_new_blocks} "
            f"!= alloc_total {c.alloc_total_blocks}"
        )
    if c.alloc_new_blocks + c.evicted_blocks > c.alloc_total_blocks:
        raise IntegrityError(
            f"window {w!r}: alloc_new {c.alloc_new_blocks} + evicted {c.evicted_blocks} "
            f"> alloc_total {c.alloc_total_blocks}"
        )


def _check_commitments(cache: CacheState, w: Window, pool: BlockPool) -> None:
    """Recount what the sequences committed from their lengths and declared ends
    (kvfold.worker.commitments): used <= committed <= total."""
    mgr = cache.managers[w]
    own = sum(
        mgr.commitment(s.num_tokens, s.end)
        for s in cache.seqs.values()
        if s.status in VALID_STATUSES
    )
    if own != cache.commit_sums[w]:
        raise IntegrityError(f"window {w!r}: committed sum {cache.commit_sums[w]} != recount {own}")
    committed = own if mgr.counts_held else own + pool.num_used
    if not pool.num_used <= committed <= pool.num_blocks:
        raise IntegrityError(
            f"window {w!r}: committed {committed} outside [used {pool.num_used}, "
            f"total {pool.num_blocks}]"
        )


def _check_tables(cache: CacheState, seq: SequenceState) -> None:
    for w, mgr in cache.managers.items():
        held = len(seq.tables.get(w, ()))
        if seq.status not in VALID_STATUSES:
            if held:
                raise IntegrityError(
                    f"seq {seq.seq_id!r} is {seq.status.name} but holds {held} blocks"
                )
            continue
        lo = mgr.first_block(seq.num_tokens)
        want = mgr.num_blocks(seq.num_tokens) + lo - seq.first[w]
        if held != want or seq.first[w] < lo:
            raise IntegrityError(
                f"seq {seq.seq_id!r} window {w!r}: holds {held} blocks from "
                f"{seq.first[w]}, expected {want} from >= {lo} for {seq.num_tokens} tokens"
            )
