"""Folding: rank reports -> NodeUtilization -> ClusterView. Pure and order-independent.

Counts are summed, never ratios: two ranks with hit rates 1/1 and 1/100 make a
node hit rate of 2/101. Only fresh ranks (of fresh nodes) count toward
capacity; the host tier counts once per node; the partial last node expects
only its clamped ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvfold.stats import (
    BlockDeltas,
    BlockGauges,
    HostStats,
    IterationStats,
    RankReport,
    SequenceStatus,
    Window,
    num_valid,
    sum_deltas,
    sum_gauges,
    sum_hosts,
    sum_status_counts,
)
from kvfold.topology import Topology
from kvfold.view import ClusterView, NodeUtilization, RankSummary, SourceState


def fold_node(
    topology: Topology,
    node: int,
    rank_reports: Mapping[int, RankReport],
    host_stats: HostStats | None,
    freshness: Mapping[int, SourceState],
    counters: Mapping[int, IterationStats] | None = None,
    ages_s: Mapping[int, float] | None = None,
    added_seq_ids: Mapping[int, tuple[str | int, ...]] | None = None,
) -> NodeUtilization:
    """Fold one node's latest rank reports.

    freshness[rank] says which ranks count (a rank without an entry is FRESH if
    it has a report, else MISSING). counters[rank] are the rank's cumulative
    deltas as kept by the receiver (default: the latest report's deltas).
    added_seq_ids[rank]: the ids the rank added recently, as kept by the receiver
    (default: the latest report's).
    """
    ranks = topology.ranks_on(node)
    on_node = set(ranks)
    for r in rank_reports:
        if r not in on_node:
            raise ValueError(f"rank {r} is not on node {node} (its ranks are {list(ranks)})")
    summaries: list[RankSummary] = []
    gpu_maps: list[Mapping[Window, BlockGauges]] = []
    delta_maps: list[Mapping[Window, BlockDeltas]] = []
    counter_maps: list[Mapping[Window, BlockDeltas]] = []
    status_maps: list[Mapping[SequenceStatus, int]] = []
    for r in ranks:
        rep = rank_reports.get(r)
        default = SourceState.FRESH if rep is not None else SourceState.MISSING
        state = freshness.get(r, default)
        if rep is None and state is SourceState.FRESH:
            state = SourceState.MISSING  # nothing to count: never silently zero capacity
        if counters is not None and r in counters:
            counter_maps.append(counters[r].windows)
        elif counters is None and rep is not None:
            counter_maps.append(rep.deltas)
        if rep is None:
            summaries.append(RankSummary(r, state, age_s=(ages_s or {}).get(r, 0.0)))
            continue
        summaries.append(
            RankSummary(
                rank=r,
                state=state,
                incarnation=rep.incarnation,
                gpu=rep.gpu,
                num_valid_sequences=num_valid(rep.num_sequences_by_status),
                age_s=(ages_s or {}).get(r, 0.0),
                added_seq_ids=(added_seq_ids or {}).get(r, rep.added_seq_ids),
                report_seq=rep.seq,
            )
        )
        if state is SourceState.FRESH:
            if rep.gpu is not None:
                gpu_maps.append(rep.gpu)
            delta_maps.append(rep.deltas)
            status_maps.append(rep.num_sequences_by_status)
    return NodeUtilization(
        node=node,
        rank_start=ranks[0],
        rank_end=ranks[-1] + 1,
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
    node_ages_s: Mapping[int, float] | None = None,
    counters_base: Mapping[int, IterationStats] | None = None,
) -> ClusterView:
    """Fold node views into a ClusterView.

    node_states[node] says which nodes count (default FRESH for a node with a
    view, MISSING without). counters_base[node] holds counts carried over
    from a node actor's earlier incarnations, so cluster counters never go
    backwards when a node actor restarts.
    """
    states = node_states or {}
    nodes: list[NodeUtilization | None] = []
    node_state_list: list[SourceState] = []
    gpu_maps: list[Mapping[Window, BlockGauges]] = []
    counter_maps: list[Mapping[Window, BlockDeltas]] = []
    hosts: list[HostStats | None] = []
    status_maps: list[Mapping[SequenceStatus, int]] = []
    for node in range(topology.num_nodes):
        view = node_views.get(node)
        if view is not None and view.node != node:
            raise ValueError(f"node_views[{node}] holds node {view.node}")
        state = states.get(node, SourceState.FRESH if view is not None else SourceState.MISSING)
        if view is None and state is SourceState.FRESH:
            state = SourceState.MISSING
        nodes.append(view)
        node_state_list.append(state)
        if view is None:
            continue
        counter_maps.append(view.counters.windows)
        if state is SourceState.FRESH:
            gpu_maps.append(view.gpu)
            hosts.append(view.host)
            status_maps.append(view.num_sequences_by_status)
    for base in (counters_base or {}).values():
        counter_maps.append(base.windows)
    ages = node_ages_s or {}
    return ClusterView(
        version=version,
        built_at_s=built_at_s,
        rank_to_node=tuple(topology.as_list()),
        nodes=tuple(nodes),
        node_states=tuple(node_state_list),
        node_age_s=tuple(ages.get(n, 0.0) for n in range(topology.num_nodes)),
        gpu=sum_gauges(gpu_maps),
        host=sum_hosts(hosts),
        num_sequences_by_status=sum_status_counts(status_maps),
        counters=IterationStats(sum_deltas(counter_maps)),
        built_at_unix_s=built_at_unix_s,
    )


__all__ = ["fold_cluster", "fold_node"]
