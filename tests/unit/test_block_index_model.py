"""Model-based: the cluster block index against a recount of every source's own keys.

Three real caches (full attention and a sliding window, small pools: evictions) on two
nodes, each node with a real host tier (offloads, onboards, its own evictions), every
source publishing its block events as encoded envelopes into a per-source channel.
Hypothesis interleaves cache operations with deliveries, lost batches, rank restarts,
rank deaths and resynchronisation from snapshots. Whenever everything in flight has
been delivered and every out-of-sync source resynchronised, the index (and a replica
following its op log) must hold exactly each live source's keys, and nothing of the
dead ones.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfold.blockindex.feed import IndexFeed, Replica
from kvfold.blockindex.index import BlockIndex, Source
from kvfold.hosttier.packing import unpack_blocks
from kvfold.hosttier.tier import HostTierServer
from kvfold.kvevents.events import (
    HOST,
    RANK,
    Envelope,
    EventBatch,
    decode_envelope,
    encode_envelope,
)
from kvfold.kvevents.snapshot import Snapshot
from kvfold.worker import PagedKVCache
from tests.unit.builders import make_config

RANK_TO_NODE = [0, 0, 1]
CONFIG = make_config({None: 10, 8: 8}, windows=(None, 8), tokens_per_block=4, head_dim=4)
PREFIXES = [list(range(100, 112)), list(range(200, 208)), []]


class TierSeam:
    """The HostTier seam over an in-process HostTierServer (a node actor's)."""

    def __init__(self, server: HostTierServer) -> None:
        self.server = server

    def fetch(self, window: Any, keys: Any) -> list[np.ndarray]:
        return unpack_blocks(*self.server.get_packed(CONFIG.block_layout(), window, list(keys)))

    def offload_many(self, items: Any) -> list[bool]:
        return self.server.put_many(CONFIG.block_layout(), items)


class Source_:
    """One publishing source: its journal's drain, its seq, its channel to the index."""

    def __init__(self, kind: str, i: int, incarnation: int, journal: Any) -> None:
        self.kind, self.i, self.incarnation, self.journal = kind, i, incarnation, journal
        self.seq = 0
        self.channel: deque[bytes] = deque()

    def publish(self) -> None:
        """The next batch, or (nothing changed) a heartbeat saying where the stream stands."""
        events = self.journal.drain()
        if events:
            self.seq += 1
        if events or self.seq:
            batch = EventBatch(0.0, tuple(events))
            env = Envelope(self.kind, self.i, self.incarnation, self.seq, batch)
            self.channel.append(encode_envelope(env))

    def snapshot(self, keys: dict[int, list[Any]], windows: dict[int, Any]) -> Snapshot:
        events = self.journal.drain()  # what changed since the last batch goes out first
        if events:
            self.seq += 1
            env = Envelope(self.kind, self.i, self.incarnation, self.seq, EventBatch(0.0, events))
            self.channel.append(encode_envelope(env))
        return Snapshot(self.kind, self.i, self.incarnation, self.seq, keys, windows, 4)


class BlockIndexModel(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.feed = IndexFeed(BlockIndex(RANK_TO_NODE), log_size=64)
        self.replica = Replica(RANK_TO_NODE)
        self.incarnations = 0
        self.tiers = [HostTierServer(6, CONFIG.block_layout()) for _ in range(2)]
        self.sources: dict[Source, Source_] = {}
        for node, tier in enumerate(self.tiers):
            self.sources[(HOST, node)] = Source_(HOST, node, self._inc(), tier.pool.journal)
        self.caches: list[PagedKVCache | None] = [None] * 3
        self.live: list[list[str]] = [[], [], []]
        self.dead: set[int] = set()
        self.n = 0
        for r in range(3):
            self._start_rank(r)

    def _inc(self) -> int:
        self.incarnations += 1
        return self.incarnations

    def _start_rank(self, r: int) -> None:
        tier = TierSeam(self.tiers[RANK_TO_NODE[r]])
        cache = PagedKVCache(CONFIG, host_tier=tier)  # type: ignore[arg-type]
        cache.events.cleared()  # as the rank actor does: a new cache starts empty
        self.caches[r] = cache
        self.live[r] = []
        self.sources[(RANK, r)] = Source_(RANK, r, self._inc(), cache.events)

    # ------------------------------------------------------------ the caches

    @rule(r=st.integers(0, 2), p=st.integers(0, 2), extra=st.integers(1, 14))
    def add(self, r: int, p: int, extra: int) -> None:
        cache = self.caches[r]
        if cache is None:
            return
        self.n += 1
        sid = f"s{self.n}"
        if cache.add_sequence(sid, PREFIXES[p] + list(range(self.n * 50, self.n * 50 + extra))):
            self.live[r].append(sid)

    @rule(r=st.integers(0, 2), k=st.integers(0, 9), n=st.integers(1, 6))
    def grow(self, r: int, k: int, n: int) -> None:
        cache = self.caches[r]
        if cache is not None and self.live[r]:
            cache.append_tokens(self.live[r][k % len(self.live[r])], list(range(n)))

    @rule(r=st.integers(0, 2), k=st.integers(0, 9))
    def free(self, r: int, k: int) -> None:
        cache = self.caches[r]
        if cache is not None and self.live[r]:
            cache.free_sequence(self.live[r].pop(k % len(self.live[r])))

    # ------------------------------------------------------------ faults

    @rule(r=st.integers(0, 2))
    def restart_rank(self, r: int) -> None:
        """A new incarnation: an empty cache; batches of the old one may still be in flight."""
        self.dead.discard(r)
        self._start_rank(r)

    @rule(r=st.integers(0, 2))
    def rank_dies(self, r: int) -> None:
        self.caches[r] = None
        self.dead.add(r)
        self.sources.pop((RANK, r), None)
        self.feed.drop((RANK, r))

    # ------------------------------------------------------------ the channels

    @rule()
    def tick(self) -> None:
        """Every source publishes (the report loops' tick)."""
        for src in self.sources.values():
            src.publish()

    @rule()
    def deliver_all(self) -> None:
        for src in self.sources.values():
            while src.channel:
                self.feed.ingest(decode_envelope(src.channel.popleft()))

    @rule(which=st.integers(0, 4), lose=st.booleans())
    def deliver(self, which: int, lose: bool) -> None:
        """The next batch of one source arrives, or is lost."""
        srcs = [s for s in self.sources.values() if s.channel]
        if not srcs:
            return
        data = srcs[which % len(srcs)].channel.popleft()
        if not lose:
            self.feed.ingest(decode_envelope(data))

    @rule(which=st.integers(0, 4))
    def lose_newest(self, which: int) -> None:
        """The newest batch of one source is lost (nothing may follow it for a while)."""
        srcs = [s for s in self.sources.values() if s.channel]
        if srcs:
            srcs[which % len(srcs)].channel.pop()

    @rule()
    def resync(self) -> None:
        for kind, i in self.feed.wanted():
            self._snapshot(kind, i)

    def _snapshot(self, kind: str, i: int) -> None:
        src = self.sources.get((kind, i))
        if src is None:
            return
        if kind == RANK:
            cache = self.caches[i]
            assert cache is not None
            snap = src.snapshot(cache.reusable_keys(), dict(enumerate(cache.windows)))
        else:
            pool = self.tiers[i].pool
            snap = src.snapshot(pool.reusable_keys(), dict(enumerate(CONFIG.windows)))
        self.feed.install(snap)

    @rule()
    def follow(self) -> None:
        cursor, ops = self.feed.since(self.replica.cursor)
        if ops is None:
            cursor, ops = self.feed.snapshot_ops()
            self.replica.take(cursor, ops, whole=True)
        else:
            self.replica.take(cursor, ops)

    # ------------------------------------------------------------ the promise

    def _truth(self, source: Source) -> dict[int, set[Any]]:
        kind, i = source
        if kind == RANK:
            cache = self.caches[i]
            keys = cache.reusable_keys() if cache is not None else {}
        else:
            keys = self.tiers[i].pool.reusable_keys()
        return {g: set(ks) for g, ks in keys.items() if ks}

    @precondition(lambda self: True)
    @rule()
    def quiesce_and_check(self) -> None:
        for _ in range(20):  # publish, deliver everything, resync, until nothing moves
            for src in self.sources.values():
                src.publish()
                while src.channel:
                    self.feed.ingest(decode_envelope(src.channel.popleft()))
            if not self.feed.wanted():
                break
            self.resync()
        assert not self.feed.wanted()
        idx = self.feed.index
        for source in self.sources:
            assert idx.keys_of(source) == self._truth(source), source
        for r in self.dead:
            assert idx.keys_of((RANK, r)) == {}, f"dead rank {r} still in the index"
        self.follow()
        for source in {*self.sources, *((RANK, r) for r in self.dead)}:
            assert self.replica.index.keys_of(source) == idx.keys_of(source), source
        if idx.sources():  # a replica rebuilt from snapshots can match prompts too
            assert self.replica.index.block_size == idx.block_size == 4
        self._check_masks(idx)

    def _check_masks(self, idx: BlockIndex) -> None:
        """The per-key masks agree with the per-source sets (the index's own recount)."""

        def held(source: Source, g: int) -> set[Any]:
            sets = idx.held.get(source, [])
            return sets[g] if g < len(sets) else set()

        for g, table in enumerate(idx.gpu):
            for key, mask in table.items():
                holders = {r for r in range(3) if key in held((RANK, r), g)}
                assert holders == {r for r in range(3) if mask >> r & 1}
        for g, table in enumerate(idx.host):
            for key, mask in table.items():
                nodes = [n for n in range(2) if mask >> (2 * n) & 1]
                assert nodes == [n for n in range(2) if key in held((HOST, n), g)]

    @invariant()
    def caches_hold_together(self) -> None:
        for cache in self.caches:
            if cache is not None:
                cache.check_integrity()


BlockIndexModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
TestBlockIndexModel = BlockIndexModel.TestCase
