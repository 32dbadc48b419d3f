"""IndexFeed: per-source event streams into a BlockIndex, and the op log its replicas follow.

Each source (a rank's GPU cache, a node's host tier) numbers its batches 1, 2, ... per
incarnation. The feed applies a source's batches in that order:

    next seq                    applied
    seq already applied         ignored (a duplicate)
    a gap, or a new incarnation
        not starting at 1       the source is out of sync: its batches are kept aside,
                                and it is listed in `wanted()` until a snapshot of its
                                keys (taken with the seq it stands at) is installed;
                                the kept batches after it then apply in order
    new incarnation at seq 1    its old entries are dropped; it starts empty
    a dead source               `drop()`: its entries leave the index

A batch is never empty; an envelope with no events is a heartbeat: "I stand at seq",
sent now and then by an idle source, so a lost last batch is noticed even when
nothing follows it.

Every change to the index is also appended to a bounded op log; a replica (a
controller's copy, kvfold.blockindex.feed.Replica) asks for the ops after its cursor,
or gets a whole snapshot when it fell behind the log. A cursor is (epoch, ops so far):
a feed started again (an aggregator restart) has a new epoch, so a replica of the old
one is rebuilt rather than fed another log's ops. Pure; no Ray.

An index may be kept in shards, each feed the sources of some nodes (a rack's, in its
rack actor: docs/scale.md). A replica follows them all as one: `follow_shards` turns
each shard's answer into ops on the one replica, a shard's whole snapshot preceded by a
("clear_nodes", its nodes) op, so the other shards' sources stay; its cursor is then one
cursor per shard (`ShardCursor`).
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfold.blockindex.index import BlockIndex, Source
from kvfold.kvevents.events import Envelope, Event
from kvfold.kvevents.snapshot import Snapshot

MAX_KEPT_BATCHES = 256  # per source while out of sync; the snapshot covers what is dropped
MAX_RETIRED = 8  # incarnations of a source remembered, so their late batches are ignored

# op log entries: ("apply", source, events)
#                 | ("reset", source, keys by group, windows, block size)
#                 | ("drop", source)
# and, made by a replica following shards: ("clear_nodes", nodes)
Op = tuple[Any, ...]
Cursor = tuple[int, int]  # (the feed's epoch, ops appended so far)
NO_CURSOR: Cursor = (0, -1)  # a replica that has taken nothing yet
# a replica following shards: (shard name, its cursor) per shard, in the shards' order
ShardCursor = tuple[tuple[str, Cursor], ...]


def apply_op(index: BlockIndex, op: Op) -> None:
    """One op of the log, on an index (the feed's own, or a replica's)."""
    kind = op[0]
    if kind == "apply":
        index.apply(op[1], op[2])
    elif kind == "reset":
        index.reset(op[1], op[2], op[3], op[4])
    elif kind == "clear_nodes":
        nodes = op[1]
        for source in [s for s in index.held if index.node_of(s) in nodes]:
            index.clear(source)
    else:
        index.clear(op[1])


def is_shard_cursor(cursor: Any) -> bool:
    """A ShardCursor, not one feed's Cursor (nor a replica's first)."""
    return bool(cursor) and isinstance(cursor[0], (tuple, list))


def shard_cursor(cursor: Any, shards: Sequence[str]) -> list[Cursor]:
    """Each shard's cursor in a replica's `cursor` (NO_CURSOR for a shard it has not
    followed: a replica's first cursor, or one of a single feed)."""
    held: dict[str, Cursor] = {}
    if is_shard_cursor(cursor):
        held = {name: (int(c[0]), int(c[1])) for name, c in cursor}
    return [held.get(name, NO_CURSOR) for name in shards]


def follow_shards(
    shards: Sequence[tuple[str, frozenset[int]]],
    cursor: Any,
    answers: Sequence[tuple[Cursor, list[Op], bool] | None],
) -> tuple[ShardCursor, list[Op], bool]:
    """A replica's next (cursor, ops, whole), from each shard's answer (name, its nodes)
    to `since` its cursor: (cursor now, ops, whole), or None when it did not come in time
    (that shard's cursor stays; it is asked again next refresh). `whole`: the replica had
    no shard cursor (its first refresh, or it followed one feed): it starts over."""
    olds = shard_cursor(cursor, [name for name, _ in shards])
    merged: list[tuple[str, Cursor]] = []
    ops: list[Op] = []
    for (name, nodes), old, answer in zip(shards, olds, answers, strict=True):
        if answer is None:
            merged.append((name, old))
            continue
        now, shard_ops, whole = answer
        if whole:  # the shard's snapshot rebuilds its nodes alone: the others stay
            ops.append(("clear_nodes", nodes))
        ops.extend(shard_ops)
        merged.append((name, (int(now[0]), int(now[1]))))
    return tuple(merged), ops, not is_shard_cursor(cursor)


@dataclass(slots=True)
class _Stream:
    incarnation: int
    seq: int = 0  # the last batch applied (or the snapshot's seq)
    synced: bool = True
    kept: dict[int, tuple[Event, ...]] = field(default_factory=dict)
    retired: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_RETIRED))


class IndexFeed:
    def __init__(self, index: BlockIndex, log_size: int = 4096) -> None:
        self.index = index
        self.streams: dict[Source, _Stream] = {}
        # dropped sources: (the life dropped, the lives it had retired)
        self._dropped: dict[Source, tuple[int, deque[int]]] = {}
        self.log: deque[Op] = deque(maxlen=log_size)
        self.epoch = secrets.randbits(62) | 1
        self.num_ops = 0  # ops appended so far; the log holds the last len(log) of them
        self.counts = {
            "applied": 0,
            "duplicate": 0,
            "kept": 0,
            "gaps": 0,
            "snapshots": 0,
            "stale_incarnation": 0,
            "dropped": 0,
            "heartbeat": 0,
            "stale_snapshot": 0,
        }

    @property
    def cursor(self) -> Cursor:
        return (self.epoch, self.num_ops)

    # ------------------------------------------------------------------ intake

    def _op(self, op: Op) -> None:
        apply_op(self.index, op)
        self.log.append(op)
        self.num_ops += 1

    def ingest(self, env: Envelope) -> str:
        """Take one batch; return what became of it (a key of `counts`)."""
        source: Source = (env.kind, env.source)
        self.index.check_source(source)
        st = self.streams.get(source)
        if st is None or st.incarnation != env.incarnation:
            dropped = self._dropped.get(source) if st is None else None
            retired = st.retired if st is not None else dropped[1] if dropped else ()
            if env.incarnation in retired:
                return self._count("stale_incarnation")
            fresh = _Stream(env.incarnation)
            fresh.retired.extend(retired)
            if st is not None:
                fresh.retired.append(st.incarnation)
            again = dropped is not None and dropped[0] == env.incarnation
            if dropped is not None and not again:
                fresh.retired.append(dropped[0])  # a new life: the dropped one is over
            self._dropped.pop(source, None)
            self.streams[source] = st = fresh
            if source in self.index.held:
                self._op(("drop", source))  # a new incarnation: the old one's keys are gone
            # joined late, or a dropped life come back: what it holds is unknown
            if env.seq != 1 or not env.batch.events or again:
                st.synced = False
                self.counts["gaps"] += 1
        if not env.batch.events:  # a heartbeat: only says where the source stands
            if env.seq > st.seq and st.synced:
                st.synced = False
                self.counts["gaps"] += 1
            return self._count("heartbeat")
        if env.seq <= st.seq:
            return self._count("duplicate")
        if st.synced and env.seq == st.seq + 1:
            self._apply(source, st, env.seq, env.batch.events)
            return self._count("applied")
        if st.synced:
            st.synced = False
            self.counts["gaps"] += 1
        st.kept[env.seq] = env.batch.events
        while len(st.kept) > MAX_KEPT_BATCHES:
            del st.kept[min(st.kept)]
        return self._count("kept")

    def _count(self, what: str) -> str:
        self.counts[what] += 1
        return what

    def _apply(self, source: Source, st: _Stream, seq: int, events: tuple[Event, ...]) -> None:
        self._op(("apply", source, events))
        st.seq = seq

    def wanted(self) -> list[Source]:
        """Sources out of sync: each needs a snapshot (`install`)."""
        return [s for s, st in self.streams.items() if not st.synced]

    def install(self, snap: Snapshot) -> bool:
        """Reset an out-of-sync source to its snapshot, then apply the kept batches after
        it. A snapshot of another incarnation than the stream's, or for a stream in sync
        by now, is ignored (it may be older than what was applied since): False."""
        source: Source = (snap.kind, snap.source)
        self.index.check_source(source)
        st = self.streams.get(source)
        if st is None or st.synced or st.incarnation != snap.incarnation:
            self.counts["stale_snapshot"] += 1
            return False
        self._op(("reset", source, dict(snap.keys), dict(snap.windows), snap.block_size))
        self.counts["snapshots"] += 1
        st.seq, st.synced = max(st.seq, snap.seq), True
        for seq in sorted(st.kept):
            if seq <= st.seq:
                continue
            if seq != st.seq + 1:
                st.synced = False  # still a hole: another snapshot
                break
            self._apply(source, st, seq, st.kept[seq])
        st.kept = {s: e for s, e in st.kept.items() if s > st.seq} if not st.synced else {}
        return True

    def life(self, source: Source) -> tuple[int, tuple[int, ...]] | None:
        """(the incarnation a source's stream is in, the ones it retired), or None."""
        st = self.streams.get(source)
        return None if st is None else (st.incarnation, tuple(st.retired))

    def drop(self, source: Source) -> None:
        """A dead, removed or replaced source: its entries leave the index; it starts over
        if it comes back (late batches of the lives it had retired are still ignored)."""
        st = self.streams.pop(source, None)
        if st is not None:  # its own life may come back (silence is not always death): a
            # stream of it opens out of sync, credited only from a snapshot; a later life
            # retires it
            self._dropped[source] = (st.incarnation, deque(st.retired, maxlen=MAX_RETIRED))
        if source in self.index.held:
            self._op(("drop", source))
            self.counts["dropped"] += 1

    # ------------------------------------------------------------------ replicas

    def since(self, cursor: Cursor) -> tuple[Cursor, list[Op] | None]:
        """The ops after `cursor` (None: another epoch, or the log no longer reaches
        back: take `snapshot_ops`)."""
        epoch, n = cursor
        behind = self.num_ops - n
        if epoch != self.epoch or behind < 0 or behind > len(self.log):
            return self.cursor, None
        if behind == 0:
            return self.cursor, []
        return self.cursor, list(self.log)[len(self.log) - behind :]

    def snapshot_ops(self) -> tuple[Cursor, list[Op]]:
        """Ops that rebuild the whole index from empty, and the cursor they stand at."""
        idx = self.index
        ops: list[Op] = [
            ("reset", s, {g: list(ks) for g, ks in idx.keys_of(s).items()}, dict(idx.windows),
             idx.block_size)
            for s in idx.sources()
        ]  # fmt: skip
        return self.cursor, ops


class Replica:
    """A copy of an index, kept up to date from an IndexFeed's op log (a controller's)."""

    def __init__(self, rank_to_node: list[int]) -> None:
        self.rank_to_node = list(rank_to_node)
        self.index = BlockIndex(self.rank_to_node)
        self.cursor: Cursor = NO_CURSOR
        self.resets = 0  # whole snapshots taken (first sync, fell behind, a new feed)

    def take(self, cursor: Cursor, ops: Iterable[Op] | None, whole: bool = False) -> None:
        """Apply ops that follow this replica's cursor; `whole`: they rebuild it from empty."""
        if whole:
            self.index = BlockIndex(self.rank_to_node)
            self.resets += 1
        for op in ops or ():
            apply_op(self.index, op)
        self.cursor = cursor
