"""ReservationBook: one controller's promises its ranks have not shown yet. Pure; no Ray.

Kept as parallel arrays (rank, ticket, time made, live, blocks per window), so that
settling what a view shows (every live promise whose ticket is at or below its rank's
entry), expiring, and summing what is promised per rank are vector operations: a view
refresh that settles a thousand tickets costs a few array passes, not a thousand
Python steps. Slots of settled promises are reused when the book compacts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from kvfold.stats import Window

IntArray = npt.NDArray[np.int64]


class ReservationBook:
    def __init__(self, capacity: int = 1024) -> None:
        self.columns: dict[Window, int] = {}  # the blocks column of every window promised
        self.rank: IntArray = np.zeros(capacity, dtype=np.int64)
        self.ticket: IntArray = np.zeros(capacity, dtype=np.int64)
        self.made_s = np.zeros(capacity, dtype=np.float64)
        self.live = np.zeros(capacity, dtype=bool)
        self.blocks: IntArray = np.zeros((capacity, 0), dtype=np.int64)
        self.ids: list[str | None] = [None] * capacity
        self.slot_of: dict[str, int] = {}
        self.used = 0  # slots handed out since the last compaction
        self.num_live = 0

    def __len__(self) -> int:
        return self.num_live

    def __contains__(self, request_id: object) -> bool:
        slot = self.slot_of.get(request_id) if isinstance(request_id, str) else None
        return slot is not None and bool(self.live[slot])

    def request_ids(self) -> list[str]:
        """The live promises' request ids, oldest first."""
        return [self.ids[s] for s in np.flatnonzero(self.live[: self.used])]  # type: ignore[misc]

    # ------------------------------------------------------------ changes

    def add(
        self, request_id: str, rank: int, ticket: int, blocks: Mapping[Window, int], now_s: float
    ) -> None:
        if self.used == len(self.live):
            self._make_room()
        s = self.used
        self.used += 1
        for w, n in blocks.items():
            c = self.columns.get(w)
            if c is None:
                c = self._add_column(w)
            self.blocks[s, c] = n
        self.rank[s], self.ticket[s], self.made_s[s], self.live[s] = rank, ticket, now_s, True
        self.ids[s] = request_id
        self.slot_of[request_id] = s
        self.num_live += 1

    def remove(self, request_id: str) -> tuple[int, dict[Window, int]] | None:
        """Drop a live promise; (its rank, its blocks per window), or None if none."""
        s = self.slot_of.pop(request_id, None)
        if s is None or not self.live[s]:
            return None
        self.live[s] = False
        self.num_live -= 1
        return int(self.rank[s]), {w: int(self.blocks[s, c]) for w, c in self.columns.items()}

    def settle(self, seen: IntArray) -> int:
        """Drop every live promise whose ticket its rank shows (`seen[rank]`, the rank's
        highest ticket of this controller); returns how many."""
        m = self.used
        live = self.live[:m]
        done = live & (self.ticket[:m] <= seen[self.rank[:m]])
        return self._drop(done)

    def expire(self, made_by_s: float) -> int:
        """Drop every live promise made at or before `made_by_s`; returns how many."""
        m = self.used
        return self._drop(self.live[:m] & (self.made_s[:m] <= made_by_s))

    def _drop(self, mask: npt.NDArray[np.bool_]) -> int:
        count = int(np.count_nonzero(mask))
        if count:
            self.live[: self.used][mask] = False
            self.num_live -= count
        return count

    # ------------------------------------------------------------ sums

    def reserved(self, windows: tuple[Window, ...], world_size: int) -> IntArray:
        """Blocks promised per window (in `windows` order) and rank."""
        out = np.zeros((len(windows), world_size), dtype=np.int64)
        if not self.num_live:
            return out
        slots = np.flatnonzero(self.live[: self.used])
        ranks = self.rank[slots]
        for i, w in enumerate(windows):
            c = self.columns.get(w)
            if c is not None:
                out[i] = np.bincount(ranks, weights=self.blocks[slots, c], minlength=world_size)
        return out

    # ------------------------------------------------------------ storage

    def _add_column(self, window: Window) -> int:
        c = self.columns[window] = len(self.columns)
        self.blocks = np.concatenate(
            [self.blocks, np.zeros((len(self.blocks), 1), dtype=np.int64)], axis=1
        )
        return c

    def _make_room(self) -> None:
        """Compact when at most half the slots are live, else double the arrays."""
        cap = len(self.live)
        if self.num_live * 2 <= cap:
            keep = np.flatnonzero(self.live[: self.used])
            ids = [self.ids[s] for s in keep]
            for name in ("rank", "ticket", "made_s", "live", "blocks"):
                arr = getattr(self, name)
                fresh = np.zeros_like(arr)
                fresh[: len(keep)] = arr[keep]
                setattr(self, name, fresh)
            self.ids = ids + [None] * (cap - len(ids))
            self.slot_of = {rid: s for s, rid in enumerate(ids) if rid is not None}
            self.used = len(keep)
            return
        for name in ("rank", "ticket", "made_s", "live", "blocks"):
            arr = getattr(self, name)
            grown = np.zeros((2 * cap, *arr.shape[1:]), dtype=arr.dtype)
            grown[:cap] = arr
            setattr(self, name, grown)
        self.ids += [None] * cap
