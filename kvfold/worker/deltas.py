"""DeltaLedger: one rank's counters per window, the open interval and the committed sum.

The cache counts into `pending[window]` as it works; `commit()` freezes the open
interval into frozen BlockDeltas and starts the next one; `cumulative()` is every
count since the cache was built. Evictions are read from the pools (they happen
inside `BlockPool.take`), so they are counted exactly once, where they happen.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvfold.stats import DELTA_FIELDS, BlockDeltas, IterationStats, Window
from kvfold.worker.block_pool import BlockPool


class Counts:
    """Mutable deltas of one window for the open interval (frozen by `freeze`)."""

    __slots__ = DELTA_FIELDS

    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    onboarded_blocks: int
    onboarded_bytes: int
    missed_blocks: int
    gen_alloc_blocks: int
    evicted_blocks: int
    offloaded_blocks: int
    offloaded_bytes: int

    def __init__(self) -> None:
        for f in DELTA_FIELDS:
            setattr(self, f, 0)

    def freeze(self) -> BlockDeltas:
        return BlockDeltas(*(getattr(self, f) for f in DELTA_FIELDS))


class DeltaLedger:
    def __init__(self, pools: Mapping[Window, BlockPool]) -> None:
        self.pools = pools
        self.pending = {w: Counts() for w in pools}
        self._committed = {w: BlockDeltas() for w in pools}  # cumulative
        self._evicted_committed = dict.fromkeys(pools, 0)

    def commit(self) -> IterationStats:
        """Hand out the deltas since the previous commit and start a new interval."""
        out: dict[Window, BlockDeltas] = {}
        for w, pool in self.pools.items():
            c = self.pending[w]
            c.evicted_blocks = pool.evicted_total - self._evicted_committed[w]
            self._evicted_committed[w] = pool.evicted_total
            out[w] = d = c.freeze()
            self._committed[w] = self._committed[w] + d
            self.pending[w] = Counts()
        return IterationStats(out)

    def cumulative(self) -> IterationStats:
        """Every delta since the cache was built, committed or pending."""
        out = {}
        for w in self.pools:
            evicted = self.pools[w].evicted_total - self._evicted_committed[w]
            pending = self.pending[w].freeze()
            out[w] = self._committed[w] + pending + BlockDeltas(evicted_blocks=evicted)
        return IterationStats(out)
