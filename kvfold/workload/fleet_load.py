"""FleetSlice: what a slice of a fleet's node actors send the aggregator, without the
fleet: for the load harness (benchmarks/bench_scale.py).

Per node, every interval: a node report (the node's ranks folded, real codec, its
incarnation and sequence numbers, gauges that move) and each rank's batch of block
events (real envelopes: a rank's incarnation and seq). Block events follow a model
of prefix reuse and eviction: a rank stores chains of blocks, a share of them under
prefixes many ranks hold (system prompts), and evicts its oldest blocks when full.

Probes make lag measurable from outside. Once per interval one rank of the slice
stores a block whose key carries the wall-clock time it was sent (`probe_key` /
`probe_sent_s`): a reader that sees the key knows how long the index took. And each
node's first rank reports, as its `num_refused`, the milliseconds since `epoch_unix_s`
at which its report was made (`report_sent_s`): a reader knows how old a view is from
the send of the newest report in it, queues on the way included.
Pure; no Ray.
"""

from __future__ import annotations

import random
import secrets
from collections import deque
from dataclasses import dataclass, field

from kvfold.aggregator.fold import fold_node
from kvfold.codec import encode_node_report
from kvfold.kvevents.events import RANK, BlockRemoved, BlockStored, Envelope, EventBatch
from kvfold.kvevents.events import encode_envelope as encode_events
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology

PROBE_TAG = 0x5A << 56  # keys with this top byte are probes; the rest is microseconds
SHARED_TAG = 0x3C << 56  # keys of shared prefixes
PROBE_MASK = (1 << 56) - 1


def probe_key(sent_unix_s: float) -> int:
    return PROBE_TAG | (int(sent_unix_s * 1e6) & PROBE_MASK)


def report_sent_s(first_rank_num_refused: int, epoch_unix_s: float) -> float:
    """When a node's report was made (unix seconds), from its first rank's stamp."""
    return epoch_unix_s + first_rank_num_refused / 1e3


def probe_sent_s(key: object) -> float | None:
    """When a probe key was sent (unix seconds), or None for any other key."""
    if isinstance(key, int) and key >> 56 == PROBE_TAG >> 56:
        return (key & PROBE_MASK) / 1e6
    return None


@dataclass
class _Rank:
    incarnation: int = field(default_factory=lambda: secrets.randbits(62) | 1)
    seq: int = 0  # event batches
    report_seq: int = 0
    held: deque[int] = field(default_factory=deque)  # keys, oldest first
    held_set: set[int] = field(default_factory=set)
    next_key: int = 0
    key_base: int = 0  # the rank's own keys: (rank << 32) | a counter


@dataclass(frozen=True)
class LoadShape:
    """events_per_rank_s: block events per rank per second, each block stored or removed
    counted as one (a BlockStored of 8 blocks is 8), as the fleet's rates are stated."""

    ranks_per_node: int = 8
    blocks_per_rank: int = 4096
    events_per_rank_s: float = 200.0
    block_size: int = 16
    shared_prefixes: int = 64
    shared_share: float = 0.3  # of stored chains that start with a shared prefix
    chain_blocks: int = 8


class FleetSlice:
    """Nodes `nodes` of a fleet of `num_nodes` x `shape.ranks_per_node` ranks."""

    def __init__(
        self,
        nodes: range,
        num_nodes: int,
        shape: LoadShape,
        seed: int = 0,
        epoch_unix_s: float = 0.0,
    ) -> None:
        self.nodes = nodes
        self.epoch_unix_s = epoch_unix_s
        self.shape = shape
        self.topology = Topology.from_mapping(
            [n for n in range(num_nodes) for _ in range(shape.ranks_per_node)]
        )
        self.rng = random.Random(seed)
        self.node_incarnation = {n: secrets.randbits(62) | 1 for n in nodes}
        self.node_seq = dict.fromkeys(nodes, 0)
        self.ranks = {r: _Rank(key_base=r << 32) for n in nodes for r in self.topology.ranks_on(n)}
        self._debt = 0.0  # events owed per rank, carried between ticks

    def restart_node(self, node: int) -> None:
        """The node actor and its ranks start again: new incarnations, empty caches."""
        self.node_incarnation[node] = secrets.randbits(62) | 1
        self.node_seq[node] = 0
        for r in self.topology.ranks_on(node):
            self.ranks[r] = _Rank(key_base=r << 32)

    def tick(self, interval_s: float, now_unix_s: float) -> list[tuple[int, bytes, list[bytes]]]:
        """One interval: per node, (node, its report, its ranks' event envelopes)."""
        self._debt += self.shape.events_per_rank_s * interval_s
        per_rank = int(self._debt)
        self._debt -= per_rank
        out = []
        probe_rank = self.rng.choice(list(self.ranks)) if self.ranks else None
        for node in self.nodes:
            reports: dict[int, RankReport] = {}
            envelopes = []
            for r in self.topology.ranks_on(node):
                rank = self.ranks[r]
                events = self._events(rank, per_rank)
                if r == probe_rank:
                    events.append(self._stored(rank, [probe_key(now_unix_s)], None))
                if events:
                    rank.seq += 1
                    env = Envelope(
                        RANK, r, rank.incarnation, rank.seq, EventBatch(now_unix_s, tuple(events))
                    )
                    envelopes.append(encode_events(env))
                stamp = r == self.topology.ranks_on(node)[0]
                reports[r] = self._report(r, rank, per_rank, now_unix_s if stamp else None)
            self.node_seq[node] += 1
            util = fold_node(self.topology, node, reports, None)
            report = encode_node_report(util, self.node_incarnation[node], self.node_seq[node])
            out.append((node, report, envelopes))
        return out

    def _stored(self, rank: _Rank, keys: list[int], parent: int | None) -> BlockStored:
        rank.held.extend(keys)
        rank.held_set.update(keys)
        return BlockStored(tuple(keys), parent, self.shape.block_size)

    def _events(self, rank: _Rank, budget: int) -> list[BlockStored | BlockRemoved]:
        """About half the budget stored as chains, the rest (and whatever overflows the
        cache) removed, oldest first."""
        shape = self.shape
        events: list[BlockStored | BlockRemoved] = []
        stored = 0
        while stored < budget // 2:
            n = min(shape.chain_blocks, budget // 2 - stored)
            if self.rng.random() < shape.shared_share:
                p = self.rng.randrange(shape.shared_prefixes)
                keys = [SHARED_TAG | (p << 16) | i for i in range(n)]
                keys = [k for k in keys if k not in rank.held_set]
            else:
                keys = [rank.key_base | (rank.next_key + i) for i in range(n)]
                rank.next_key += n
            if keys:
                events.append(self._stored(rank, keys, None))
            stored += n
        drop = max(budget - stored, len(rank.held) - shape.blocks_per_rank)
        drop = min(drop, len(rank.held))
        if drop > 0:
            gone = [rank.held.popleft() for _ in range(drop)]
            rank.held_set.difference_update(gone)
            events.append(BlockRemoved(tuple(gone)))
        return events

    def _report(self, r: int, rank: _Rank, per_rank: int, sent: float | None) -> RankReport:
        total = self.shape.blocks_per_rank
        used = self.rng.randrange(total // 4, total)
        cached = min(len(rank.held), total - used)
        gauges = BlockGauges(total, used, cached, self.shape.block_size, used)
        rank.report_seq += 1
        status = {SequenceStatus.IN_DECODE: self.rng.randrange(1, 64)}
        return RankReport(
            rank=r,
            incarnation=rank.incarnation,
            seq=rank.report_seq,
            gpu={None: gauges},
            deltas={None: BlockDeltas(alloc_total_blocks=per_rank // 2)},
            num_sequences_by_status=status,
            num_refused=0 if sent is None else max(0, int((sent - self.epoch_unix_s) * 1e3)),
        )
