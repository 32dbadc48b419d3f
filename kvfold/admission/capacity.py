"""CapacityIndex: one view's per-rank capacity as arrays, for a controller. Pure; no Ray.

A rank's room in window w is what its last report left uncommitted:

    room = total - max(committed, used)

`committed` is the rank's own count (held blocks plus what its sequences may still need,
kvfold.worker.commitments). The policy (kvfold.admission.policy) takes from it the
watermark and what this controller promised since. A rank whose source does not
publish its commitments (an engine's, `RankSummary.unknown`) is no candidate: room on
it cannot be promised (the front door keeps an engine's commitments itself, DESIGN
§11). `seen` is, per rank, this controller's highest ticket the rank has shown
(kvfold.tickets), which settles those promises.

What a node gives a controller is its `NodeRows`: a few numbers per rank, nothing of
the node's sequences, counters or report times. A `CapacityTable` holds every rank's
rows as arrays and takes them node by node; an index is a snapshot of a table. A
controller following capacity deltas (kvfold.aggregator.capacity_delta) fills its table
with the nodes whose rows changed; one given whole ClusterViews fills it from every
node. Both give the index of the same view.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvfold.stats import Window, window_sort_key
from kvfold.view import ClusterView, NodeUtilization, SourceState
from kvfold.worker.windows import window_manager

IntArray = npt.NDArray[np.int64]
FRESH = SourceState.FRESH

# a rank's status for admission
NOT_CANDIDATE = 0  # not fresh, on a node that is not fresh, or no KV cache bound
CANDIDATE = 1
COMMITTED_UNKNOWN = 2  # fresh, but its commitments are not published (an engine's rank)


class NodeRows(NamedTuple):
    """What one node gives a controller, per rank in rank order. Equal rows: nothing a
    decision reads has changed (the ranks' report times and counters may have)."""

    ranks: tuple[int, ...]
    status: tuple[int, ...]
    tokens_per_block: tuple[int, ...]  # first nonzero over its windows; 0: none
    gauges: tuple[tuple[int, Window, int, int], ...]  # (rank, window, room, total), candidates
    tickets: tuple[Mapping[str, int], ...]  # per rank: controller -> highest ticket shown


def node_rows(node: NodeUtilization) -> NodeRows:
    node_fresh = node.state is FRESH
    ranks: list[int] = []
    status: list[int] = []
    tpbs: list[int] = []
    gauges: list[tuple[int, Window, int, int]] = []
    tickets: list[Mapping[str, int]] = []
    for r in node.ranks:
        ranks.append(r.rank)
        tickets.append(r.tickets)
        gpu = r.gpu
        tpb = 0
        if not (node_fresh and gpu and r.state is FRESH):
            s = NOT_CANDIDATE
        elif "committed" in r.unknown:
            s = COMMITTED_UNKNOWN
        else:
            s = CANDIDATE
            for w, g in gpu.items():
                held = g.num_blocks_committed
                if held < g.num_blocks_used:
                    held = g.num_blocks_used
                gauges.append((r.rank, w, g.num_blocks_total - held, g.num_blocks_total))
                tpb = tpb or g.tokens_per_block
        status.append(s)
        tpbs.append(tpb)
    return NodeRows(tuple(ranks), tuple(status), tuple(tpbs), tuple(gauges), tuple(tickets))


class RankColumns(NamedTuple):
    """Rows of several nodes as columns, for one controller: what a CapacityTable takes.
    `g_*` list every candidate's windows (`g_window` indexes `windows`)."""

    windows: tuple[Window, ...]
    ranks: npt.NDArray[np.int64]
    status: npt.NDArray[np.int8]
    tokens_per_block: npt.NDArray[np.int64]
    seen: IntArray  # this controller's highest ticket each rank has shown; 0: none
    g_rank: npt.NDArray[np.int64]
    g_window: npt.NDArray[np.int64]
    g_room: IntArray
    g_total: IntArray


def rank_columns(
    rows: Iterable[NodeRows], controller_id: str, windows: dict[Window, int] | None = None
) -> RankColumns:
    """Columns of `rows` as `controller_id` reads them. `windows`: the window numbering to
    use, extended with any new window (a sender keeps one for its life)."""
    col = {} if windows is None else windows
    ranks: list[int] = []
    status: list[int] = []
    tpb: list[int] = []
    seen: list[int] = []
    g_rank: list[int] = []
    g_window: list[int] = []
    g_room: list[int] = []
    g_total: list[int] = []
    for row in rows:
        ranks += row.ranks
        status += row.status
        tpb += row.tokens_per_block
        seen += [shown.get(controller_id, 0) if shown else 0 for shown in row.tickets]
        for rank, w, room, total in row.gauges:
            i = col.get(w)
            if i is None:
                i = col[w] = len(col)
            g_rank.append(rank)
            g_window.append(i)
            g_room.append(room)
            g_total.append(total)
    i64 = np.int64
    return RankColumns(
        tuple(col),
        np.array(ranks, dtype=i64),
        np.array(status, dtype=np.int8),
        np.array(tpb, dtype=i64),
        np.array(seen, dtype=i64),
        np.array(g_rank, dtype=i64),
        np.array(g_window, dtype=i64),
        np.array(g_room, dtype=i64),
        np.array(g_total, dtype=i64),
    )


class CapacityTable:
    """Every rank's rows as arrays (a window's room and total where a candidate has the
    window), updated by the ranks given. Not thread-safe."""

    def __init__(self, rank_to_node: Sequence[int]) -> None:
        self.rank_to_node = tuple(rank_to_node)
        n = len(self.rank_to_node)
        self.windows: list[Window] = []
        self.status = np.zeros(n, dtype=np.int8)
        self.tokens_per_block = np.zeros(n, dtype=np.int64)
        self.seen = np.zeros(n, dtype=np.int64)
        self.has = np.zeros((0, n), dtype=bool)
        self.room = np.zeros((0, n), dtype=np.int64)
        self.total = np.zeros((0, n), dtype=np.int64)

    def take(self, c: RankColumns) -> None:
        """Replace the rows of the ranks in `c` with its."""
        n = len(self.rank_to_node)
        if c.ranks.size and (c.ranks.min() < 0 or c.ranks.max() >= n):
            raise ValueError(f"capacity rows name a rank outside a world of {n}")
        cols = np.array([self._col(w) for w in c.windows], dtype=np.int64)
        ranks = c.ranks
        self.status[ranks] = c.status
        self.tokens_per_block[ranks] = c.tokens_per_block
        self.seen[ranks] = c.seen
        self.has[:, ranks] = False
        self.room[:, ranks] = 0
        self.total[:, ranks] = 0
        if c.g_rank.size:
            at = cols[c.g_window]
            self.has[at, c.g_rank] = True
            self.room[at, c.g_rank] = c.g_room
            self.total[at, c.g_rank] = c.g_total

    def _col(self, w: Window) -> int:
        try:
            return self.windows.index(w)
        except ValueError:
            n = len(self.rank_to_node)
            self.windows.append(w)
            self.has = np.vstack([self.has, np.zeros((1, n), dtype=bool)])
            self.room = np.vstack([self.room, np.zeros((1, n), dtype=np.int64)])
            self.total = np.vstack([self.total, np.zeros((1, n), dtype=np.int64)])
            return len(self.windows) - 1

    def index(self, version: int) -> CapacityIndex:
        """The index of what the table holds, as at `version` (a copy: later takes do not
        change it)."""
        fresh = self.status == CANDIDATE
        held = self.has & fresh
        present = [i for i in range(len(self.windows)) if held[i].any()]
        present.sort(key=lambda i: window_sort_key(self.windows[i]))
        known = self.tokens_per_block[fresh]
        known = known[known > 0]
        return CapacityIndex(
            version,
            self.rank_to_node,
            tuple(self.windows[i] for i in present),
            int(known[0]) if known.size else 0,
            np.where(held[present], self.room[present], 0),
            np.where(held[present], self.total[present], 0),
            fresh,
            int(np.count_nonzero(self.status == COMMITTED_UNKNOWN)),
            self.seen.copy(),
        )


class ViewCapacity:
    """The index of each whole view a controller is given, computing rows only for the
    node entries that are not the very objects of the view before (ClusterState and
    ViewReader keep the entries that did not change). Not thread-safe."""

    def __init__(self, controller_id: str) -> None:
        self.controller_id = controller_id
        self._entries: tuple[NodeUtilization, ...] = ()
        self._table: CapacityTable | None = None

    def index(self, view: ClusterView) -> CapacityIndex:
        table, old = self._table, self._entries
        if table is None or table.rank_to_node != view.rank_to_node:
            table, old = CapacityTable(view.rank_to_node), ()
        changed = [
            node_rows(entry)
            for n, entry in enumerate(view.nodes)
            if n >= len(old) or entry is not old[n]
        ]
        table.take(rank_columns(changed, self.controller_id))
        self._table, self._entries = table, view.nodes
        return table.index(view.version)


class CapacityIndex:
    """Per-rank capacity of one view as arrays (windows x ranks), so a decision is a few
    vector ops. Read-only once built; ranks that are not candidates have room and total
    0. `CapacityIndex.of_view(view, controller_id)`, or a CapacityTable's `index()`."""

    def __init__(
        self,
        version: int,
        rank_to_node: tuple[int, ...],
        windows: tuple[Window, ...],
        tokens_per_block: int,
        room: IntArray,
        total: IntArray,
        fresh: npt.NDArray[np.bool_],
        num_unknown: int,
        seen: IntArray,
    ) -> None:
        self.version = version
        self.rank_to_node = rank_to_node
        self.world_size = len(rank_to_node)
        self.windows = windows
        self.col = {w: i for i, w in enumerate(windows)}
        self.tokens_per_block = tokens_per_block
        self.managers = [window_manager(w, tokens_per_block) for w in windows]
        self.room = room
        self.total = total
        self.fresh = fresh
        self.any_fresh = bool(fresh.any())
        self.num_unknown = num_unknown  # fresh ranks never promised on: commitments unknown
        self.seen = seen

    @classmethod
    def of_view(cls, view: ClusterView, controller_id: str) -> CapacityIndex:
        table = CapacityTable(view.rank_to_node)
        table.take(rank_columns(map(node_rows, view.nodes), controller_id))
        return table.index(view.version)

    def same_as(self, other: CapacityIndex) -> bool:
        """Equal in everything a decision reads (for tests and checks)."""
        return (
            self.version == other.version
            and self.rank_to_node == other.rank_to_node
            and self.windows == other.windows
            and self.tokens_per_block == other.tokens_per_block
            and self.num_unknown == other.num_unknown
            and all(
                np.array_equal(a, b)
                for a, b in (
                    (self.room, other.room),
                    (self.total, other.total),
                    (self.fresh, other.fresh),
                    (self.seen, other.seen),
                )
            )
        )
