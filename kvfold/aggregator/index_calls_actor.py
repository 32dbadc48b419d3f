"""IndexCalls: the cluster block index's calls (DESIGN §9), a base class of the actors
that keep it, as RankCalls is of the rank: sources' batches in, replicas' ops out, and
the loop that drops dead sources and resynchronises the rest from snapshots. The
ClusterAggregator keeps the index of the nodes that push to it; a RackAggregator keeps
its rack's nodes' (an index shard: docs/scale.md). Their __init__ sets the state; each
says where the view it drops sources by comes from (`_liveness`)."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import ray

from kvfold.blockindex.feed import IndexFeed
from kvfold.blockindex.liveness import Liveness, sources_gone
from kvfold.kvevents.events import RANK, BlockHash, EventError, decode_envelope
from kvfold.naming import node_actor_name, rank_actor_name
from kvfold.ray_actor import named_actor

SNAPSHOT_TIMEOUT_S = 5.0  # how long a source may take to hand over its keys
MAX_BATCHES_PER_CALL = 16_384  # batches in one push (a node's, a rack's); the rest refused


class IndexCalls:
    blocks: IndexFeed
    blocks_lock: threading.Lock
    events_refused: int
    events_error: str | None
    _asked: dict[tuple[str, int], tuple[Any, float]]  # snapshots asked, when
    namespace: str

    def _liveness(self, nodes: set[int]) -> Liveness | None:
        """What the aggregator's view says of `nodes` (kvfold.blockindex.liveness; None:
        not known now, nothing is dropped this tick)."""
        raise NotImplementedError

    @ray.method(concurrency_group="events")
    def block_events(self, data: bytes) -> str:
        """One source's batch of block events (kvfold.kvevents.events): what became of
        it ("applied", "kept", "duplicate", ...), or "refused" (counted)."""
        return self._ingest(data)

    def _ingest(self, data: bytes) -> str:
        try:
            env = decode_envelope(data)
            with self.blocks_lock:
                return self.blocks.ingest(env)
        except (EventError, ValueError) as e:
            self.events_refused += 1
            self.events_error = str(e)[:300]
            return "refused"

    def _ingest_all(self, batches: list[bytes]) -> list[str]:
        """Batches of many sources in one call (a node's or a rack's push), in order;
        past MAX_BATCHES_PER_CALL the rest are refused (counted)."""
        answers = [self._ingest(data) for data in batches[:MAX_BATCHES_PER_CALL]]
        over = len(batches) - len(answers)
        self.events_refused += over
        return answers + ["refused"] * over

    def block_index_since(self, cursor: tuple[int, int]) -> bytes:
        """For a replica at `cursor`: (cursor now, ops after it, False), or (cursor now,
        ops that rebuild the index from empty, True) when the log no longer reaches back.
        Pickled: one trusted kvfold process to another, like the view."""
        with self.blocks_lock:
            now, ops = self.blocks.since(tuple(cursor))  # type: ignore[arg-type]
            whole = ops is None
            if ops is None:
                now, ops = self.blocks.snapshot_ops()
            return pickle.dumps((now, ops, whole), protocol=pickle.HIGHEST_PROTOCOL)

    def block_index_counts(self) -> dict[str, Any]:
        with self.blocks_lock:
            idx = self.blocks.index
            return {
                **self.blocks.counts,
                "refused": self.events_refused,
                "last_error": self.events_error,
                "entries": idx.num_entries,
                "sources": len(idx.sources()),
                "out_of_sync": [list(s) for s in self.blocks.wanted()],
                "ops": self.blocks.num_ops,
            }

    def block_keys(self, kind: str, source: int) -> dict[int, list[BlockHash]]:
        """What the index holds for one source, per window group (for checks)."""
        with self.blocks_lock:
            return {g: list(ks) for g, ks in self.blocks.index.keys_of((kind, source)).items()}

    def _resync(self) -> None:
        """Drop from the index every source the view holds not alive (kvfold.blockindex.
        liveness); ask out-of-sync sources for their keys. With the view not known now (a
        shard whose aggregator is away), nothing is dropped, but sources still resync."""
        with self.blocks_lock:
            feed = self.blocks
            sources = set(feed.streams) | set(feed.index.held)
            nodes = set(map(feed.index.node_of, sources))
        # asked with the lock free (a rack asks the aggregator); a source come since is
        # judged next tick
        known = self._liveness(nodes) if nodes else None
        with self.blocks_lock:
            if known is not None:
                lives = {s: feed.life(s) for s in sources}
                for source in sources_gone(known, sources, lives):
                    feed.drop(source)
            wanted = feed.wanted()
        self._collect_snapshots(wanted)

    def _collect_snapshots(self, wanted: list[tuple[str, int]]) -> None:
        """Install the snapshots that came since the last tick, and ask the sources still
        out of sync that have no question pending (again after SNAPSHOT_TIMEOUT_S).
        Never waits: the next tick's drops must not wait on a slow source."""
        now = time.monotonic()
        if self._asked:
            refs = [ref for ref, _ in self._asked.values()]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(ready)
            for source, (ref, asked_at) in list(self._asked.items()):
                if ref in done:
                    del self._asked[source]
                    try:
                        snap = ray.get(ref)
                    except ray.exceptions.RayError:
                        continue
                    with self.blocks_lock:  # each as it comes: fewer batches kept aside
                        self.blocks.install(snap)
                elif now - asked_at > SNAPSHOT_TIMEOUT_S:
                    del self._asked[source]  # asked again below
        for kind, i in wanted:
            if (kind, i) in self._asked:
                continue
            name = rank_actor_name(i) if kind == RANK else node_actor_name(i)
            actor = named_actor(name, self.namespace)
            if actor is not None:
                self._asked[(kind, i)] = (actor.block_snapshot.remote(), now)
