"""Folding: rank reports -> NodeUtilization -> ClusterView. Pure and order-independent.

Counts are summed, never ratios: two ranks with hit rates 1/1 and 1/100 make a
node hit rate of 2/101. Only fresh ranks (of fresh nodes) count toward
capacity; the host tier counts once per node; the partial last node expects
only its clamped ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfold.stats import (
    BlockDeltas,
    BlockGauges,
    HostStats,
    IterationStats,
    RankReport,
    SequenceStatus,
    Window,
    host_counters,
    num_valid,
    sum_deltas,
    sum_gauges,
    sum_hosts,
    sum_status_counts,
    with_host_counters,
)
from kvfold.topology import Topology
from kvfold.view import ClusterView, NodeUtilization, RankSummary, SourceState


@dataclass(frozen=True, slots=True)
class RankRecord:
    """What a node knows of one rank: its latest report and the receiver's verdicts.

    state: None means FRESH with a report, MISSING without. counters: the rank's
    cumulative deltas as kept by the receiver (None: the report's).
    """

    report: RankReport | None
    state: SourceState | None = None
    counters: IterationStats | None = None
    age_s: float = 0.0

    def effective_state(self) -> SourceState:
        """A rank without a report is never FRESH: nothing of it may count as zero capacity."""
        if self.report is None:
            if self.state is None or self.state is SourceState.FRESH:
                return SourceState.MISSING
            return self.state
        return SourceState.FRESH if self.state is None else self.state

    def summary(self, rank: int) -> RankSummary:
        rep, state = self.report, self.effective_state()
        if rep is None:
            return RankSummary(rank, state, age_s=self.age_s)
        return RankSummary(
            rank=rank,
            state=state,
            incarnation=rep.incarnation,
            gpu=rep.gpu,
            num_valid_sequences=num_valid(rep.num_sequences_by_status),
            age_s=self.age_s,
            tickets=rep.tickets,
            report_seq=rep.seq,
            num_refused=rep.num_refused,
            unknown=rep.unknown,
        )


_NO_RECORD = RankRecord(None)
FRESH = SourceState.FRESH


def _rank_of(
    rank: int, record: RankRecord | RankReport
) -> tuple[RankReport | None, RankSummary, Mapping[Window, BlockDeltas] | None]:
    """(latest report, summary, cumulative counters) of one rank of a node."""
    if type(record) is RankReport:  # the common case: fresh, inline (the hot path)
        summary = RankSummary(
            rank,
            FRESH,
            record.incarnation,
            record.gpu,
            num_valid(record.num_sequences_by_status),
            0.0,
            record.tickets,
            record.seq,
            record.num_refused,
            record.unknown,
        )
        return record, summary, record.deltas
    if not isinstance(record, RankRecord):
        raise TypeError(f"ranks[{rank}] must be a RankRecord or a RankReport, got {record!r}")
    rep = record.report
    if record.counters is not None:
        return rep, record.summary(rank), record.counters.windows
    return rep, record.summary(rank), None if rep is None else rep.deltas


def fold_node(
    topology: Topology,
    node: int,
    ranks: Mapping[int, RankRecord | RankReport],
    host_stats: HostStats | None,
) -> NodeUtilization:
    """Fold one node's ranks (a bare RankReport stands for a fresh record of it). Every
    rank of the node is listed; only fresh ones count toward capacity and sequences;
    every rank's counters count (counters never go backwards)."""
    expected = topology.ranks_on(node)
    on_node = set(expected)
    for r in ranks:
        if r not in on_node:
            raise ValueError(f"rank {r} is not on node {node} (its ranks are {list(expected)})")
    summaries: list[RankSummary] = []
    gpu_maps: list[Mapping[Window, BlockGauges]] = []
    delta_maps: list[Mapping[Window, BlockDeltas]] = []
    counter_maps: list[Mapping[Window, BlockDeltas]] = []
    status_maps: list[Mapping[SequenceStatus, int]] = []
    for r in expected:
        rep, summary, counts = _rank_of(r, ranks.get(r, _NO_RECORD))
        summaries.append(summary)
        if counts is not None:
            counter_maps.append(counts)
        if rep is not None and summaries[-1].state is SourceState.FRESH:
            if rep.gpu is not None:
                gpu_maps.append(rep.gpu)
            delta_maps.append(rep.deltas)
            status_maps.append(rep.num_sequences_by_status)
    return NodeUtilization(
        node=node,
        rank_start=expected[0],
        rank_end=expected[-1] + 1,
        ranks=tuple(summaries),
        gpu=sum_gauges(gpu_maps),
        host=host_stats,
        num_sequences_by_status=sum_status_counts(status_maps),
        deltas=IterationStats(sum_deltas(delta_maps)),
        counters=IterationStats(sum_deltas(counter_maps)),
    )


def fold_cluster(
    topology: Topology,
    node_views: Mapping[int, NodeUtilization],
    node_states: Mapping[int, SourceState] | None = None,
    *,
    version: int = 0,
    built_at_s: float = 0.0,
    built_at_unix_s: float = 0.0,
    node_last_report_s: Mapping[int, float] | None = None,
) -> ClusterView:
    """Fold node views into a ClusterView: one entry per node, each with the cluster's
    verdict on it (state, silence); a node never heard from is an empty entry.

    node_states[node] says which nodes count (default FRESH for a node with a view,
    MISSING without). Gauges count fresh nodes only; counters (the block counters and
    the host tiers' moves) count every node whatever its state, so that they never go
    backwards when a node goes stale or dies (a node's view holds every one of its lives'
    counters when the aggregator's ledger stamped it: kvfold.aggregator.counter_ledger).
    """
    states, last_report = node_states or {}, node_last_report_s or {}
    nodes: list[NodeUtilization] = []
    gpu_maps: list[Mapping[Window, BlockGauges]] = []
    counter_maps: list[Mapping[Window, BlockDeltas]] = []
    hosts: list[HostStats | None] = []
    host_counts: list[HostStats | None] = []
    status_maps: list[Mapping[SequenceStatus, int]] = []
    for node in range(topology.num_nodes):
        view = node_views.get(node)
        if view is not None and view.node != node:
            raise ValueError(f"node_views[{node}] holds node {view.node}")
        state = states.get(node, SourceState.FRESH if view is not None else SourceState.MISSING)
        if view is None:
            state = SourceState.MISSING if state is SourceState.FRESH else state
            nodes.append(_stamped(fold_node(topology, node, {}, None), state, None))
            continue
        nodes.append(_stamped(view, state, last_report.get(node, view.last_report_s)))
        counter_maps.append(view.counters.windows)
        host_counts.append(view.host)
        if state is SourceState.FRESH:
            gpu_maps.append(view.gpu)
            hosts.append(view.host)
            status_maps.append(view.num_sequences_by_status)
    return ClusterView(
        version=version,
        built_at_s=built_at_s,
        rank_to_node=tuple(topology.as_list()),
        nodes=tuple(nodes),
        gpu=sum_gauges(gpu_maps),
        host=_cluster_host(sum_hosts(hosts), sum_hosts(host_counts)),
        num_sequences_by_status=sum_status_counts(status_maps),
        counters=IterationStats(sum_deltas(counter_maps)),
        built_at_unix_s=built_at_unix_s,
    )


def _cluster_host(fresh: HostStats, every: HostStats) -> HostStats:
    """Gauges of the fresh nodes' host tiers; counters of every node's."""
    out = with_host_counters(fresh, host_counters(every))
    return fresh if out is None else out


_NODE_FIELDS = NodeUtilization.__slots__


def _stamped(
    util: NodeUtilization, state: SourceState, last_report_s: float | None
) -> NodeUtilization:
    """`util` with the cluster's verdict; the same object when nothing changed (a cluster
    keeps stamped views, so a fold copies only the nodes that reported or changed state)."""
    if util.state is state and util.last_report_s == last_report_s:
        return util
    new = object.__new__(NodeUtilization)  # a field-for-field copy, cheaper than replace()
    for name in _NODE_FIELDS:
        object.__setattr__(new, name, getattr(util, name))
    object.__setattr__(new, "state", state)
    object.__setattr__(new, "last_report_s", last_report_s)
    return new


__all__ = ["RankRecord", "fold_cluster", "fold_node"]
