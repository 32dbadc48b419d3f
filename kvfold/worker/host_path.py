"""The rank's side of its node's host KV tier: onboard on a prompt miss, offload on eviction.

    add_sequence:  plan (nothing changed)  ->  fetch from the tier  ->  take / attach / write
                                               (a failure is a miss)    (cannot fail)
    eviction:      the block's bytes are *copied* the moment its key is dropped, before
                   anything can be written into the block again; the copies go to the
                   tier in one batch when the operation ends (`flush`)

A failing host tier is a miss (docs/decisions.md): whatever `fetch` raises or returns
that is not one block of the window's layout, the cache computes those blocks instead
and counts a fetch failure; whatever `offload_many` raises, those blocks are simply not
stored, counted as offload failures. The engine's operation always completes, and
never half-way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvfold.stats import Window

if TYPE_CHECKING:
    from kvfold.worker.storage import KVStorage

log = logging.getLogger("kvfold.host")

OffloadItem = tuple[Window, bytes, np.ndarray]


class HostTier(Protocol):
    """The node's host KV tier as a rank sees it (a seam: real client or in-memory fake)."""

    def fetch(self, window: Window, keys: Sequence[bytes]) -> list[np.ndarray]:
        """Payloads of the leading keys the tier holds, in order; stops at the first miss."""
        ...

    def offload_many(self, items: list[OffloadItem]) -> list[bool] | None:
        """Offer evicted blocks (window, key, bytes), in one go. A list: whether each was
        stored (False: tier off, full, already held); None: sent, answers pending: the
        tier calls `PagedKVCache.record_offload` for each block the host stored."""
        ...


class HostLink:
    """Owns the traffic between one cache and its host tier, and counts what failed."""

    def __init__(self, tier: HostTier, storage: Callable[[], KVStorage]) -> None:
        self.tier = tier
        self.storage = storage  # the cache's bytes, once built (kvfold.worker.storage_holder)
        self.fetch_failures = 0  # fetches that raised or returned something unusable
        self.offload_failures = 0  # blocks whose offload raised (not stored)
        self._outbox: list[OffloadItem] = []

    def fetch(self, window: Window, keys: Sequence[bytes]) -> list[np.ndarray]:
        """The leading blocks of `keys` the tier holds, each checked to be one block of
        `window`'s layout; fewer (down to none) when the tier fails. Changes no cache state."""
        if not keys:
            return []
        try:
            payloads = list(self.tier.fetch(window, keys))
        except Exception as e:  # any failure of the seam is a miss (docs/decisions.md)
            self.fetch_failures += 1
            log.warning("host tier fetch failed, computing instead: %s: %s", type(e).__name__, e)
            return []
        if not payloads:  # nothing to copy in: the bytes need not exist yet (storage_holder)
            return []
        nbytes = self.storage().block_nbytes(window)
        out: list[np.ndarray] = []
        for p in payloads[: len(keys)]:
            if not isinstance(p, np.ndarray) or p.dtype != np.uint8 or p.shape != (nbytes,):
                self.fetch_failures += 1
                got = f"{p.size} {p.dtype}" if isinstance(p, np.ndarray) else type(p).__name__
                log.warning(
                    "host tier returned %s for a %d-byte block; computing instead", got, nbytes
                )
                break
            out.append(p)
        return out

    def copier(self, window: Window) -> Callable[[int, bytes], None]:
        """The pool's evict listener: copy the block's bytes out now, send them at `flush`."""
        storage = self.storage
        outbox = self._outbox

        def copy_out(block: int, key: bytes) -> None:
            outbox.append((window, key, storage().read_block(window, block)))

        return copy_out

    def flush(self) -> list[tuple[Window, int]]:
        """Offer the blocks evicted since the last flush in one batch; return the
        (window, nbytes) of each block the tier confirmed it stored right away."""
        if not self._outbox:
            return []
        items = list(self._outbox)
        self._outbox.clear()
        try:
            stored = self.tier.offload_many(items)
        except Exception as e:  # a failing tier stores nothing (docs/decisions.md)
            self.offload_failures += len(items)
            log.warning(
                "host tier offload of %d blocks failed: %s: %s", len(items), type(e).__name__, e
            )
            return []
        if stored is None:
            return []
        if len(stored) != len(items):
            self.offload_failures += len(items)
            log.warning("host tier answered %d verdicts for %d blocks", len(stored), len(items))
            return []
        return [(w, int(p.nbytes)) for (w, _, p), ok in zip(items, stored, strict=True) if ok]
