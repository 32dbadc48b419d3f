"""HostTierServer: a node's host KV tier as its ranks reach it: the pool behind a layout check.

Every rank on the node offloads into and onboards from one HostKVPool. A block is only
meaningful to a rank with the same layout (tokens per block, heads, head size, dtype,
bytes per window), so every call carries the caller's BlockLayout: a mismatch stores
nothing (offload) or is refused with a ValueError (onboard), and is counted.
"""

from __future__ import annotations

import numpy as np

from kvfold.hosttier.layout import BlockLayout
from kvfold.hosttier.pool import HostKVPool
from kvfold.kvevents.events import CPU
from kvfold.kvevents.journal import EventJournal
from kvfold.stats import HostStats, Window


class HostTierServer:
    def __init__(self, num_blocks: int, layout: BlockLayout | None) -> None:
        slot_nbytes = 0 if layout is None or not num_blocks else layout.max_block_nbytes
        self.pool = HostKVPool(num_blocks if slot_nbytes else 0, slot_nbytes)
        self.layout = layout
        self.refused_layout = 0  # calls refused for another block layout
        if layout is not None and self.pool.enabled:
            windows = [w for w, _ in layout.bytes_per_block]
            self.pool.journal = EventJournal(windows, layout.tokens_per_block, CPU)
            self.pool.journal.cleared()  # a new tier: whatever this node held before is gone

    def _admits(self, layout: BlockLayout) -> bool:
        if self.layout is not None and layout != self.layout:
            self.refused_layout += 1
            return False
        return True

    def put_many(
        self, layout: BlockLayout, items: list[tuple[Window, bytes, np.ndarray]]
    ) -> list[bool]:
        """Offload blocks; all refused (counted) when the caller's layout is not the node's."""
        if not self._admits(layout):
            return [False] * len(items)
        return [self.pool.put(w, key, payload) for w, key, payload in items]

    def get_packed(
        self, layout: BlockLayout, window: Window, keys: list[bytes]
    ) -> tuple[np.ndarray, list[int]]:
        """Onboard: the leading held blocks, packed (kvfold.hosttier.packing)."""
        if not self._admits(layout):
            raise ValueError(
                f"block layout {layout} does not match the host tier's {self.layout}; "
                "refusing to onboard"
            )
        return self.pool.get_packed(window, keys)

    def stats(self) -> HostStats | None:
        """None when the tier is off (0 blocks)."""
        return self.pool.stats() if self.pool.enabled else None
