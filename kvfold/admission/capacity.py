"""CapacityIndex: one view's per-rank capacity as arrays, for a controller. Pure; no Ray.

A rank's room in window w is what its last report left uncommitted:

    room = total - max(committed, used)

`committed` is the rank's own count (held blocks plus what its sequences may still need,
kvfold.worker.commitments). The policy (kvfold.admission.policy) takes from it the
watermark and what this controller promised since. A rank whose source does not
publish its commitments (an engine's, `RankSummary.unknown`) is no candidate: room on
it cannot be promised (the front door keeps an engine's commitments itself, DESIGN
§11). `seen` is, per rank, this
controller's highest ticket the rank has shown (kvfold.worker.tickets), which settles
those promises.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvfold.stats import Window, window_sort_key
from kvfold.view import ClusterView, SourceState
from kvfold.worker.windows import window_manager

IntArray = npt.NDArray[np.int64]
FRESH = SourceState.FRESH


class CapacityIndex:
    """Per-rank capacity of one view as arrays (windows x ranks), so a decision is a few
    vector ops. Built in one pass over the ranks (a refresh at 1,024 ranks is on the hot
    path). Read-only once built; ranks that are not fresh have room and total 0."""

    def __init__(self, view: ClusterView, controller_id: str) -> None:
        self.version = view.version
        self.world_size = n = view.world_size
        self.rank_to_node = np.asarray(view.rank_to_node, dtype=np.int64)
        rooms: dict[Window, list[int]] = {}  # total - max(committed, used), per window
        totals: dict[Window, list[int]] = {}
        fresh = [False] * n
        tpb = 0
        seen: dict[int, int] = {}  # this controller's highest ticket each rank has shown
        unknown = 0  # fresh ranks whose commitments are unknown: never promised on
        for node in view.nodes:
            node_fresh = node.state is FRESH
            for r in node.ranks:
                if r.tickets:
                    t = r.tickets.get(controller_id)
                    if t:
                        seen[r.rank] = t
                gpu = r.gpu
                if not (node_fresh and gpu and r.state is FRESH):
                    continue
                if "committed" in r.unknown:  # an engine's rank: what it owes is not known
                    unknown += 1
                    continue
                rank = r.rank
                fresh[rank] = True
                for w, g in gpu.items():
                    room = rooms.get(w)
                    if room is None:
                        room = rooms[w] = [0] * n
                        totals[w] = [0] * n
                        tpb = tpb or g.tokens_per_block
                    held = g.num_blocks_committed
                    if held < g.num_blocks_used:
                        held = g.num_blocks_used
                    room[rank] = g.num_blocks_total - held
                    totals[w][rank] = g.num_blocks_total
        self.windows: tuple[Window, ...] = tuple(sorted(rooms, key=window_sort_key))
        self.col = {w: i for i, w in enumerate(self.windows)}
        self.tokens_per_block = tpb
        self.managers = [window_manager(w, tpb) for w in self.windows]
        k = len(self.windows)
        self.room: IntArray = np.array([rooms[w] for w in self.windows], dtype=np.int64)
        self.total: IntArray = np.array([totals[w] for w in self.windows], dtype=np.int64)
        self.room.shape = self.total.shape = (k, n)
        self.fresh = np.array(fresh, dtype=bool)
        self.any_fresh = any(fresh)
        self.num_unknown = unknown
        self.seen: IntArray = np.zeros(n, dtype=np.int64)
        if seen:
            self.seen[list(seen)] = list(seen.values())
