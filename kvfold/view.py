"""NodeUtilization and ClusterView: the folded pictures readers get.

Both are frozen and hold counts; every ratio is a property over summed counts.
Capacity of stale, dead or missing sources is excluded from totals, and the
view lists those sources, so a stale source is never silently counted as full
or as empty.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfold.stats import (
    BlockDeltas,
    BlockGauges,
    HostStats,
    IterationStats,
    SequenceStatus,
    Window,
    num_valid,
    ratio,
    total_deltas,
    total_of,
)


class SourceState(enum.Enum):
    """How current a source (rank or node) is, by the receiver's monotonic clock."""

    FRESH = "fresh"
    STALE = "stale"  # silent for stale_after_s
    DEAD = "dead"  # silent for dead_after_s, or Ray says its actor is dead
    MISSING = "missing"  # expected, never heard from


@dataclass(frozen=True, slots=True)
class RankSummary:
    """One rank inside a node view, for drill-down. Gauges are the last ones
    received, shown for every state but summed into totals only when fresh."""

    rank: int
    state: SourceState
    incarnation: int = 0
    gpu: Mapping[Window, BlockGauges] | None = None
    num_valid_sequences: int = 0
    age_s: float = 0.0
    tickets: Mapping[str, int] = field(default_factory=dict)  # controller -> highest taken in
    report_seq: int = 0
    num_refused: int = 0  # placements it refused as over-commits (this incarnation)
    unknown: frozenset[str] = frozenset()  # of stats.UNKNOWABLE: what its source does not publish

    @property
    def num_blocks_free(self) -> int:
        return total_of(self.gpu.values()).num_blocks_free if self.gpu else 0


@dataclass(frozen=True, slots=True)
class NodeUtilization:
    """One node: its ranks (clamped to the world size) folded, its host tier once."""

    node: int
    rank_start: int
    rank_end: int  # exclusive, clamped to the world size
    ranks: tuple[RankSummary, ...]  # every expected rank, in rank order
    gpu: Mapping[Window, BlockGauges]  # summed over fresh ranks
    host: HostStats | None  # None: no host tier on this node
    num_sequences_by_status: Mapping[SequenceStatus, int]  # fresh ranks
    deltas: IterationStats  # the latest interval of each fresh rank, summed
    counters: IterationStats  # every delta ever received from the node's ranks
    # the cluster's verdict on the node, by the aggregator's clock (a node's own fold: FRESH)
    state: SourceState = SourceState.FRESH
    last_report_s: float | None = None  # when its last report arrived; None: never

    @property
    def num_ranks_expected(self) -> int:
        return len(self.ranks)

    def _count(self, state: SourceState) -> int:
        return sum(1 for r in self.ranks if r.state is state)

    @property
    def num_ranks_fresh(self) -> int:
        return self._count(SourceState.FRESH)

    @property
    def num_ranks_stale(self) -> int:
        return self._count(SourceState.STALE)

    @property
    def num_ranks_dead(self) -> int:
        return self._count(SourceState.DEAD)

    @property
    def num_ranks_missing(self) -> int:
        return self._count(SourceState.MISSING)

    @property
    def stale_ranks(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.state is SourceState.STALE)

    @property
    def dead_ranks(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.state is SourceState.DEAD)

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.state is SourceState.MISSING)

    @property
    def gpu_total(self) -> BlockGauges:
        return total_of(self.gpu.values())

    @property
    def free_percent(self) -> float:
        """100 * free / total over fresh ranks' GPU blocks; 0.0 when total is 0."""
        return self.gpu_total.free_percent

    @property
    def num_valid_sequences(self) -> int:
        return num_valid(self.num_sequences_by_status)

    @property
    def rank_free_blocks(self) -> dict[int, int]:
        """Free GPU blocks of each fresh rank, summed over windows."""
        return {r.rank: r.num_blocks_free for r in self.ranks if r.state is SourceState.FRESH}

    @property
    def unknown(self) -> dict[str, tuple[int, ...]]:
        """Per field of stats.UNKNOWABLE, the fresh ranks that do not publish it: the
        node's sums of that field leave them out, so they say which ranks it could not
        count (empty for kvfold's own ranks)."""
        out: dict[str, list[int]] = {}
        for r in self.ranks:
            if r.unknown and r.state is SourceState.FRESH:
                for name in r.unknown:
                    out.setdefault(name, []).append(r.rank)
        return {k: tuple(v) for k, v in sorted(out.items())}


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster, versioned. `version` grows with every change the aggregator sees."""

    version: int
    built_at_s: float  # the aggregator's monotonic clock
    rank_to_node: tuple[int, ...]  # the topology the view was folded on
    nodes: tuple[NodeUtilization, ...]  # every node, with its state (MISSING: never heard)
    gpu: Mapping[Window, BlockGauges]  # fresh ranks of fresh nodes
    host: HostStats  # gauges: fresh nodes' host tiers, each once; counters: every node's
    num_sequences_by_status: Mapping[SequenceStatus, int]  # fresh ranks of fresh nodes
    counters: IterationStats  # cumulative, every node whatever its state; never backwards
    built_at_unix_s: float = 0.0  # for display only; freshness never uses it

    @property
    def world_size(self) -> int:
        return len(self.rank_to_node)

    def node(self, node: int) -> NodeUtilization:
        return self.nodes[node]

    def age_s(self, node: int) -> float:
        """Seconds the node had been silent when the view was built (0.0: never heard)."""
        last = self.nodes[node].last_report_s
        return 0.0 if last is None else max(0.0, self.built_at_s - last)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_states(self) -> tuple[SourceState, ...]:
        return tuple(n.state for n in self.nodes)

    def _nodes_in(self, state: SourceState) -> tuple[int, ...]:
        return tuple(n.node for n in self.nodes if n.state is state)

    @property
    def fresh_nodes(self) -> list[NodeUtilization]:
        return [n for n in self.nodes if n.state is SourceState.FRESH]

    @property
    def stale_nodes(self) -> tuple[int, ...]:
        return self._nodes_in(SourceState.STALE)

    @property
    def dead_nodes(self) -> tuple[int, ...]:
        return self._nodes_in(SourceState.DEAD)

    @property
    def missing_nodes(self) -> tuple[int, ...]:
        return self._nodes_in(SourceState.MISSING)

    def rank_states(self) -> dict[int, SourceState]:
        """Every rank's effective state: its own within a fresh node; a stale node
        makes its live ranks stale, a dead node makes them all dead, and the ranks
        of a node never heard from are missing."""
        out: dict[int, SourceState] = {}
        for n in self.nodes:
            for summary in n.ranks:
                if n.state is SourceState.FRESH or summary.state is SourceState.DEAD:
                    out[summary.rank] = summary.state
                else:
                    out[summary.rank] = n.state
        return out

    def _ranks_in(self, state: SourceState) -> tuple[int, ...]:
        return tuple(sorted(r for r, s in self.rank_states().items() if s is state))

    @property
    def stale_ranks(self) -> tuple[int, ...]:
        """Ranks silent past stale_after_s, and every live rank of a stale node."""
        return self._ranks_in(SourceState.STALE)

    @property
    def dead_ranks(self) -> tuple[int, ...]:
        """Ranks known dead, and every rank of a dead node."""
        return self._ranks_in(SourceState.DEAD)

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return self._ranks_in(SourceState.MISSING)

    @property
    def fresh_ranks(self) -> tuple[int, ...]:
        return tuple(
            r.rank for n in self.fresh_nodes for r in n.ranks if r.state is SourceState.FRESH
        )

    @property
    def gpu_total(self) -> BlockGauges:
        return total_of(self.gpu.values())

    @property
    def num_valid_sequences(self) -> int:
        return num_valid(self.num_sequences_by_status)

    @property
    def free_percent(self) -> float:
        return self.gpu_total.free_percent

    @property
    def hit_rate(self) -> float:
        """Cumulative reused / (reused + missed) over the cluster (counts summed first)."""
        t: BlockDeltas = total_deltas(self.counters.windows.values())
        return ratio(t.reused_blocks, t.reused_blocks + t.missed_blocks)

    @property
    def unknown(self) -> dict[str, tuple[int, ...]]:
        """Per field of stats.UNKNOWABLE, the fresh ranks of fresh nodes that do not
        publish it (the totals of that field could not count them)."""
        out: dict[str, tuple[int, ...]] = {}
        for n in self.fresh_nodes:
            for name, ranks in n.unknown.items():
                out[name] = out.get(name, ()) + ranks
        return out

    def rank_summary(self, rank: int) -> tuple[RankSummary, SourceState] | None:
        """A rank's last summary and its node's state, or None outside the world."""
        if not 0 <= rank < self.world_size:
            return None
        n = self.nodes[self.rank_to_node[rank]]
        for r in n.ranks:
            if r.rank == rank:
                return r, n.state
        return None
