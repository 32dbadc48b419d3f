"""Model-based: a replica following an index kept in shards (kvfold.blockindex.feed
.follow_shards), against the shards' own indexes. Hypothesis interleaves block events of
sources on each shard's nodes, source deaths, shard restarts (a new feed: a new epoch,
empty until its sources' snapshots come) and a replica that refreshes now and then, or
misses a shard's answer. After each refresh, the replica holds exactly what every
shard's index holds, source by source; a shard answering whole rebuilds only its nodes.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfold.blockindex.feed import (
    NO_CURSOR,
    IndexFeed,
    Replica,
    Snapshot,
    follow_shards,
    shard_cursor,
)
from kvfold.blockindex.index import BlockIndex, Source
from kvfold.kvevents.events import (
    CPU,
    GPU,
    HOST,
    RANK,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventBatch,
)

RANK_TO_NODE = [0, 0, 1, 1, 2, 2]
SHARDS = (("rack-0", frozenset({0, 1})), ("rack-1", frozenset({2})))
SOURCES: list[Source] = [(RANK, r) for r in range(6)] + [(HOST, n) for n in range(3)]
KEYS = [bytes([k]) * 8 for k in range(12)]


def _node(source: Source) -> int:
    kind, i = source
    return i if kind == HOST else RANK_TO_NODE[i]


def _shard_of(source: Source) -> int:
    return next(k for k, (_, nodes) in enumerate(SHARDS) if _node(source) in nodes)


class ShardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.feeds = [IndexFeed(BlockIndex(RANK_TO_NODE), log_size=8) for _ in SHARDS]
        self.seq = dict.fromkeys(SOURCES, 0)
        self.life = dict.fromkeys(SOURCES, 1)
        self.truth: dict[Source, set[bytes]] = {s: set() for s in SOURCES}  # what each holds
        self.replica = Replica(RANK_TO_NODE)
        self.refreshed = False

    def _send(self, source: Source, events: tuple[object, ...]) -> None:
        """One batch into its shard's feed; a source the feed does not follow from its
        first batch (it joined late: a restarted shard) is resynchronised from a snapshot,
        as the keeper's resync loop asks for one."""
        if events:  # a heartbeat (no events) says where the source stands: the same seq
            self.seq[source] += 1
        kind, i = source
        batch = EventBatch(0.0, events)  # type: ignore[arg-type]
        env = Envelope(kind, i, self.life[source], self.seq[source], batch)
        feed = self.feeds[_shard_of(source)]
        feed.ingest(env)
        if source in feed.wanted():
            keys = {0: sorted(self.truth[source])}
            snap = Snapshot(kind, i, self.life[source], self.seq[source], keys, {0: None})
            assert feed.install(snap)

    @rule(source=st.sampled_from(SOURCES), keys=st.sets(st.sampled_from(KEYS), min_size=1))
    def store(self, source: Source, keys: set[bytes]) -> None:
        self.truth[source] |= keys
        medium = CPU if source[0] == HOST else GPU
        self._send(source, (BlockStored(tuple(sorted(keys)), None, 4, medium),))

    @rule(source=st.sampled_from(SOURCES), keys=st.sets(st.sampled_from(KEYS), min_size=1))
    def remove(self, source: Source, keys: set[bytes]) -> None:
        self.truth[source] -= keys
        medium = CPU if source[0] == HOST else GPU
        self._send(source, (BlockRemoved(tuple(sorted(keys)), medium),))

    @rule(source=st.sampled_from(SOURCES))
    def source_dies(self, source: Source) -> None:
        self.feeds[_shard_of(source)].drop(source)
        self.life[source] += 1  # it comes back as a new life, empty
        self.seq[source] = 0
        self.truth[source] = set()

    @rule(k=st.integers(0, len(SHARDS) - 1))
    def shard_restarts(self, k: int) -> None:
        """A new feed, empty; its sources resynchronise from snapshots at their next batch."""
        self.feeds[k] = IndexFeed(BlockIndex(RANK_TO_NODE), log_size=8)
        for s in SOURCES:
            if _shard_of(s) == k and self.seq[s]:
                self._send(s, ())  # a heartbeat: where it stands; its snapshot follows

    @rule(missed=st.sets(st.integers(0, len(SHARDS) - 1), max_size=1))
    def replica_refreshes(self, missed: set[int]) -> None:
        """Each shard answers its cursor as the keepers' block_index_since does (the ops
        after it, or a whole snapshot), but a missed one; the replica takes the merge."""
        olds = shard_cursor(self.replica.cursor, [name for name, _ in SHARDS])
        answers: list[tuple[Any, Any, bool] | None] = []
        for k, old in enumerate(olds):
            if k in missed:  # this shard did not answer in time
                answers.append(None)
                continue
            now, ops = self.feeds[k].since(old)
            whole = ops is None
            if ops is None:
                now, ops = self.feeds[k].snapshot_ops()
            answers.append((now, ops, whole))
        cursor, ops, whole = follow_shards(SHARDS, self.replica.cursor, answers)
        assert whole == (self.replica.cursor == NO_CURSOR)  # starts over only the first time
        self.replica.take(cursor, ops, whole)
        self.refreshed = not missed

    @invariant()
    def every_shard_holds_its_sources_keys(self) -> None:
        for s in SOURCES:
            held = self.feeds[_shard_of(s)].index.keys_of(s)
            assert held.get(0, set()) == self.truth[s], s

    @invariant()
    def a_full_refresh_holds_what_every_shard_holds(self) -> None:
        if not self.refreshed:
            return
        for s in SOURCES:
            want = self.feeds[_shard_of(s)].index.keys_of(s)
            assert self.replica.index.keys_of(s) == want, s
        self.refreshed = False  # the next change makes it stale until the next refresh


TestShardMachine = ShardMachine.TestCase
TestShardMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_replicas_first_cursor_is_no_shards_cursor() -> None:
    assert shard_cursor(NO_CURSOR, ["a", "b"]) == [NO_CURSOR, NO_CURSOR]
    cursor = (("a", (5, 7)), ("b", (9, 1)))
    assert shard_cursor(cursor, ["b", "c"]) == [(9, 1), NO_CURSOR]
