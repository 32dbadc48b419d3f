"""EventJournal: what one source's reusable keys gained and lost since the last drain.

A block pool (or a host tier) tells the journal each key it makes reusable, in runs
with the run's parent, and each key it drops. `drain()` hands out the net change as
vLLM-shaped events (kvfold.kvevents.events), compacted:

    stored then removed within one batch    -> nothing
    removed then stored again               -> nothing (the index already holds it)
    cleared                                 -> AllBlocksCleared, then what came after

so a batch's size follows what changed, not how often it changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfold.kvevents.events import (
    GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)
from kvfold.stats import Window

_STORED = 1
_REMOVED = -1


class _GroupJournal:
    __slots__ = ("net", "runs")

    def __init__(self) -> None:
        self.net: dict[BlockHash, int] = {}  # key -> _STORED / _REMOVED since the last drain
        self.runs: list[tuple[BlockHash | None, list[BlockHash]]] = []  # (parent, keys)


class EventJournal:
    def __init__(self, windows: Sequence[Window], block_size: int, medium: str = GPU) -> None:
        self.windows = tuple(windows)
        self.group_of = {w: i for i, w in enumerate(self.windows)}
        self.block_size = block_size
        self.medium = medium
        self._groups = [_GroupJournal() for _ in self.windows]
        self._cleared = False

    def stored(self, window: Window, keys: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """Keys that became reusable, in prefix order after `parent`."""
        if not keys:
            return
        g = self._groups[self.group_of[window]]
        net = g.net
        for k in keys:
            if net.get(k) == _REMOVED and not self._cleared:
                del net[k]  # removed then stored again: the index still holds it
            else:
                net[k] = _STORED  # (after a clear the index holds nothing: say it)
        g.runs.append((parent, list(keys)))

    def removed(self, window: Window, key: BlockHash) -> None:
        g = self._groups[self.group_of[window]]
        if g.net.get(key) == _STORED:
            del g.net[key]
        else:
            g.net[key] = _REMOVED

    def cleared(self) -> None:
        """Everything this source held is gone (a cache rebuilt, a tier emptied)."""
        self._groups = [_GroupJournal() for _ in self.windows]
        self._cleared = True

    def __bool__(self) -> bool:
        return self._cleared or any(g.net for g in self._groups)

    def drain(self) -> list[Event]:
        """The net change since the last drain, and start a new batch."""
        out: list[Event] = [AllBlocksCleared()] if self._cleared else []
        for i, g in enumerate(self._groups):
            window = self.windows[i]
            gone = [k for k, v in g.net.items() if v == _REMOVED]
            if gone:
                out.append(BlockRemoved(tuple(gone), self.medium, i))
            out.extend(self._stored_events(g, i, window))
        self._groups = [_GroupJournal() for _ in self.windows]
        self._cleared = False
        return out

    def _stored_events(self, g: _GroupJournal, group: int, window: Window) -> list[Event]:
        """Each run, less what no longer counts as stored, split where keys dropped out;
        every piece keeps its true parent (the key before it in its run)."""
        out: list[Event] = []
        net, emitted = g.net, set()
        for parent, keys in g.runs:
            piece: list[BlockHash] = []
            before = parent
            for k in keys:
                if net.get(k) == _STORED and k not in emitted:
                    if not piece:
                        piece_parent = before
                    piece.append(k)
                    emitted.add(k)
                elif piece:
                    out.append(self._stored(piece, piece_parent, group, window))
                    piece = []
                before = k
            if piece:
                out.append(self._stored(piece, piece_parent, group, window))
        return out

    def _stored(
        self, keys: list[BlockHash], parent: BlockHash | None, group: int, window: Window
    ) -> BlockStored:
        return BlockStored(tuple(keys), parent, self.block_size, self.medium, group, window)
