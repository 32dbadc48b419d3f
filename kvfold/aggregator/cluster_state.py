"""ClusterState: what the cluster aggregator knows about the nodes. Pure; no Ray.

    receive(bytes, now_s) -> "accepted" | a refusal reason
    view(now_s) -> ClusterView        (rebuilt, with a new version, only when something changed)

The version grows with every accepted node report and every change of a
node's freshness. It starts from `version_base` (the aggregator passes the
wall clock in microseconds at start), so it keeps growing across restarts.
When a node actor restarts (new incarnation), the counters of its previous
life are kept in a base, so the cluster's counters never go backwards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from kvfold.aggregator.fold import fold_cluster
from kvfold.aggregator.freshness import Verdict
from kvfold.aggregator.receiver import ACCEPTED, ReportReceiver
from kvfold.codec import NodeReport, decode_node_report
from kvfold.stats import IterationStats, Window, sum_deltas
from kvfold.topology import Topology
from kvfold.view import ClusterView, NodeUtilization, SourceState


class ClusterState(ReportReceiver[NodeReport]):
    def __init__(
        self,
        topology: Topology,
        windows: Collection[Window] | None,
        stale_after_s: float,
        dead_after_s: float,
        version_base: int = 0,
    ) -> None:
        super().__init__(stale_after_s, dead_after_s)  # self.refused: node reports refused here
        self.topology = topology
        self.windows = None if windows is None else frozenset(windows)
        self.nodes: dict[int, NodeUtilization] = {}
        self.counters_base: dict[int, IterationStats] = {}
        self.node_refused: dict[int, dict[str, int]] = {}  # rank reports refused at each node
        self.node_refused_base: Counter[str] = Counter()  # from nodes' earlier incarnations
        self.version = version_base
        self._changed = True
        self._states: tuple[SourceState, ...] = ()
        self._view: ClusterView | None = None

    def _decode(self, data: bytes) -> NodeReport:
        return decode_node_report(data, self.topology, self.windows)

    def identity(self, report: NodeReport) -> tuple[int, int, int]:
        return report.node, report.incarnation, report.seq

    def _fold(self, report: NodeReport, verdict: Verdict, now_s: float) -> str:
        if not verdict.current:  # late: a node report is a snapshot, a newer one is in
            return verdict.value
        old = self.nodes.get(report.node)
        if verdict is Verdict.NEW_INCARNATION and old is not None:
            base = self.counters_base.get(report.node)
            maps = [old.counters.windows] + ([base.windows] if base else [])
            self.counters_base[report.node] = IterationStats(sum_deltas(maps))
            self.node_refused_base.update(self.node_refused.get(report.node, {}))
        self.node_refused[report.node] = dict(report.refused)
        self.nodes[report.node] = report.util
        self._changed = True
        return ACCEPTED

    def refused_totals(self) -> dict[tuple[str, str], int]:
        """Refused reports by (where, reason): 'aggregator' for node reports refused here,
        'node' for rank reports refused at the nodes; cumulative, never backwards."""
        nodes: Counter[str] = Counter(self.node_refused_base)
        for counts in self.node_refused.values():
            nodes.update(counts)
        out = {("aggregator", r): c for r, c in self.refused.items()}
        out.update({("node", r): c for r, c in nodes.items()})
        return out

    def node_states(self, now_s: float) -> tuple[SourceState, ...]:
        return tuple(self.freshness.state(n, now_s) for n in range(self.topology.num_nodes))

    def view(self, now_s: float, unix_s: float = 0.0) -> ClusterView:
        """The current view; a new version only when a report or a freshness state changed."""
        states = self.node_states(now_s)
        if self._view is not None and not self._changed and states == self._states:
            return self._view
        self.version += 1
        self._changed = False
        self._states = states
        self._view = fold_cluster(
            self.topology,
            self.nodes,
            dict(enumerate(states)),
            version=self.version,
            built_at_s=now_s,
            built_at_unix_s=unix_s,
            node_last_report_s=self.freshness.last_seen(),
            counters_base=self.counters_base,
        )
        for n in self.nodes:  # keep the stamped views: the next fold copies only what changed
            self.nodes[n] = self._view.nodes[n]
        return self._view
