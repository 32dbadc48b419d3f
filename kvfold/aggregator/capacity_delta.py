"""A view's capacity on the wire as deltas, for controllers. Pure; no Ray.

A view entry changes with every report: its ranks' report numbers and ages, the node's
report time, its counters. What a decision reads of it (kvfold.admission.capacity.
NodeRows: per rank its state, each window's room and total, its tickets) changes only
when a rank's gauges, state or tickets do. So a controller is sent the nodes whose rows
changed since the version it holds, as a few columns of integers with its own tickets
alone, and takes them into its CapacityTable as arrays: it never decodes a node entry.
At 1,024 nodes x 8 ranks, 10% of the nodes changed is about 20 KiB and well under a
millisecond (`benchmarks/bench_fold_codec.py`), where their view entries are 142 KiB and
13 ms.

Positions (epoch, version), the sender's random epoch and the three answers (nothing;
the nodes changed after the reader's version; everything, with the topology) are those
of kvfold.aggregator.view_delta, whose versions these are. Pickled columns: one trusted
kvfold process to another.
"""

from __future__ import annotations

import pickle
import secrets
import threading
from typing import Any

import numpy as np

from kvfold.admission.capacity import (
    CapacityIndex,
    CapacityTable,
    NodeRows,
    RankColumns,
    node_rows,
    rank_columns,
)
from kvfold.aggregator.view_delta import KEEP, NOTHING, TAKE, what_to_do
from kvfold.stats import Window
from kvfold.view import ClusterView, NodeUtilization

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# on the wire: (field, dtype); ranks and counts of blocks fit 32 bits, tickets do not
_WIRE = (
    ("ranks", np.int32),
    ("status", np.int8),
    ("tokens_per_block", np.int32),
    ("seen", np.int64),
    ("g_rank", np.int32),
    ("g_window", np.int16),
    ("g_room", np.int32),
    ("g_total", np.int32),
)


def _pack(c: RankColumns) -> tuple[bytes, ...]:
    return tuple(getattr(c, name).astype(dtype, copy=False).tobytes() for name, dtype in _WIRE)


def _unpack(windows: tuple[Window, ...], packed: tuple[bytes, ...]) -> RankColumns:
    cols: list[Any] = [
        np.frombuffer(b, dtype=dtype).astype(np.int8 if name == "status" else np.int64)
        for (name, dtype), b in zip(_WIRE, packed, strict=True)
    ]
    return RankColumns(windows, *cols)


class CapacitySender:
    """The sending side, in the aggregator: `update` with every view it serves (cheap when
    the version did not change: node entries that are the same objects are skipped),
    then `since(position, controller_id)` for each controller."""

    def __init__(self) -> None:
        self.epoch = secrets.token_bytes(8)
        self.version = -1  # of the last view taken; -1: none yet
        self.first_version = -1
        self.rank_to_node: tuple[int, ...] | None = None
        self._entries: list[NodeUtilization] = []
        self._rows: list[NodeRows] = []
        self._changed_at: list[int] = []
        self._windows: dict[Window, int] = {}  # numbering of windows, for this sender's life

    def update(self, view: ClusterView) -> None:
        if view.version == self.version:
            return
        if view.rank_to_node != self.rank_to_node:
            self.rank_to_node, self.first_version = view.rank_to_node, view.version
            self._entries, self._rows, self._changed_at = [], [], []
        entries, rows, changed = self._entries, self._rows, self._changed_at
        for n, entry in enumerate(view.nodes):
            if n == len(entries):
                entries.append(entry)
                rows.append(node_rows(entry))
                changed.append(view.version)
            elif entry is not entries[n]:
                entries[n] = entry
                now = node_rows(entry)
                if now != rows[n]:
                    rows[n] = now
                    changed[n] = view.version
        self.version = view.version

    def since(self, position: tuple[bytes, int], controller_id: str) -> bytes | None:
        """What `controller_id`, holding `position` (epoch, version), needs; None: it is
        current."""
        if self.version < 0:
            raise RuntimeError("CapacitySender.since before any update")
        epoch, version = position
        if epoch == self.epoch and version == self.version:
            return None
        whole = epoch != self.epoch or not self.first_version <= version < self.version
        sent = (
            self._rows
            if whole
            else [r for r, at in zip(self._rows, self._changed_at, strict=True) if at > version]
        )
        c = rank_columns(sent, controller_id, self._windows)
        delta = (
            self.epoch,
            self.version,
            whole,
            self.rank_to_node if whole else None,
            c.windows,
            _pack(c),
        )
        return pickle.dumps(delta, _PROTOCOL)


class CapacityReader:
    """The reading side, for one controller: the index of the newest view it took.
    Thread-safe; within one sender's life it never goes back to an older version."""

    def __init__(self) -> None:
        self.index: CapacityIndex | None = None
        self.epoch = NOTHING[0]
        self._table: CapacityTable | None = None
        self._lock = threading.Lock()

    @property
    def position(self) -> tuple[bytes, int]:
        with self._lock:
            idx = self.index
            return (self.epoch, idx.version) if idx is not None else NOTHING

    def apply(self, data: bytes | None, asked: tuple[bytes, int]) -> CapacityIndex | None:
        """The index after a sender's answer to `since(asked, ...)`; None when that answer
        is relative to a version this reader no longer holds: ask again from `position`."""
        delta: Any = None if data is None else pickle.loads(data)
        with self._lock:
            old = self.index
            if delta is None:
                if old is None:
                    raise ValueError("capacity delta: nothing sent and no index held")
                return old
            epoch, version, whole, rank_to_node, windows, packed = delta
            held = (self.epoch, old.version) if old is not None else NOTHING
            todo = what_to_do(held, epoch, version, whole, asked)
            if todo != TAKE:
                return old if todo == KEEP else None
            if whole:
                self._table = CapacityTable(rank_to_node)
            assert self._table is not None
            self._table.take(_unpack(windows, packed))
            self.index = self._table.index(version)
            self.epoch = epoch
            return self.index
