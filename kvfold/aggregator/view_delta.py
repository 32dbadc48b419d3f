"""Views on the wire as deltas: a reader is sent only the nodes that changed since the
version it holds, each encoded once per change. Pure; no Ray.

A fold keeps the node entries that did not change (kvfold.aggregator.cluster_state:
the same objects), so the sender knows, per node, the version at which its entry last
changed, and keeps that entry's bytes. Each sender draws a random epoch; a reader holding
version v of epoch e gets:

    nothing                                   it holds this sender's current version
    the cluster's totals + the nodes whose    it holds an older version of this sender's
      entry changed after v                   (most reads: one node or a few)
    everything                                it holds nothing, or a view of another
                                              sender (the aggregator restarted: its
                                              versions may even be lower)

so a reader pays to decode what changed, not the whole cluster (at 1,024 ranks a whole
view takes milliseconds to decode), and the sender encodes each node once per change,
not once per reader. The reader rebuilds a ClusterView equal to the sender's.
Pickled, as whole views are: one trusted kvfold process to another.
"""

from __future__ import annotations

import pickle
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from kvfold.view import ClusterView, NodeUtilization

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_TOTALS = ("built_at_s", "gpu", "host", "num_sequences_by_status", "counters", "built_at_unix_s")


NOTHING: tuple[bytes, int] = (b"", 0)  # a reader's position before its first view
KEEP, ASK_AGAIN, TAKE = "keep", "ask_again", "take"


def what_to_do(
    held: tuple[bytes, int], epoch: bytes, version: int, whole: bool, asked: tuple[bytes, int]
) -> str:
    """What a reader holding `held` does with a sender's answer (its epoch, version, and
    whether it is whole) to `since(asked)`: KEEP what it holds (as new or newer, from the
    same sender), ASK_AGAIN (a delta from a version it no longer holds: another thread
    moved it on), or TAKE it. Readers of views and of capacity alike."""
    if held[0] == epoch and version <= held[1]:
        return KEEP
    if not whole and held != asked:
        return ASK_AGAIN
    return TAKE


@dataclass(frozen=True, slots=True)
class ViewDelta:
    epoch: bytes  # the sender's
    version: int
    whole: bool  # every node is here, with the topology: the reader starts over
    rank_to_node: tuple[int, ...] | None  # with `whole` only
    totals: bytes  # the cluster's own fields (everything but the nodes and the topology)
    nodes: tuple[tuple[int, bytes], ...]  # (node, its entry) for the nodes sent


class ViewSender:
    """The sending side, in the aggregator. `update` with every view it serves (cheap
    when the version did not change), then `since(v)` for each reader."""

    def __init__(self) -> None:
        self.epoch = secrets.token_bytes(8)
        self.view: ClusterView | None = None
        self.first_version = -1  # the first version this sender saw
        self._entries: list[NodeUtilization] = []
        self._bytes: list[bytes | None] = []  # an entry's, once a reader was sent it
        self._changed_at: list[int] = []
        self._totals = b""

    def update(self, view: ClusterView) -> None:
        old = self.view
        if old is not None and view.version == old.version:
            return
        if old is None or view.rank_to_node != old.rank_to_node:
            self.first_version = view.version
            self._entries, self._bytes, self._changed_at = [], [], []
        entries, encoded, changed = self._entries, self._bytes, self._changed_at
        for n, entry in enumerate(view.nodes):
            if n == len(entries):
                entries.append(entry)
                encoded.append(None)
                changed.append(view.version)
            elif entry is not entries[n] and entry != entries[n]:
                entries[n] = entry
                encoded[n] = None
                changed[n] = view.version
        self._totals = pickle.dumps(tuple(getattr(view, f) for f in _TOTALS), _PROTOCOL)
        self.view = view

    def since(self, position: tuple[bytes, int]) -> bytes | None:
        """What a reader at `position` (epoch, version) needs; None: it is current."""
        view = self.view
        if view is None:
            raise RuntimeError("ViewSender.since before any update")
        epoch, version = position
        if epoch == self.epoch and version == view.version:
            return None
        whole = epoch != self.epoch or not self.first_version <= version < view.version
        nodes = tuple(
            (n, self._encoded(n)) for n, at in enumerate(self._changed_at) if whole or at > version
        )
        delta = ViewDelta(
            self.epoch,
            view.version,
            whole,
            view.rank_to_node if whole else None,
            self._totals,
            nodes,
        )
        return pickle.dumps(delta, _PROTOCOL)

    def _encoded(self, node: int) -> bytes:
        b = self._bytes[node]
        if b is None:  # encoded once per change, when first sent (capacity readers never ask)
            b = self._bytes[node] = pickle.dumps(self._entries[node], _PROTOCOL)
        return b


class ViewReader:
    """The reading side, in a client: the newest view it rebuilt. Thread-safe; within one
    sender's life it never goes back to an older version."""

    def __init__(self) -> None:
        self.view: ClusterView | None = None
        self.epoch = NOTHING[0]
        self._lock = threading.Lock()

    @property
    def position(self) -> tuple[bytes, int]:
        """(epoch, version) of the view held: what to ask a sender `since`."""
        with self._lock:
            view = self.view
            return (self.epoch, view.version) if view is not None else NOTHING

    def apply(self, data: bytes | None, asked: tuple[bytes, int]) -> ClusterView | None:
        """The view after a sender's answer to `since(asked)`; None when that answer is
        relative to a view this reader no longer holds (another thread moved it on):
        ask again from `position`."""
        delta: ViewDelta | None = None if data is None else pickle.loads(data)
        with self._lock:
            old = self.view
            if delta is None:  # `asked` is current: what it holds is that, or newer
                if old is None:
                    raise ValueError("view delta: nothing sent and no view held")
                return old
            held = (self.epoch, old.version) if old is not None else NOTHING
            todo = what_to_do(held, delta.epoch, delta.version, delta.whole, asked)
            if todo != TAKE:
                return old if todo == KEEP else None
            if delta.whole:
                assert delta.rank_to_node is not None
                rank_to_node = delta.rank_to_node
                nodes: list[Any] = [None] * len(delta.nodes)
            else:
                assert old is not None
                rank_to_node, nodes = old.rank_to_node, list(old.nodes)
            for n, entry in delta.nodes:
                nodes[n] = pickle.loads(entry)
            totals = dict(zip(_TOTALS, pickle.loads(delta.totals), strict=True))
            self.view = ClusterView(
                version=delta.version, rank_to_node=rank_to_node, nodes=tuple(nodes), **totals
            )
            self.epoch = delta.epoch
            return self.view
