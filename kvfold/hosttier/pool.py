"""HostKVPool: a node's host-memory KV tier, shared by every rank on the node.

Keyed by (window, block key); least recently used first out. Bytes live in one
uint8 arena of `num_blocks` slots: page-locked (pinned) torch memory when CUDA is
present, so copies to a GPU can be asynchronous; plain numpy memory otherwise
(the node actor then never loads torch). A slot holds one block of any window
whose size is at most `slot_nbytes`.

    put(w, key, bytes)      offload: store, evicting the LRU entry when full
    lookup(w, keys) -> n    how many leading keys are held (no side effects)
    get(w, keys) -> [bytes] onboard: copies of the leading held blocks (LRU touched)

`dropped_blocks` counts entries evicted without ever having been onboarded:
offload work that bought nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfold.checks import check_int
from kvfold.devices import cuda_available
from kvfold.errors import IntegrityError
from kvfold.hosttier.packing import unpack_blocks
from kvfold.kvevents.journal import EventJournal
from kvfold.stats import HostStats, Window

HostKey = tuple[Window, bytes]


@dataclass(slots=True)
class _Entry:
    slot: int
    nbytes: int
    onboarded: bool = False


class HostKVPool:
    def __init__(self, num_blocks: int, slot_nbytes: int, pin_memory: bool | None = None) -> None:
        check_int("num_blocks", num_blocks, 0)
        check_int("slot_nbytes", slot_nbytes, 0)
        if num_blocks and slot_nbytes < 1:
            raise ValueError(f"slot_nbytes must be >= 1 for a host tier, got {slot_nbytes}")
        self.num_blocks = num_blocks
        self.slot_nbytes = slot_nbytes
        pin = num_blocks > 0 and (cuda_available() if pin_memory is None else pin_memory)
        self.pinned = bool(pin and num_blocks)
        shape = (num_blocks, slot_nbytes if num_blocks else 0)
        self.storage: np.ndarray
        if self.pinned:
            import torch

            self.storage = torch.empty(shape, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            self.storage = np.empty(shape, dtype=np.uint8)
        self._entries: OrderedDict[HostKey, _Entry] = OrderedDict()  # LRU first
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        self.offloaded_blocks = 0
        self.offloaded_bytes = 0
        self.onboarded_blocks = 0
        self.onboarded_bytes = 0
        self.dropped_blocks = 0
        self.evicted_blocks = 0
        self.refused_blocks = 0
        self.journal: EventJournal | None = None  # block events (medium CPU), when asked

    @property
    def enabled(self) -> bool:
        return self.num_blocks > 0

    def __contains__(self, item: HostKey) -> bool:
        return item in self._entries

    def keys_lru(self) -> list[HostKey]:
        """Held keys, least recently used first (the eviction order)."""
        return list(self._entries)

    def put(self, window: Window, key: bytes, payload: np.ndarray) -> bool:
        """Store one block's bytes. False: tier off, too large (refused) or already held."""
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
            raise TypeError("payload must be a 1-D uint8 numpy array")
        if not self.enabled or payload.size > self.slot_nbytes:
            self.refused_blocks += 1
            return False
        hk = (window, key)
        if hk in self._entries:
            self._entries.move_to_end(hk)
            return False
        if not self._free_slots:
            self._evict_lru()
        slot = self._free_slots.pop()
        n = int(payload.size)
        self.storage[slot, :n] = payload
        self._entries[hk] = _Entry(slot, n)
        if self.journal is not None and window in self.journal.group_of:
            self.journal.stored(window, (key,), None)  # offloaded one by one: no parent known
        self.offloaded_blocks += 1
        self.offloaded_bytes += n
        return True

    def _evict_lru(self) -> None:
        (window, key), entry = self._entries.popitem(last=False)
        if self.journal is not None and window in self.journal.group_of:
            self.journal.removed(window, key)
        self._free_slots.append(entry.slot)
        self.evicted_blocks += 1
        if not entry.onboarded:
            self.dropped_blocks += 1

    def lookup(self, window: Window, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the tier holds. Changes nothing."""
        n = 0
        for k in keys:
            if (window, k) not in self._entries:
                break
            n += 1
        return n

    def get(self, window: Window, keys: Sequence[bytes]) -> list[np.ndarray]:
        """Copies of the leading held blocks (stops at the first miss); counts an onboard."""
        packed, lengths = self.get_packed(window, keys)
        return unpack_blocks(packed, lengths)

    def get_packed(self, window: Window, keys: Sequence[bytes]) -> tuple[np.ndarray, list[int]]:
        """`get` as one contiguous copy plus each block's length (one buffer to send)."""
        entries: list[_Entry] = []
        for k in keys:
            entry = self._entries.get((window, k))
            if entry is None:
                break
            self._entries.move_to_end((window, k))
            entry.onboarded = True
            entries.append(entry)
        lengths = [e.nbytes for e in entries]
        if entries and all(n == self.slot_nbytes for n in lengths):
            packed = self.storage[[e.slot for e in entries]].reshape(-1)  # one gather copy
        else:
            packed = np.concatenate(
                [self.storage[e.slot, : e.nbytes] for e in entries] or [np.zeros(0, dtype=np.uint8)]
            )
        self.onboarded_blocks += len(entries)
        self.onboarded_bytes += sum(lengths)
        return packed, lengths

    def clear(self) -> None:
        """Drop everything (counted as dropped when never onboarded)."""
        while self._entries:
            self._evict_lru()

    def reusable_keys(self) -> dict[int, list[bytes]]:
        """Per window group of the journal, every key the tier holds (what the cluster
        block index should hold for this node's host tier)."""
        out: dict[int, list[bytes]] = {}
        if self.journal is None:
            return out
        for w, key in self._entries:
            g = self.journal.group_of.get(w)
            if g is not None:
                out.setdefault(g, []).append(key)
        return out

    def stats(self) -> HostStats:
        used = len(self._entries)
        return HostStats(
            num_blocks_total=self.num_blocks,
            num_blocks_used=used,
            num_blocks_evictable=used,  # nothing is pinned by an in-flight copy
            offloaded_blocks=self.offloaded_blocks,
            offloaded_bytes=self.offloaded_bytes,
            onboarded_blocks=self.onboarded_blocks,
            onboarded_bytes=self.onboarded_bytes,
            dropped_blocks=self.dropped_blocks,
            evicted_blocks=self.evicted_blocks,
            refused_blocks=self.refused_blocks,
        )

    def check_integrity(self) -> None:
        used = len(self._entries)
        free = len(self._free_slots)
        if used + free != self.num_blocks:
            raise IntegrityError(f"host used {used} + free {free} != total {self.num_blocks}")
        slots = [e.slot for e in self._entries.values()]
        if len(set(slots) | set(self._free_slots)) != self.num_blocks:
            raise IntegrityError("a host slot is both used and free, or used twice")
        if self.offloaded_blocks - self.evicted_blocks != used:
            raise IntegrityError(
                f"offloaded {self.offloaded_blocks} - evicted {self.evicted_blocks} != used {used}"
            )
        if self.dropped_blocks > self.evicted_blocks:
            raise IntegrityError(f"dropped {self.dropped_blocks} > evicted {self.evicted_blocks}")
